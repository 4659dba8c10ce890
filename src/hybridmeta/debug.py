"""Debug mode: checks that need a device-to-host sync run only here.

Hot-path code never syncs. Checks that must read device values (index ranges, monotonic
offsets, duplicate slots) run only when debug mode is on: set ``HYBRIDMETA_DEBUG=1`` in the
environment or use :func:`debug_mode` as a context manager.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_debug: bool = os.environ.get("HYBRIDMETA_DEBUG", "") not in ("", "0")


def is_debug() -> bool:
    """Whether syncing (device-reading) validation is enabled."""
    return _debug


def set_debug(enabled: bool) -> None:
    global _debug
    _debug = bool(enabled)


@contextlib.contextmanager
def debug_mode(enabled: bool = True) -> Iterator[None]:
    """Enable (or disable) syncing validation inside a ``with`` block."""
    global _debug
    previous = _debug
    _debug = bool(enabled)
    try:
        yield
    finally:
        _debug = previous
