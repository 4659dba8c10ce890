"""Shared test configuration: Hypothesis profiles and the GPU marker.

Profiles (select with ``HYPOTHESIS_PROFILE``):

* ``ci`` (default): quick, for the CPU-only CI machine and the Triton interpreter.
* ``dev``: a little more than ``ci``, for local iteration.
* ``thorough``: many examples, for the GPU run.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Importing hybridmeta.kernels selects the Triton interpreter when CUDA is absent; it must happen
# before any test module imports triton (imports sort third-party first).
import hybridmeta.kernels  # noqa: F401

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=_SLOW_OK, print_blob=True
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "thorough", max_examples=400, deadline=None, suppress_health_check=_SLOW_OK, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    interpreted = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    skip_gpu = pytest.mark.skip(reason="needs CUDA; none on this machine")
    skip_interp = pytest.mark.skip(
        reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1; the gpu tests run them here"
    )
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not interpreted:
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _seeded_torch_rng() -> None:
    """Every test starts from the same torch RNG state (CPU and CUDA), so a draw without an
    explicit generator gives the same data on every run and a failure reproduces."""
    torch.manual_seed(0)
