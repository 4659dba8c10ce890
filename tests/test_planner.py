"""Unit tests of the mixed-batch planner: worked examples and refusals."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hybridmeta import (
    BATCH,
    INDEX,
    Conventions,
    ForwardMetadata,
    Mamba2Metadata,
    Pad,
    Role,
    RowOrder,
    debug_mode,
    metadata,
    planner,
    tensor_field,
)
from hybridmeta.planner import MixedHostPlan, plan_host, plan_mixed_batch, plan_verify_host
from hybridmeta.staging import to_device_packed


def _plan(**over: Any) -> Mamba2Metadata:
    kw: dict[str, Any] = {
        "extend_lens": [5, 5],
        "prefix_lens": [0, 0],
        "slots": [0, 1],
        "num_decodes": 0,
        "chunk_size": 8,
        "conv_kernel": 4,
    }
    kw.update(over)
    return plan_mixed_batch(**kw)


def _host(**over: Any) -> MixedHostPlan:
    kw: dict[str, Any] = {
        "extend_lens": [5, 5],
        "prefix_lens": [0, 0],
        "slots": [0, 1],
        "num_decodes": 0,
        "chunk_size": 8,
        "conv_kernel": 4,
    }
    kw.update(over)
    return plan_host(**kw)


def test_worked_example_logical_chunks() -> None:
    # query_start_loc=[0,5,10], chunk=8: logical chunks start at 0, 5 (row 1) and 8
    md = _plan()
    mixed = md.mixed
    assert mixed is not None
    ch = mixed.chunks
    assert ch.start.tolist() == [0, 5, 8]
    assert ch.length.tolist() == [5, 3, 2]
    assert ch.row.tolist() == [0, 1, 1]
    assert ch.first.tolist() == [True, True, False]
    assert ch.row_last_chunk.tolist() == [0, 2]
    assert ch.phys_last_chunk.tolist() == [1, 2]
    assert ch.token_chunk.tolist() == [0] * 5 + [1] * 3 + [2] * 2
    assert ch.token_pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert mixed.has_initial_states.tolist() == [False, False]
    assert md.query_start_loc.tolist() == [0, 5, 10]
    assert md.mamba_track_mask is None and md.has_mamba_track_mask is False


def test_track_kinds_worked_example() -> None:
    # chunk 4, interval 4. Row 0: tokens 0..4 (prefix 2): last boundary abs 4 -> k=2, g=2:
    # off grid. Row 1: tokens 5..8 (prefix 1): boundary abs 4 -> k=3, g=8: on grid, h[1].
    # Row 2: tokens 9..11 (prefix 5): boundary abs 8 ends the row -> final.
    # Row 3 (decode, prefix 7): 7+1 = 8 -> final. Row 4 (decode, prefix 8): no boundary.
    kw: dict[str, Any] = {
        "extend_lens": [5, 4, 3, 1, 1],
        "prefix_lens": [2, 1, 5, 7, 8],
        "slots": [0, 1, 2, 3, 4],
        "num_decodes": 2,
        "chunk_size": 4,
        "track_interval": 4,
        "track_mask": [True, True, True, True, True],
        "track_slots": [10, 11, 12, 13, 14],
    }
    hp = _host(**kw)
    assert (hp.final_rows, hp.h_rows, hp.recompute_rows) == ((2, 3), (1,), (0,))
    md = _plan(**kw)
    assert md.mixed is not None
    tr = md.mixed.track
    assert tr.recompute_rows.tolist() == [0]
    assert tr.recompute_chunk.tolist() == [0]  # token 1 is in logical chunk 0 (tokens 0..3)
    assert tr.recompute_len.tolist() == [2]
    assert tr.h_rows.tolist() == [1]
    # physical chunk 1 (tokens 4..7) ends in logical chunk 2 (row 1's tokens 5..7)
    assert tr.h_chunk.tolist() == [2]
    # conv windows (K-1 = 3) before g, h entries first: row 1 (g=8): tokens 5, 6, 7;
    # row 0 (g=2): init column 2 of row 0 (extended index T + r*3 + c, T = 12), tokens 0, 1.
    assert tr.windows.tolist() == [[5, 6, 7], [12 + 0 + 2, 0, 1]]
    # rows that save: their track slot; the final saves are flagged in the mask
    assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
    assert md.mamba_track_indices.tolist() == [10, 11, 12, 13, -1]
    assert md.mamba_track_mask.tolist() == [False, False, True, True, False]
    assert md.has_mamba_track_mask is True


def test_decode_only_batch_is_decode_metadata() -> None:
    md = _plan(extend_lens=[1, 1], prefix_lens=[3, 9], num_decodes=2)
    assert md.mixed is None
    assert (md.num_prefills, md.num_decodes, md.num_prefill_tokens) == (0, 2, 0)


def test_one_staged_copy_with_the_callers_arrays() -> None:
    hp = _host()
    views = to_device_packed({**hp.arrays, "mine": torch.arange(3)}, torch.device("cpu"))
    md = hp.metadata(views)
    # every tensor of the metadata is a view of the one staged buffer
    base = views["mine"].untyped_storage().data_ptr()
    assert md.mamba_cache_indices.untyped_storage().data_ptr() == base
    assert md.mixed is not None
    assert md.mixed.chunks.start.untyped_storage().data_ptr() == base
    assert md.mixed.conv.token_windows.untyped_storage().data_ptr() == base
    with pytest.raises(ValueError, match=r"views must hold the staged MixedHostPlan\.arrays"):
        hp.metadata({"mine": views["mine"]})


def test_refuses_views_that_are_no_mapping() -> None:
    hp = _host()
    staged = list(to_device_packed(hp.arrays, torch.device("cpu")).values())
    for build in (hp.forward, hp.metadata):
        with pytest.raises(TypeError, match=r"^MixedHostPlan: views must be the mapping to_device_packed returns .*got list$"):
            build(staged)  # type: ignore[arg-type]


def test_engine_fields_pass_through_the_constructor() -> None:
    hp = _host()
    views = to_device_packed(hp.arrays, torch.device("cpu"))
    extra = torch.tensor([1])
    md = hp.metadata(views, conv_states_mask_indices=extra)
    assert md.conv_states_mask_indices is extra


def test_accepts_cpu_tensors() -> None:
    md = _plan(
        extend_lens=torch.tensor([5, 5]),
        prefix_lens=torch.tensor([0, 3], dtype=torch.int32),
        slots=torch.tensor([4, 2]),
    )
    assert md.mamba_cache_indices.tolist() == [4, 2]
    assert md.mixed is not None
    assert md.mixed.has_initial_states.tolist() == [False, True]


def test_planned_metadata_passes_the_debug_checks() -> None:
    with debug_mode():
        _plan(
            extend_lens=[5, 4, 1],
            prefix_lens=[2, 1, 7],
            slots=[0, 1, 3],
            num_decodes=1,
            chunk_size=4,
            track_interval=4,
            track_mask=[True, True, True],
            track_slots=[10, 11, 13],
        )


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"chunk_size": 0}, "chunk_size must be > 0"),
        ({"conv_kernel": 1}, "conv_kernel must be >= 2"),
        (
            {"track_interval": 12, "track_mask": [True, False], "track_slots": [5, -1]},
            r"track_interval \(12\) must be a positive multiple of the SSM chunk_size \(8\)",
        ),
        ({"prefix_lens": [0]}, "prefix_lens has 1 rows but extend_lens has 2"),
        ({"slots": [0, 1, 2]}, "slots has 3 rows but extend_lens has 2"),
        ({"extend_lens": [5, 0]}, r"extend_lens\[1\] = 0"),
        ({"prefix_lens": [0, -1]}, r"prefix_lens\[1\] = -1 must be >= 0"),
        ({"num_decodes": 1}, r"extend_lens\[1\] = 5 but row 1 is a decode row"),
        (
            {"extend_lens": [5, 1], "num_decodes": 1},
            r"prefix_lens\[1\] = 0 but row 1 is a decode row",
        ),
        ({"num_decodes": 3}, r"num_decodes must be in \[0, 2\]"),
        ({"slots": [1, 1]}, "duplicate working slot"),
        ({"slots": [0, -1]}, r"slots\[1\] = -1"),
        (
            {"track_interval": 8, "track_mask": [True, False], "track_slots": [1, 7]},
            r"track_slots\[0\] = 1 is also a working slot",
        ),
        (
            {"track_interval": 8, "track_mask": [True, True], "track_slots": [7, 7]},
            "two tracked rows share one track slot",
        ),
        (
            {"track_interval": 8, "track_mask": [False, True], "track_slots": [7, -1]},
            r"track_slots\[1\] = -1 but track_mask\[1\] is set",
        ),
        ({"track_mask": [True, False], "track_slots": [5, 6]}, "without track_interval"),
        ({"track_interval": 8, "track_mask": [True, False]}, "without track_slots"),
        ({"extend_lens": [], "prefix_lens": [], "slots": []}, "no rows"),
        ({"extend_lens": [1.5, 2.0]}, "extend_lens must hold integers"),
        (
            {"track_interval": 8, "track_mask": [1, 0], "track_slots": [5, 6]},
            "track_mask must be bool",
        ),
    ],
)
def test_refuses_inconsistent_input(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _plan(**over)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a device tensor")
def test_refuses_device_tensors() -> None:
    with pytest.raises(ValueError, match="extend_lens must be host data"):
        _plan(extend_lens=torch.tensor([5, 5], device="cuda"))


def test_refuses_meta_tensors_as_host_data() -> None:
    # any non-CPU tensor is refused before it is read (meta stands in for a device here)
    with pytest.raises(ValueError, match="slots must be host data"):
        _plan(slots=torch.tensor([0, 1], device="meta"))


def test_the_plan_never_aliases_the_callers_arrays() -> None:
    slots = np.array([4, 2])
    lens = torch.tensor([5, 5])
    hp = _host(slots=slots, extend_lens=lens)
    slots[0] = 9
    lens[0] = 1
    assert hp.arrays["hybridmeta.slots"].tolist() == [4, 2]
    assert hp.arrays["hybridmeta.query_start_loc"].tolist() == [0, 5, 10]


def test_cached_host_constants_give_the_uncached_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # Long batches bypass the cached iota / window template: the same arrays either way.
    kw: dict[str, Any] = {
        "extend_lens": [50, 2, 70, 1, 1],
        "prefix_lens": [0, 3, 9, 4, 6],
        "slots": [0, 1, 2, 3, 4],
        "num_decodes": 2,
        "chunk_size": 8,
        "track_interval": 16,
        "track_mask": [True] * 5,
        "track_slots": [5, 6, 7, 8, 9],
    }
    for k in (2, 3, 4):
        cached = _host(**kw, conv_kernel=k)
        monkeypatch.setattr(planner, "_CACHE_TOKENS", 0)
        direct = _host(**kw, conv_kernel=k)
        monkeypatch.undo()
        assert list(cached.arrays) == list(direct.arrays)
        for name, a in cached.arrays.items():
            assert a.dtype == direct.arrays[name].dtype
            assert np.array_equal(a, direct.arrays[name]), name


def _nothing_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every planning phase after the argument checks fail loudly: a refusal must
    come before anything is computed or staged."""

    def computed(*_: object, **__: object) -> None:
        raise AssertionError("the planner computed a plan from arguments it should refuse")

    for phase in ("_track_kinds", "_chunks", "_conv_windows", "_pack"):
        monkeypatch.setattr(planner, phase, computed)


_TYPED_REFUSALS: list[tuple[dict[str, Any], type[Exception], str]] = [
    # counts and sizes: plain ints (bool refused where an int is expected)
    ({"chunk_size": 8.0}, TypeError, r"^plan_mixed_batch: chunk_size must be an int, got float 8\.0$"),
    ({"chunk_size": True}, TypeError, r"chunk_size must be an int, got bool True$"),
    ({"conv_kernel": 4.0}, TypeError, r"conv_kernel must be an int, got float 4\.0$"),
    ({"conv_kernel": "4"}, TypeError, r"conv_kernel must be an int, got str '4'$"),
    ({"num_decodes": 0.0}, TypeError, r"num_decodes must be an int, got float 0\.0$"),
    ({"num_decodes": False}, TypeError, r"num_decodes must be an int, got bool False$"),
    (
        {"num_decodes": np.int64(0)},
        TypeError,
        r"num_decodes must be an int, got numpy\.int64 .*\(pass int\(\.\.\.\)\)$",
    ),
    (
        {"track_interval": 8.0, "track_mask": [True, False], "track_slots": [5, -1]},
        TypeError,
        r"track_interval must be an int, got float 8\.0$",
    ),
    # per-row lists: 1-D sequences, arrays or CPU tensors of integers
    ({"extend_lens": [[5], [5]]}, ValueError, r"extend_lens must be 1-D \(one entry per row\), got shape \(2, 1\)$"),
    ({"extend_lens": torch.tensor([[5], [5]])}, ValueError, r"extend_lens must be 1-D .*got shape \(2, 1\)$"),
    ({"slots": np.array([[0, 1]])}, ValueError, r"slots must be 1-D .*got shape \(1, 2\)$"),
    ({"prefix_lens": [[0], 0]}, ValueError, r"prefix_lens must be a flat \(1-D\) sequence of ints, one per row; got a nested or ragged sequence$"),
    ({"extend_lens": 5}, TypeError, r"extend_lens must be a 1-D sequence of ints \(one per row\), a numpy array or a CPU tensor; got int$"),
    ({"slots": "01"}, TypeError, r"slots must be a 1-D sequence of ints .*; got str$"),
    ({"slots": None}, TypeError, r"slots must be a 1-D sequence of ints .*; got NoneType$"),
    ({"extend_lens": [5, None]}, ValueError, r"extend_lens must hold integers, got extend_lens\[1\] = None \(NoneType\)$"),
    ({"extend_lens": [5, "5"]}, ValueError, r"extend_lens must hold integers, got strings"),
    (
        {"track_interval": 8, "track_mask": [[True], [False]], "track_slots": [5, 6]},
        ValueError,
        r"track_mask must be 1-D .*got shape \(2, 1\)$",
    ),
    (
        {"track_interval": 8, "track_mask": "ab", "track_slots": [5, 6]},
        TypeError,
        r"track_mask must be a 1-D sequence of bools .*; got str$",
    ),
    (
        {"track_interval": 8, "track_mask": [True, False], "track_slots": [[5], [6]]},
        ValueError,
        r"track_slots must be 1-D .*got shape \(2, 1\)$",
    ),
    # values past int64: numpy would wrap them, silently
    ({"prefix_lens": [2**63, 0]}, ValueError, r"prefix_lens\[0\] = 9223372036854775808 does not fit int64$"),
    ({"prefix_lens": [0, 2**64]}, ValueError, r"prefix_lens\[1\] = 18446744073709551616 does not fit int64$"),
    (  # numpy makes these lists uint64 (all past int64), which int64 would wrap
        {"extend_lens": [2**63], "prefix_lens": [2**63 + 1], "slots": [2**63 + 2]},
        ValueError,
        r"extend_lens\[0\] = 9223372036854775808 does not fit int64$",
    ),
    (
        {"slots": np.array([0, 2**63 + 1], dtype=np.uint64)},
        ValueError,
        r"slots\[1\] = 9223372036854775809 does not fit int64$",
    ),
    # positions and offsets that would overflow int64
    (
        {"prefix_lens": [0, 2**63 - 3]},
        ValueError,
        r"prefix_lens\[1\] \+ extend_lens\[1\] = 9223372036854775810: the row's positions overflow int64$",
    ),
    (
        {"extend_lens": [2**62, 2**62]},
        ValueError,
        r"extend_lens sum to 9223372036854775808 tokens: the token offsets overflow int64$",
    ),
    (
        {"chunk_size": 2**61, "conv_kernel": 2},
        ValueError,
        r"extend_lens hold 10 prefill tokens; with chunk_size 2305843009213693952 and conv_kernel 2, the plan's chunk and conv window indices overflow int64$",
    ),
]


@pytest.mark.parametrize(("over", "exc", "match"), _TYPED_REFUSALS)
@pytest.mark.parametrize("entry", ["plan_host", "plan_mixed_batch"])
def test_refuses_wrongly_typed_arguments_before_computing(
    monkeypatch: pytest.MonkeyPatch,
    entry: str,
    over: dict[str, Any],
    exc: type[Exception],
    match: str,
) -> None:
    _nothing_computed(monkeypatch)
    with pytest.raises(exc, match=match):
        (_host if entry == "plan_host" else _plan)(**over)


def test_integer_arrays_of_every_width_plan_alike() -> None:
    # numpy's unsigned and narrow dtypes within int64, tuples and int subclasses plan as
    # the plain lists do; the refusal of values past int64 above is the only difference
    class Width(int):
        pass

    want = _host(extend_lens=[5, 7], prefix_lens=[0, 3], slots=[4, 2])
    for got in (
        _host(extend_lens=np.array([5, 7], dtype=np.uint64), prefix_lens=(0, 3),
              slots=torch.tensor([4, 2], dtype=torch.uint8)),
        _host(extend_lens=range(5, 9, 2), prefix_lens=np.array([0, 3], dtype=np.int8),
              slots=[4, 2], chunk_size=Width(8)),
    ):  # fmt: skip
        assert list(got.arrays) == list(want.arrays)
        for name, a in want.arrays.items():
            assert np.array_equal(got.arrays[name], a), name
    with pytest.raises(ValueError, match=r"extend_lens\[0\] = 9223372036854775808 does not fit"):
        _host(extend_lens=np.array([2**63, 7], dtype=np.uint64))


def test_refuses_a_device_that_is_no_device() -> None:
    with pytest.raises(TypeError, match=r"^plan_mixed_batch: device must be a torch\.device or a str, got float 3\.0$"):
        _plan(device=3.0)
    with pytest.raises(ValueError, match=r"^plan_mixed_batch: device 'gpu0' is not a device name"):
        _plan(device="gpu0")


@metadata(extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0))
class _VllmForward(ForwardMetadata):
    """vLLM's conventions: decode rows first, null slot 0."""


def test_decodes_first_worked_example() -> None:
    # The track-kinds example above with its two decode rows first (vLLM's order): rows
    # D3 (prefix 7), D4 (prefix 8), then P0, P1, P2. The decode rows' tokens come first,
    # the prefill plan is the same (its tokens from 2), its mid-row saves name batch rows.
    kw: dict[str, Any] = {
        "extend_lens": [1, 1, 5, 4, 3],
        "prefix_lens": [7, 8, 2, 1, 5],
        "slots": [4, 5, 1, 2, 3],
        "num_decodes": 2,
        "chunk_size": 4,
        "track_interval": 4,
        "track_mask": [True] * 5,
        "track_slots": [13, 14, 10, 11, 12],
        "forward_cls": _VllmForward,
    }
    hp = _host(**kw)
    assert (hp.final_rows, hp.h_rows, hp.recompute_rows) == ((0, 4), (3,), (2,))
    with debug_mode():
        md = _plan(**kw)
    assert isinstance(md, Mamba2Metadata)
    assert md.conventions.decodes_first and md.conventions.null_slot == 0
    assert md.query_start_loc.tolist() == [0, 1, 2, 7, 11, 14]
    assert (md.decode_rows(), md.prefill_rows()) == (slice(0, 2), slice(2, 5))
    assert md.prefill_slots.tolist() == [1, 2, 3]
    assert md.mixed is not None
    tr = md.mixed.track
    assert (tr.h_rows.tolist(), tr.recompute_rows.tolist()) == ([3], [2])
    assert (tr.h_chunk.tolist(), tr.recompute_chunk.tolist(), tr.recompute_len.tolist()) == (
        [2], [0], [2]
    )  # fmt: skip
    assert tr.windows.tolist() == [[5, 6, 7], [12 + 0 + 2, 0, 1]]  # prefill-relative
    assert md.mixed.chunks.start.tolist()[:2] == [0, 4]
    # the rows that save nothing hold the declared null slot, 0
    assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
    assert md.mamba_track_indices.tolist() == [13, 0, 10, 11, 12]
    assert md.mamba_track_mask.tolist() == [True, False, False, False, True]


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        # decode rows first: rows 0..num_decodes-1 are the decode rows
        (
            {"extend_lens": [5, 1], "prefix_lens": [3, 3], "num_decodes": 1},
            ValueError,
            r"extend_lens\[0\] = 5 but row 0 is a decode row \(decode rows come first \(RowOrder\.DECODES_FIRST\)",
        ),
        (
            {"extend_lens": [1, 5], "prefix_lens": [0, 3], "num_decodes": 1},
            ValueError,
            r"prefix_lens\[0\] = 0 but row 0 is a decode row",
        ),
        # the null slot (0) is no live row's
        ({"slots": [1, 0]}, ValueError, r"slots\[1\] = 0 is the null slot 0 \(Conventions\.null_slot\), which no live row holds"),
        (
            {"track_interval": 8, "track_mask": [False, True], "track_slots": [7, 0]},
            ValueError,
            r"track_slots\[1\] = 0 is the null slot 0 \(Conventions\.null_slot\) but track_mask\[1\] is set",
        ),
    ],
)
def test_decodes_first_and_null_slot_rules(
    over: dict[str, Any], exc: type[Exception], match: str
) -> None:
    kw: dict[str, Any] = {"slots": [1, 2], "forward_cls": _VllmForward, **over}
    with pytest.raises(exc, match=match):
        _plan(**kw)
    with pytest.raises(exc, match=match):
        _host(**kw)


class _Undecorated(ForwardMetadata):
    pass


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        ("ForwardMetadata", r"forward_cls must be ForwardMetadata or an engine's extension of it"),
        (Mamba2Metadata, r"forward_cls Mamba2Metadata is a derived metadata class \(built only through evolve_from\)"),
        (_Undecorated, r"_Undecorated subclasses the metadata class ForwardMetadata but is not decorated"),
    ],
)
def test_refuses_a_forward_cls_the_planner_cannot_build(cls: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        _plan(forward_cls=cls)
    with pytest.raises(TypeError, match=match):
        plan_verify_host(slots=[0, 1], draft_token_num=2, forward_cls=cls)  # type: ignore[arg-type]


def test_track_positions_save_an_earlier_boundary_of_the_step() -> None:
    # vLLM's align mode (decode rows first, null slot 0): row 1 is a 256-token prompt with
    # interval 128; the last boundary it reaches (256) ends the row, but the cache wants
    # the state at 128 (the last boundary strictly before its last token). Row 2 (tokens
    # 128..299) keeps its last boundary (256), given explicitly.
    kw: dict[str, Any] = {
        "extend_lens": [1, 256, 172],
        "prefix_lens": [9, 0, 128],
        "slots": [4, 5, 6],
        "num_decodes": 1,
        "chunk_size": 32,
        "track_interval": 128,
        "track_mask": [False, True, True],
        "track_slots": [0, 7, 8],
        "forward_cls": _VllmForward,
    }
    default = _host(**kw)
    assert (default.final_rows, default.h_rows, default.recompute_rows) == ((1,), (2,), ())
    hp = _host(**kw, track_positions=[0, 128, 256])
    # row 1: boundary 128 = token offset 1 + 128 = 129 of the batch, prefill-flat 128: on
    # the grid (h); nothing is a final save any more
    assert (hp.final_rows, hp.h_rows, hp.recompute_rows) == ((), (1, 2), ())
    md = _plan(**kw, track_positions=[0, 128, 256])
    assert md.mixed is not None and md.mamba_track_indices is not None
    tr = md.mixed.track
    # the chunk ending at prefill-flat 128 (row 1's token 127), and row 2's at 256 + 128
    ch = md.mixed.chunks
    assert [int(ch.start[c] + ch.length[c]) for c in tr.h_chunk.tolist()] == [128, 256 + 128]
    assert md.mamba_track_indices.tolist() == [0, 7, 8]
    assert md.mamba_track_mask is not None and md.mamba_track_mask.tolist() == [False] * 3
    assert md.has_mamba_track_mask is False


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([0, 256, 96], r"track_positions\[2\] = 96 but row 2 is tracked over tokens 128\.\.300"),
        ([0, 0, 256], r"track_positions\[1\] = 0 but row 1 is tracked over tokens 0\.\.256"),
        ([0, 64, 256], r"track_positions\[1\] = 64 .* a multiple of track_interval \(128\)"),
        ([0, 384, 256], r"track_positions\[1\] = 384"),
        ([0, 128], r"track_positions has 2 rows but extend_lens has 3"),
    ],
)
def test_track_positions_are_checked(positions: list[int], match: str) -> None:
    kw: dict[str, Any] = {
        "extend_lens": [1, 256, 172], "prefix_lens": [9, 0, 128], "slots": [4, 5, 6],
        "num_decodes": 1, "chunk_size": 32, "track_interval": 128,
        "track_mask": [False, True, True], "track_slots": [0, 7, 8], "forward_cls": _VllmForward,
    }  # fmt: skip
    with pytest.raises(ValueError, match=match):
        _host(**kw, track_positions=positions)
    with pytest.raises(ValueError, match="track_positions given without track_mask"):
        _host(extend_lens=[5], prefix_lens=[0], slots=[1], track_positions=[4])


@metadata(extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0))
class _EngineStep(ForwardMetadata):
    """An engine's step with a field of its own (no default: the planner must pass it)."""

    seq_lens: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0), role=Role.ENGINE_ONLY)


def test_plan_mixed_batch_passes_engine_fields_through_the_constructor() -> None:
    seq = torch.tensor([8, 5])
    for ext, nd in (([1, 5], 1), ([1, 1], 2)):  # mixed, and decode-only
        md = plan_mixed_batch(extend_lens=ext, prefix_lens=[7, 4], slots=[3, 4], num_decodes=nd,
                              chunk_size=4, conv_kernel=4, forward_cls=_EngineStep,
                              engine={"seq_lens": seq})  # fmt: skip
        assert isinstance(md, _EngineStep) and md.seq_lens is seq
        assert md.mamba_cache_indices.tolist() == [3, 4]
    with pytest.raises(TypeError):  # the class's own field is required
        plan_mixed_batch(extend_lens=[1, 5], prefix_lens=[7, 4], slots=[3, 4], num_decodes=1,
                         chunk_size=4, conv_kernel=4, forward_cls=_EngineStep)  # fmt: skip
