"""``check_disjoint_writes``: the tensor-op judgement of a clean step refuses exactly what the
rule refuses (a slot written twice, or a slot one row reads and another row writes), on
random steps with duplicates, pads and inactive rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridmeta.kernels._validate import check_disjoint_writes

_Triple = tuple[str, torch.Tensor, torch.Tensor]


def _rule(writes: list[_Triple], reads: _Triple | None) -> bool:
    """The rule, stated directly: the refusal it must give (True) or not."""
    owner: dict[int, int] = {}
    for _, slots, active in writes:
        for row, (s, on) in enumerate(zip(slots.tolist(), active.tolist(), strict=True)):
            if on:
                if s in owner:
                    return True
                owner[s] = row
    if reads is not None:
        _, slots, active = reads
        for row, (s, on) in enumerate(zip(slots.tolist(), active.tolist(), strict=True)):
            if on and s in owner and owner[s] != row:
                return True
    return False


@st.composite
def _steps(draw: st.DrawFn) -> tuple[list[_Triple], _Triple | None]:
    bs = draw(st.integers(0, 12))
    slot = st.integers(-1, 9)  # a small range: collisions are common
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))

    def triple(name: str) -> _Triple:
        slots = torch.tensor(draw(st.lists(slot, min_size=bs, max_size=bs)), dtype=dtype)
        active = torch.tensor(
            draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), dtype=torch.bool
        )
        return name, slots, active

    writes = [triple("state_indices")] + ([triple("track_indices")] if draw(st.booleans()) else [])
    reads = triple("state_indices") if draw(st.booleans()) else None
    if reads is not None and draw(st.booleans()):
        reads = (reads[0], writes[0][1], reads[2])  # the in-place update: read what it writes
    return writes, reads


@given(step=_steps())
def test_a_step_is_refused_exactly_when_the_rule_says(
    step: tuple[list[_Triple], _Triple | None],
) -> None:
    writes, reads = step
    if _rule(writes, reads):
        with pytest.raises(ValueError, match=r"slot -?\d+ is (written twice|read by)"):
            check_disjoint_writes("op", writes, reads)
    else:
        check_disjoint_writes("op", writes, reads)


def test_a_row_may_write_the_slot_it_reads_itself() -> None:
    s = torch.tensor([3, 5])
    on = torch.tensor([True, True])
    check_disjoint_writes("op", [("state_indices", s, on)], ("state_indices", s, on))
    with pytest.raises(ValueError, match=r"slot 5 is read by `state_indices` of row 1 and "
                       r"written by `state_indices` of row 0"):  # fmt: skip
        check_disjoint_writes(
            "op", [("state_indices", torch.tensor([5, 6]), on)], ("state_indices", s, on)
        )
