"""The attention layers' plan: padding round trip, positions, one staged copy."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.runtime.plan import attention_host_plan
from hybridmeta.staging import to_device_packed

CPU = torch.device("cpu")


def test_gather_scatter_round_trip_and_positions() -> None:
    ah = attention_host_plan([5, 11], [0, 16])
    plan = ah.plan(to_device_packed(ah.arrays, CPU))
    assert plan.padded_len == 11
    flat = torch.arange(16) + 100
    padded = torch.cat([flat, torch.tensor([-1])])[plan.gather]  # [P, L]
    assert padded[0, :5].tolist() == [100, 101, 102, 103, 104]
    assert padded[0, 5:].eq(-1).all()
    assert padded[1, :11].tolist() == list(range(105, 116))
    assert torch.equal(padded.reshape(-1)[plan.scatter], flat)
    assert plan.valid.sum(1).tolist() == [5, 11]
    assert plan.token_row.tolist() == [0] * 5 + [1] * 11
    assert plan.token_pos.tolist() == list(range(5)) + list(range(16, 27))
    assert plan.last.tolist() == [4, 15]
    assert plan.starts.tolist() == [0, 16]


@pytest.mark.parametrize(
    ("lengths", "starts", "match"),
    [
        ([], [], "need one start per row and >= 1 row"),
        ([3], [0, 1], "need one start per row"),
        ([0], [0], "every row needs length >= 1 and start >= 0"),
        ([2], [-1], "every row needs length >= 1 and start >= 0"),
    ],
)
def test_refuses_bad_rows(lengths: list[int], starts: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        attention_host_plan(lengths, starts)
