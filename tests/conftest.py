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
    # Tests marked `interpreter` run Triton kernels on CPU tensors: hybridmeta runs those
    # launches in the Triton interpreter on any machine (decided per launch, no
    # TRITON_INTERPRET needed), so only the gpu tests are skipped without CUDA.
    skip_gpu = pytest.mark.skip(reason="needs CUDA; none on this machine")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _clean_kernel_error_record() -> None:
    """Every test starts with clean kernel error records: a fault an earlier test left on
    purpose (an invalid id in a stale buffer) is not a later test's."""
    from hybridmeta.kernels import reset_errors

    reset_errors()


@pytest.fixture(autouse=True)
def _seeded_torch_rng() -> None:
    """Every test starts from the same torch RNG state (CPU and CUDA), so a draw without an
    explicit generator gives the same data on every run and a failure reproduces."""
    torch.manual_seed(0)
