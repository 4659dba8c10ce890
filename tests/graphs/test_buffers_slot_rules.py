"""Slot rules of ``StaticBuffers.refresh`` on short steps (checked on Python lists) and
long ones (past 32 rows: numpy arrays), with and without a slot table, int32 and int64
ids, and declared null slots inside and outside the pool."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import BATCH, INDEX, Conventions, Role, metadata, tensor_field
from hybridmeta.graphs import StaticBuffers
from hybridmeta.model import ForwardMetadata
from tests.graphs.test_buffers import _assert_untouched, _snapshot
from tests.graphs.test_buffers import _buffers as _base_buffers

SHORT, LONG = 5, 33  # 33: past the list check, and odd (an int32 array has no uint64 view)
N = 80  # slots


@metadata(extension=True, conventions=Conventions(null_slot=0))
class _Null0(ForwardMetadata):
    """Null slot 0: a reserved slot inside the pool (vLLM's null block)."""


@metadata(extension=True, conventions=Conventions(null_slot=3))
class _Null3(ForwardMetadata):
    """A null slot inside the pool, not its first slot."""


@metadata(extension=True, conventions=Conventions(null_slot=N))
class _NullN(ForwardMetadata):
    """A null slot just past an N-slot pool."""


@metadata(extension=True)
class _WithSrc(ForwardMetadata):
    """One more slot field (Role.SLOT) beside the working and track slots."""

    src_slot: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, role=Role.SLOT, default=None
    )


def _buffers(bs: int, **kw: Any) -> StaticBuffers:
    """``test_buffers``' buffers for ``bs`` rows of an ``N``-slot pool, with no input."""
    return _base_buffers(**{"max_bs": bs, "num_slots": N, "inputs": {}, **kw})


def _step(
    slots: list[int],
    track: list[int] | None = None,
    mask: list[bool] | None = None,
    *,
    cls: type[ForwardMetadata] = ForwardMetadata,
    dtype: torch.dtype = torch.int64,
    **kw: Any,
) -> ForwardMetadata:
    def ids(v: list[int] | None) -> torch.Tensor | None:
        return None if v is None else torch.tensor(v, dtype=dtype)

    args: dict[str, Any] = {
        "query_start_loc": torch.arange(len(slots) + 1, dtype=dtype),
        "mamba_cache_indices": ids(slots),
        "mamba_track_indices": ids(track),
        "mamba_track_mask": None if mask is None else torch.tensor(mask),
        "has_mamba_track_mask": mask is not None,
    }
    args.update(kw)
    return cls(**args)


def _refused(buffers: StaticBuffers, step: ForwardMetadata, match: str) -> None:
    """``step`` is refused with ``match`` and nothing is written."""
    before = _snapshot(buffers)
    with pytest.raises(ValueError, match=match):
        buffers.refresh(step, step.mamba_cache_indices.shape[0])
    _assert_untouched(before, _snapshot(buffers))


# --------------------------------------------------------------------------- valid steps


@pytest.mark.parametrize("bs", [SHORT, LONG])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("table", [False, True])
def test_a_valid_step_is_written_on_both_check_paths(
    bs: int, dtype: torch.dtype, table: bool
) -> None:
    # Working slots (physical) N-bs..N-1; two flagged rows save into free slots 0 and 5,
    # an unflagged row holds N-1 (the top slot; not saved into), the rest -1 (none).
    phys = [N - 1 - r for r in range(bs)]
    slot_table = torch.arange(N - 1, -1, -1, dtype=dtype) if table else None  # v -> N-1-v
    slots = list(range(bs)) if table else phys
    track = [0, 5, N - 1] + [-1] * (bs - 3)
    mask = [True, True] + [False] * (bs - 2)
    buffers = _buffers(bs, index_dtype=dtype, slot_table=slot_table)
    md = buffers.refresh(_step(slots, track, mask, dtype=dtype), bs)
    assert md.mamba_cache_indices.tolist() == phys
    assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
    assert md.mamba_track_indices.tolist() == track
    assert md.mamba_track_mask.tolist() == mask


@pytest.mark.parametrize("bs", [SHORT, LONG])
def test_a_valid_step_without_track_fields_on_both_paths(bs: int) -> None:
    buffers = _buffers(bs, optional_fields=())
    md = buffers.refresh(_step(list(range(bs))), bs)
    assert md.mamba_cache_indices.tolist() == list(range(bs))


@pytest.mark.parametrize("bs", [SHORT, LONG])
def test_an_extra_slot_field_is_checked_beside_the_working_slots(bs: int) -> None:
    buffers = _buffers(bs, source=_WithSrc, optional_fields=("src_slot",))
    src = [N - 1, -1] + [2] * (bs - 2)  # Role.SLOT ids need not be distinct
    md = buffers.refresh(_step(list(range(bs)), cls=_WithSrc, src_slot=torch.tensor(src)), bs)
    assert md.mamba_cache_indices.tolist() == list(range(bs))
    _refused(
        buffers,
        _step(list(range(bs)), cls=_WithSrc, src_slot=torch.tensor([N, *src[1:]])),
        rf"src_slot row 0 holds {N}: not -1 \(pad\) nor a slot in \[0, {N}\)",
    )


def test_slot_ids_are_compared_exactly_past_float_precision() -> None:
    # 2**60 and 2**60 + 1 are one float64: the table and the rules compare ints.
    big = 2**60
    buffers = _buffers(
        SHORT, num_slots=2**62, slot_table=torch.tensor([big + 1, big, big + 2, big + 3, big + 4])
    )
    md = buffers.refresh(_step([1, 0]), 2)
    assert md.mamba_cache_indices.tolist() == [big, big + 1]
    # A step that tracks but flags no row: nothing joins the working slots.
    plain = _buffers(SHORT, num_slots=2**62)
    md = plain.refresh(_step([big, big + 1], [-1, -1], [False, False]), 2)
    assert md.mamba_cache_indices.tolist() == [big, big + 1]
    assert md.has_mamba_track_mask


# --------------------------------------------------------------------------- refusals


def _long(slot: int, at: int = 7) -> list[int]:
    """LONG distinct working slots 0..LONG-1, row ``at`` holding ``slot`` instead."""
    out = list(range(LONG))
    out[at] = slot
    return out


@pytest.mark.parametrize(
    ("slot", "what"),
    [(-1, r"the pad -1 in a live row"), (-2, "a value"), (2**32, "a value"), (40, "a value")],
)
@pytest.mark.parametrize("bs", [SHORT, LONG])
def test_a_virtual_slot_outside_the_table_is_refused(bs: int, slot: int, what: str) -> None:
    table = torch.arange(N // 2)  # 40 entries, the last ones unused by the step
    buffers = _buffers(LONG, slot_table=table)
    slots = _long(slot, at=3)[:bs]
    _refused(
        buffers,
        _step(slots),
        rf"^StaticBuffers\.refresh: mamba_cache_indices row 3 holds {slot} \({what}\): not a "
        rf"virtual slot \(slot-table index\) in \[0, {N // 2}\)",
    )


@pytest.mark.parametrize("value", [-5, -2, N, 2**32, 2**32 + 1])
@pytest.mark.parametrize("bs", [SHORT, LONG])
def test_an_unflagged_track_slot_outside_the_pool_is_refused(bs: int, value: int) -> None:
    # No save reads it, but every slot field holds its pad or a slot.
    buffers = _buffers(LONG)
    track = [-1] * bs
    track[3] = value
    mask = [True] + [False] * (bs - 1)
    track[0] = N - 1
    _refused(
        buffers,
        _step(list(range(bs)), track, mask),
        rf"^StaticBuffers\.refresh: mamba_track_indices row 3 holds {value}: not -1 \(pad\) "
        rf"nor a slot in \[0, {N}\)$",
    )


# --------------------------------------------------------------------------- null slots


@pytest.mark.parametrize("bs", [SHORT, LONG])
def test_null_slot_0_is_no_live_rows_slot_and_no_track_slot(bs: int) -> None:
    buffers = _buffers(LONG, source=_Null0)
    slots = list(range(1, bs + 1))
    track = [N - 1, N - 2] + [0] * (bs - 2)  # 0: none
    mask = [True] + [False] * (bs - 1)
    md = buffers.refresh(_step(slots, track, mask, cls=_Null0), bs)
    assert md.mamba_cache_indices.tolist() == slots
    assert md.mamba_track_indices is not None
    assert md.mamba_track_indices.tolist() == track
    _refused(
        buffers,
        _step([*slots[:-1], 0], cls=_Null0),
        rf"mamba_cache_indices holds the pad 0 in live row {bs - 1}: every row of a step is "
        r"live and needs a slot",
    )
    flagged_none = [True, False, True] + [False] * (bs - 3)
    _refused(
        buffers,
        _step(slots, track, flagged_none, cls=_Null0),
        r"mamba_track_indices row 2 is 0 \(none\) but mamba_track_mask flags it: a flagged "
        r"row needs a track slot",
    )


@pytest.mark.parametrize("bs", [SHORT, LONG])
@pytest.mark.parametrize("cls", [_Null3, _NullN])
def test_a_null_slot_inside_or_past_the_pool_is_the_only_non_slot_allowed(
    bs: int, cls: type[ForwardMetadata]
) -> None:
    null = 3 if cls is _Null3 else N
    buffers = _buffers(LONG, source=cls)
    slots = list(range(N - bs, N))
    # Slot 0 is a slot beside a null 3; the null N is the "none" of a track slot.
    track = [0, null] + [null] * (bs - 2)
    mask = [True] + [False] * (bs - 1)
    md = buffers.refresh(_step(slots, track, mask, cls=cls), bs)
    assert md.mamba_track_indices is not None
    assert md.mamba_track_indices.tolist() == track
    bad = [0, -1] + [null] * (bs - 2)  # -1 is not this class's null slot
    _refused(
        buffers,
        _step(slots, bad, mask, cls=cls),
        rf"mamba_track_indices row 1 holds -1: not {null} \(pad\) nor a slot in \[0, {N}\)",
    )


@pytest.mark.parametrize("bs", [SHORT, LONG])
def test_a_track_slot_below_the_pad_is_refused_in_the_widest_pool_the_ids_can_name(
    bs: int,
) -> None:
    # 2**31 slots: int32 ids name them all (the last is 2**31 - 1); -2 is neither the pad
    # nor a slot. With 2**32 slots the check past 32 rows (ids + 1 viewed as uint32) wrapped
    # and let -2 through: such a pool is now refused at construction.
    buffers = _buffers(bs, num_slots=2**31, index_dtype=torch.int32)
    track = [10] + [-1] * (bs - 1)
    track[3] = -2
    slots = [100 + r for r in range(bs - 1)] + [2**31 - 1]
    step = _step(slots, track, [True] + [False] * (bs - 1), dtype=torch.int32)
    _refused(buffers, step, r"mamba_track_indices row 3 holds -2: not -1 \(pad\) nor a slot")
    track[3] = -1
    md = buffers.refresh(_step(slots, track, [True] + [False] * (bs - 1), dtype=torch.int32), bs)
    assert md.mamba_cache_indices.tolist() == slots


@pytest.mark.parametrize(("dtype", "limit"), [(torch.int32, 2**31), (torch.int64, 2**63)])
def test_a_pool_wider_than_its_ids_can_name_is_refused(dtype: torch.dtype, limit: int) -> None:
    _buffers(SHORT, num_slots=limit, index_dtype=dtype)
    with pytest.raises(
        ValueError,
        match=rf"^StaticBuffers: num_slots must be <= {limit} for {dtype} ids \(slots 0 to "
        rf"{limit - 1}\), got {limit + 1}$",
    ):
        _buffers(SHORT, num_slots=limit + 1, index_dtype=dtype)
