"""Static buffers: refresh writes live rows and pad in place, hands out exactly B rows,
and refuses bad input (naming the field and the rule) before writing anything."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from hybridmeta import (
    BATCH,
    INDEX,
    TOKENS,
    Conventions,
    Dim,
    Pad,
    Role,
    RowOrder,
    debug_mode,
    fields_of,
    metadata,
    tensor_field,
)
from hybridmeta.graphs import (
    EmulatedGraphBackend,
    InputSpec,
    StaticBuffers,
    bucket_for,
    default_buckets,
)
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, SpecCommitMetadata

MAX_BS = 6
SLOTS = 16


def _buffers(**kw: Any) -> StaticBuffers:
    args: dict[str, Any] = {
        "max_bs": MAX_BS,
        "num_slots": SLOTS,
        "device": "cpu",
        "inputs": {"x": InputSpec((2,), torch.float32)},
        "optional_fields": ("mamba_track_indices", "mamba_track_mask"),
    }
    args.update(kw)
    return StaticBuffers(**args)


def _step(
    slots: list[int],
    track: list[int] | None = None,
    mask: list[bool] | None = None,
    **kw: Any,
) -> ForwardMetadata:
    bs = len(slots)
    args: dict[str, Any] = {
        "query_start_loc": torch.arange(bs + 1),
        "mamba_cache_indices": torch.tensor(slots, dtype=torch.int64),
        "mamba_track_indices": None if track is None else torch.tensor(track, dtype=torch.int64),
        "mamba_track_mask": None if mask is None else torch.tensor(mask),
        "has_mamba_track_mask": any(mask or ()),
    }
    args.update(kw)
    return ForwardMetadata(**args)


def _x(bs: int) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(2.0 * bs).reshape(bs, 2) + 1}


def _snapshot(buffers: StaticBuffers) -> dict[str, torch.Tensor]:
    snap: dict[str, torch.Tensor] = {}
    buffers.poison_(0, lambda name, t: snap.__setitem__(name, t.clone()))
    return snap


def _assert_untouched(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    # NaN poison compares equal to itself: a write into a float buffer is caught too.
    for key, t in before.items():
        torch.testing.assert_close(after[key], t, rtol=0, atol=0, equal_nan=True, msg=key)


def _poison(buffers: StaticBuffers) -> None:
    def fill(name: str, t: torch.Tensor) -> None:
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(7)  # a real slot id of some other request

    buffers.poison_(0, fill)


def test_refresh_writes_live_rows_and_pad_and_hands_out_bucket_rows() -> None:
    buffers = _buffers()
    _poison(buffers)
    md = buffers.refresh(_step([3, 1], [9, -1], [True, False]), 4, _x(2))
    assert isinstance(md, Mamba2Metadata)
    assert md.num_decodes == 4
    assert md.has_mamba_track_mask
    assert md.query_start_loc.tolist() == [0, 1, 2, 2, 2]  # cumulative: pad rows empty
    assert md.mamba_cache_indices.tolist() == [3, 1, -1, -1]
    assert md.mamba_track_indices is not None
    assert md.mamba_track_indices.tolist() == [9, -1, -1, -1]
    assert md.mamba_track_mask is not None
    assert md.mamba_track_mask.tolist() == [True, False, False, False]
    x = buffers.views(4)["x"]
    assert x.tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]
    # Rows [B:max_bs) were not touched by refresh and are not reachable from the metadata.
    snap = _snapshot(buffers)
    assert snap["mamba_cache_indices"][4:].tolist() == [7, 7]
    assert torch.isnan(snap["x"][4:]).all()


def test_views_are_the_same_storage_every_step() -> None:
    buffers = _buffers()
    a = buffers.refresh(_step([1, 2, 3]), 4, _x(3))
    b = buffers.refresh(_step([5]), 4, _x(1))
    assert a.mamba_cache_indices is b.mamba_cache_indices
    assert a.query_start_loc.data_ptr() == b.query_start_loc.data_ptr()
    assert b.mamba_cache_indices.tolist() == [5, -1, -1, -1]


def test_every_per_row_field_is_buffered() -> None:
    # Declared from the metadata classes: every per-row field gets a buffer by default,
    # except an optional one whose None no pad can stand for (a tree's parents: None means
    # chains, the pad -1 would mean roots), which a step must then always give.
    buffers = StaticBuffers(max_bs=2, num_slots=4, device="cpu")
    per_row = {s.name for s in fields_of(ForwardMetadata) if s.per_row}
    assert set(buffers.field_names) == per_row - {"retrieve_parent_token"}
    # the subsumed flag is captured True because every field it governs is buffered
    assert buffers.static["has_mamba_track_mask"] is True
    partial = _buffers(optional_fields=())
    assert partial.static["has_mamba_track_mask"] is False
    # Buffering half of a governed pair builds no valid metadata: refused at construction.
    with pytest.raises(ValueError, match="given together or not at all"):
        _buffers(optional_fields=("mamba_track_mask",))


def test_optional_field_left_none_is_padded_over_the_bucket() -> None:
    buffers = _buffers()
    _poison(buffers)
    md = buffers.refresh(_step([2, 4]), 3, _x(2))
    assert md.mamba_track_mask is not None
    assert md.mamba_track_indices is not None
    assert md.mamba_track_mask.tolist() == [False] * 3
    assert md.mamba_track_indices.tolist() == [-1] * 3
    assert md.has_mamba_track_mask  # captured True covers a step with no tracking


def test_pad_all_makes_every_row_padding() -> None:
    buffers = _buffers()
    _poison(buffers)
    md = buffers.pad_all(3)
    assert md.query_start_loc.tolist() == [0, 0, 0, 0]
    assert md.mamba_cache_indices.tolist() == [-1, -1, -1]
    assert buffers.views(3)["x"].tolist() == [[0.0, 0.0]] * 3


def test_virtual_slots_are_translated_once() -> None:
    table = torch.tensor([5, 4, 3, 2, 1, 0, 15, 14], dtype=torch.int64)
    buffers = _buffers(slot_table=table)
    md = buffers.refresh(_step([0, 6, 2], [8, 9, 10], [True, True, False]), 4, _x(3))
    assert md.mamba_cache_indices.tolist() == [5, 15, 3, -1]
    # Track slots are physical already: not translated.
    assert md.mamba_track_indices is not None
    assert md.mamba_track_indices.tolist() == [8, 9, 10, -1]


def _count_foreach_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the length of every ``torch._foreach_copy_`` list (the copies still run)."""
    calls: list[int] = []
    real = torch._foreach_copy_

    def counted(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        calls.append(len(dsts))
        real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    return calls


def test_refresh_copies_every_dtype_in_one_foreach_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # int64 slots and offsets, a bool mask, a float input: one dispatcher call (one launch
    # on a GPU) for every live row and pad of the three dtypes, written exactly.
    buffers = _buffers()
    _poison(buffers)
    calls = _count_foreach_copies(monkeypatch)
    md = buffers.refresh(_step([3, 1], [9, -1], [True, False]), 4, _x(2))
    assert len(calls) == 1 and calls[0] >= 3, calls
    assert md.mamba_cache_indices.tolist() == [3, 1, -1, -1]
    assert md.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    assert md.mamba_track_mask is not None
    assert md.mamba_track_mask.tolist() == [True, False, False, False]
    assert buffers.views(4)["x"].tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]
    calls.clear()
    buffers.pad_all(4)
    assert len(calls) == 1, calls
    assert md.mamba_track_mask.tolist() == [False] * 4


def test_a_source_without_byte_view_is_copied_per_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # A live source whose last dimension is strided has no byte view: that refresh copies
    # per dtype, with the same values, and leaves the rows past the bucket alone.
    buffers = _buffers(slot_table=torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int64))
    _poison(buffers)
    calls = _count_foreach_copies(monkeypatch)
    strided_slots = torch.tensor([[0, 9], [4, 9]])[:, 0]  # stride 2
    strided_x = (torch.arange(8.0).reshape(2, 4) + 1)[:, ::2]  # [[1, 3], [5, 7]]
    step = _step([0, 4], [8, -1], [True, False], mamba_cache_indices=strided_slots)
    md = buffers.refresh(step, 3, {"x": strided_x})
    assert len(calls) >= 2, calls  # one per dtype
    assert md.mamba_cache_indices.tolist() == [5, 1, -1]  # translated
    assert md.mamba_track_indices is not None
    assert md.mamba_track_indices.tolist() == [8, -1, -1]
    assert md.mamba_track_mask is not None
    assert md.mamba_track_mask.tolist() == [True, False, False]
    assert buffers.views(3)["x"].tolist() == [[1.0, 3.0], [5.0, 7.0], [0.0, 0.0]]
    snap = _snapshot(buffers)
    assert snap["mamba_cache_indices"][3:].tolist() == [7] * (MAX_BS - 3)
    assert torch.isnan(snap["x"][3:]).all()
    # The next contiguous step takes the one-call path again, on the same plan.
    calls.clear()
    md = buffers.refresh(_step([0, 4], [8, -1], [True, False]), 3, {"x": strided_x.contiguous()})
    assert len(calls) == 1 and md.mamba_cache_indices.tolist() == [5, 1, -1]


@pytest.mark.gpu
def test_a_cuda_refresh_is_one_copy_launch_and_one_translation() -> None:
    # On a GPU the byte-view copy must take the multi-tensor fast path: one kernel for the
    # int64, bool and float rows and pads together, plus the translation's with a table.
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    for table, launches in ((None, 1), (torch.arange(SLOTS, device=dev).flip(0), 2)):
        buffers = _buffers(device=dev, slot_table=table)
        _poison(buffers)
        cpu = _step([3, 1], [9, -1], [True, False])
        step = ForwardMetadata(
            query_start_loc=cpu.query_start_loc.to(dev),
            mamba_cache_indices=cpu.mamba_cache_indices.to(dev),
            mamba_track_indices=cpu.mamba_track_indices.to(dev),  # type: ignore[union-attr]
            mamba_track_mask=cpu.mamba_track_mask.to(dev),  # type: ignore[union-attr]
            has_mamba_track_mask=True,
        )
        x = {"x": _x(2)["x"].to(dev)}
        buffers.refresh(step, 4, x)  # the plan is made on the first call
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            md = buffers.refresh(step, 4, x)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if str(e.device_type) == "DeviceType.CUDA"]
        assert len(kernels) == launches, kernels
        slots = [3, 1] if table is None else [SLOTS - 4, SLOTS - 2]
        assert md.mamba_cache_indices.tolist() == [*slots, -1, -1]
        assert md.query_start_loc.tolist() == [0, 1, 2, 2, 2]
        assert md.mamba_track_mask is not None
        assert md.mamba_track_mask.tolist() == [True, False, False, False]
        assert buffers.views(4)["x"].tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]
        assert _snapshot(buffers)["mamba_cache_indices"][4:].tolist() == [7, 7]


def test_target_verify_buffers_per_token_inputs_and_tree_fields() -> None:
    buffers = StaticBuffers(
        max_bs=4,
        num_slots=8,
        device="cpu",
        max_draft=3,
        optional_fields=("retrieve_next_token",),
        static={"is_target_verify": True},
        inputs={"h": InputSpec((1,), torch.float32, rows=TOKENS, pad=0.5)},
    )
    step = ForwardMetadata(
        query_start_loc=torch.tensor([0, 3, 6]),
        mamba_cache_indices=torch.tensor([1, 2]),
        retrieve_next_token=torch.tensor([[1, 2, -1], [-1, -1, -1]]),
        is_target_verify=True,
        draft_token_num=3,
    )
    md = buffers.refresh(step, 3, {"h": torch.ones(6, 1)})
    assert md.is_target_verify
    assert md.query_start_loc.tolist() == [0, 3, 6, 6]
    assert md.retrieve_next_token is not None
    assert md.retrieve_next_token.tolist() == [[1, 2, -1], [-1, -1, -1], [-1, -1, -1]]
    assert buffers.views(3)["h"].flatten().tolist() == [1.0] * 6 + [0.5] * 3


def test_refresh_does_not_read_device_values_outside_debug_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Refresh inside an emulated capture: any host read of a tensor value would raise. The
    # one documented read is the slot check, which runs on host-known values (CPU buffers)
    # only, and on a GPU in debug mode: take it out, the rest must read nothing.
    ranges: list[int] = []
    buffers = _buffers(slot_table=torch.arange(SLOTS))

    def counted(step: ForwardMetadata, present: tuple[bool, ...]) -> bool:
        ranges.append(1)
        return True

    monkeypatch.setattr(buffers, "_slot_check", counted)
    step = _step([1, 2], [3, -1], [True, False])
    x = _x(2)
    graph = EmulatedGraphBackend().capture(lambda: buffers.refresh(step, 4, x), warmup=0)
    assert graph.outputs.mamba_cache_indices.tolist() == [1, 2, -1, -1]
    assert ranges == [1]


# ----------------------------------------------------------------------- bad input

_Case = tuple[str, Callable[[StaticBuffers], object], str]
# Debug cases build the step outside debug mode (the core's own debug checks would fire on
# construction) and refresh it inside.
_Refresh = tuple[ForwardMetadata, int, dict[str, torch.Tensor]]
_DebugCase = tuple[str, Callable[[], _Refresh], str]

_CHEAP_CASES: list[_Case] = [
    (
        "bs>max_bs",
        lambda b: b.refresh(_step(list(range(MAX_BS + 1))), MAX_BS, _x(MAX_BS + 1)),
        r"mamba_cache_indices has bs=7 rows, more than max_bs=6",
    ),
    ("bs=0", lambda b: b.refresh(_step([]), 1, _x(0)), r"mamba_cache_indices must have bs > 0"),
    ("bucket<bs", lambda b: b.refresh(_step([1, 2, 3]), 2, _x(3)), r"bucket must satisfy bs <="),
    ("bucket>max", lambda b: b.refresh(_step([1]), MAX_BS + 1, _x(1)), r"bucket must satisfy"),
    (
        "dtype",
        lambda b: b.refresh(
            _step(
                [1, 2],
                query_start_loc=torch.arange(3, dtype=torch.int32),
                mamba_cache_indices=torch.tensor([1, 2], dtype=torch.int32),
            ),
            2,
            _x(2),
        ),
        r"query_start_loc must have dtype torch.int64",
    ),
    (
        "device",
        lambda b: b.refresh(
            _step(
                [1, 2],
                query_start_loc=torch.arange(3, device="meta"),
                mamba_cache_indices=torch.empty(2, dtype=torch.int64, device="meta"),
            ),
            2,
            {"x": torch.ones(2, 2, device="meta")},
        ),
        r"mamba_cache_indices must be on cpu",
    ),
    (
        "input rows",
        lambda b: b.refresh(_step([1, 2]), 2, _x(3)),
        r"input x must have 2 rows \(bs=2\)",
    ),
    (
        "input shape",
        lambda b: b.refresh(_step([1]), 1, {"x": torch.ones(1, 3)}),
        r"input x must have trailing shape \(2,\), got \(3,\)",
    ),
    (
        "input dtype",
        lambda b: b.refresh(_step([1]), 1, {"x": torch.ones(1, 2, dtype=torch.float64)}),
        r"input x must have dtype torch.float32",
    ),
    ("missing input", lambda b: b.refresh(_step([1]), 1, {}), r"inputs must name exactly"),
    (
        "host value drift",
        lambda b: b.refresh(_step([1], is_target_verify=True), 1, _x(1)),
        r"is_target_verify is True but the graphs were captured with False; host values are "
        r"frozen at capture \(use a StaticBuffers/runner built for this value\)",
    ),
    (
        "unbuffered field",
        lambda b: b.refresh(_step([1], conv_states_mask_indices=torch.tensor([0])), 1, _x(1)),
        r"conv_states_mask_indices is set but is not a static buffer of this graph; a captured "
        r"step would silently ignore it",
    ),
    (
        "slot out of range (host-known: always)",
        lambda b: b.refresh(_step([1, SLOTS]), 2, _x(2)),
        r"mamba_cache_indices row 1 holds 16: not a slot in \[0, 16\)",
    ),
    (
        "negative slot (host-known: always)",
        lambda b: b.refresh(_step([-5]), 1, _x(1)),
        r"mamba_cache_indices row 0 holds -5",
    ),
    (
        "track slot out of range (host-known: always)",
        lambda b: b.refresh(_step([1], [SLOTS + 2], [True]), 1, _x(1)),
        r"mamba_track_indices row 0 holds 18",
    ),
    (
        "track slot below the pad (host-known: always)",
        lambda b: b.refresh(_step([1, 2], [-2, 5], [False, True]), 2, _x(2)),
        r"mamba_track_indices row 0 holds -2: not -1 \(pad\) nor a slot in \[0, 16\)",
    ),
    # The slot rules of a live step (host-known: always on CPU buffers; debug mode on a GPU).
    (
        "duplicate working slot",
        lambda b: b.refresh(_step([3, 5, 3]), 3, _x(3)),
        r"mamba_cache_indices rows 0 and 2 hold the same slot 3: two rows would update one state",
    ),
    (
        "pad value in a live row",
        lambda b: b.refresh(_step([2, -1]), 2, _x(2)),
        r"mamba_cache_indices holds the pad -1 in live row 1: every row of a step is live and "
        r"needs a slot in \[0, 16\) \(pad rows are the buffers' business\)",
    ),
    (
        "flagged row without track slot",
        lambda b: b.refresh(_step([1, 2], [-1, 4], [True, False]), 2, _x(2)),
        r"mamba_track_indices row 0 is -1 \(none\) but mamba_track_mask flags it: a flagged "
        r"row needs a track slot",
    ),
    (
        "track slot is another row's working slot",
        lambda b: b.refresh(_step([5, 2], [2, -1], [True, False]), 2, _x(2)),
        r"mamba_track_indices row 0 \(flagged in mamba_track_mask\) saves into slot 2, the "
        r"mamba_cache_indices of row 1: the save would overwrite live state",
    ),
    (
        "track slot is the row's own working slot",
        lambda b: b.refresh(_step([5, 2], [5, -1], [True, False]), 2, _x(2)),
        r"saves into slot 5, its own mamba_cache_indices",
    ),
    (
        "two flagged rows save into one track slot",
        lambda b: b.refresh(_step([1, 2, 3], [9, 8, 9], [True, False, True]), 3, _x(3)),
        r"mamba_track_indices rows 0 and 2, both flagged in mamba_track_mask, save into the "
        r"same track slot 9",
    ),
    (
        "0-d input",
        lambda b: b.refresh(_step([1]), 1, {"x": torch.tensor(1.0)}),
        r"input x must have a leading row dimension \(1 rows\), got a 0-d tensor",
    ),
    (
        "unbuffered per-row field",
        lambda b: b.refresh(
            _step([1], retrieve_next_token=torch.tensor([[0]])),
            1,
            _x(1),
        ),
        r"retrieve_next_token is set but is not a static buffer",
    ),
    (
        "track slot at num_slots",
        lambda b: b.refresh(_step([1], [SLOTS], [True]), 1, _x(1)),
        r"mamba_track_indices row 0 holds 16: not -1 \(pad\) nor a slot in \[0, 16\)",
    ),
    # Slot 0 is a slot: a step using it is refused for its real fault, named as such.
    (
        "slot 0 beside a duplicate",
        lambda b: b.refresh(_step([0, 5, 5]), 3, _x(3)),
        r"mamba_cache_indices rows 1 and 2 hold the same slot 5: two rows",
    ),
    (
        "track slot 0 beside a duplicate",
        lambda b: b.refresh(_step([1, 1], [0, -1], [True, False]), 2, _x(2)),
        r"mamba_cache_indices rows 0 and 1 hold the same slot 1",
    ),
    (
        "duplicate above the smallest slot",
        lambda b: b.refresh(_step([5, 3, 5]), 3, _x(3)),
        r"mamba_cache_indices rows 0 and 2 hold the same slot 5",
    ),
    (
        "input not a tensor",
        lambda b: b.refresh(_step([1]), 1, {"x": [[1.0, 2.0]]}),  # type: ignore[dict-item]
        r"StaticBuffers\.refresh: input x must be a torch\.Tensor, got list",
    ),
    (
        "input device",
        lambda b: b.refresh(_step([1]), 1, {"x": torch.ones(1, 2, device="meta")}),
        r"StaticBuffers\.refresh: input x must be on cpu \(the static buffer's device\), got meta",
    ),
]

_DEBUG_CASES: list[_DebugCase] = [
    (
        "decreasing qsl",
        lambda: (_step([1, 2], query_start_loc=torch.tensor([0, 1, 0])), 2, _x(2)),
        # the prefix names the refresh and the step's class (check_values' where=)
        r"^StaticBuffers\.refresh: ForwardMetadata\.query_start_loc must be non-decreasing",
    ),
    (
        "qsl not from 0",
        lambda: (_step([1], query_start_loc=torch.tensor([1, 2])), 1, _x(1)),
        r"query_start_loc must start at 0",
    ),
    (
        "qsl not one token per row",
        lambda: (_step([1, 2], query_start_loc=torch.tensor([0, 2, 3])), 2, _x(2)),
        r"query_start_loc must give every row 1 token",
    ),
    (
        "NaN input",
        lambda: (_step([1]), 1, {"x": torch.tensor([[1.0, float("nan")]])}),
        r"input x holds NaN in a live row",
    ),
]


@pytest.mark.parametrize(("name", "call", "match"), _CHEAP_CASES, ids=[c[0] for c in _CHEAP_CASES])
def test_bad_input_is_refused_before_anything_is_written(
    name: str, call: Callable[[StaticBuffers], object], match: str
) -> None:
    buffers = _buffers()
    _poison(buffers)
    before = _snapshot(buffers)
    with pytest.raises((ValueError, TypeError), match=match):
        call(buffers)
    _assert_untouched(before, _snapshot(buffers))


@pytest.mark.parametrize(("name", "make", "match"), _DEBUG_CASES, ids=[c[0] for c in _DEBUG_CASES])
def test_value_checks_run_in_debug_mode_before_anything_is_written(
    name: str, make: Callable[[], _Refresh], match: str
) -> None:
    buffers = _buffers()
    _poison(buffers)
    before = _snapshot(buffers)
    step, bucket, inputs = make()
    with debug_mode(), pytest.raises(ValueError, match=match):
        buffers.refresh(step, bucket, inputs)
    _assert_untouched(before, _snapshot(buffers))


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ([1, 4], r"mamba_cache_indices row 1 holds 4 \(a value\): not a virtual slot "
         r"\(slot-table index\) in \[0, 4\)"),
        # A live -1 passed the range check and the buffers were written before the
        # translation raised a bare IndexError (issue 21).
        ([1, -1], r"mamba_cache_indices row 1 holds -1 \(the pad -1 in a live row\): not a "
         r"virtual slot \(slot-table index\) in \[0, 4\); every row of a step is live and "
         r"the slot table has no pad entry"),
    ],
)  # fmt: skip
def test_virtual_slot_out_of_table_is_refused_before_anything_is_written(
    slots: list[int], match: str
) -> None:
    buffers = _buffers(slot_table=torch.arange(4, dtype=torch.int64))
    _poison(buffers)
    before = _snapshot(buffers)
    with pytest.raises(ValueError, match=match):
        buffers.refresh(_step(slots, [6, -1], [True, False]), 2, _x(2))
    _assert_untouched(before, _snapshot(buffers))


def test_debug_checks_run_on_physical_ids() -> None:
    """With a slot table, working ids are virtual: a virtual id equal to a row's physical
    track slot is legitimate (table[3] = 4, track slot 3) and must not be refused; a real
    collision (physical working slot == track slot) is refused before any write."""
    table = torch.tensor([0, 1, 2, 4, 3, 5, 6, 7], dtype=torch.int64)
    buffers = _buffers(slot_table=table)
    with debug_mode():
        md = buffers.refresh(_step([3], [3], [True]), 1, _x(1))
    assert md.mamba_cache_indices.tolist() == [4]
    _poison(buffers)
    before = _snapshot(buffers)
    match = r"saves into slot 4, its own mamba_cache_indices \(physical, through the slot table\)"
    for debug in (False, True):  # host-known values: refused in and outside debug mode
        with debug_mode(debug), pytest.raises(ValueError, match=match):
            buffers.refresh(_step([3], [4], [True]), 1, _x(1))  # virtual 3 -> physical 4
        _assert_untouched(before, _snapshot(buffers))
    # Two virtual ids are distinct, their physical slots too (the table has no duplicate).
    with pytest.raises(ValueError, match=r"rows 0 and 1 hold the same slot 4 \(physical"):
        buffers.refresh(_step([3, 3]), 2, _x(2))
    # Virtual slot 0 is a table index like any other: the duplicate is what is named.
    with pytest.raises(ValueError, match=r"rows 1 and 2 hold the same slot 4 \(physical"):
        buffers.refresh(_step([0, 3, 3]), 3, _x(3))


@pytest.mark.gpu
def test_slot_rules_on_a_gpu_run_in_debug_mode_only() -> None:
    # On a GPU the step's ids are device values: reading them would be a sync per step, so
    # outside debug mode the refresh does not check them (the kernels' own in-kernel
    # checks stand guard); debug mode refuses, before anything is written.
    dev = torch.device("cuda")
    buffers = _buffers(device=dev)
    cpu = _step([3, 3])
    step = ForwardMetadata(
        query_start_loc=cpu.query_start_loc.to(dev),
        mamba_cache_indices=cpu.mamba_cache_indices.to(dev),
    )
    x = {"x": _x(2)["x"].to(dev)}
    md = buffers.refresh(step, 2, x)
    assert md.mamba_cache_indices.tolist() == [3, 3]
    _poison(buffers)
    before = _snapshot(buffers)
    with debug_mode(), pytest.raises(ValueError, match="rows 0 and 1 hold the same slot 3"):
        buffers.refresh(step, 2, x)
    _assert_untouched(before, _snapshot(buffers))


def test_cuda_without_cuda_is_refused_with_our_message() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"device cuda was asked for but CUDA is not available"):
        _buffers(device="cuda")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_bs": 0}, "max_bs must be an int > 0"),
        ({"num_slots": 0}, "num_slots must be an int > 0"),
        ({"max_bs": 2.5}, "max_bs must be an int > 0"),
        ({"index_dtype": torch.float32}, "index_dtype must be int32 or int64"),
        ({"optional_fields": ("query_start_loc",)}, "not an optional per-row field"),
        ({"static": {"nope": 1}}, "unknown"),
        ({"max_draft": 0}, "max_draft must be an int > 0"),
        ({"static": {"draft_token_num": 2}}, "draft columns are a bucket dimension"),
        ({"max_draft": 2}, "draft_token_num is 2 but is_target_verify is False"),
        ({"slot_table": torch.tensor([0, SLOTS])}, "slot_table maps to slots outside"),
        ({"slot_table": torch.tensor([0, -1])}, r"or to the pad -1: virtual slot 1 maps to -1"),
        (
            {"slot_table": torch.tensor([4, 0, 7, 4])},
            r"virtual slots 0 and 3 both map to physical slot 4",
        ),
        (
            {"slot_table": torch.tensor([0], dtype=torch.int32)},
            r"slot_table must be a 1-D torch.int64 tensor on cpu, got \(1,\) torch.int32 on cpu",
        ),
        ({"slot_table": [0, 1]}, "slot_table must be a 1-D torch.int64 tensor on cpu, got list"),
        (
            {"slot_table": torch.tensor([4, 0, 7, 0])},
            r"slot_table has a duplicate entry: virtual slots 1 and 3 both map to physical "
            r"slot 0 \(two requests would update one state\)",
        ),
        ({"inputs": {"mamba_cache_indices": InputSpec((1,), torch.float32)}}, "collides"),
    ],
)
def test_constructor_refuses_bad_configuration(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _buffers(**kw)


def test_input_spec_rows_must_be_known() -> None:
    with pytest.raises(ValueError, match=r"InputSpec\.rows"):
        InputSpec((1,), torch.float32, rows=Dim("prefills"))


def test_poison_start_out_of_range() -> None:
    with pytest.raises(ValueError, match="start must be in"):
        _buffers().poison_(MAX_BS + 1, lambda n, t: None)
    with pytest.raises(ValueError, match="start must be in"):
        _buffers().poison_(-1, lambda n, t: None)


def test_poison_hands_out_exactly_the_rows_past_start() -> None:
    buffers = _buffers()
    tails: dict[str, int] = {}
    buffers.poison_(MAX_BS, lambda name, t: tails.__setitem__(name, t.shape[0]))
    assert tails == {"query_start_loc": 0, "mamba_cache_indices": 0, "mamba_track_indices": 0,
                     "mamba_track_mask": 0, "x": 0}  # fmt: skip
    _poison(buffers)
    buffers.refresh(_step([3, 1]), 2, _x(2))
    buffers.poison_(2, lambda name, t: tails.__setitem__(name, t.shape[0]))
    assert tails["query_start_loc"] == MAX_BS + 1 - 3 and tails["x"] == MAX_BS - 2
    assert tails["mamba_cache_indices"] == MAX_BS - 2

    def fill(name: str, t: torch.Tensor) -> None:
        t.fill_(5)

    buffers.poison_(2, fill)
    snap = buffers.snapshot()  # rows [0:start) keep the refresh
    assert snap["mamba_cache_indices"].tolist() == [3, 1] + [5] * (MAX_BS - 2)
    assert snap["query_start_loc"].tolist() == [0, 1, 2] + [5] * (MAX_BS - 2)


def test_buckets() -> None:
    assert default_buckets(1) == (1,)
    assert default_buckets(6) == (1, 2, 4, 6)
    assert default_buckets(8) == (1, 2, 4, 8)
    assert bucket_for((1, 2, 4, 6), 3) == 4
    assert bucket_for((1, 2, 4, 6), 4) == 4
    with pytest.raises(ValueError, match=r"bs=5 exceeds the largest captured bucket 4$"):
        bucket_for((1, 2, 4), 5)
    with pytest.raises(ValueError, match="max_bs must be > 0"):
        default_buckets(0)


def test_int32_index_buffers() -> None:
    table = torch.arange(SLOTS, dtype=torch.int32).flip(0)  # virtual v -> SLOTS - 1 - v
    buffers = _buffers(index_dtype=torch.int32, slot_table=table)
    i32 = torch.int32
    step = ForwardMetadata(
        query_start_loc=torch.arange(3, dtype=i32),
        mamba_cache_indices=torch.tensor([4, 2], dtype=i32),
        mamba_track_indices=torch.tensor([9, 10], dtype=i32),
        mamba_track_mask=torch.tensor([True, False]),
        has_mamba_track_mask=True,
    )
    md = buffers.refresh(step, 3, _x(2))
    assert md.query_start_loc.dtype == i32
    assert md.query_start_loc.tolist() == [0, 1, 2, 2]
    assert md.mamba_cache_indices.dtype == i32
    assert md.mamba_cache_indices.tolist() == [SLOTS - 5, SLOTS - 3, -1]


def test_generated_step_check_accepts_exactly_what_the_detailed_checks_accept() -> None:
    # refresh runs one generated straight-line check per step and the detailed checks
    # (which name the broken rule) only when it fails: both must agree on every step,
    # with the same (bs, t, which optional fields are set).
    from hybridmeta.model import SpecCommitMetadata, prepare_commit, prepare_target_verify

    plain = _buffers()
    every_optional = StaticBuffers(max_bs=MAX_BS, num_slots=SLOTS, device="cpu")
    verify = StaticBuffers(
        max_bs=4, num_slots=8, device="cpu", max_draft=3, static={"is_target_verify": True}
    )
    commit = StaticBuffers(
        max_bs=4,
        num_slots=8,
        device="cpu",
        max_draft=2,
        metadata_class=SpecCommitMetadata,
        static={"is_target_verify": True},
    )
    i32 = torch.int32
    tree = torch.tensor([[-1, 0], [-1, 0]])
    verify_fwd = ForwardMetadata(
        query_start_loc=torch.tensor([0, 2, 4]),
        mamba_cache_indices=torch.tensor([1, 2]),
        is_target_verify=True,
        draft_token_num=2,
    )
    verify_md = prepare_target_verify(verify_fwd)
    steps: list[ForwardMetadata] = [
        _step([1, 2]),
        _step([1, 2], [3, 4], [True, False]),
        _step([1, 2], [3, 4], [False, False]),
        _step(list(range(MAX_BS))),
        _step(list(range(MAX_BS + 1))),
        _step([]),
        _step([1], is_target_verify=True),
        _step([1], conv_states_mask_indices=torch.tensor([0])),
        _step([1], retrieve_next_token=torch.tensor([[0]])),
        _step([1], query_start_loc=torch.arange(2, dtype=i32)),
        _step(
            [1],
            mamba_cache_indices=torch.tensor([1], dtype=i32),
            query_start_loc=torch.arange(2, dtype=i32),
        ),
        _step([1], [2], [True], mamba_track_indices=torch.tensor([2], dtype=i32)),
        _step(
            [1, 2],
            query_start_loc=torch.arange(3, device="meta"),
            mamba_cache_indices=torch.empty(2, dtype=torch.int64, device="meta"),
        ),
        verify_fwd,
        ForwardMetadata(
            query_start_loc=torch.tensor([0, 2, 4]),
            mamba_cache_indices=torch.tensor([1, 2]),
            is_target_verify=True,
            draft_token_num=2,
            retrieve_parent_token=tree,
        ),
        verify_md,
        prepare_commit(
            verify_md, accepted_index=torch.tensor([0, 1]), track_token=torch.tensor([-1, -1])
        ),
    ]
    checked = 0
    for buffers in (plain, every_optional, verify, commit):
        for step in steps:
            for key in ((1, 1), (2, 1), (2, 2), (4, 3), (MAX_BS, 1), (MAX_BS + 1, 1)):
                fast = buffers._step_check(step, *key)
                try:
                    slow = buffers._validate_step(step, key)
                except (ValueError, TypeError):
                    slow = None
                assert fast == slow, (step, key)
                checked += fast is not None
    assert checked >= 10  # the accepting side is exercised too


def test_the_slot_table_is_copied_and_frozen_at_construction() -> None:
    # Issue 21: the table was kept by reference; changing it after construction sent slot
    # 100 of a 16-slot pool straight to the kernels.
    table = torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int64)
    buffers = _buffers(slot_table=table)
    table[1] = 100
    table.resize_(2)
    md = buffers.refresh(_step([1, 5]), 2, _x(2))
    assert md.mamba_cache_indices.tolist() == [4, 0]
    with pytest.raises(
        ValueError, match=r"row 0 holds 6 \(a value\): not a virtual slot .* \[0, 6\)"
    ):
        buffers.refresh(_step([6]), 1, _x(1))


def test_refreshed_bucket_names_the_bucket_the_buffers_hold_whole() -> None:
    buffers = _buffers()
    held = [buffers.refreshed_bucket]
    buffers.refresh(_step([3, 1]), 4, _x(2))
    held.append(buffers.refreshed_bucket)
    with pytest.raises(ValueError, match="hold the same slot 3"):
        buffers.refresh(_step([3, 3]), 2, _x(2))
    held.append(buffers.refreshed_bucket)  # a refusal writes nothing: the bucket stays whole
    buffers.pad_all(2)
    held.append(buffers.refreshed_bucket)
    buffers.poison_(2, lambda name, t: None)  # past the bucket
    held.append(buffers.refreshed_bucket)
    buffers.poison_(1, lambda name, t: None)  # into it
    held.append(buffers.refreshed_bucket)
    assert held == [None, (4, 1), (4, 1), (2, 1), (2, 1), None]


def test_a_subsumed_flag_off_pads_the_fields_it_governs() -> None:
    # The graphs are captured with has_mamba_track_mask on (every row masked per row); a step
    # with the flag off saves nothing eagerly, whatever its mask says: its track rows are
    # padded, and its track values are not checked (no layer reads them).
    buffers = _buffers()
    _poison(buffers)
    step = _step([1, 2], [2, -7], [True, True], has_mamba_track_mask=False)
    md = buffers.refresh(step, 3, _x(2))
    assert md.mamba_track_mask is not None and md.mamba_track_indices is not None
    assert md.mamba_track_mask.tolist() == [False] * 3
    assert md.mamba_track_indices.tolist() == [-1] * 3


def test_a_write_that_fails_leaves_no_bucket_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Whatever stops a write part way (here the copy itself), the buffers then hold no
    # complete bucket: no graph may replay them until the next refresh.
    buffers = _buffers()
    buffers.refresh(_step([3, 1]), 4, _x(2))

    def broken(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        dsts[0].copy_(srcs[0])
        raise RuntimeError("device lost")

    with monkeypatch.context() as m:
        m.setattr(torch, "_foreach_copy_", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            buffers.refresh(_step([5, 2]), 4, _x(2))
    held = [buffers.refreshed_bucket]
    buffers.refresh(_step([5, 2]), 4, _x(2))
    held.append(buffers.refreshed_bucket)
    assert held == [None, (4, 1)]


# --------------------------------------------------------------------------- engine extensions


@metadata(extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0))
class _EngineStep(ForwardMetadata):
    """vLLM-shaped: its own per-row field and host field, null slot 0 (a reserved block)."""

    seq_lens: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0))
    spec_budget: int = 0


def _engine_step(slots: list[int], seq: list[int], **kw: Any) -> _EngineStep:
    bs = len(slots)
    return _EngineStep(
        query_start_loc=torch.arange(bs + 1),
        mamba_cache_indices=torch.tensor(slots, dtype=torch.int64),
        seq_lens=torch.tensor(seq, dtype=torch.int64),
        **kw,
    )


def _as_engine(md: Mamba2Metadata) -> _EngineStep:
    # The bucket's metadata is the generated specialisation: the engine's fields flow.
    assert isinstance(md, _EngineStep) and isinstance(md, Mamba2Metadata)
    return md


def test_an_engine_extension_is_buffered_from_its_declarations() -> None:
    buffers = _buffers(source=_EngineStep, optional_fields=(), num_slots=SLOTS)
    _poison(buffers)
    md = _as_engine(buffers.refresh(_engine_step([3, 1], [17, 9]), 4, _x(2)))
    ptr = md.seq_lens.data_ptr()
    assert md.seq_lens.tolist() == [17, 9, 0, 0]  # its declared pad on the pad rows
    # Slot fields pad with the class's declared null slot, not -1.
    assert md.mamba_cache_indices.tolist() == [3, 1, 0, 0]
    assert md.spec_budget == 0
    # The stale tail beyond the bucket stays unreachable.
    assert _snapshot(buffers)["seq_lens"][4:].tolist() == [7, 7]
    # A smaller step through the same bucket: the previous rows 1..3 are padded again.
    md = _as_engine(buffers.refresh(_engine_step([5], [4]), 4, _x(1)))
    assert md.seq_lens.tolist() == [4, 0, 0, 0]
    assert md.seq_lens.data_ptr() == ptr  # one static buffer, every step
    assert md.mamba_cache_indices.tolist() == [5, 0, 0, 0]


def test_an_engine_extension_step_is_checked_like_the_root() -> None:
    buffers = _buffers(source=_EngineStep, optional_fields=())
    with pytest.raises(TypeError, match=r"step must be a _EngineStep, got ForwardMetadata"):
        buffers.refresh(_step([1]), 2, _x(1))
    with pytest.raises(ValueError, match=r"spec_budget.*captured with 0"):
        buffers.refresh(_engine_step([1], [3], spec_budget=2), 2, _x(1))
    frozen = _buffers(source=_EngineStep, optional_fields=(), static={"spec_budget": 2})
    assert (
        _as_engine(frozen.refresh(_engine_step([1], [3], spec_budget=2), 2, _x(1))).spec_budget == 2
    )
    with pytest.raises(ValueError, match=r"source must be ForwardMetadata or an extension"):
        _buffers(source=Mamba2Metadata)
    with pytest.raises(ValueError, match=r"supported with metadata_class=Mamba2Metadata only"):
        _buffers(source=_EngineStep, metadata_class=SpecCommitMetadata)


def test_an_engine_null_slot_is_refused_in_the_slot_table() -> None:
    # _EngineStep's null slot is 0, inside the pool: a table entry 0 would send a live
    # request to the reserved block.
    with pytest.raises(ValueError, match=r"or to the pad 0: virtual slot 1 maps to 0"):
        _buffers(source=_EngineStep, optional_fields=(), slot_table=torch.tensor([1, 0]))


# --------------------------------------------------------------------------- more refusals


@metadata
class _DecodeExtra(Mamba2Metadata):
    """A class derived from Mamba2Metadata without target verify (decode rows)."""

    extra: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0))


def test_a_step_with_prefill_rows_is_refused_naming_num_prefills() -> None:
    from hybridmeta.planner import plan_mixed_batch

    buffers = StaticBuffers(
        max_bs=4, num_slots=8, device="cpu", metadata_class=_DecodeExtra, optional_fields=()
    )
    _poison(buffers)
    before = _snapshot(buffers)
    md = plan_mixed_batch(extend_lens=[5, 1], prefix_lens=[7, 4], slots=[3, 4], num_decodes=1,
                          chunk_size=4, conv_kernel=4)  # fmt: skip
    step = _DecodeExtra.evolve_from(md, extra=torch.tensor([1, 2]))
    with pytest.raises(
        ValueError,
        match=r"^StaticBuffers\.refresh: num_prefills is 1; graphs capture decode and verify "
        r"rows only$",
    ):
        buffers.refresh(step, 2)
    _assert_untouched(before, _snapshot(buffers))


def test_an_unused_extra_slot_field_does_not_hide_a_broken_track_slot() -> None:
    # An extension's own slot field (Role.SLOT), left None by a step, is skipped; the
    # track slot after it is still checked and named.
    @metadata(extension=True)
    class _WithSrc(ForwardMetadata):
        src_slot: torch.Tensor | None = tensor_field(
            rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), role=Role.SLOT, default=None
        )

    buffers = _buffers(source=_WithSrc, optional_fields=(
        "src_slot", "mamba_track_indices", "mamba_track_mask"))  # fmt: skip
    assert "src_slot" in buffers.field_names
    step = _WithSrc(
        query_start_loc=torch.arange(2),
        mamba_cache_indices=torch.tensor([1]),
        mamba_track_indices=torch.tensor([SLOTS + 1]),
        mamba_track_mask=torch.tensor([True]),
        has_mamba_track_mask=True,
    )
    with pytest.raises(ValueError, match=r"mamba_track_indices row 0 holds 17: not -1 \(pad\)"):
        buffers.refresh(step, 1, _x(1))
    bad_src = _WithSrc(
        query_start_loc=torch.arange(2),
        mamba_cache_indices=torch.tensor([1]),
        src_slot=torch.tensor([SLOTS]),
    )
    with pytest.raises(ValueError, match=r"src_slot row 0 holds 16: not -1 \(pad\) nor a slot"):
        buffers.refresh(bad_src, 1, _x(1))


def test_duplicates_are_named_lowest_row_first_on_long_steps() -> None:
    # Past numpy's small-array sort the rows of a repeated id are still named in order.
    n = 18
    perm = np.random.default_rng(0).permutation(n)
    perm[-1] = perm[0]
    buffers = StaticBuffers(max_bs=n, num_slots=2 * n, device="cpu", optional_fields=())
    step = ForwardMetadata(
        query_start_loc=torch.arange(n + 1), mamba_cache_indices=torch.from_numpy(perm)
    )
    with pytest.raises(ValueError, match=rf"rows 0 and {n - 1} hold the same slot {perm[0]}:"):
        buffers.refresh(step, n)
    with pytest.raises(
        ValueError, match=rf"virtual slots 0 and {n - 1} both map to physical slot {perm[0]} "
    ):
        StaticBuffers(max_bs=2, num_slots=2 * n, device="cpu", slot_table=torch.from_numpy(perm))


# --------------------------------------------------------------------------- copy paths


def test_one_dtype_buffers_refresh_and_pad() -> None:
    # Only int64 buffers (no inputs, no mask): one copy group, nothing to merge.
    buffers = StaticBuffers(max_bs=4, num_slots=8, device="cpu", optional_fields=())
    _poison(buffers)
    md = buffers.refresh(_step([3, 1]), 3)
    assert md.mamba_cache_indices.tolist() == [3, 1, -1]
    assert md.query_start_loc.tolist() == [0, 1, 2, 2]
    md = buffers.pad_all(4)
    assert md.mamba_cache_indices.tolist() == [-1] * 4
    assert md.query_start_loc.tolist() == [0] * 5
    assert buffers.refreshed_bucket == (4, 1)
    md = buffers.pad_all(1)  # the smallest bucket is padded like any other
    assert md.mamba_cache_indices.tolist() == [-1]
    assert buffers.refreshed_bucket == (1, 1)


def test_two_dtypes_are_one_foreach_call(monkeypatch: pytest.MonkeyPatch) -> None:
    buffers = _buffers(optional_fields=())  # int64 metadata and a float32 input
    calls = _count_foreach_copies(monkeypatch)
    md = buffers.refresh(_step([3, 1]), 4, _x(2))
    assert len(calls) == 1, calls
    assert md.mamba_cache_indices.tolist() == [3, 1, -1, -1]
    assert buffers.views(4)["x"].tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]


def test_per_dtype_copies_with_one_destination_each() -> None:
    # A strided input takes the per-dtype path; with bs == B the float input is one live
    # copy, the unused track mask one pad copy, and every group is written.
    buffers = _buffers()
    _poison(buffers)
    strided_x = (torch.arange(8.0).reshape(2, 4) + 1)[:, ::2]  # [[1, 3], [5, 7]]
    md = buffers.refresh(_step([3, 1]), 2, {"x": strided_x})
    assert md.mamba_cache_indices.tolist() == [3, 1]
    assert md.query_start_loc.tolist() == [0, 1, 2]
    assert md.mamba_track_mask is not None and md.mamba_track_mask.tolist() == [False, False]
    assert md.mamba_track_indices is not None and md.mamba_track_indices.tolist() == [-1, -1]
    assert buffers.views(2)["x"].tolist() == [[1.0, 3.0], [5.0, 7.0]]


def test_a_pad_all_that_fails_leaves_no_bucket_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    buffers = _buffers()
    buffers.pad_all(4)

    def broken(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(torch, "_foreach_copy_", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        buffers.pad_all(2)
    assert buffers.refreshed_bucket is None


def test_a_bucket_metadata_is_built_once_outside_debug_mode() -> None:
    # The same object every step (what a captured graph was handed); debug mode rebuilds
    # it so the core's checks see the refreshed rows.
    buffers = _buffers()
    a = buffers.refresh(_step([1, 2]), 4, _x(2))
    b = buffers.refresh(_step([5]), 4, _x(1))
    assert a is b and buffers.pad_all(4) is a
    with debug_mode():
        c = buffers.refresh(_step([5]), 4, _x(1))
    assert c is not a and c.mamba_cache_indices.tolist() == [5, -1, -1, -1]


def test_a_refresh_under_another_default_device_builds_on_the_buffers_device() -> None:
    """The offsets' pad table is built on the buffers' device, not on torch's default
    device: a refresh under ``with torch.device("meta")`` failed copying out of a meta
    tensor (and under a default CUDA device CPU buffers took a device round trip)."""
    want = _buffers().refresh(_step([3, 5]), 4, _x(2))
    buffers = _buffers()
    step, x = _step([3, 5]), _x(2)
    with torch.device("meta"):
        md = buffers.refresh(step, 4, x)
    assert md.query_start_loc.device.type == "cpu"
    assert md.query_start_loc.tolist() == want.query_start_loc.tolist() == [0, 1, 2, 2, 2]
    assert md.mamba_cache_indices.tolist() == want.mamba_cache_indices.tolist()
