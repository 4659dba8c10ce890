"""The replay harness reads the kernels' error record at its comparison and reports a
fault (an id a kernel found invalid on the device) as a replay failure naming it."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from hypothesis import settings

from hybridmeta.kernels import causal_conv1d_update_reference, check_errors, reset_errors
from hybridmeta.testing import ReplayFailure, check_replay, resolve_settings
from tests.testing.test_replay import Tiny

_QUICK = settings(resolve_settings(), max_examples=5, stateful_step_count=3, database=None)


class Faulting(Tiny):
    """Tiny, whose captured step also runs a conv update on a side pool with every live
    row's slot shifted past that pool: the rows write nothing there (the compared pool is
    untouched), but each replay records a fault on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.side = torch.zeros(2, 3, 1)
        self.weight = torch.ones(3, 2)

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        slots = self.slots[:bucket]
        shifted = torch.where(slots >= 0, slots + 100, -1)
        causal_conv1d_update_reference(
            torch.zeros(bucket, 3), self.side, self.weight, None, torch.empty(bucket, 3),
            shifted, silu=False,
        )  # fmt: skip
        return super().forward(bucket)


def test_a_kernel_fault_during_replay_is_a_replay_failure_naming_it() -> None:
    reset_errors()
    with pytest.raises(ReplayFailure) as info:
        check_replay(Faulting, settings=_QUICK, track=False)
    text = str(info.value)
    assert "kernel fault in the replay or its reference: causal_conv1d_update: " in text
    assert "`cache_indices` values must be -1 (pad) or in [0, 2); row 0 holds 100 " in text
    assert check_errors() is None, "the harness read (and reset) the record"


def test_a_correct_backend_leaves_the_record_clean() -> None:
    reset_errors()
    check_replay(Tiny, settings=_QUICK, track=False)
    assert check_errors() is None
