"""pytest plugin: fixtures for testing an engine backend with :mod:`hybridmeta.testing`.

Enable it in your top-level ``conftest.py``::

    pytest_plugins = ["hybridmeta.testing.pytest_plugin"]

It is deliberately not registered as a ``pytest11`` entry point: importing it imports
torch and hybridmeta (seconds of start-up), and an entry point would do that in every
pytest session of every project installed beside hybridmeta.

Fixtures
--------
hybridmeta_settings
    The Hypothesis settings of the selected profile (``--hybridmeta-profile NAME``, else
    ``HYBRIDMETA_PROFILE``, else ``hybridmeta-ci``).
hybridmeta_device
    ``torch.device("cuda")`` when CUDA is available, else ``torch.device("cpu")``.
replay_check
    ``replay_check(factory, **options)``: :func:`hybridmeta.testing.check_replay` with the
    selected profile.
field_flow_check
    ``field_flow_check(source, construct, **options)``:
    :func:`hybridmeta.testing.assert_field_flow` with the selected profile.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from hybridmeta.testing.profiles import PROFILES, register_profiles, resolve_settings

register_profiles()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hybridmeta")
    group.addoption(
        "--hybridmeta-profile",
        choices=list(PROFILES),
        default=None,
        help="Hypothesis profile for hybridmeta.testing checks (default: hybridmeta-ci, or "
        "$HYBRIDMETA_PROFILE)",
    )


def pytest_configure(config: pytest.Config) -> None:
    chosen = config.getoption("--hybridmeta-profile", default=None)
    if chosen:
        os.environ["HYBRIDMETA_PROFILE"] = str(chosen)


@pytest.fixture
def hybridmeta_settings() -> Any:
    return resolve_settings()


@pytest.fixture
def hybridmeta_device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def replay_check(hybridmeta_settings: Any) -> Callable[..., None]:
    from hybridmeta.testing.replay import check_replay

    def run(factory: Callable[[], Any], **options: Any) -> None:
        options.setdefault("settings", hybridmeta_settings)
        check_replay(factory, **options)

    return run


@pytest.fixture
def field_flow_check(hybridmeta_settings: Any) -> Callable[..., Any]:
    from hybridmeta.testing.flow import assert_field_flow

    def run(source: type, construct: Callable[[Any], Any], **options: Any) -> Any:
        options.setdefault("settings", hybridmeta_settings)
        return assert_field_flow(source, construct, **options)

    return run
