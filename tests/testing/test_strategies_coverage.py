"""What the public strategies can reach, and what they never produce.

An engine's property test is only as strong as the cases its strategy draws: a
``batches`` that never draws a flagged row, a pad row between live rows or a track slot
shared with another row's working slot, or a ``metadata_instances`` that never draws the
pad slot, an absent optional or the widest batch, passes a backend that breaks on exactly
those. Each test here finds the case (``hypothesis.find``) or checks the bound on every
draw, so a strategy that loses a case or leaves its range fails.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from hybridmeta.core import BATCH, BOOL, INDEX, Dim, Pad, Role, field, metadata, tensor_field
from hybridmeta.testing import Batch, DraftTree, TailFill, batches, fill_tail, metadata_instances
from hybridmeta.testing.strategies import _non_tensor_strategy

T = TypeVar("T")
# Derandomized: the same draws on every machine, so a reachability check cannot pass here
# and miss its case elsewhere.
_FIND = settings(max_examples=3000, database=None, phases=(Phase.generate,), derandomize=True,
                 suppress_health_check=list(HealthCheck))  # fmt: skip
_EVERY = settings(max_examples=60, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip


def reach(strategy: st.SearchStrategy[T], what: Callable[[T], bool]) -> T:
    """An example satisfying ``what`` (the test fails when the strategy cannot draw one)."""
    return find(strategy, what, settings=_FIND)


# --------------------------------------------------------------------------- batches


def test_batches_reach_both_ends_of_bs() -> None:
    s = batches(max_bs=5, num_slots=10, min_bs=2, track=False)
    assert reach(s, lambda b: b.bs == 2).bs == 2
    assert reach(s, lambda b: b.bs == 5).bs == 5


def test_batches_reach_the_first_and_last_slot() -> None:
    s = batches(max_bs=2, num_slots=4, track=False)
    reach(s, lambda b: 0 in b.slots)
    reach(s, lambda b: 3 in b.slots)


def test_batches_reach_a_pad_row_between_live_rows() -> None:
    b = reach(
        batches(max_bs=3, num_slots=6, pad_rows=True, track=False),
        lambda b: b.bs == 3 and b.slots[1] == -1 and b.slots[0] >= 0 and b.slots[2] >= 0,
    )
    assert b.live_rows() == (0, 2)


def test_batches_reach_every_track_case() -> None:
    s = batches(max_bs=2, num_slots=6)
    flagged = reach(s, lambda b: any(b.track_mask))
    assert flagged.tracked_rows() and flagged.has_track
    reach(s, lambda b: not any(b.track_mask) and all(t == -1 for t in b.track_slots))

    # Unflagged rows carry -1, a spare slot, or a slot another row works on (never written).
    def foreign(b: Batch) -> bool:
        return any(
            not m and t >= 0 and t in b.slots[:i] + b.slots[i + 1 :]
            for i, (m, t) in enumerate(zip(b.track_mask, b.track_slots, strict=True))
        )

    shared = reach(s, foreign)
    assert set(shared.addressed()) == set(shared.slots) | {
        shared.track_slots[i] for i in shared.tracked_rows()
    }
    reach(s, lambda b: not b.track_mask[0] and b.track_slots[0] not in (-1, *b.slots))


def test_batches_reach_every_prefill_mix_and_length() -> None:
    s = batches(max_bs=3, num_slots=6, prefills=True, max_extend=5, track=False)
    reach(s, lambda b: b.num_prefills == 0)
    reach(s, lambda b: b.num_prefills == b.bs == 3)
    reach(s, lambda b: 0 < b.num_prefills < b.bs)
    reach(s, lambda b: 1 in b.extend_lens[: b.num_prefills])
    reach(s, lambda b: 5 in b.extend_lens[: b.num_prefills])


@_EVERY
@given(b=batches(max_bs=3, num_slots=6, prefills=True, max_extend=5, draft_token_num=st.just(3)))
def test_batch_extend_lens_stay_in_range(b: Batch) -> None:
    assert all(1 <= n <= 5 for n in b.extend_lens[: b.num_prefills])
    assert b.extend_lens[b.num_prefills :] == (3,) * b.num_decodes
    assert b.draft_token_num == 3
    assert b.draft_trees is not None and len(b.draft_trees) == b.bs
    assert all(t.k == 3 for t in b.draft_trees)
    assert 0 <= b.seed <= 2**16


def test_batches_draw_draft_token_num_from_a_strategy() -> None:
    s = batches(max_bs=1, num_slots=2, draft_token_num=st.integers(1, 3))
    assert reach(s, lambda b: b.draft_token_num == 1).draft_trees is None
    assert reach(s, lambda b: b.draft_token_num == 3).draft_trees is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_bs": 2, "num_slots": 3}, r"num_slots=3 < 4 \(2 \* max_bs with track\)"),
        ({"max_bs": 2, "num_slots": 1, "track": False}, r"num_slots=1 < 2"),
        ({"max_bs": 2, "num_slots": 4, "min_bs": 0}, r"need 1 <= min_bs <= max_bs, got 0, 2"),
        ({"max_bs": 2, "num_slots": 4, "min_bs": 3}, r"need 1 <= min_bs <= max_bs, got 3, 2"),
        (
            {"max_bs": 2, "num_slots": 4, "draft_token_num": 0},
            r"draft_token_num must be >= 1, got 0",
        ),
    ],
)
def test_batches_refuse_impossible_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        find(batches(**kwargs), lambda b: True, settings=_FIND)


def test_batches_accept_the_smallest_pools() -> None:
    assert reach(batches(max_bs=2, num_slots=2, track=False), lambda b: b.bs == 2).bs == 2
    assert reach(batches(max_bs=2, num_slots=4), lambda b: b.bs == 2).bs == 2
    assert reach(batches(max_bs=2, num_slots=4, min_bs=2), lambda b: True).bs == 2


# --------------------------------------------------------------------------- metadata

THINGS = Dim("things")


@metadata
class Probe:
    """One field of each kind ``metadata_instances`` draws differently."""

    slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
    offsets: torch.Tensor = tensor_field(rows=BATCH + 1, dtypes=INDEX, pad=Pad.CUMULATIVE)
    counts: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0))
    mask: torch.Tensor = tensor_field(rows=BATCH, dtypes=BOOL, pad=Pad.value(False))
    values: torch.Tensor = tensor_field(
        rows=BATCH, dtypes=(torch.float32, torch.bfloat16), pad=Pad.value(0.0)
    )
    anything: torch.Tensor = tensor_field(rows=BATCH, pad=Pad.value(0.0))  # no dtypes declared
    weights: torch.Tensor = tensor_field(
        rows=BATCH, ndim=2, dtypes=(torch.float32,), pad=Pad.value(0.0)
    )
    things: torch.Tensor = tensor_field(rows=THINGS, dtypes=INDEX)
    free: torch.Tensor = tensor_field(dtypes=INDEX)
    width: int = field(default=1)
    table: torch.Tensor = tensor_field(rows=BATCH, cols="width", dtypes=INDEX, pad=Pad.value(-1))
    grid: torch.Tensor = tensor_field(rows=BATCH, ndim=2, dtypes=INDEX, pad=Pad.value(0))
    flag: bool = field(default=False)
    ratio: float = field(default=0.0)
    opt: int | None = field(default=None)
    lens: tuple[int, ...] = field(default=())
    maybe: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(-1), default=None
    )
    other: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(0), default=None
    )


_PROBES = metadata_instances(Probe, max_bs=3, max_rows=4, num_slots=5)


def test_rows_symbols_reach_their_bounds() -> None:
    reach(_PROBES, lambda m: m.slots.shape[0] == 1)
    reach(_PROBES, lambda m: m.slots.shape[0] == 3)
    reach(_PROBES, lambda m: m.things.shape[0] == 0)
    reach(_PROBES, lambda m: m.things.shape[0] == 4)
    reach(_PROBES, lambda m: m.free.shape[0] == 0)
    reach(_PROBES, lambda m: m.free.shape[0] == 4)


def test_slot_fields_reach_the_pad_and_the_last_slot() -> None:
    reach(_PROBES, lambda m: bool((m.slots == -1).any()))
    reach(_PROBES, lambda m: bool((m.slots == 4).any()))
    reach(_PROBES, lambda m: bool((m.table == -1).any()))  # a slot field by its -1 pad
    reach(_PROBES, lambda m: bool((m.counts == 4).any()))
    reach(_PROBES, lambda m: bool((m.counts == 0).any()))


def test_offsets_reach_empty_and_longest_rows() -> None:
    reach(_PROBES, lambda m: bool(((m.offsets[1:] - m.offsets[:-1]) == 0).any()))
    reach(_PROBES, lambda m: bool(((m.offsets[1:] - m.offsets[:-1]) == 4).any()))


def _has_dtype(name: str, dtype: torch.dtype) -> Callable[[Probe], bool]:
    return lambda m: bool(getattr(m, name).dtype == dtype)


def test_index_fields_reach_each_declared_dtype() -> None:
    for name in ("slots", "offsets", "counts"):  # slot ids, offsets, other indices
        for dtype in INDEX:
            reach(_PROBES, _has_dtype(name, dtype))


def test_host_annotations_map_to_bounded_strategies() -> None:
    floats, ints = _non_tensor_strategy(float), _non_tensor_strategy(int)
    assert floats is not None and ints is not None
    for bad in (lambda x: x > 4, lambda x: x < -4):
        with pytest.raises(NoSuchExample):
            find(floats, bad, settings=_FIND)
    with pytest.raises(NoSuchExample):
        find(ints, lambda x: not 1 <= x <= 4, settings=_FIND)
    # Only variadic tuples of drawable items are drawable; an optional of an undrawable
    # type is always None.
    assert _non_tensor_strategy(tuple[int, int]) is None
    assert _non_tensor_strategy(tuple[object, ...]) is None
    assert _non_tensor_strategy(object) is None
    none_only = _non_tensor_strategy(object | None)
    assert none_only is not None
    with pytest.raises(NoSuchExample):
        find(none_only, lambda v: v is not None, settings=_FIND)
    several = _non_tensor_strategy(int | str | None)
    assert several is None


def test_tensor_values_reach_both_bools_and_both_dtypes() -> None:
    reach(_PROBES, lambda m: bool(m.mask.any()))
    reach(_PROBES, lambda m: not bool(m.mask.all()))
    reach(_PROBES, lambda m: m.values.dtype == torch.bfloat16)
    reach(_PROBES, lambda m: m.values.dtype == torch.float32)
    reach(_PROBES, lambda m: bool((m.values < -1).any()))
    reach(_PROBES, lambda m: bool((m.values > 1).any()))


def test_two_d_widths_follow_the_declaration() -> None:
    reach(_PROBES, lambda m: m.width == 1)
    reach(_PROBES, lambda m: m.width == 4)
    reach(_PROBES, lambda m: m.grid.shape[1] == 1)
    reach(_PROBES, lambda m: m.grid.shape[1] == 3)


def test_host_fields_reach_their_values() -> None:
    reach(_PROBES, lambda m: m.flag)
    reach(_PROBES, lambda m: not m.flag)
    reach(_PROBES, lambda m: m.ratio < -1)
    reach(_PROBES, lambda m: m.ratio > 1)
    reach(_PROBES, lambda m: m.opt is None)
    reach(_PROBES, lambda m: m.opt == 1)
    reach(_PROBES, lambda m: m.opt == 4)
    reach(_PROBES, lambda m: m.lens == ())
    reach(_PROBES, lambda m: len(m.lens) == 4)


def test_optional_fields_are_all_present_all_absent_or_each_drawn() -> None:
    reach(_PROBES, lambda m: m.maybe is not None and m.other is not None)
    reach(_PROBES, lambda m: m.maybe is None and m.other is None)
    reach(_PROBES, lambda m: (m.maybe is None) != (m.other is None))


@_EVERY
@given(m=_PROBES)
def test_every_draw_keeps_the_declared_ranges(m: Probe) -> None:
    bs = m.slots.shape[0]
    assert 1 <= bs <= 3
    for t in (m.offsets, m.slots, m.counts, m.things, m.free, m.table, m.grid):
        assert t.dtype in INDEX
    assert m.offsets.shape == (bs + 1,) and int(m.offsets[0]) == 0
    steps = m.offsets[1:] - m.offsets[:-1]
    assert bool((steps >= 0).all()) and bool((steps <= 4).all())
    assert bool((m.slots >= -1).all()) and bool((m.slots <= 4).all())
    assert bool((m.table >= -1).all()) and bool((m.table <= 4).all())
    # An index field that is not a slot (pad 0, not -1) never holds -1.
    assert bool((m.counts >= 0).all()) and bool((m.counts <= 4).all())
    assert bool((m.grid >= 0).all()) and bool((m.grid <= 4).all())
    assert bool((m.things >= 0).all()) and bool((m.free >= 0).all())
    assert 0 <= m.things.shape[0] <= 4 and 0 <= m.free.shape[0] <= 4
    assert m.mask.dtype == torch.bool and m.mask.shape == (bs,)
    assert bool((m.values.float().abs() <= 4).all())
    # Float values are drawn half-precision-exact (they survive the engine's casts), in
    # float32 where no dtype is declared; 2-D float fields are filled row by row.
    for v in (m.values, m.weights, m.anything):
        assert torch.equal(v.float().half().float(), v.float())
    assert m.anything.dtype == torch.float32 and m.anything.shape == (bs,)
    assert m.weights.dtype == torch.float32 and m.weights.shape[0] == bs
    assert 1 <= m.width <= 4 and m.table.shape == (bs, m.width)
    assert m.grid.dim() == 2 and 1 <= m.grid.shape[1] <= 3
    assert isinstance(m.flag, bool) and -4 <= m.ratio <= 4
    assert m.opt is None or 1 <= m.opt <= 4
    assert isinstance(m.lens, tuple) and len(m.lens) <= 4
    assert all(1 <= n <= 4 for n in m.lens)
    for opt in (m.maybe, m.other):
        assert opt is None or opt.shape == (bs,)


def test_cols_override_a_two_d_width() -> None:
    s = metadata_instances(Probe, max_bs=2, cols={"grid": 2, "table": "width"})
    m = reach(s, lambda m: m.width == 3)
    assert m.grid.shape[1] == 2 and m.table.shape[1] == 3


def test_values_override_fields_and_see_what_was_drawn() -> None:
    seen: list[set[str]] = []

    def opt_after(drawn: Mapping[str, Any]) -> st.SearchStrategy[int]:
        seen.append(set(drawn))
        return st.just(drawn["width"] + 10)

    s = metadata_instances(Probe, max_bs=3, values={"width": st.just(2), "opt": opt_after})
    m = reach(s, lambda m: True)
    assert m.width == 2 and m.table.shape[1] == 2 and m.opt == 12
    # Host fields are drawn first, in declaration order: the rows are not drawn yet.
    assert seen and all("width" in names and "batch" not in names for names in seen)


def test_governed_fields_follow_their_flag() -> None:
    from hybridmeta import ForwardMetadata

    s = metadata_instances(ForwardMetadata)
    on = reach(s, lambda m: m.has_mamba_track_mask)
    assert on.mamba_track_mask is not None and on.mamba_track_indices is not None
    reach(s, lambda m: not m.has_mamba_track_mask and m.mamba_track_mask is not None)
    reach(s, lambda m: not m.has_mamba_track_mask and m.mamba_track_mask is None)
    reach(s, lambda m: m.is_target_verify and m.retrieve_parent_token is None)
    reach(s, lambda m: m.is_target_verify and m.retrieve_parent_token is not None)


@metadata
class GroupProbe:
    """A governed pair beside two ungoverned optionals; an optional declared before a
    required tensor (an absent one must not end the drawing)."""

    slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
    has_pair: bool = field(default=False, governs=("left", "right"))
    left: torch.Tensor | None = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0), default=None)
    early: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(0), default=None
    )
    required: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0))
    right: torch.Tensor | None = tensor_field(
        rows=BATCH, dtypes=INDEX, pad=Pad.value(0), default=None
    )
    z: torch.Tensor | None = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0), default=None)
    w: torch.Tensor | None = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0), default=None)


_GROUPS = metadata_instances(GroupProbe, max_bs=2, num_slots=3)


@_EVERY
@given(m=_GROUPS)
def test_a_governed_group_is_present_or_absent_as_one(m: GroupProbe) -> None:
    assert (m.left is None) == (m.right is None), "a governed pair split"
    assert m.required.shape == m.slots.shape  # drawn after an absent optional too


def test_an_optional_declared_before_a_required_field_can_be_absent() -> None:
    m = reach(_GROUPS, lambda m: m.early is None and m.left is None)
    assert m.required.shape == m.slots.shape


def test_a_governed_group_is_drawn_in_every_presence_mode() -> None:
    # Present beside ungoverned optionals drawn each on their own (one present, one
    # absent): the group's presence is drawn in that mode too, not only with "all".
    reach(_GROUPS, lambda m: m.left is not None and (m.z is None) != (m.w is None))
    reach(_GROUPS, lambda m: m.left is None and (m.z is None) != (m.w is None))
    # and whatever the flag says (this flag does not require its fields)
    reach(_GROUPS, lambda m: not m.has_pair and m.left is not None)
    reach(_GROUPS, lambda m: m.has_pair and m.left is None)


@metadata
class WideSource:
    slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
    width: int = field(default=1)


@metadata
class WideDerived(WideSource):
    """Derived fields whose shape depends on the source: a width named by a source field,
    a 3-D field."""

    table: torch.Tensor = tensor_field(rows=BATCH, cols="width", dtypes=INDEX, pad=Pad.value(-1))
    cube: torch.Tensor = tensor_field(
        rows=BATCH, ndim=3, dtypes=(torch.float32,), pad=Pad.value(0.0)
    )


def test_a_derived_field_is_as_wide_as_the_source_field_it_names() -> None:
    # 4 is past the shared drawn width (1-3): only the source's value can make it.
    m = reach(metadata_instances(WideDerived, max_bs=2), lambda m: m.width == 4)
    assert m.table.shape == (m.slots.shape[0], 4)
    assert m.cube.dim() == 3 and m.cube.shape[0] == m.slots.shape[0]


def test_device_is_honoured() -> None:
    m = reach(metadata_instances(Probe, device="meta"), lambda m: m.maybe is not None)
    assert all(
        t.device.type == "meta" for t in (m.slots, m.offsets, m.mask, m.values, m.table, m.maybe)
    )


# --------------------------------------------------------------------------- stale tails


def _filled(dtype: torch.dtype, fill: TailFill, num_slots: int = 5, seed: int = 0) -> torch.Tensor:
    t = torch.full((64,), 3).to(dtype)
    fill_tail(t, fill, num_slots=num_slots, seed=seed)
    assert t.dtype == dtype and t.shape == (64,)
    return t


def test_other_slots_are_random_legal_values_fixed_by_the_seed() -> None:
    ints = _filled(torch.int32, TailFill.OTHER_SLOTS)
    assert set(ints.tolist()) == set(range(5)), "every slot of the pool, none outside"
    flags = _filled(torch.bool, TailFill.OTHER_SLOTS)
    assert bool(flags.any()) and not bool(flags.all())
    floats = _filled(torch.float32, TailFill.OTHER_SLOTS)
    assert bool((floats < 0).any()) and bool((floats > 0).any())
    for dtype in (torch.int64, torch.bool, torch.bfloat16):
        a, b = (
            _filled(dtype, TailFill.OTHER_SLOTS, seed=7),
            _filled(dtype, TailFill.OTHER_SLOTS, seed=7),
        )
        assert torch.equal(a, b), "the same seed, the same stale tail"
        assert not torch.equal(a, _filled(dtype, TailFill.OTHER_SLOTS, seed=8))


def test_a_one_row_tail_is_filled() -> None:
    t = torch.full((1,), 2.0)  # one element
    fill_tail(t, TailFill.NAN, num_slots=4)
    assert bool(t.isnan().all())


def test_index_fills_of_a_one_slot_pool_stay_in_it() -> None:
    for fill in (TailFill.ZEROS, TailFill.NAN, TailFill.HUGE, TailFill.OTHER_SLOTS):
        assert set(_filled(torch.int64, fill, num_slots=1).tolist()) == {0}, fill
    # NaN has no integer: an index buffer gets other slots.
    assert len(set(_filled(torch.int64, TailFill.NAN).tolist())) > 1


# --------------------------------------------------------------------------- deferred hints


def test_an_unresolvable_host_hint_is_named_and_a_tensor_hint_is_not_needed() -> None:
    from tests.testing.deferred_hints import DeferredMeta

    with pytest.raises(TypeError) as info:
        find(metadata_instances(DeferredMeta), lambda m: True, settings=_FIND)
    msg = str(info.value)
    # The tensor field is drawn from its declaration: only the host field is named.
    assert msg.startswith(
        "metadata_instances(DeferredMeta): cannot resolve the type hint of DeferredMeta "
        "field(s) 'scheduler_output': 'SchedulerOutput | None' (NameError: name "
        "'SchedulerOutput' is not defined)."
    )
    assert "values={'scheduler_output': strategy}" in msg and "'slots'" not in msg
    # localns resolves it (here to an int: drawn as one), values= replaces it.
    by_localns = metadata_instances(DeferredMeta, localns={"SchedulerOutput": int})
    assert reach(by_localns, lambda m: m.scheduler_output == 3).slots.dtype in INDEX
    by_values = metadata_instances(DeferredMeta, values={"scheduler_output": st.just(None)})
    assert reach(by_values, lambda m: m.count == 4).scheduler_output is None


# --------------------------------------------------------------------------- Batch


def test_slot_zero_is_a_live_slot_and_a_track_slot() -> None:
    b = Batch(slots=(0, -1, 2), track_slots=(1, 0, 0), track_mask=(True, True, False),
              extend_lens=(1, 1, 1))  # fmt: skip
    assert b.live_rows() == (0, 2)
    assert b.tracked_rows() == (0,)  # the pad row's flag does not count
    b0 = Batch(slots=(1,), track_slots=(0,), track_mask=(True,), extend_lens=(1,))
    assert b0.tracked_rows() == (0,) and b0.addressed() == {
        1: "working slot of row 0",
        0: "track slot of row 0",
    }


def test_a_batch_with_rows_of_different_lengths_is_refused_where_read() -> None:
    b = Batch(slots=(1, 2), track_slots=(3,), track_mask=(True, True), extend_lens=(1, 1))
    with pytest.raises(ValueError, match="shorter than argument"):
        b.tracked_rows()


def test_batch_repr_names_prefills_and_drafts() -> None:
    tree = DraftTree(parent=(-1, 0), next_token=(1, -1), next_sibling=(-1, -1))
    b = Batch(slots=(1,), track_slots=(-1,), track_mask=(False,), extend_lens=(2,),
              draft_token_num=2, draft_trees=(tree,), seed=5)  # fmt: skip
    assert repr(b) == (
        "Batch(bs=1, slots=(1,), track_slots=(-1,), track_mask=(False,), draft_token_num=2, "
        f"draft_trees={(tree,)}, seed=5)"
    )
    p = Batch(slots=(1, 2), track_slots=(-1, -1), track_mask=(False, False),
              extend_lens=(4, 1), num_prefills=1)  # fmt: skip
    assert repr(p) == (
        "Batch(bs=2, slots=(1, 2), track_slots=(-1, -1), track_mask=(False, False), "
        "num_prefills=1, extend_lens=(4, 1), seed=0)"
    )
