"""The mixed-batch planner: host description of a batch in, ``Mamba2Metadata`` + plan out.

Everything is decided here, once per forward, from host data (``REFERENCE.md`` §2 class F,
§3): no device tensor is read, and the device-side plan is one packed, non-blocking
host-to-device copy. The Mamba2 metadata itself is built through
:func:`hybridmeta.model.prepare_mixed` (or :func:`~hybridmeta.model.prepare_decode` when the
batch has no prefill row), never by hand.

The track plan (prefix cache of recurrent state). A row with ``track_mask`` set saves its
conv + SSM state at the *last* absolute position ``b`` (a positive multiple of
``track_interval``) reached by its new tokens, ``prefix < b <= prefix + extend``:

* ``b`` ends the row: the final state, written to the row's working slot by the scan (or by
  the decode update for a decode row), is copied working slot -> track slot
  (``track_ssm_final_src/dst``; the conv window likewise);
* ``b`` falls on the SSD scan's chunk grid, which is **global over the flattened prefill
  tokens** (``REFERENCE.md`` §2 class C): the flattened position ``g`` after the
  boundary token satisfies ``g % chunk_size == 0`` and the state is the chunk state
  ``h[g // chunk_size - 1]`` (``track_ssm_h_src/dst``);
* otherwise the boundary is off the grid and is recomputed from the state entering its
  logical chunk plus fewer than ``chunk_size`` tokens (``recompute_*``).

The conv window of a mid-row boundary is gathered with ``track_conv_indices``
``[n_mid, K-1]``, indices into the *extended* conv input: ``i < T`` is flattened prefill
token ``i``; ``T + r * (K-1) + c`` is column ``c`` (oldest first) of prefill row ``r``'s
initial conv state (zeros where the row has none). Windows that reach back before a row's
first new token read its initial state that way.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from hybridmeta.chunks import chunk_indices_offsets
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, prepare_decode, prepare_mixed
from hybridmeta.staging import to_device_packed

__all__ = ["PrefillPlan", "TrackPlan", "plan_mixed_batch"]

IntArray = npt.NDArray[np.int64]
IntLike = Sequence[int] | torch.Tensor | npt.NDArray[np.integer]
BoolLike = Sequence[bool] | torch.Tensor | npt.NDArray[np.bool_]


@attrs.frozen(kw_only=True)
class TrackPlan:
    """Device-side extend track plan (all int64). Entries are in row order.

    Attributes
    ----------
    final_src, final_dst : torch.Tensor
        ``[n_final]`` working slot -> track slot, conv and SSM (boundary ends the row).
    h_src, h_dst : torch.Tensor
        ``[n_h]`` physical chunk on the global grid -> track slot.
    h_logical : torch.Tensor
        ``[n_h]`` the logical chunk whose end is that physical chunk's end (what the scan
        gathers; ``h_src`` is the engine-facing index).
    recompute_chunk, recompute_len, recompute_dst : torch.Tensor
        ``[n_rc]`` logical chunk holding the boundary, number of its tokens before the
        boundary (``1 .. chunk_size - 1``), track slot.
    conv_indices, conv_dst : torch.Tensor
        ``[n_mid, K-1]`` extended-input indices of each mid-row boundary's conv window and
        ``[n_mid]`` its track slot (``h`` entries first, then recompute entries).
    final_rows, h_rows, recompute_rows : tuple of int
        Host copies: which batch rows produced each kind (for logs and tests).
    """

    final_src: torch.Tensor
    final_dst: torch.Tensor
    h_src: torch.Tensor
    h_dst: torch.Tensor
    h_logical: torch.Tensor
    recompute_chunk: torch.Tensor
    recompute_len: torch.Tensor
    recompute_dst: torch.Tensor
    conv_indices: torch.Tensor
    conv_dst: torch.Tensor
    final_rows: tuple[int, ...]
    h_rows: tuple[int, ...]
    recompute_rows: tuple[int, ...]

    @property
    def empty(self) -> bool:
        """Host-side: no row saves anything this step."""
        return not (self.final_rows or self.h_rows or self.recompute_rows)


@attrs.frozen(kw_only=True)
class PrefillPlan:
    """Planner output: the forward's ``Mamba2Metadata`` and the prefill-side device plan.

    Attributes
    ----------
    metadata : Mamba2Metadata
        Built by ``prepare_mixed`` / ``prepare_decode``; carries ``query_start_loc``,
        ``seq_idx``, ``has_initial_states``, logical chunks and the track plan fields.
    num_prefills, num_decodes, num_prefill_tokens, chunk_size, conv_kernel : int
    track_interval : int or None
    extend_lens, prefix_lens : tuple of int
        Host copies, all rows.
    query_start_loc_cpu : tuple of int
        ``[bs + 1]`` host copy.
    slots : torch.Tensor
        ``[num_prefills]`` working slots of the prefill rows (device).
    has_initial_states : torch.Tensor
        ``[num_prefills]`` bool (device).
    token_chunk, token_pos : torch.Tensor
        ``[num_prefill_tokens]`` logical chunk of each token and its position in it.
    chunk_start, chunk_len, chunk_row : torch.Tensor
        ``[num_logical_chunks]`` first token, length, prefill row.
    chunk_first : torch.Tensor
        ``[num_logical_chunks]`` bool: the chunk opens its row.
    row_last_chunk : torch.Tensor
        ``[num_prefills]`` logical chunk holding the row's last token.
    phys_last_chunk : torch.Tensor
        ``[num_physical_chunks]`` last logical chunk of each physical chunk.
    final_conv_indices : torch.Tensor
        ``[num_prefills, K-1]`` extended-input indices of each row's final conv window.
    token_conv_indices : torch.Tensor
        ``[num_prefill_tokens, K]`` extended-input indices of each token's conv window.
    track : TrackPlan
    """

    metadata: Mamba2Metadata
    num_prefills: int
    num_decodes: int
    num_prefill_tokens: int
    num_logical_chunks: int
    num_physical_chunks: int
    chunk_size: int
    conv_kernel: int
    track_interval: int | None
    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    query_start_loc_cpu: tuple[int, ...]
    slots: torch.Tensor
    has_initial_states: torch.Tensor
    token_chunk: torch.Tensor
    token_pos: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    chunk_row: torch.Tensor
    chunk_first: torch.Tensor
    row_last_chunk: torch.Tensor
    phys_last_chunk: torch.Tensor
    final_conv_indices: torch.Tensor
    token_conv_indices: torch.Tensor
    track: TrackPlan


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
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
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
            "state-grid chunks cannot index the grid (REFERENCE.md §2 class C)"
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
    if (extend < 1).any():
        r = int(np.argmax(extend < 1))
        raise ValueError(
            f"plan_mixed_batch: extend_lens[{r}] = {extend[r]}; every row needs >= 1 new token"
        )
    if (prefix < 0).any():
        r = int(np.argmax(prefix < 0))
        raise ValueError(f"plan_mixed_batch: prefix_lens[{r}] = {prefix[r]} must be >= 0")
    dec = slice(n - num_decodes, n)
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
    if np.unique(slots).shape[0] != n:
        raise ValueError("plan_mixed_batch: slots has a duplicate working slot")


def _check_track(track_mask: npt.NDArray[np.bool_], track_slots: IntArray, slots: IntArray) -> None:
    n = slots.shape[0]
    for name, arr in (("track_mask", track_mask), ("track_slots", track_slots)):
        if arr.shape[0] != n:
            raise ValueError(
                f"plan_mixed_batch: {name} has {arr.shape[0]} rows but extend_lens has {n}"
            )
    tracked = track_slots[track_mask]
    if (tracked < 0).any():
        r = int(np.flatnonzero(track_mask)[np.argmax(tracked < 0)])
        raise ValueError(
            f"plan_mixed_batch: track_slots[{r}] = {track_slots[r]} but track_mask[{r}] is set; "
            "a tracked row needs a track slot >= 0"
        )
    clash = np.isin(tracked, slots)
    if clash.any():
        r = int(np.flatnonzero(track_mask)[np.argmax(clash)])
        raise ValueError(
            f"plan_mixed_batch: track_slots[{r}] = {track_slots[r]} is also a working slot of "
            "this batch; saving into it would overwrite a live state"
        )
    if np.unique(tracked).shape[0] != tracked.shape[0]:
        raise ValueError("plan_mixed_batch: two tracked rows share one track slot")


def _ext_index(q: IntArray, row: IntArray, row_start: IntArray, total: int, k1: int) -> IntArray:
    """Extended-input index of flattened position ``q`` as seen by prefill row ``row``."""
    before = q < row_start
    init_col = k1 - (row_start - q)  # column of the row's initial state, oldest first
    return np.where(before, total + row * k1 + init_col, q)


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
) -> PrefillPlan:
    """Plan one mixed forward from host data.

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
        ``[bs]`` rows whose state is saved into their track slot.
    track_slots : sequence of int or CPU tensor, optional
        ``[bs]`` track slot of each row (ignored where ``track_mask`` is False); must not be a
        working slot of this batch.
    device : torch.device or str
        Where the device-side plan lives.

    Returns
    -------
    PrefillPlan

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
    dev = torch.device(device)
    n_pre = n_rows - num_decodes
    k1 = conv_kernel - 1
    L = chunk_size

    qsl = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(ext, out=qsl[1:])
    total = int(qsl[n_pre])  # flattened prefill tokens

    # Logical chunks: a new one at every physical chunk start and every row start (the
    # rule of hybridmeta.chunks, which prepare_mixed applies to the metadata too).
    ind, off = chunk_indices_offsets(torch.from_numpy(qsl[: n_pre + 1]), L)
    starts = (ind * L + off).numpy()
    n_logical = starts.shape[0]
    n_phys = -(-total // L)
    ends = np.append(starts[1:], total).astype(np.int64)
    seq_idx = np.repeat(np.arange(n_pre, dtype=np.int64), ext[:n_pre])
    chunk_row = seq_idx[starts]
    chunk_first = np.isin(starts, qsl[:n_pre]).astype(np.int64)
    token_chunk = np.repeat(np.arange(n_logical, dtype=np.int64), ends - starts)
    token_pos = np.arange(total, dtype=np.int64) - starts[token_chunk]
    row_last_chunk = np.searchsorted(starts, qsl[1 : n_pre + 1], side="left") - 1
    phys_last_chunk = np.searchsorted(starts, np.arange(1, n_phys + 1) * L, side="left") - 1

    # Conv windows: token t reads positions t-(K-1) .. t; a row's final window is its last
    # K-1 inputs.
    tok = np.arange(total, dtype=np.int64)
    q_tok = tok[:, None] - k1 + np.arange(conv_kernel, dtype=np.int64)[None, :]
    token_conv = _ext_index(q_tok, seq_idx[:, None], qsl[seq_idx][:, None], total, k1)
    rows_p = np.arange(n_pre, dtype=np.int64)
    q_fin = qsl[1 : n_pre + 1, None] - k1 + np.arange(k1, dtype=np.int64)[None, :]
    final_conv = _ext_index(q_fin, rows_p[:, None], qsl[:n_pre, None], total, k1)

    # Track plan: each tracked row's last boundary b = floor((prefix+extend)/I)*I.
    interval = track_interval if track_interval is not None else 1
    end_abs = pre + ext
    b = (end_abs // interval) * interval
    k = b - pre  # new tokens before the boundary
    saves = tmask & (k > 0)
    is_final = saves & (k == ext)
    mid = saves & (k < ext)  # only prefill rows: decode rows have ext == 1
    g = qsl[:-1] + k  # flattened position after the boundary token
    on_grid = mid & (g % L == 0)
    off_grid = mid & ~on_grid
    final_rows = np.flatnonzero(is_final)
    h_rows = np.flatnonzero(on_grid)
    rc_rows = np.flatnonzero(off_grid)
    h_src = g[h_rows] // L - 1
    h_logical = phys_last_chunk[h_src]
    rc_g = g[rc_rows]
    rc_chunk = np.searchsorted(starts, rc_g - 1, side="right") - 1
    rc_len = rc_g - starts[rc_chunk]
    mid_rows = np.concatenate([h_rows, rc_rows])
    q_mid = g[mid_rows][:, None] - k1 + np.arange(k1, dtype=np.int64)[None, :]
    conv_mid = _ext_index(q_mid, mid_rows[:, None], qsl[mid_rows][:, None], total, k1)

    # One packed host buffer, one non-blocking copy; the plan tensors are views of it.
    parts: list[tuple[str, IntArray]] = [
        ("slots", slt[:n_pre]),
        ("has_init", (pre[:n_pre] > 0).astype(np.int64)),
        ("token_chunk", token_chunk),
        ("token_pos", token_pos),
        ("chunk_start", starts),
        ("chunk_len", ends - starts),
        ("chunk_row", chunk_row),
        ("chunk_first", chunk_first),
        ("row_last_chunk", row_last_chunk),
        ("phys_last_chunk", phys_last_chunk),
        ("final_conv", final_conv.reshape(-1)),
        ("token_conv", token_conv.reshape(-1)),
        ("final_src", slt[final_rows]),
        ("final_dst", tslots[final_rows]),
        ("h_src", h_src),
        ("h_dst", tslots[h_rows]),
        ("h_logical", h_logical),
        ("rc_chunk", rc_chunk),
        ("rc_len", rc_len),
        ("rc_dst", tslots[rc_rows]),
        ("conv_mid", conv_mid.reshape(-1)),
        ("conv_dst", tslots[mid_rows]),
        ("qsl", qsl),
        ("all_slots", slt),
        ("track_slots", np.where(tmask, tslots, -1)),
        ("track_mask", tmask.astype(np.int64)),
    ]
    views = to_device_packed(dict(parts), dev)

    has_track = bool(tmask.any())
    fwd = ForwardMetadata(
        query_start_loc=views["qsl"],
        mamba_cache_indices=views["all_slots"],
        mamba_track_indices=views["track_slots"] if track_mask is not None else None,
        mamba_track_mask=(views["track_mask"] != 0) if track_mask is not None else None,
        has_mamba_track_mask=has_track,
        # ForwardMetadata declares it 1-D: the [n_mid, K-1] plan, flattened.
        track_conv_indices=views["conv_mid"],
        track_ssm_h_src=views["h_src"],
        track_ssm_h_dst=views["h_dst"],
        track_ssm_final_src=views["final_src"],
        track_ssm_final_dst=views["final_dst"],
    )
    if n_pre:
        md = prepare_mixed(
            fwd,
            extend_seq_lens_cpu=[int(v) for v in ext[:n_pre]],
            extend_prefix_lens_cpu=[int(v) for v in pre[:n_pre]],
            chunk_size=L,
        )
    else:
        md = prepare_decode(fwd)

    track = TrackPlan(
        final_src=views["final_src"],
        final_dst=views["final_dst"],
        h_src=views["h_src"],
        h_dst=views["h_dst"],
        h_logical=views["h_logical"],
        recompute_chunk=views["rc_chunk"],
        recompute_len=views["rc_len"],
        recompute_dst=views["rc_dst"],
        conv_indices=views["conv_mid"].view(-1, k1),
        conv_dst=views["conv_dst"],
        final_rows=tuple(int(r) for r in final_rows),
        h_rows=tuple(int(r) for r in h_rows),
        recompute_rows=tuple(int(r) for r in rc_rows),
    )
    return PrefillPlan(
        metadata=md,
        num_prefills=n_pre,
        num_decodes=num_decodes,
        num_prefill_tokens=total,
        num_logical_chunks=n_logical,
        num_physical_chunks=n_phys,
        chunk_size=L,
        conv_kernel=conv_kernel,
        track_interval=track_interval,
        extend_lens=tuple(int(v) for v in ext),
        prefix_lens=tuple(int(v) for v in pre),
        query_start_loc_cpu=tuple(int(v) for v in qsl),
        slots=views["slots"],
        has_initial_states=views["has_init"] != 0,
        token_chunk=views["token_chunk"],
        token_pos=views["token_pos"],
        chunk_start=views["chunk_start"],
        chunk_len=views["chunk_len"],
        chunk_row=views["chunk_row"],
        chunk_first=views["chunk_first"] != 0,
        row_last_chunk=views["row_last_chunk"],
        phys_last_chunk=views["phys_last_chunk"],
        final_conv_indices=views["final_conv"].view(n_pre, k1),
        token_conv_indices=views["token_conv"].view(total, conv_kernel),
        track=track,
    )
