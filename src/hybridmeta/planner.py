"""The mixed-batch planner: host description of a batch in, ``Mamba2Metadata`` out.

Everything is decided here, once per forward, from host data: no device tensor is read,
and the whole device-side plan (the forward's per-row fields and the nested
:class:`~hybridmeta.model.MixedMetadata`) is one packed, non-blocking host-to-device copy.
The metadata is built through the declared constructors only (``ForwardMetadata(...)``,
then ``Mamba2Metadata.evolve_from`` via :func:`~hybridmeta.model.prepare_decode` or
:meth:`MixedHostPlan.metadata`).

Two steps, so an engine can stage its own arrays (attention plans) in the same copy::

    hp = plan_host(extend_lens=..., prefix_lens=..., slots=..., num_decodes=..., ...)
    views = to_device_packed({**hp.arrays, **my_arrays}, device)
    md = hp.metadata(views)

or in one call: ``md = plan_mixed_batch(..., device=device)``.

The track policy (prefix cache of recurrent state), one for every implementation. A row
with ``track_mask`` set saves its conv + SSM state at the *last* absolute position ``b`` (a
positive multiple of ``track_interval``) reached by its new tokens,
``prefix < b <= prefix + extend``:

* ``b`` ends the row (every decode row that reaches a boundary; a prefill row whose
  boundary is its last token): ``mamba_track_mask`` is set for the row, and the layers
  save its final state after they ran (the decode track-save);
* ``b`` falls on the SSD scan's chunk grid, which is **global over the flattened prefill
  tokens**: the flattened position ``g`` after the boundary token satisfies
  ``g % chunk_size == 0`` and the state is the chunk state after chunk ``g // chunk_size - 1``
  (``ExtendTrackPlan.h_*``);
* otherwise the boundary is off the grid and is recomputed from the state entering its
  logical chunk plus fewer than ``chunk_size`` tokens (``ExtendTrackPlan.recompute_*``).

Rows that save record their track slot in ``mamba_track_indices``; the others hold ``-1``.

A speculative target-verify forward (``draft_token_num`` tokens per row, every row a
verify row) is planned by :func:`plan_verify_host` / :func:`plan_verify` the same way: host
data in, one staged copy, ``prepare_target_verify`` out. Its track fields flag the rows
that *may* cross a boundary with their draft: the commit after the verify
(:func:`~hybridmeta.model.prepare_commit`) saves the boundary's state only when the
accepted tokens reach it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from hybridmeta.chunks import logical_chunk_starts
from hybridmeta.model import (
    ChunkPlan,
    ConvWindows,
    ExtendTrackPlan,
    ForwardMetadata,
    Mamba2Metadata,
    MixedMetadata,
    prepare_decode,
    prepare_target_verify,
)
from hybridmeta.staging import to_device_packed

__all__ = [
    "MixedHostPlan",
    "VerifyHostPlan",
    "plan_host",
    "plan_mixed_batch",
    "plan_verify",
    "plan_verify_host",
]

IntArray = npt.NDArray[np.int64]
IntLike = Sequence[int] | torch.Tensor | npt.NDArray[np.integer]
BoolLike = Sequence[bool] | torch.Tensor | npt.NDArray[np.bool_]

_P = "hybridmeta."  # key prefix of the planner's staged arrays
_PV = "hybridmeta.verify."  # ... of a verify plan's


@attrs.frozen(kw_only=True, eq=False)
class MixedHostPlan:
    """A forward planned on the host; :meth:`metadata` builds it from staged views.

    Attributes
    ----------
    arrays : dict of str to numpy array
        Every device-side array of the forward (int64), keyed ``"hybridmeta.<name>"``;
        stage them with :func:`~hybridmeta.staging.to_device_packed`.
    num_prefills, num_decodes, num_prefill_tokens, chunk_size, conv_kernel : int
    track : bool
        Track fields are present (``track_mask`` was given).
    any_final_save : bool
        Some row saves its final state this step (``has_mamba_track_mask``).
    final_rows, h_rows, recompute_rows : tuple of int
        Which rows save which kind of boundary (host copies, for logs and tests).
    """

    arrays: dict[str, IntArray]
    num_prefills: int
    num_decodes: int
    num_prefill_tokens: int
    chunk_size: int
    conv_kernel: int
    track: bool
    any_final_save: bool
    final_rows: tuple[int, ...]
    h_rows: tuple[int, ...]
    recompute_rows: tuple[int, ...]

    def forward(self, views: Mapping[str, torch.Tensor], **engine: object) -> ForwardMetadata:
        """The forward's ``ForwardMetadata`` over staged ``views`` of :attr:`arrays`.

        ``engine`` passes further ``ForwardMetadata`` fields of the engine's own (e.g.
        ``mamba_track_mask_indices``) through the same constructor.
        """
        return _forward(_views(views), self.track, self.any_final_save, **engine)

    def metadata(self, views: Mapping[str, torch.Tensor], **engine: object) -> Mamba2Metadata:
        """The forward's ``Mamba2Metadata`` over staged ``views`` of :attr:`arrays`."""
        v = _views(views)
        fwd = _forward(v, self.track, self.any_final_save, **engine)
        if not self.num_prefills:
            return prepare_decode(fwd)
        k1 = self.conv_kernel - 1
        mixed = MixedMetadata(
            has_initial_states=v["has_init"] != 0,
            chunks=ChunkPlan(
                chunk_size=self.chunk_size,
                start=v["chunk_start"],
                length=v["chunk_len"],
                row=v["chunk_row"],
                first=v["chunk_first"] != 0,
                token_chunk=v["token_chunk"],
                token_pos=v["token_pos"],
                row_last_chunk=v["row_last_chunk"],
                phys_last_chunk=v["phys_last_chunk"],
            ),
            conv=ConvWindows(
                kernel_size=self.conv_kernel,
                token_windows=v["token_conv"].view(self.num_prefill_tokens, self.conv_kernel),
                final_windows=v["final_conv"].view(self.num_prefills, k1),
            ),
            track=ExtendTrackPlan(
                h_rows=v["h_rows"],
                h_chunk=v["h_chunk"],
                recompute_rows=v["rc_rows"],
                recompute_chunk=v["rc_chunk"],
                recompute_len=v["rc_len"],
                windows=v["mid_conv"].view(-1, k1),
            ),
        )
        return Mamba2Metadata.evolve_from(
            fwd,
            num_prefills=self.num_prefills,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decodes=self.num_decodes,
            mixed=mixed,
        )


def _views(
    views: Mapping[str, torch.Tensor], prefix: str = _P, owner: str = "MixedHostPlan"
) -> dict[str, torch.Tensor]:
    out = {k[len(prefix) :]: t for k, t in views.items() if k.startswith(prefix)}
    if "slots" not in out:
        raise ValueError(
            f"{owner}: views must hold the staged {owner}.arrays (keys "
            f"'{prefix}<name>'); got {sorted(views)[:4]}"
        )
    return out


def _forward(
    v: Mapping[str, torch.Tensor], track: bool, any_save: bool, **fields: object
) -> ForwardMetadata:
    """The ``ForwardMetadata`` of a staged plan (mixed or verify): offsets, slots, tracking."""
    return ForwardMetadata(
        query_start_loc=v["query_start_loc"],
        mamba_cache_indices=v["slots"],
        mamba_track_indices=v["track_slots"] if track else None,
        mamba_track_mask=(v["track_mask"] != 0) if track else None,
        has_mamba_track_mask=any_save,
        **fields,  # type: ignore[arg-type]
    )


def _check_host(name: str, value: torch.Tensor) -> None:
    if value.device.type != "cpu":
        raise ValueError(
            f"plan_mixed_batch: {name} must be host data (a sequence or a CPU tensor); "
            f"got a tensor on {value.device}: reading it would sync the stream"
        )


def _host_ints(name: str, value: IntLike) -> IntArray:
    if isinstance(value, torch.Tensor):
        _check_host(name, value)
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"plan_mixed_batch: {name} must hold integers, got {value.dtype}")
        return value.to(torch.int64).reshape(-1).numpy().copy()
    arr = np.asarray(value)
    # dtype.kind: signed or unsigned integer ('i', 'u'); np.issubdtype is ~2 us a call
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"plan_mixed_batch: {name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64).reshape(-1)


def _host_bools(name: str, value: BoolLike) -> npt.NDArray[np.bool_]:
    if isinstance(value, torch.Tensor):
        _check_host(name, value)
        if value.dtype != torch.bool:
            raise ValueError(f"plan_mixed_batch: {name} must be bool, got {value.dtype}")
        return value.reshape(-1).numpy().copy()
    arr = np.asarray(value)
    if arr.size and arr.dtype != np.bool_:
        raise ValueError(f"plan_mixed_batch: {name} must be bool, got dtype {arr.dtype}")
    return arr.astype(np.bool_).reshape(-1)


def _check_config(chunk_size: int, track_interval: int | None, conv_kernel: int) -> None:
    if chunk_size <= 0:
        raise ValueError(f"plan_mixed_batch: chunk_size must be > 0, got {chunk_size}")
    if conv_kernel < 2:
        raise ValueError(f"plan_mixed_batch: conv_kernel must be >= 2, got {conv_kernel}")
    if track_interval is not None and (track_interval <= 0 or track_interval % chunk_size):
        raise ValueError(
            f"plan_mixed_batch: track_interval ({track_interval}) must be a positive multiple "
            f"of the SSM chunk_size ({chunk_size}); a cache chunk that is not a whole number of "
            "state-grid chunks cannot index the grid (docs/background.md, index-grid confusion)"
        )


def _check_rows(
    extend: IntArray,
    prefix: IntArray,
    slots: IntArray,
    num_decodes: int,
) -> None:
    n = extend.shape[0]
    for name, arr in (("prefix_lens", prefix), ("slots", slots)):
        if arr.shape[0] != n:
            raise ValueError(
                f"plan_mixed_batch: {name} has {arr.shape[0]} rows but extend_lens has {n}"
            )
    if not 0 <= num_decodes <= n:
        raise ValueError(f"plan_mixed_batch: num_decodes must be in [0, {n}], got {num_decodes}")
    if n == 0:
        raise ValueError("plan_mixed_batch: the batch has no rows")
    dec = slice(n - num_decodes, n)
    # Fast path: one reduction per rule; the checks below find the row only on failure.
    if (
        extend.min() >= 1
        and prefix.min() >= 0
        and slots.min() >= 0
        and (not num_decodes or (extend[dec].max() == 1 and prefix[dec].min() >= 1))
        and not _has_duplicate(slots)
    ):
        return
    if (extend < 1).any():
        r = int(np.argmax(extend < 1))
        raise ValueError(
            f"plan_mixed_batch: extend_lens[{r}] = {extend[r]}; every row needs >= 1 new token"
        )
    if (prefix < 0).any():
        r = int(np.argmax(prefix < 0))
        raise ValueError(f"plan_mixed_batch: prefix_lens[{r}] = {prefix[r]} must be >= 0")
    if (extend[dec] != 1).any():
        r = n - num_decodes + int(np.argmax(extend[dec] != 1))
        raise ValueError(
            f"plan_mixed_batch: extend_lens[{r}] = {extend[r]} but row {r} is a decode row "
            "(decode rows come last and take exactly 1 token)"
        )
    if (prefix[dec] < 1).any():
        r = n - num_decodes + int(np.argmax(prefix[dec] < 1))
        raise ValueError(
            f"plan_mixed_batch: prefix_lens[{r}] = 0 but row {r} is a decode row, which always "
            "resumes from a state"
        )
    if (slots < 0).any():
        r = int(np.argmax(slots < 0))
        raise ValueError(
            f"plan_mixed_batch: slots[{r}] = {slots[r]}; the planner takes live rows only "
            "(pad rows are added by the graph buffers)"
        )
    if _has_duplicate(slots):
        raise ValueError("plan_mixed_batch: slots has a duplicate working slot")


def _check_track(track_mask: npt.NDArray[np.bool_], track_slots: IntArray, slots: IntArray) -> None:
    n = slots.shape[0]
    for name, arr in (("track_mask", track_mask), ("track_slots", track_slots)):
        if arr.shape[0] != n:
            raise ValueError(
                f"plan_mixed_batch: {name} has {arr.shape[0]} rows but extend_lens has {n}"
            )
    tracked = track_slots[track_mask]
    if tracked.shape[0] == 0:
        return
    # Fast path: the working slots are distinct (checked first), so one sort of both finds
    # a track slot that is a working slot or another tracked row's; details only on failure.
    if tracked.min() >= 0 and not _has_duplicate(np.concatenate((slots, tracked))):
        return
    if (tracked < 0).any():
        r = int(np.flatnonzero(track_mask)[np.argmax(tracked < 0)])
        raise ValueError(
            f"plan_mixed_batch: track_slots[{r}] = {track_slots[r]} but track_mask[{r}] is set; "
            "a tracked row needs a track slot >= 0"
        )
    clash = _member(tracked, slots)
    if clash.any():
        r = int(np.flatnonzero(track_mask)[np.argmax(clash)])
        raise ValueError(
            f"plan_mixed_batch: track_slots[{r}] = {track_slots[r]} is also a working slot of "
            "this batch; saving into it would overwrite a live state"
        )
    if _has_duplicate(tracked):
        raise ValueError("plan_mixed_batch: two tracked rows share one track slot")


def _member(values: IntArray, pool: IntArray) -> npt.NDArray[np.bool_]:
    """``np.isin(values, pool)`` for small int arrays, by binary search (several times
    faster than ``np.isin`` at a few hundred elements)."""
    ordered = np.sort(pool)
    if ordered.shape[0] == 0:
        return np.zeros(values.shape, dtype=np.bool_)
    pos = np.minimum(np.searchsorted(ordered, values), ordered.shape[0] - 1)
    found: npt.NDArray[np.bool_] = ordered[pos] == values
    return found


def _has_duplicate(values: IntArray) -> bool:
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def _ext_index(q: IntArray, row: IntArray, row_start: IntArray, total: int, k1: int) -> IntArray:
    """Extended-input index of flattened position ``q`` as seen by prefill row ``row``."""
    before = q < row_start
    init_col = k1 - (row_start - q)  # column of the row's initial state, oldest first
    return np.where(before, total + row * k1 + init_col, q)


def _token_windows(qsl: IntArray, total: int, k1: int) -> IntArray:
    """``[total, k1 + 1]`` extended-input indices of every prefill token's conv window.

    The same values as ``_ext_index`` over all tokens, without its full-size passes: a
    window is the flattened positions ``t - k1 .. t`` except in the first ``k1`` tokens of
    a row, whose leading entries read the row's initial state (few: patched in place).
    """
    # Column by column: numpy's broadcast over a 4-wide inner axis is several times slower.
    win = np.empty((total, k1 + 1), dtype=np.int64)
    base = np.arange(-k1, total - k1, dtype=np.int64)
    for c_out in range(k1 + 1):
        np.add(base, c_out, out=win[:, c_out])
    if k1 == 0 or qsl.shape[0] < 2:
        return win
    # Token j of row r (j < k1), column c < k1 - j: initial-state column j + c of row r.
    j = np.arange(k1, dtype=np.int64)[None, :, None]
    c = np.arange(k1 + 1, dtype=np.int64)[None, None, :]
    hit = (j < (qsl[1:] - qsl[:-1])[:, None, None]) & (c < k1 - j)
    r_at, j_at, c_at = np.nonzero(hit)
    win[qsl[r_at] + j_at, c_at] = total + r_at * k1 + j_at + c_at
    return win


def plan_host(
    *,
    extend_lens: IntLike,
    prefix_lens: IntLike,
    slots: IntLike,
    num_decodes: int,
    chunk_size: int,
    conv_kernel: int,
    track_interval: int | None = None,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
) -> MixedHostPlan:
    """Plan one mixed forward from host data (no device work).

    Parameters
    ----------
    extend_lens : sequence of int or CPU tensor
        ``[bs]`` new tokens per row; prefill rows first, then ``num_decodes`` decode rows
        with exactly 1 token each.
    prefix_lens : sequence of int or CPU tensor
        ``[bs]`` tokens already in the row's state (> 0 means the row resumes from the
        state in its working slot).
    slots : sequence of int or CPU tensor
        ``[bs]`` working state slot of each row (``mamba_cache_indices``), distinct, >= 0.
    num_decodes : int
        Number of decode rows at the end of the batch.
    chunk_size : int
        SSD scan chunk size (the state grid).
    conv_kernel : int
        Causal conv1d width ``K`` (the conv state keeps ``K - 1`` inputs).
    track_interval : int, optional
        Track every this many tokens; a positive multiple of ``chunk_size``. Required when
        ``track_mask`` is given.
    track_mask : sequence of bool or CPU tensor, optional
        ``[bs]`` rows that track: each saves its last boundary reached this step into its
        track slot.
    track_slots : sequence of int or CPU tensor, optional
        ``[bs]`` track slot of each row (ignored where ``track_mask`` is False); must not be a
        working slot of this batch.

    Returns
    -------
    MixedHostPlan

    Raises
    ------
    ValueError
        Inconsistent configuration or rows; the message names the field and the rule.
    """
    _check_config(chunk_size, track_interval, conv_kernel)
    ext = _host_ints("extend_lens", extend_lens)
    pre = _host_ints("prefix_lens", prefix_lens)
    slt = _host_ints("slots", slots)
    _check_rows(ext, pre, slt, num_decodes)
    n_rows = ext.shape[0]
    if track_mask is None:
        if track_slots is not None:
            raise ValueError("plan_mixed_batch: track_slots given without track_mask")
        tmask = np.zeros(n_rows, dtype=np.bool_)
        tslots = np.full(n_rows, -1, dtype=np.int64)
    else:
        if track_slots is None:
            raise ValueError("plan_mixed_batch: track_mask given without track_slots")
        if track_interval is None:
            raise ValueError("plan_mixed_batch: track_mask given without track_interval")
        tmask = _host_bools("track_mask", track_mask)
        tslots = _host_ints("track_slots", track_slots)
        _check_track(tmask, tslots, slt)
    n_pre = n_rows - num_decodes
    k1 = conv_kernel - 1
    L = chunk_size

    qsl = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(ext, out=qsl[1:])
    total = int(qsl[n_pre])  # flattened prefill tokens

    # Track plan: each tracked row's last boundary b = floor((prefix+extend)/I)*I.
    interval = track_interval if track_interval is not None else 1
    end_abs = pre + ext
    b = (end_abs // interval) * interval
    k = b - pre  # new tokens before the boundary
    saves = tmask & (k > 0)
    is_final = saves & (k == ext)
    mid = saves & (k < ext)  # only prefill rows: decode rows have ext == 1
    g = qsl[:-1] + k  # flattened position after the boundary token
    parts: dict[str, IntArray] = {
        "query_start_loc": qsl,
        "slots": slt,
        "track_slots": np.where(saves, tslots, -1),
        "track_mask": is_final.astype(np.int64),
    }
    h_rows = rc_rows = np.zeros(0, dtype=np.int64)
    if n_pre:
        # The prefill plan: chunks, conv windows, mid-row saves. A decode-only batch (the
        # hot path of a decode step) skips all of it: its rows have one token each, so a
        # save is always the row's final token.
        #
        # Logical chunks: a new one at every physical chunk start and every row start (the
        # rule of hybridmeta.chunks).
        starts = logical_chunk_starts(qsl[: n_pre + 1], L)
        n_logical = starts.shape[0]
        n_phys = -(-total // L)
        ends = np.append(starts[1:], total).astype(np.int64)
        # Row of each chunk: the last row starting at or before it (rows have >= 1 token).
        chunk_row = np.searchsorted(qsl[1 : n_pre + 1], starts, side="right")
        # A chunk is its row's first when it starts where its row starts.
        chunk_first = (starts == qsl[chunk_row]).astype(np.int64)
        token_chunk = np.repeat(np.arange(n_logical, dtype=np.int64), ends - starts)
        token_pos = np.arange(total, dtype=np.int64) - starts[token_chunk]
        row_last_chunk = np.searchsorted(starts, qsl[1 : n_pre + 1], side="left") - 1
        phys_last_chunk = np.searchsorted(starts, np.arange(1, n_phys + 1) * L, side="left") - 1

        # Conv windows: token t reads positions t-(K-1) .. t; a row's final window is its
        # last K-1 inputs.
        token_conv = _token_windows(qsl[: n_pre + 1], total, k1)
        rows_p = np.arange(n_pre, dtype=np.int64)
        q_fin = qsl[1 : n_pre + 1, None] - k1 + np.arange(k1, dtype=np.int64)[None, :]
        final_conv = _ext_index(q_fin, rows_p[:, None], qsl[:n_pre, None], total, k1)

        # Mid-row saves: on the chunk grid (the chunk's end state) or recomputed.
        on_grid = mid & (g % L == 0)
        off_grid = mid & ~on_grid
        h_rows = np.flatnonzero(on_grid)
        rc_rows = np.flatnonzero(off_grid)
        h_chunk = phys_last_chunk[g[h_rows] // L - 1]
        rc_g = g[rc_rows]
        rc_chunk = np.searchsorted(starts, rc_g - 1, side="right") - 1
        rc_len = rc_g - starts[rc_chunk]
        mid_rows = np.concatenate([h_rows, rc_rows])
        q_mid = g[mid_rows][:, None] - k1 + np.arange(k1, dtype=np.int64)[None, :]
        mid_conv = _ext_index(q_mid, mid_rows[:, None], qsl[mid_rows][:, None], total, k1)

        parts.update(
            {
                "has_init": (pre[:n_pre] > 0).astype(np.int64),
                "chunk_start": starts,
                "chunk_len": ends - starts,
                "chunk_row": chunk_row,
                "chunk_first": chunk_first,
                "token_chunk": token_chunk,
                "token_pos": token_pos,
                "row_last_chunk": row_last_chunk,
                "phys_last_chunk": phys_last_chunk,
                "token_conv": token_conv.reshape(-1),
                "final_conv": final_conv.reshape(-1),
                "h_rows": h_rows,
                "h_chunk": h_chunk,
                "rc_rows": rc_rows,
                "rc_chunk": rc_chunk,
                "rc_len": rc_len,
                "mid_conv": mid_conv.reshape(-1),
            }
        )
    return MixedHostPlan(
        arrays={_P + name: a for name, a in parts.items()},
        num_prefills=n_pre,
        num_decodes=num_decodes,
        num_prefill_tokens=total,
        chunk_size=L,
        conv_kernel=conv_kernel,
        track=track_mask is not None,
        any_final_save=bool(is_final.any()),
        final_rows=tuple(np.flatnonzero(is_final).tolist()),
        h_rows=tuple(h_rows.tolist()),
        recompute_rows=tuple(rc_rows.tolist()),
    )


def plan_mixed_batch(
    *,
    extend_lens: IntLike,
    prefix_lens: IntLike,
    slots: IntLike,
    num_decodes: int,
    chunk_size: int,
    conv_kernel: int,
    track_interval: int | None = None,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
    device: torch.device | str = "cpu",
) -> Mamba2Metadata:
    """:func:`plan_host`, then one staged copy to ``device``: the forward's metadata.

    Parameters are those of :func:`plan_host`, plus the ``device`` of the metadata.
    """
    hp = plan_host(
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        slots=slots,
        num_decodes=num_decodes,
        chunk_size=chunk_size,
        conv_kernel=conv_kernel,
        track_interval=track_interval,
        track_mask=track_mask,
        track_slots=track_slots,
    )
    return hp.metadata(to_device_packed(hp.arrays, torch.device(device)))


@attrs.frozen(kw_only=True, eq=False)
class VerifyHostPlan:
    """A target-verify forward planned on the host; :meth:`metadata` builds it from staged
    views.

    Attributes
    ----------
    arrays : dict of str to numpy array
        The forward's per-row arrays (int64), keyed ``"hybridmeta.verify.<name>"``; stage
        them with :func:`~hybridmeta.staging.to_device_packed`, with the engine's own.
    num_rows, draft_token_num : int
    track : bool
        Track fields are present (``track_mask`` was given).
    any_track : bool
        Some row may cross a boundary (``has_mamba_track_mask``).
    """

    arrays: dict[str, IntArray]
    num_rows: int
    draft_token_num: int
    track: bool
    any_track: bool

    def forward(self, views: Mapping[str, torch.Tensor], **engine: object) -> ForwardMetadata:
        """The verify forward's ``ForwardMetadata`` over staged ``views`` of :attr:`arrays`.

        ``engine`` passes further ``ForwardMetadata`` fields (a tree:
        ``retrieve_parent_token``, ``retrieve_next_token``, ``retrieve_next_sibling``, each
        ``[num_rows, draft_token_num]``) through the same constructor.
        """
        v = _views(views, _PV, "VerifyHostPlan")
        return _forward(
            v, self.track, self.any_track,
            is_target_verify=True, draft_token_num=self.draft_token_num, **engine,
        )  # fmt: skip

    def metadata(self, views: Mapping[str, torch.Tensor], **engine: object) -> Mamba2Metadata:
        """The verify forward's ``Mamba2Metadata`` (:func:`~hybridmeta.model.prepare_target_verify`)."""
        return prepare_target_verify(self.forward(views, **engine))


def plan_verify_host(
    *,
    slots: IntLike,
    draft_token_num: int,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
) -> VerifyHostPlan:
    """Plan a speculative target-verify forward from host data (no device work).

    Parameters
    ----------
    slots : sequence of int or CPU tensor
        ``[bs]`` working slot of each row (distinct, >= 0); every row verifies
        ``draft_token_num`` tokens.
    draft_token_num : int
        Tokens per row (the pending token and its draft), ``>= 1``.
    track_mask, track_slots : optional
        ``[bs]`` rows that may cross a track boundary with their tokens, and the track slot
        each reserved (not a working slot of this batch). The commit decides from the
        accepted tokens whether (and from which column) the boundary is saved.

    Raises
    ------
    ValueError
        The message names the argument and the rule.
    """
    if isinstance(draft_token_num, bool) or not isinstance(draft_token_num, int) or draft_token_num < 1:
        raise ValueError(f"plan_verify: draft_token_num must be an int >= 1, got {draft_token_num!r}")
    slt = _host_ints("slots", slots)
    n = slt.shape[0]
    if n == 0:
        raise ValueError("plan_verify: the batch has no rows")
    if (slt < 0).any() or _has_duplicate(slt):
        raise ValueError("plan_verify: slots must be distinct working slots >= 0 (live rows only)")
    if (track_mask is None) != (track_slots is None):
        raise ValueError("plan_verify: track_mask and track_slots are given together")
    tmask = np.zeros(n, dtype=np.bool_)
    tslots = np.full(n, -1, dtype=np.int64)
    if track_mask is not None and track_slots is not None:
        tmask = _host_bools("track_mask", track_mask)
        tslots = _host_ints("track_slots", track_slots)
        _check_track(tmask, tslots, slt)
    arrays = {
        "query_start_loc": np.arange(n + 1, dtype=np.int64) * draft_token_num,
        "slots": slt,
        "track_slots": np.where(tmask, tslots, -1),
        "track_mask": tmask.astype(np.int64),
    }
    return VerifyHostPlan(
        arrays={_PV + k: a for k, a in arrays.items()},
        num_rows=n,
        draft_token_num=draft_token_num,
        track=track_mask is not None,
        any_track=bool(tmask.any()),
    )


def plan_verify(
    *,
    slots: IntLike,
    draft_token_num: int,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
    device: torch.device | str = "cpu",
    **engine: object,
) -> Mamba2Metadata:
    """:func:`plan_verify_host`, then one staged copy to ``device``: the verify forward's
    metadata (``engine``: further ``ForwardMetadata`` fields, e.g. a tree)."""
    hp = plan_verify_host(
        slots=slots,
        draft_token_num=draft_token_num,
        track_mask=track_mask,
        track_slots=track_slots,
    )
    return hp.metadata(to_device_packed(hp.arrays, torch.device(device)), **engine)
