"""Hypothesis strategies for graphs: decode and verify steps over a state pool, buckets."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
from hypothesis import strategies as st

from tests.properties.strategies.kernels import draft_trees

__all__ = [
    "DecodeStepSpec",
    "VerifyStepSpec",
    "bucket_sets",
    "decode_steps",
    "draft_bucket_sets",
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
