"""Prefill plans: padding round trip, positions, track targets on the row's chunk grid."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.runtime.plan import PrefillRow, TrackTarget, build_prefill_plan

CPU = torch.device("cpu")


def test_gather_scatter_round_trip_and_positions() -> None:
    rows = [
        PrefillRow(slot=3, start=0, length=5, has_initial_state=False),
        PrefillRow(slot=1, start=16, length=11, has_initial_state=True),
    ]
    plan = build_prefill_plan(rows, [], chunk_size=8, device=CPU)
    assert plan.padded_len == 16
    flat = torch.arange(16) + 100
    padded = torch.cat([flat, torch.tensor([-1])])[plan.gather]  # [P, L]
    assert padded[0, :5].tolist() == [100, 101, 102, 103, 104]
    assert padded[0, 5:].eq(-1).all()
    assert padded[1, :11].tolist() == list(range(105, 116))
    assert torch.equal(padded.reshape(-1)[plan.scatter], flat)
    assert plan.valid.sum(1).tolist() == [5, 11]
    assert plan.token_slot.tolist() == [3] * 5 + [1] * 11
    assert plan.token_pos.tolist() == list(range(5)) + list(range(16, 27))
    assert plan.last.tolist() == [4, 15]


def test_track_targets_map_to_chunk_indices() -> None:
    rows = [PrefillRow(slot=1, start=16, length=20, has_initial_state=True)]
    plan = build_prefill_plan(
        rows, [TrackTarget(row=0, boundary=32, slot=7)], chunk_size=8, device=CPU
    )
    assert plan.track_rel.tolist() == [16]
    assert plan.track_chunk.tolist() == [2]
    assert plan.track_slot.tolist() == [7]


@pytest.mark.parametrize(
    ("rows", "tracks", "message"),
    [
        ([], [], "rows must not be empty"),
        ([PrefillRow(slot=1, start=0, length=0, has_initial_state=False)], [], "length >= 1"),
        (
            [PrefillRow(slot=1, start=8, length=4, has_initial_state=False)],
            [],
            "has_initial_state is False",
        ),
        (
            [PrefillRow(slot=1, start=0, length=20, has_initial_state=False)],
            [TrackTarget(row=0, boundary=12, slot=5)],
            "chunk grid",
        ),
        (
            [PrefillRow(slot=1, start=0, length=20, has_initial_state=False)],
            [TrackTarget(row=0, boundary=24, slot=5)],
            r"must lie in \(0, 20\]",
        ),
        (
            [PrefillRow(slot=1, start=0, length=20, has_initial_state=False)],
            [TrackTarget(row=2, boundary=8, slot=5)],
            "is not a row index",
        ),
    ],
)
def test_bad_plans_are_refused(
    rows: list[PrefillRow], tracks: list[TrackTarget], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_prefill_plan(rows, tracks, chunk_size=8, device=CPU)
