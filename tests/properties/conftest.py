"""The kernel properties (``test_kernels_*``) exercise the Triton kernels: op calls there
default to ``impl="triton"`` (the interpreter on the CPU, compiled on a GPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridmeta.kernels import implementation


@pytest.fixture(autouse=True, scope="module")
def _triton_ops_in_kernel_properties(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.module.__name__.rsplit(".", 1)[-1].startswith("test_kernels"):
        with implementation("triton"):
            yield
    else:
        yield
