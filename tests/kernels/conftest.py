"""Kernel tests exercise the Triton kernels: every op call here defaults to
``impl="triton"`` (the interpreter on the CPU, compiled on a GPU); a test that wants the
reference says ``impl="reference"``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridmeta.kernels import implementation


@pytest.fixture(autouse=True, scope="module")
def _triton_ops() -> Iterator[None]:
    with implementation("triton"):
        yield
