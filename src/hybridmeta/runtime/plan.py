"""Host-side plans of one runtime step, built from host data only and moved to the device once.

A prefill plan lays the step's prefill rows out on a padded ``[P, L]`` grid (``L`` a
multiple of the SSM chunk size), each row on its own chunk grid that starts at the row's
first new token. Because a row starts at a multiple of the track interval and the interval
is a multiple of the chunk size, every track boundary inside a row is a chunk boundary of
that row, so its state is one of the scan's chunk states: no recompute and no per-request
index arithmetic on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from hybridmeta.staging import to_device_packed

if TYPE_CHECKING:
    from hybridmeta.prefill import PrefillPlan as MambaPrefillPlan

__all__ = ["DecodeInputs", "PrefillPlan", "PrefillRow", "TrackTarget", "build_prefill_plan"]


@attrs.frozen(kw_only=True)
class PrefillRow:
    """One request's prefill work in a step (host data).

    Attributes
    ----------
    slot : int
        Working slot of the request.
    start : int
        Position of the first new token (tokens before it are in the slot's state).
    length : int
        Number of new tokens.
    has_initial_state : bool
        Whether the slot holds state for ``start`` earlier tokens.
    """

    slot: int
    start: int
    length: int
    has_initial_state: bool


@attrs.frozen(kw_only=True)
class TrackTarget:
    """Save the state of prefill row ``row`` after ``boundary`` tokens into track ``slot``."""

    row: int
    boundary: int
    slot: int


@attrs.frozen(kw_only=True, eq=False)
class PrefillPlan:
    """Device tensors describing the prefill rows of one step.

    Attributes
    ----------
    slots : torch.Tensor
        ``[P]`` int64 working slot per row.
    has_init : torch.Tensor
        ``[P]`` bool.
    starts : torch.Tensor
        ``[P]`` int64 position of each row's first new token.
    lengths : torch.Tensor
        ``[P]`` int64 new tokens per row.
    gather : torch.Tensor
        ``[P, L]`` int64 index into the flat tokens; pad cells point at index ``T``
        (one past the end: callers append a zero row).
    valid : torch.Tensor
        ``[P, L]`` bool.
    scatter : torch.Tensor
        ``[T]`` int64 index of each flat token into the flattened ``[P*L]`` grid.
    token_slot, token_pos : torch.Tensor
        ``[T]`` int64 slot and absolute position of each flat token.
    last : torch.Tensor
        ``[P]`` int64 flat index of each row's last token.
    track_row, track_rel, track_chunk, track_slot : torch.Tensor
        ``[K]`` int64 per track target: row, position relative to the row start, chunk
        index on the row's grid, destination track slot.
    mamba : hybridmeta.prefill.PrefillPlan or None
        When set, Mamba layers run through :mod:`hybridmeta.prefill` (planner, conv,
        chunked scan on the global grid, extend track-save) with this plan instead of the
        padded torch scan; the ``track_*`` fields are then unused by Mamba layers.
    """

    slots: torch.Tensor
    has_init: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    gather: torch.Tensor
    valid: torch.Tensor
    scatter: torch.Tensor
    token_slot: torch.Tensor
    token_pos: torch.Tensor
    last: torch.Tensor
    track_row: torch.Tensor
    track_rel: torch.Tensor
    track_chunk: torch.Tensor
    track_slot: torch.Tensor
    num_rows: int
    num_tokens: int
    padded_len: int
    num_tracks: int
    mamba: MambaPrefillPlan | None = None


def build_prefill_plan(
    rows: Sequence[PrefillRow],
    tracks: Sequence[TrackTarget],
    *,
    chunk_size: int,
    device: torch.device,
    mamba: MambaPrefillPlan | None = None,
) -> PrefillPlan:
    """Build the device plan of a step's prefill rows from host data.

    Raises
    ------
    ValueError
        No rows; a row with ``length < 1`` or ``start < 0``; a track target outside its
        row or off the row's chunk grid (the caller must align rows to the track interval).
    """
    if not rows:
        raise ValueError("build_prefill_plan: rows must not be empty")
    for i, r in enumerate(rows):
        if r.length < 1 or r.start < 0:
            raise ValueError(
                f"build_prefill_plan: rows[{i}] needs length >= 1 and start >= 0, got {r}"
            )
        if r.start > 0 and not r.has_initial_state:
            raise ValueError(
                f"build_prefill_plan: rows[{i}] starts at {r.start} but has_initial_state is False"
            )
    lengths = torch.tensor([r.length for r in rows], dtype=torch.int64)
    starts = torch.tensor([r.start for r in rows], dtype=torch.int64)
    p = len(rows)
    t = int(lengths.sum())
    longest = int(lengths.max())
    padded = -(-longest // chunk_size) * chunk_size
    offsets = torch.cumsum(lengths, 0) - lengths  # [P] first flat index per row
    col = torch.arange(padded)[None, :]  # [1, L]
    valid = col < lengths[:, None]  # [P, L]
    gather = torch.where(valid, offsets[:, None] + col, torch.full_like(col, t))
    row_of_token = torch.repeat_interleave(torch.arange(p), lengths)  # [T]
    col_of_token = torch.arange(t) - offsets[row_of_token]
    scatter = row_of_token * padded + col_of_token
    slots = torch.tensor([r.slot for r in rows], dtype=torch.int64)
    token_slot = slots[row_of_token]
    token_pos = starts[row_of_token] + col_of_token
    last = offsets + lengths - 1

    for j, tr in enumerate(tracks):
        if not 0 <= tr.row < p:
            raise ValueError(f"build_prefill_plan: tracks[{j}].row {tr.row} is not a row index")
        row = rows[tr.row]
        rel = tr.boundary - row.start
        if not 0 < rel <= row.length or rel % chunk_size:
            raise ValueError(
                f"build_prefill_plan: tracks[{j}] boundary {tr.boundary} must lie in "
                f"({row.start}, {row.start + row.length}] on the row's chunk grid "
                f"(start + k*{chunk_size})"
            )
    track_row = torch.tensor([tr.row for tr in tracks], dtype=torch.int64)
    track_rel = torch.tensor([tr.boundary - rows[tr.row].start for tr in tracks], dtype=torch.int64)
    track_slot = torch.tensor([tr.slot for tr in tracks], dtype=torch.int64)

    # One packed int64 host buffer, one copy; the plan tensors are views of it (the two
    # masks are compared back to bool on the device).
    parts = {
        "slots": slots,
        "has_init": torch.tensor([r.has_initial_state for r in rows], dtype=torch.int64),
        "starts": starts,
        "lengths": lengths,
        "gather": gather,
        "valid": valid.to(torch.int64),
        "scatter": scatter,
        "token_slot": token_slot,
        "token_pos": token_pos,
        "last": last,
        "track_row": track_row,
        "track_rel": track_rel,
        "track_chunk": track_rel // chunk_size,
        "track_slot": track_slot,
    }
    d = to_device_packed(parts, device)

    return PrefillPlan(
        slots=d["slots"],
        has_init=d["has_init"] != 0,
        starts=d["starts"],
        lengths=d["lengths"],
        gather=d["gather"],
        valid=d["valid"] != 0,
        scatter=d["scatter"],
        token_slot=d["token_slot"],
        token_pos=d["token_pos"],
        last=d["last"],
        track_row=d["track_row"],
        track_rel=d["track_rel"],
        track_chunk=d["track_chunk"],
        track_slot=d["track_slot"],
        num_rows=p,
        num_tokens=t,
        padded_len=padded,
        num_tracks=len(tracks),
        mamba=mamba,
    )


@attrs.frozen(kw_only=True, eq=False)
class DecodeInputs:
    """The per-row inputs of a decode forward (static buffers in graph mode).

    Attributes
    ----------
    input_ids : torch.Tensor
        ``[B]`` int64 token per row.
    slots : torch.Tensor
        ``[B]`` int64 working slot per row; pad rows carry ``-1``.
    positions : torch.Tensor
        ``[B]`` int64 position of the row's token (tokens already in the state); pad 0.
    kernels : {"torch", "triton"}
        Mamba decode ops: pure torch, or the Triton kernels of :mod:`hybridmeta.kernels`.
    """

    input_ids: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    kernels: str = "torch"
