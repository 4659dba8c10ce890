"""Hypothesis strategies for graphs: decode and verify steps over a state pool, buckets."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from hypothesis import strategies as st

from hybridmeta import ForwardMetadata, Role, fields_of
from tests.properties.strategies.kernels import draft_trees

# The id pad rows carry in the working and track slot fields: the declared pad.
_PAD = {
    s.role: s.pad.value for s in fields_of(ForwardMetadata) if s.role.is_slot and s.pad is not None
}
WORKING_PAD = int(_PAD[Role.WORKING_SLOT])  # type: ignore[arg-type]
TRACK_PAD = int(_PAD[Role.TRACK_SLOT])  # type: ignore[arg-type]

__all__ = [
    "SLOT_RULE_KINDS",
    "STRUCTURAL_KINDS",
    "DecodeStepSpec",
    "InvalidStepSpec",
    "SlotValues",
    "VerifyStepSpec",
    "bucket_sets",
    "decode_steps",
    "draft_bucket_sets",
    "invalid_decode_steps",
    "slot_values",
    "verify_steps",
]


@attrs.frozen
class DecodeStepSpec:
    """Live rows of one decode step, in physical slot ids.

    Attributes
    ----------
    slots : tuple of int
        Working slot of each live row (distinct).
    track : tuple of int
        Track slot of each row (distinct from every working slot and from each other), or
        ``-1`` for an unflagged row that carries none.
    mask : tuple of bool
        Rows whose new state is saved into their track slot.
    seed : int
        Seed for the step's float inputs and for the poison written past the prefix.
    """

    slots: tuple[int, ...]
    track: tuple[int, ...]
    mask: tuple[bool, ...]
    seed: int

    @property
    def bs(self) -> int:
        return len(self.slots)


@st.composite
def decode_steps(
    draw: st.DrawFn, *, num_slots: int, max_bs: int, min_bs: int = 1
) -> DecodeStepSpec:
    """A decode step with ``min_bs <= bs <= max_bs`` rows over a pool of ``num_slots``.

    ``num_slots`` must be at least ``2 * max_bs`` (working and track slots are disjoint).
    """
    if num_slots < 2 * max_bs:
        raise ValueError(f"decode_steps: num_slots={num_slots} < 2 * max_bs={2 * max_bs}")
    bs = draw(st.integers(min_bs, max_bs))
    picked = draw(st.permutations(range(num_slots)))[: 2 * bs]
    mask = tuple(draw(st.lists(st.booleans(), min_size=bs, max_size=bs)))
    keep_unflagged = draw(st.lists(st.booleans(), min_size=bs, max_size=bs))
    track = tuple(
        t if m or keep else -1 for t, m, keep in zip(picked[bs:], mask, keep_unflagged, strict=True)
    )
    seed = draw(st.integers(0, 2**31 - 1))
    return DecodeStepSpec(slots=tuple(picked[:bs]), track=track, mask=mask, seed=seed)


@st.composite
def bucket_sets(draw: st.DrawFn, max_bs: int) -> tuple[int, ...]:
    """A sorted set of capture buckets that ends at ``max_bs``."""
    others = draw(st.sets(st.integers(1, max_bs - 1), max_size=3)) if max_bs > 1 else set()
    return tuple(sorted({*others, max_bs}))


@attrs.frozen
class VerifyStepSpec:
    """Live rows of one speculative verify + commit step (physical slot ids).

    Attributes
    ----------
    step : DecodeStepSpec
        Working slots, track slots and flags, seed (as a decode step).
    T : int
        Draft columns of every row.
    parents : tuple of tuple of int, or None
        One draft tree per row (``retrieve_parent_token`` convention), ``None`` for chains.
    accepted : tuple of int
        Each row's verdict: the column of its last accepted token, ``-1`` for none.
    track_token : tuple of int
        Each row's boundary column, ``-1`` for none (used where the row is flagged).
    """

    step: DecodeStepSpec
    T: int
    parents: tuple[tuple[int, ...], ...] | None
    accepted: tuple[int, ...]
    track_token: tuple[int, ...]

    @property
    def bs(self) -> int:
        return self.step.bs


@st.composite
def verify_steps(
    draw: st.DrawFn,
    *,
    num_slots: int,
    max_bs: int,
    max_draft: int,
    trees: bool,
    min_bs: int = 1,
) -> VerifyStepSpec:
    """A verify step: ``min_bs <= bs <= max_bs`` rows of ``1 <= T <= max_draft`` drafts,
    random trees (or chains), random accepted columns (``-1`` included) and boundaries."""
    step = draw(decode_steps(num_slots=num_slots, max_bs=max_bs, min_bs=min_bs))
    T = draw(st.integers(1, max_draft))
    parents = tuple(draw(draft_trees(T)) for _ in range(step.bs)) if trees else None
    cols = st.integers(-1, T - 1)
    accepted = tuple(draw(cols) for _ in range(step.bs))
    token = tuple(draw(cols) for _ in range(step.bs))
    return VerifyStepSpec(step=step, T=T, parents=parents, accepted=accepted, track_token=token)


@st.composite
def draft_bucket_sets(draw: st.DrawFn, max_draft: int) -> tuple[int, ...]:
    """A sorted set of captured draft lengths that ends at ``max_draft`` (some missing: a
    step then pads its draft columns to the next one)."""
    others = draw(st.sets(st.integers(1, max_draft - 1))) if max_draft > 1 else set()
    return tuple(sorted({*others, max_draft}))


def poison_fill(seed: int, num_slots: int) -> Callable[[str, torch.Tensor], None]:
    """A ``StaticBuffers.poison_`` filler: NaN floats, random flags, and ints drawn from
    other requests' slot ids (and the pad value ``-1``), seeded."""
    gen = torch.Generator().manual_seed(seed)

    def fill(name: str, tail: torch.Tensor) -> None:
        if tail.numel() == 0:
            return
        if tail.dtype == torch.bool:
            v = torch.rand(tail.shape, generator=gen) < 0.5
        elif tail.is_floating_point():
            v = torch.full(tail.shape, float("nan"))
        else:
            v = torch.randint(-1, num_slots, tail.shape, generator=gen)
        tail.copy_(v.to(tail.dtype))

    return fill


#: Corruptions of a step's slot values: each breaks one slot rule of a live step.
SLOT_RULE_KINDS = (
    "working_pad",  # a live row carries the pad id
    "working_out_of_range",  # a working id outside the pool (or the slot table)
    "working_duplicate",  # two rows share a working slot
    "flagged_without_track",  # a flagged row carries no track slot
    "track_out_of_range",  # a track id outside the pool (and not the pad)
    "track_duplicate",  # two flagged rows save into one track slot
    "track_is_working",  # a flagged row saves into a row's (physical) working slot
)
#: Corruptions of a step's shape, types or host values (applied where the step is built).
STRUCTURAL_KINDS = (
    "too_many_rows",
    "index_dtype",
    "input_rows",
    "input_dtype",
    "missing_input",
    "host_value",
    "unbuffered_field",
)


@attrs.frozen
class InvalidStepSpec:
    """A decode step that must be refused before anything is written.

    Attributes
    ----------
    kind : str
        One of :data:`SLOT_RULE_KINDS` (the ids below break it) or
        :data:`STRUCTURAL_KINDS` (the ids are valid; whoever builds the step breaks it).
    step : DecodeStepSpec
        The step's ids as it carries them: working ids in the slot table's (virtual) space,
        track ids physical.
    field : str
        The field (or argument) the refusal must name.
    """

    kind: str
    step: DecodeStepSpec
    field: str


@st.composite
def invalid_decode_steps(
    draw: st.DrawFn, *, table: tuple[int, ...], num_slots: int, max_bs: int
) -> InvalidStepSpec:
    """A step of ``1 <= bs <= max_bs`` rows (``max_bs + 1`` for ``too_many_rows``) that
    breaks one rule, drawn from :data:`SLOT_RULE_KINDS` and :data:`STRUCTURAL_KINDS`.

    ``table`` maps the step's working (virtual) ids to physical slots of a pool of
    ``num_slots`` (``num_slots >= 2 * max_bs + 2``)."""
    kind = draw(st.sampled_from(SLOT_RULE_KINDS + STRUCTURAL_KINDS))
    need_two = kind in ("working_duplicate", "track_duplicate")
    if need_two and max_bs < 2:
        kind = "working_pad"
    rows = max_bs + 1 if kind == "too_many_rows" else max_bs
    low = rows if kind == "too_many_rows" else 2 if need_two else 1
    base = draw(decode_steps(num_slots=num_slots, max_bs=rows, min_bs=low))
    inverse = {p: v for v, p in enumerate(table)}
    slots = [inverse[s] for s in base.slots]  # carried: virtual ids
    track, mask = list(base.track), list(base.mask)
    bs = base.bs
    r = draw(st.integers(0, bs - 1))
    field = "mamba_cache_indices"
    if kind == "working_pad":
        slots[r] = WORKING_PAD
    elif kind == "working_out_of_range":
        slots[r] = draw(st.sampled_from([len(table), len(table) + 3, WORKING_PAD - 1, -7]))
    elif kind == "working_duplicate":
        other = draw(st.integers(0, bs - 1).filter(lambda i: i != r))
        slots[r] = slots[other]
    elif kind in ("flagged_without_track", "track_out_of_range", "track_is_working"):
        field = "mamba_track_indices"
        mask[r] = True
        if kind == "flagged_without_track":
            track[r] = TRACK_PAD
        elif kind == "track_out_of_range":
            track[r] = draw(st.sampled_from([num_slots, num_slots + 5, TRACK_PAD - 1]))
            mask[r] = draw(st.booleans()) or not any(mask[:r] + mask[r + 1 :])
        else:
            track[r] = table[slots[draw(st.integers(0, bs - 1))]]
    elif kind == "track_duplicate":
        field = "mamba_track_indices"
        other = draw(st.integers(0, bs - 1).filter(lambda i: i != r))
        mask[r] = mask[other] = True
        working = {table[v] for v in slots}
        free = [t for t in (track[r], track[other]) if t != TRACK_PAD]
        shared = free[0] if free else min(set(range(num_slots)) - working)
        track[r] = track[other] = shared
    else:
        field = {
            "too_many_rows": "mamba_cache_indices",
            "index_dtype": "query_start_loc",
            "input_rows": "input",
            "input_dtype": "input",
            "missing_input": "inputs",
            "host_value": "is_target_verify",
            "unbuffered_field": "conv_states_mask_indices",
        }[kind]
    step = DecodeStepSpec(slots=tuple(slots), track=tuple(track), mask=tuple(mask), seed=base.seed)
    return InvalidStepSpec(kind=kind, step=step, field=field)


@attrs.frozen
class SlotValues:
    """Arbitrary slot values of one step (valid or not): working ids, track ids, track
    mask, the step's ``has_mamba_track_mask``, and whether the track fields are set."""

    working: tuple[int, ...]
    track: tuple[int, ...]
    mask: tuple[bool, ...]
    flag: bool
    with_track: bool


@st.composite
def slot_values(
    draw: st.DrawFn, *, bound: int, max_bs: int, table: tuple[int, ...] | None = None
) -> SlotValues:
    """Slot values near the rules' edges, so that every slot rule is both met and broken.

    Working ids (virtual ids of ``table`` when one is given: ``[0, len(table))``) are
    distinct valid ones half of the time, valid with one repeat a quarter, else drawn from
    a small alphabet around the edges (the pads, the bound). Each track id is the pad, a
    free slot, a row's physical working slot (a collision), another row's track slot, or
    out of range; two rows in three are flagged; ``has_mamba_track_mask`` is mostly on
    when the track fields are set."""
    bs = draw(st.integers(1, max_bs))
    n_work = len(table) if table is not None else bound
    pads = sorted({WORKING_PAD, TRACK_PAD})
    edge = st.one_of(
        st.integers(0, min(n_work - 1, 3)),
        st.sampled_from([*pads, pads[0] - 1, n_work, n_work + 1]),
    )
    how = draw(st.sampled_from(["valid", "valid", "repeated", "edge"]))
    if how == "edge":
        working = tuple(draw(st.lists(edge, min_size=bs, max_size=bs)))
    else:
        picked = draw(st.permutations(range(n_work)))[:bs]
        if how == "repeated" and bs > 1:
            picked[draw(st.integers(1, bs - 1))] = picked[0]
        working = tuple(picked)
    physical = [(table[w] if table is not None else w) for w in working if 0 <= w < n_work]
    track: list[int] = []
    for _ in range(bs):
        kind = draw(st.sampled_from(["free", "working", "repeat", "pad", "out"]))
        if kind == "working" and physical:
            track.append(draw(st.sampled_from(physical)))
        elif kind == "repeat" and track:
            track.append(draw(st.sampled_from(track)))
        elif kind == "out":
            track.append(draw(st.sampled_from([TRACK_PAD - 1, bound, bound + 2])))
        elif kind == "pad":
            track.append(TRACK_PAD)
        else:  # a free slot (or a repeat / collision with nothing to repeat yet)
            track.append(draw(st.integers(0, bound - 1)))
    flags = st.integers(0, 2).map(lambda i: i < 2)  # flagged two times in three
    mask = tuple(draw(st.lists(flags, min_size=bs, max_size=bs)))
    with_track = draw(st.integers(0, 3)) < 3
    flag = with_track and draw(st.integers(0, 3)) < 3
    return SlotValues(
        working=working, track=tuple(track), mask=mask, flag=flag, with_track=with_track
    )
