"""Mamba2 single-token SSM state update: Triton kernels, launcher, op, reference.

Two kernels, one contract; the launcher picks by the state pool's dtype (H200 sweeps,
``docs/perf_notes.md``):

* **fp32 state: the row walk.** A *unit* is a ``[BLOCK_P, dstate]`` tile of one head
  (``headdim / BLOCK_P`` units per head). The grid is ``units x row_splits``: program
  ``(u, s)`` walks a contiguous range of ``rows_per_prog`` rows and, for each live row,
  updates unit ``u`` of its state in place in the pool (or into a separate destination
  slot) and writes the unit's share of the output. ``row_splits`` is sized on the host so
  that the programs fill a few waves of the GPU; ``bs`` and ``rows_per_prog`` are runtime
  values, so a new batch size never recompiles. A program first reads the source slots of
  up to ``ROW_BLOCK`` rows at once, writes the zero output of their pad rows in one store
  and skips the block when it holds no live row: a bucket-256 CUDA graph replayed with one
  live row costs little more than a bucket-1 graph.
* **bf16 / fp16 state, and fp32 launches of at most 32 rows: one tile a program.** One
  program updates a ``[BLOCK_P, dstate]`` tile of one head of one row (grid
  ``p-tiles x bs x heads``). The row walk keeps more registers live per thread, which
  costs a 2-byte state tile a third of its bandwidth; at a handful of rows its loop costs
  more than its row skipping saves (``SsmLaunchConfig.tile_max_bs``).
  With ``R > 1`` rows a program (``SsmLaunchConfig.tile_rows`` / ``tile_rows_from``; for
  bf16 / fp16 states 16 from 128 rows, 32 from 256) a program owns the tile of ``R``
  consecutive rows (grid ``p-tiles x ceil(bs / R) x heads``; ``bs`` stays a runtime value): it reads
  their source slots at once, writes the zero output of their pad rows in one store and
  runs the row body from its first to its last live row, nothing for a block of pad rows.
  The row body is the one-row kernel's, called as an outlined function so that the
  compiler keeps none of its loop-invariant offsets live across the loop. ``R = 1``
  compiles to the one-row kernel. A bucket-256 bf16 graph replayed with one live row costs
  1.8x a bucket-1 graph (60x at one row a program).

Pad rows (source slot ``-1``) read no state, write no state and get zero output. Flagged
rows may also store the new state into their track slot in the same pass.

The launchers never allocate and never validate; the public op :func:`ssm_state_update`
does both (:func:`ssm_args_ok` is its fast check), then runs a Triton kernel or the
pure-torch :func:`ssm_state_update_reference` (the op call's ``impl``). The metadata
entry point :func:`ssm_state_update_from_metadata` takes its slots from a
``Mamba2Metadata``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import SsmLaunchConfig, cdiv, pow2_ceil, ssm_launch_config
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, resolve
from hybridmeta.kernels._errors import (
    MAX_ROWS,
    NO_FAULT,
    TAG,
    fault_keys,
    host_check,
    record_,
    record_for,
    report,
    valid_slot,
)
from hybridmeta.kernels._launch import DirectLauncher, device_capacity
from hybridmeta.kernels._math import discretize, scatter_rows_, ssm_step
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MASK_DTYPES,
    NO_DT_LIMIT,
    PAD_MAX,
    PAD_MIN,
    check_disjoint_writes,
    check_dt_limit,
    check_optional,
    check_pad_slot_id,
    check_pool,
    check_rows,
    check_slots,
    check_tensor,
    decode_rows,
    non_overlapping,
    pad_slot_of,
    slot_kinds,
)
from hybridmeta.model import Mamba2Metadata

__all__ = [
    "launch_ssm_update",
    "ssm_args_ok",
    "ssm_state_update",
    "ssm_state_update_from_metadata",
    "ssm_state_update_reference",
]

_FLOAT: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
_INDEX: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
_OP = "ssm_state_update"
_TAG: tl.constexpr = tl.constexpr(TAG[_OP])


@triton.jit  # type: ignore[arg-type]  # a helper returning values; the stub types kernels
def _row_slots(
    i_b: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """Row ``i_b``'s slots (int64) and what it may do, per-row scalars only.

    Returns ``(src, dst, trk, live, write, track, bad)``: ``live`` the row reads its source
    slot, ``write`` / ``track`` it stores into ``dst`` / ``trk``, ``bad`` it holds an id that
    is neither the pad id nor a valid slot (its source, its destination, or its track slot
    when flagged): such a row reads and writes no state and its output is NaN; the caller
    reports it (:func:`_report_row`: the tile path after its stores, the row walk before
    its loads, each where it measured cheaper) (a pad row's other ids are never looked
    at). Only the predicates are on the hot path: the fault's field and value are
    worked out again by the report, off it. The row walk's blocks judged clean at once
    (:func:`_rows_bad`) skip this for a pad-id compare.
    """
    src = tl.load(src_ptr + i_b).to(tl.int64)
    src_ok = valid_slot(src, pad_id, n_slots)
    bad = (src != pad_id) & (src_ok == 0)
    if HAS_DST:
        dst = tl.load(dst_ptr + i_b).to(tl.int64)
        dst_ok = valid_slot(dst, pad_id, n_slots)
        bad = bad | (src_ok & (dst != pad_id) & (dst_ok == 0))
    else:
        dst = src
        dst_ok = src_ok
    if HAS_TRACK:
        flag = tl.load(track_mask_ptr + i_b) != 0
        trk = tl.load(track_idx_ptr + i_b).to(tl.int64)
        trk_ok = flag & valid_slot(trk, pad_id, n_slots)
        bad = bad | (src_ok & flag & (trk != pad_id) & (trk_ok == 0))
    else:
        trk = src
        trk_ok = src_ok & (src_ok == 0)
    live = src_ok & (bad == 0)
    return src, dst, trk, live, live & dst_ok, live & trk_ok, bad


@triton.jit
def _report_row(
    i_b: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
) -> None:
    """Report the fault of row ``i_b`` (a row :func:`_row_slots` found bad): its first bad
    id (source, then destination, then track slot), read again. Called in a branch taken
    only on a fault."""
    src = tl.load(src_ptr + i_b).to(tl.int64)
    src_ok = valid_slot(src, pad_id, n_slots)
    field = tl.where(src_ok, 2, 0)
    value = src
    if HAS_DST:
        dst = tl.load(dst_ptr + i_b).to(tl.int64)
        bad_dst = src_ok & (dst != pad_id) & (valid_slot(dst, pad_id, n_slots) == 0)
        field = tl.where(bad_dst, 1, field)
        value = tl.where(bad_dst, dst, value)
    else:
        bad_dst = src_ok & (src_ok == 0)
    if HAS_TRACK:
        trk = tl.load(track_idx_ptr + i_b).to(tl.int64)
        value = tl.where(src_ok & (bad_dst == 0), trk, value)
    report(err_ptr, _TAG, i_b, field, value, pad_id, n_slots)


@triton.jit  # type: ignore[arg-type]  # a helper returning a block; the stub types kernels
def _rows_bad(
    o_r: tl.tensor,
    m_r: tl.tensor,
    v_src: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
) -> tl.tensor:
    """:func:`_row_slots`' ``bad`` for the rows ``o_r`` (``m_r``: in the batch) at once,
    ``v_src`` their source slots (int64)."""
    src_ok: tl.tensor = valid_slot(v_src, pad_id, n_slots)
    bad: tl.tensor = m_r & (v_src != pad_id) & (src_ok == 0)
    if HAS_DST:
        v_dst = tl.load(dst_ptr + o_r, mask=m_r, other=0).to(tl.int64)
        bad = bad | (m_r & src_ok & (v_dst != pad_id) & (valid_slot(v_dst, pad_id, n_slots) == 0))
    if HAS_TRACK:
        flag = tl.load(track_mask_ptr + o_r, mask=m_r, other=0) != 0
        v_trk = tl.load(track_idx_ptr + o_r, mask=m_r, other=0).to(tl.int64)
        bad_t = flag & (v_trk != pad_id) & (valid_slot(v_trk, pad_id, n_slots) == 0)
        bad = bad | (m_r & src_ok & bad_t)
    return bad


@triton.jit
def _walk_row(
    b: tl.tensor,
    i_h: tl.tensor,
    i_g: tl.tensor,
    o_p: tl.tensor,
    o_n: tl.tensor,
    m_p: tl.tensor,
    m_n: tl.tensor,
    o_s: tl.tensor,
    o_out: tl.tensor,
    b_A: tl.tensor,
    state_ptr: tl.tensor,
    x_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    headdim: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    CHECKED: tl.constexpr,
) -> None:
    """Row ``b`` of the row walk (head ``i_h``, its p-tile: ``o_p``, ``o_s``, ``o_out``):
    the one-program-per-row kernel of docs/kernels.md. ``CHECKED``: the row judges its own
    ids (:func:`_row_slots`; a bad row reports before its loads, moves no state byte and
    gets NaN); else its block was judged clean beforehand and a pad-id compare decides.
    Every load issued at once, the row's liveness folded into the masks (a pad row's state
    masks are empty: no state byte moves), no branch around the loads."""
    if CHECKED:
        src, dst, trk, live, m_write, m_track, bad = _row_slots(
            b, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, pad_id, n_slots, HAS_DST,
            HAS_TRACK,
        )  # fmt: skip
    else:
        # A block judged clean (no row with a bad id): any id but the pad id is a valid
        # slot, so a pad-id compare is all a row needs, as before the slot checks.
        src = tl.load(src_ptr + b).to(tl.int64)
        live = src != pad_id
        bad = live & (live == 0)
        if HAS_DST:
            dst = tl.load(dst_ptr + b).to(tl.int64)
            m_write = live & (dst != pad_id)
        else:
            dst = src
            m_write = live
        if HAS_TRACK:
            flag = tl.load(track_mask_ptr + b) != 0
            trk = tl.load(track_idx_ptr + b).to(tl.int64)
            m_track = live & flag & (trk != pad_id)
        else:
            trk = src
            m_track = bad  # False
    # A checked row reports before its loads: on the H200 the row walk measured 1.01x the
    # unchecked kernel so, against 1.03x with the report after the stores and 1.05x with
    # the least bad row carried through the walk and reported once (docs/perf_notes.md,
    # "Round 3"); later ones did not beat it (fourth GPU session). A clean block's rows
    # never get here.
    if CHECKED and bad:
        _report_row(
            b, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, pad_id,
            n_slots, HAS_DST, HAS_TRACK,
        )  # fmt: skip
    # Row predicates enter masks as a bound on the headdim offset (a pad row's bound
    # is 0): the Triton interpreter mistypes `block_mask & scalar_mask`.
    lim_read = tl.where(live, headdim, 0)
    lim_write = tl.where(m_write, headdim, 0)
    b_s = tl.load(
        state_ptr + src * stride_s_slot + o_s,
        mask=(o_p < lim_read)[:, None] & m_n[None, :],
        other=0.0,
    ).to(tl.float32)  # [BP, BN]
    b_x = tl.load(
        x_ptr + b * stride_x_b + i_h * stride_x_h + o_p * stride_x_p, mask=m_p, other=0.0
    ).to(tl.float32)  # [BP]
    b_dt = tl.load(dt_ptr + b * stride_dt_b + i_h * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias_ptr + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        # softplus(x) equals x in fp32 above 20; the threshold also keeps exp from
        # overflowing.
        b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
    # dt limits ((-inf, inf) when the call gives none); NaN stays NaN, as in torch.
    b_dt = tl.maximum(b_dt, dt_min, propagate_nan=tl.PropagateNan.ALL)
    b_dt = tl.minimum(b_dt, dt_max, propagate_nan=tl.PropagateNan.ALL)
    b_dA = tl.exp(b_A * b_dt)
    b_B = tl.load(
        B_ptr + b * stride_B_b + i_g * stride_B_g + o_n * stride_B_n, mask=m_n, other=0.0
    ).to(tl.float32)  # [BN]
    b_C = tl.load(
        C_ptr + b * stride_C_b + i_g * stride_C_g + o_n * stride_C_n, mask=m_n, other=0.0
    ).to(tl.float32)  # [BN]

    b_s = b_s * b_dA + (b_x * b_dt)[:, None] * b_B[None, :]  # [BP, BN]
    b_o = tl.sum(b_s * b_C[None, :], axis=1)  # [BP]
    if HAS_D:
        b_o += b_x * tl.load(D_ptr + i_h).to(tl.float32)
    if HAS_Z:
        b_z = tl.load(
            z_ptr + b * stride_z_b + i_h * stride_z_h + o_p * stride_z_p,
            mask=m_p,
            other=0.0,
        ).to(tl.float32)
        b_o *= b_z * tl.sigmoid(b_z)
    # A pad row's inputs may be garbage (even NaN): select, never multiply, to zero
    # it (a pad row in a block with live rows is zeroed twice: same bytes); a row
    # with an invalid id is poisoned.
    b_o = tl.where(live, b_o, tl.where(bad, float("nan"), 0.0))
    tl.store(out_ptr + b * stride_o_b + o_out, b_o.to(out_ptr.dtype.element_ty), mask=m_p)

    b_new = b_s.to(state_ptr.dtype.element_ty)
    tl.store(
        state_ptr + dst * stride_s_slot + o_s,
        b_new,
        mask=(o_p < lim_write)[:, None] & m_n[None, :],
    )
    if HAS_TRACK:
        lim_track = tl.where(m_track, headdim, 0)
        tl.store(
            state_ptr + trk * stride_s_slot + o_s,
            b_new,
            mask=(o_p < lim_track)[:, None] & m_n[None, :],
        )


@triton.jit(noinline=True)
def _walk_row_checked(
    b: tl.tensor,
    i_p: tl.tensor,
    i_h: tl.tensor,
    b_A: tl.tensor,
    state_ptr: tl.tensor,
    x_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_s_h: tl.tensor,
    stride_s_p: tl.tensor,
    stride_s_n: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    """:func:`_walk_row` judging its own ids, as a called function (its tile offsets worked
    out again from the scalars): the rows of a block that holds a bad id, and every row
    when a block is one row. Inlined beside the clean loop's row body it took ptxas from
    123 to 162 registers a thread."""
    i_g = i_h // heads_per_group
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    o_n = tl.arange(0, BLOCK_N)  # [BN]
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_s = i_h * stride_s_h + o_p[:, None] * stride_s_p + o_n[None, :] * stride_s_n  # [BP, BN]
    o_out = i_h * stride_o_h + o_p * stride_o_p  # [BP]
    _walk_row(
        b, i_h, i_g, o_p, o_n, m_p, m_n, o_s, o_out, b_A, state_ptr, x_ptr, dt_ptr,
        dt_bias_ptr, D_ptr, z_ptr, B_ptr, C_ptr, out_ptr, src_ptr, dst_ptr,
        track_idx_ptr, track_mask_ptr, err_ptr, dt_min, dt_max, pad_id, n_slots,
        headdim, stride_s_slot, stride_x_b, stride_x_h, stride_x_p, stride_dt_b,
        stride_dt_h, stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g,
        stride_C_n, stride_z_b, stride_z_h, stride_z_p, stride_o_b, DT_SOFTPLUS,
        HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST, HAS_TRACK, True,
    )  # fmt: skip


@triton.jit(do_not_specialize=["bs", "rows_per_prog", "pad_id", "n_slots"])
def _ssm_update_kernel(
    state_ptr: tl.tensor,
    x_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    A_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    bs: tl.tensor,
    rows_per_prog: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_s_h: tl.tensor,
    stride_s_p: tl.tensor,
    stride_s_n: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    N_PTILES: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
) -> None:
    i_u = tl.program_id(0)
    i_p = i_u % N_PTILES
    # int64 from here on: slot * per-slot stride overflows int32 for large pools.
    i_h = (i_u // N_PTILES).to(tl.int64)
    i_g = i_h // heads_per_group
    row0 = tl.program_id(1).to(tl.int64) * rows_per_prog
    row_end = tl.minimum(row0 + rows_per_prog, bs)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    o_n = tl.arange(0, BLOCK_N)  # [BN]
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_s = i_h * stride_s_h + o_p[:, None] * stride_s_p + o_n[None, :] * stride_s_n  # [BP, BN]
    o_out = i_h * stride_o_h + o_p * stride_o_p  # [BP]

    b_A = tl.load(A_ptr + i_h).to(tl.float32)  # per head: once per program

    for r0 in tl.range(row0, row_end, ROW_BLOCK):
        r1 = tl.minimum(r0 + ROW_BLOCK, row_end)
        if rows_per_prog > 1:
            # Source slots of the whole block at once: pad rows get their zero output in
            # one store, and the row loop below only spans first to last live row (nothing
            # for a block of pad rows: the tail of a bucket's CUDA graph).
            o_r = r0 + tl.arange(0, ROW_BLOCK)  # [R]
            m_r = o_r < r1
            v_src = tl.load(src_ptr + o_r, mask=m_r, other=0).to(tl.int64)  # [R]
            # Pad rows here; rows with any other id (valid or not) take the row body.
            m_pad = m_r & (v_src == pad_id)
            tl.store(
                out_ptr + o_r[:, None] * stride_o_b + o_out[None, :],
                tl.zeros([ROW_BLOCK, BLOCK_P], dtype=out_ptr.dtype.element_ty),
                mask=m_pad[:, None] & m_p[None, :],
            )
            v_live = m_r & (v_src != pad_id)
            r_lo = tl.min(tl.where(v_live, o_r, r1), axis=0)
            r_hi = tl.max(tl.where(v_live, o_r + 1, r0), axis=0)
            # The block's ids judged at once: a block with no bad id (every block of a
            # correct caller) walks its rows without the per-row bound checks.
            v_bad = _rows_bad(
                o_r, m_r, v_src, dst_ptr, track_idx_ptr, track_mask_ptr, pad_id, n_slots,
                HAS_DST, HAS_TRACK,
            )  # fmt: skip
            clean = tl.max(v_bad.to(tl.int32), axis=0) == 0
        else:
            r_lo = r0
            r_hi = r1
            clean = r0 < 0  # False: one row a block, each row judges itself
        # Two loops, not a branch per row: the clean one carries no report call.
        if clean:
            for b in tl.range(r_lo, r_hi):
                _walk_row(
                    b, i_h, i_g, o_p, o_n, m_p, m_n, o_s, o_out, b_A, state_ptr, x_ptr, dt_ptr,
                    dt_bias_ptr, D_ptr, z_ptr, B_ptr, C_ptr, out_ptr, src_ptr,
                    dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, dt_min,
                    dt_max, pad_id, n_slots, headdim, stride_s_slot, stride_x_b,
                    stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
                    stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g,
                    stride_C_n, stride_z_b, stride_z_h, stride_z_p, stride_o_b,
                    DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST, HAS_TRACK, False,
                )  # fmt: skip
        else:
            for b in tl.range(r_lo, r_hi):
                _walk_row_checked(
                    b, i_p, i_h, b_A, state_ptr, x_ptr, dt_ptr, dt_bias_ptr, D_ptr, z_ptr, B_ptr,
                    C_ptr, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr,
                    dt_min, dt_max, pad_id, n_slots, headdim, dstate, heads_per_group,
                    stride_s_slot, stride_s_h, stride_s_p, stride_s_n, stride_x_b, stride_x_h,
                    stride_x_p, stride_dt_b, stride_dt_h, stride_B_b, stride_B_g, stride_B_n,
                    stride_C_b, stride_C_g, stride_C_n, stride_z_b, stride_z_h, stride_z_p,
                    stride_o_b, stride_o_h, stride_o_p, DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z,
                    HAS_DST, HAS_TRACK, BLOCK_P, BLOCK_N,
                )  # fmt: skip


_LAUNCHER = DirectLauncher(_ssm_update_kernel)
# Programs launched, in units of half the GPU's resident one-warp programs (32 per SM): the
# H200 sweep put 8 row splits of the fp32 tile (10,240 programs, 2.4 full waves) at 91% of
# copy against 87% for one wave sized from the occupancy (docs/perf_notes.md, run 1).
_WAVES = 5


def ssm_args_ok(
    state: object,
    x: object,
    dt: object,
    A: object,
    B: object,
    C: object,
    src: object,
    D: object,
    z: object,
    dt_bias: object,
    dst: object,
    track: object,
    mask: object,
    out: object,
    pad: object = -1,
) -> bool:
    """Fast path of the public op's validation: ``True`` only if every check passes.

    One expression, no messages; stricter than the detailed checks in
    :func:`_check_ssm_args` (which run when this says ``False`` and
    name the broken rule). Reads shapes, strides, dtypes and devices only.
    """
    T = torch.Tensor
    if not (
        isinstance(state, T)
        and isinstance(x, T)
        and isinstance(dt, T)
        and isinstance(A, T)
        and isinstance(B, T)
        and isinstance(C, T)
        and isinstance(src, T)
    ):
        return False
    if state.dim() != 4 or x.dim() != 3 or B.dim() != 3:
        return False
    slots, nheads, headdim, dstate = state.shape
    bs = x.shape[0]
    ngroups = B.shape[1]
    dev = state.get_device()
    f = _FLOAT
    if not (
        state.dtype in f
        and type(pad) is int
        and PAD_MIN <= pad <= PAD_MAX
        and slots <= PAD_MAX
        and bs < MAX_ROWS
        and non_overlapping(state.shape, state.stride())
        and x.shape == (bs, nheads, headdim)
        and x.dtype in f
        and x.get_device() == dev
        and dt.shape == (bs, nheads)
        and dt.dtype in f
        and dt.get_device() == dev
        and A.shape == (nheads,)
        and A.dtype in f
        and A.get_device() == dev
        and A.is_contiguous()
        and ngroups > 0
        and nheads % ngroups == 0
        and B.shape == (bs, ngroups, dstate)
        and B.dtype in f
        and B.get_device() == dev
        and C.shape == (bs, ngroups, dstate)
        and C.dtype in f
        and C.get_device() == dev
        and src.shape == (bs,)
        and src.dtype in _INDEX
        and src.get_device() == dev
        and src.is_contiguous()
        and (track is None) == (mask is None)
    ):
        return False
    opt: tuple[tuple[object, tuple[int, ...], tuple[torch.dtype, ...]], ...] = (
        (D, (nheads,), f),
        (dt_bias, (nheads,), f),
        (z, (bs, nheads, headdim), f),
        (out, (bs, nheads, headdim), (x.dtype,)),
    )
    for t, shape, dtypes in opt:
        if t is not None and not (
            isinstance(t, T)
            and t.shape == shape
            and t.dtype in dtypes
            and t.get_device() == dev
            and (t.dim() != 1 or t.is_contiguous())
        ):
            return False
    idx: tuple[tuple[object, tuple[torch.dtype, ...]], ...] = (
        (dst, _INDEX), (track, _INDEX), (mask, (torch.bool,)),
    )  # fmt: skip
    for t, dtypes in idx:
        if t is not None and not (
            isinstance(t, T)
            and t.shape == (bs,)
            and t.dtype in dtypes
            and t.get_device() == dev
            and t.is_contiguous()
        ):
            return False
    return True


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@triton.jit
def _ssm_tile_row(
    i_b: tl.tensor,
    i_p: tl.tensor,
    i_h: tl.tensor,
    state_ptr: tl.tensor,
    x_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    A_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_s_h: tl.tensor,
    stride_s_p: tl.tensor,
    stride_s_n: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REPORT: tl.constexpr,
    LATE_POISON: tl.constexpr,
) -> None:
    """One ``[BLOCK_P, dstate]`` tile (p-tile ``i_p``) of head ``i_h`` of row ``i_b``
    (int64): every load issued at once, the row's liveness folded into the masks (a pad
    row's state masks are empty: no state byte moves), no branch around the loads.

    A bad row (:func:`_row_slots`) moves no state byte either, and its output is NaN.
    ``REPORT``: the row reports its fault, in a branch after the stores (the one-row path);
    the multi-row path judges its rows once and reports after its row loop instead.
    ``LATE_POISON`` (``SsmLaunchConfig.late_poison``): a bad row stores zeros as a pad row
    does, then NaN over them after the stores (in the report's branch, or after the
    multi-row loop), and nothing about the fault is kept live through the row's arithmetic
    but the sign of its state bound; else the NaN is selected at the output store."""
    i_g = i_h // heads_per_group

    src, dst, trk, live, m_write, m_track, bad = _row_slots(
        i_b, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, pad_id, n_slots, HAS_DST,
        HAS_TRACK,
    )  # fmt: skip
    # Row predicates enter masks as a bound on the headdim offset (a pad row's bound is 0,
    # a bad row's -1): the Triton interpreter mistypes `block_mask & scalar_mask`.
    if REPORT and LATE_POISON:
        lim_read = tl.where(live, headdim, tl.where(bad, -1, 0))
    else:
        lim_read = tl.where(live, headdim, 0)
    lim_write = tl.where(m_write, headdim, 0)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    o_n = tl.arange(0, BLOCK_N)  # [BN]
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_s = i_h * stride_s_h + o_p[:, None] * stride_s_p + o_n[None, :] * stride_s_n  # [BP, BN]

    # Pad rows: the mask is false, so no state byte is read.
    b_s = tl.load(
        state_ptr + src * stride_s_slot + o_s,
        mask=(o_p < lim_read)[:, None] & m_n[None, :],
        other=0.0,
    ).to(tl.float32)  # [BP, BN]
    b_x = tl.load(
        x_ptr + i_b * stride_x_b + i_h * stride_x_h + o_p * stride_x_p, mask=m_p, other=0.0
    ).to(tl.float32)  # [BP]
    b_dt = tl.load(dt_ptr + i_b * stride_dt_b + i_h * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias_ptr + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        # softplus(x) equals x in fp32 above 20; the threshold also keeps exp from overflowing.
        b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
    # dt limits ((-inf, inf) when the call gives none); NaN stays NaN, as in torch.
    b_dt = tl.maximum(b_dt, dt_min, propagate_nan=tl.PropagateNan.ALL)
    b_dt = tl.minimum(b_dt, dt_max, propagate_nan=tl.PropagateNan.ALL)
    b_dA = tl.exp(tl.load(A_ptr + i_h).to(tl.float32) * b_dt)
    b_B = tl.load(
        B_ptr + i_b * stride_B_b + i_g * stride_B_g + o_n * stride_B_n, mask=m_n, other=0.0
    ).to(tl.float32)  # [BN]
    b_C = tl.load(
        C_ptr + i_b * stride_C_b + i_g * stride_C_g + o_n * stride_C_n, mask=m_n, other=0.0
    ).to(tl.float32)  # [BN]

    b_s = b_s * b_dA + (b_x * b_dt)[:, None] * b_B[None, :]  # [BP, BN]
    b_o = tl.sum(b_s * b_C[None, :], axis=1)  # [BP]
    if HAS_D:
        b_o += b_x * tl.load(D_ptr + i_h).to(tl.float32)
    if HAS_Z:
        b_z = tl.load(
            z_ptr + i_b * stride_z_b + i_h * stride_z_h + o_p * stride_z_p, mask=m_p, other=0.0
        ).to(tl.float32)
        b_o *= b_z * tl.sigmoid(b_z)
    # A pad row's inputs may be garbage (even NaN): select, never multiply, to zero it; a
    # bad row is poisoned (late: below, or after the multi-row loop).
    if LATE_POISON:
        b_o = tl.where(live, b_o, 0.0)
    else:
        b_o = tl.where(live, b_o, tl.where(bad, float("nan"), 0.0))
    tl.store(
        out_ptr + i_b * stride_o_b + i_h * stride_o_h + o_p * stride_o_p,
        b_o.to(out_ptr.dtype.element_ty),
        mask=m_p,
    )

    b_new = b_s.to(state_ptr.dtype.element_ty)
    tl.store(
        state_ptr + dst * stride_s_slot + o_s, b_new, mask=(o_p < lim_write)[:, None] & m_n[None, :]
    )
    if HAS_TRACK:
        lim_track = tl.where(m_track, headdim, 0)
        tl.store(
            state_ptr + trk * stride_s_slot + o_s,
            b_new,
            mask=(o_p < lim_track)[:, None] & m_n[None, :],
        )
    # A bad row's report, after the stores (an outlined call before the loads serialises
    # them); late poisoning also stores its NaN output there, over the zeros above, which
    # other threads of the program may have stored (hence the barrier; the branch is
    # uniform across the program).
    if REPORT and LATE_POISON:
        if lim_read < 0:
            tl.debug_barrier()
            tl.store(
                out_ptr + i_b * stride_o_b + i_h * stride_o_h + o_p * stride_o_p,
                tl.full([BLOCK_P], float("nan"), out_ptr.dtype.element_ty),
                mask=m_p,
            )
            _report_row(
                i_b, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, pad_id,
                n_slots, HAS_DST, HAS_TRACK,
            )  # fmt: skip
    elif REPORT and bad:
        _report_row(
            i_b, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, pad_id, n_slots,
            HAS_DST, HAS_TRACK,
        )  # fmt: skip


@triton.jit(noinline=True)
def _ssm_tile_row_outlined(
    i_b: tl.tensor,
    i_p: tl.tensor,
    i_h: tl.tensor,
    state_ptr: tl.tensor,
    x_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    A_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_s_h: tl.tensor,
    stride_s_p: tl.tensor,
    stride_s_n: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LATE_POISON: tl.constexpr,
) -> None:
    """:func:`_ssm_tile_row` as a called function (not inlined): the row loop of the
    multi-row kernel calls it, so the compiler cannot hoist the row body's loop-invariant
    offsets and pointers out of the loop and keep them live across it (their registers
    would cost the resident programs that keep memory busy). Its arguments are mostly the
    kernel's own, which the callee reads from the kernel's parameter space."""
    _ssm_tile_row(
        i_b, i_p, i_h, state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
        z_ptr, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, dt_min,
        dt_max, pad_id, n_slots, headdim, dstate, heads_per_group, stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
        stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h, stride_B_b, stride_B_g,
        stride_B_n, stride_C_b, stride_C_g, stride_C_n, stride_z_b, stride_z_h, stride_z_p,
        stride_o_b, stride_o_h, stride_o_p, DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST,
        HAS_TRACK, BLOCK_P, BLOCK_N, False, LATE_POISON,
    )  # fmt: skip


@triton.jit(noinline=True)
def _poison_block(
    bs: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    headdim: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ROWS: tl.constexpr,
) -> None:
    """The bad rows of this program's block of rows, after its row loop: their NaN output
    over the zeros the row body stored (after a barrier: other threads stored those), and
    the least one's fault reported. Called only when the block has a bad row. The block's
    ids, its position and its least bad row are worked out again here: nothing but that
    one flag is kept live through the loop (with Triton 3.9 ptxas kept what a call after
    the loop takes, 72 -> 80 registers a thread)."""
    i_p = tl.program_id(0)
    row0 = tl.program_id(1).to(tl.int64) * ROWS
    i_h = tl.program_id(2).to(tl.int64)
    o_r = row0 + tl.arange(0, ROWS)  # [R]
    m_r = o_r < bs
    v_src = tl.load(src_ptr + o_r, mask=m_r, other=0).to(tl.int64)
    v_bad = _rows_bad(
        o_r, m_r, v_src, dst_ptr, track_idx_ptr, track_mask_ptr, pad_id, n_slots, HAS_DST,
        HAS_TRACK,
    )  # fmt: skip
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    tl.debug_barrier()
    tl.store(
        out_ptr + o_r[:, None] * stride_o_b + (i_h * stride_o_h + o_p * stride_o_p)[None, :],
        tl.full([ROWS, BLOCK_P], float("nan"), out_ptr.dtype.element_ty),
        mask=v_bad[:, None] & (o_p < headdim)[None, :],
    )
    r_bad = tl.min(tl.where(v_bad, o_r, row0 + ROWS), axis=0)
    _report_row(
        r_bad, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, pad_id, n_slots,
        HAS_DST, HAS_TRACK,
    )  # fmt: skip


@triton.jit(do_not_specialize=["bs", "pad_id", "n_slots"])
def _ssm_update_tile_kernel(
    state_ptr: tl.tensor,
    x_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    A_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_s_h: tl.tensor,
    stride_s_p: tl.tensor,
    stride_s_n: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    # Last of the runtime arguments: one row a program never reads it, and there it leaves
    # the PTX of the other arguments' loads as it was (placed after `dt_max` it moved
    # ptxas' fp32 one-warp tracked variant from 96 to 127 registers, Triton 3.6). The pad
    # id and the pool's slots (the row body's bound checks) follow it.
    bs: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    LATE_POISON: tl.constexpr,
) -> None:
    i_p = tl.program_id(0)
    if ROWS > 1:
        # ROWS consecutive rows: their source slots at once, the zero output of their pad
        # rows in one store, then the row body from the first to the last live row (nothing
        # for a block of pad rows: the tail of a bucket's CUDA graph).
        row0 = tl.program_id(1).to(tl.int64) * ROWS
        i_h = tl.program_id(2).to(tl.int64)
        o_r = row0 + tl.arange(0, ROWS)  # [R]
        m_r = o_r < bs
        v_src = tl.load(src_ptr + o_r, mask=m_r, other=0).to(tl.int64)  # [R]
        o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
        # Pad rows here; rows with any other id (valid or not) take the row body.
        tl.store(
            out_ptr + o_r[:, None] * stride_o_b + (i_h * stride_o_h + o_p * stride_o_p)[None, :],
            tl.zeros([ROWS, BLOCK_P], dtype=out_ptr.dtype.element_ty),
            mask=(m_r & (v_src == pad_id))[:, None] & (o_p < headdim)[None, :],
        )
        v_live = m_r & (v_src != pad_id)
        r_lo = tl.min(tl.where(v_live, o_r, row0 + ROWS), axis=0)
        r_hi = tl.max(tl.where(v_live, o_r + 1, row0), axis=0)
        # The block's rows judged once, from their id tiles; after the loop its bad rows'
        # NaN output (over what the row body stored) and its least bad row's report (the
        # record keeps the least row of all): the outlined row body makes no report call.
        # On the H200 this measured the same as a report inside the row body
        # (0.996-1.000x; docs/perf_notes.md, "Round 3, third GPU session").
        v_bad = _rows_bad(
            o_r, m_r, v_src, dst_ptr, track_idx_ptr, track_mask_ptr, pad_id, n_slots, HAS_DST,
            HAS_TRACK,
        )  # fmt: skip
        # Only this flag crosses the loop (a block kept live there cost registers).
        any_bad = tl.max(v_bad.to(tl.int32), axis=0) != 0
        for i_b in tl.range(r_lo, r_hi, num_stages=1):
            _ssm_tile_row_outlined(
                i_b, i_p, i_h, state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
                z_ptr, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, dt_min,
                dt_max, pad_id, n_slots, headdim, dstate, heads_per_group, stride_s_slot, stride_s_h, stride_s_p,
                stride_s_n, stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
                stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
                stride_z_b, stride_z_h, stride_z_p, stride_o_b, stride_o_h, stride_o_p,
                DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST, HAS_TRACK, BLOCK_P, BLOCK_N,
                LATE_POISON,
            )  # fmt: skip
        if any_bad:
            _poison_block(
                bs, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, pad_id,
                n_slots, headdim, stride_o_b, stride_o_h, stride_o_p, HAS_DST, HAS_TRACK,
                BLOCK_P, ROWS,
            )  # fmt: skip
    else:
        # One row a program, the row body inlined: the same code (and PTX) as before the
        # `ROWS` knob. int64 from here on: slot * per-slot stride overflows int32 for large
        # pools.
        i_b = tl.program_id(1).to(tl.int64)
        i_h = tl.program_id(2).to(tl.int64)
        _ssm_tile_row(
            i_b, i_p, i_h, state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
            z_ptr, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, err_ptr, dt_min,
            dt_max, pad_id, n_slots, headdim, dstate, heads_per_group, stride_s_slot, stride_s_h, stride_s_p,
            stride_s_n, stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
            stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
            stride_z_b, stride_z_h, stride_z_p, stride_o_b, stride_o_h, stride_o_p,
            DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST, HAS_TRACK, BLOCK_P, BLOCK_N, True,
            LATE_POISON,
        )  # fmt: skip


def launch_ssm_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    *,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT,
    config: SsmLaunchConfig | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch the SSM update on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    state : torch.Tensor
        ``[slots, nheads, headdim, dstate]`` pool, updated in place.
    x, z, out : torch.Tensor
        ``[bs, nheads, headdim]``.
    dt : torch.Tensor
        ``[bs, nheads]``.
    A, D, dt_bias : torch.Tensor
        ``[nheads]``.
    B, C : torch.Tensor
        ``[bs, ngroups, dstate]``.
    src_indices, dst_indices, track_indices, track_mask : torch.Tensor
        ``[bs]``, contiguous; ``pad_slot_id`` marks a pad row (source) or "write nothing"
        (destination, track); any other id outside ``[0, slots)`` is a fault (the row
        writes nothing, its output is NaN, ``errors`` records it).
    dt_limit : tuple of float
        ``(lo, hi)`` clamp of the discretised ``dt`` (checked: ``lo <= hi``).
    config : SsmLaunchConfig, optional
        Kernel, tile shape, warps, row splits and rows a program; the default is picked
        from the state dtype and shapes (row splits from the device's capacity).
    pad_slot_id : int
        The pad id (int32).
    errors : torch.Tensor, optional
        The error record (default: the device's, :func:`hybridmeta.kernels.error_record`).
    """
    bs = x.shape[0]
    if bs == 0:
        return
    err = errors if errors is not None else record_for(state)
    n_slots, nheads, headdim, dstate = state.shape
    ngroups = B.shape[1]
    cfg = config if config is not None else ssm_launch_config(state.dtype, headdim, dstate)
    if not cfg.walks_rows(bs):
        _launch_tiles(
            state, x, dt, A, B, C, out, src_indices, D, z, dt_bias, dt_softplus, dst_indices,
            track_indices, track_mask, dt_limit, cfg, pad_slot_id, err,
        )  # fmt: skip
        return
    block_p = cfg.block_p
    n_ptiles = (headdim + block_p - 1) // block_p
    dev = state.get_device()
    ss, xs, dts, Bs, Cs, os_ = state.stride(), x.stride(), dt.stride(), B.stride(), C.stride(), out.stride()  # fmt: skip
    zs = z.stride() if z is not None else (0, 0, 0)
    ints = (
        headdim, dstate, nheads // ngroups, *ss, *xs, *dts, *Bs, *Cs, *zs, *os_,
    )  # fmt: skip
    flags = (
        dt_softplus, dt_bias is not None, D is not None, z is not None,
        dst_indices is not None, track_indices is not None, n_ptiles, block_p,
        pow2_ceil(dstate), cfg.row_block,
    )  # fmt: skip
    ptrs = (
        state.data_ptr(), x.data_ptr(), dt.data_ptr(), _ptr(dt_bias), A.data_ptr(),
        B.data_ptr(), C.data_ptr(), _ptr(D), _ptr(z), out.data_ptr(), src_indices.data_ptr(),
        _ptr(dst_indices), _ptr(track_indices), _ptr(track_mask), err.data_ptr(),
    )  # fmt: skip
    aligned = True
    for p in ptrs:
        if p is not None and p & 15:
            aligned = False
    key = (
        dev, cfg.num_warps, ints, flags, state.dtype, x.dtype, dt.dtype, A.dtype, B.dtype,
        C.dtype, out.dtype, src_indices.dtype,
        None if D is None else D.dtype, None if z is None else z.dtype,
        None if dt_bias is None else dt_bias.dtype,
        None if dst_indices is None else dst_indices.dtype,
        None if track_indices is None else track_indices.dtype,
        None if track_mask is None else track_mask.dtype,
    )  # fmt: skip

    var = _LAUNCHER.lookup(key, aligned)
    units = n_ptiles * nheads
    splits = cfg.row_splits
    if splits is None:
        if dev < 0:
            # The interpreter: two splits, so both the one-row and the multi-row paths of
            # the kernel run in the CPU tests.
            splits = 2
        else:
            splits = max(1, (_WAVES * device_capacity(dev, cfg.num_warps, 0, 0)) // (2 * units))
    rows_per_prog = (bs + min(splits, bs) - 1) // min(splits, bs)
    grid = (units, (bs + rows_per_prog - 1) // rows_per_prog, 1)

    def fast_args() -> tuple[object, ...]:
        # Positional order of the kernel; constexpr positions are ignored by the launcher.
        return (*ptrs, *dt_limit, bs, rows_per_prog, pad_slot_id, n_slots, *ints, *flags)

    def slow(g: tuple[int, int, int]) -> object:
        return launchable(_ssm_update_kernel, state.device)[g](
            state, x, dt, dt_bias, A, B, C, D, z, out, src_indices, dst_indices,
            track_indices, track_mask, err, *dt_limit, bs, rows_per_prog, pad_slot_id,
            n_slots, *ints,
            DT_SOFTPLUS=dt_softplus, HAS_DT_BIAS=dt_bias is not None, HAS_D=D is not None,
            HAS_Z=z is not None, HAS_DST=dst_indices is not None,
            HAS_TRACK=track_indices is not None, N_PTILES=n_ptiles, BLOCK_P=block_p,
            BLOCK_N=flags[8], ROW_BLOCK=cfg.row_block, num_warps=cfg.num_warps,
            # No software pipelining of the row loops: latency is hidden by the resident
            # programs, and pipelined loads would stage through shared memory.
            num_stages=1,
        )  # fmt: skip

    _LAUNCHER.launch(var, grid, key, dev, aligned, fast_args, slow)


_TILE_LAUNCHER = DirectLauncher(_ssm_update_tile_kernel)


def _launch_tiles(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    dt_limit: tuple[float, float],
    cfg: SsmLaunchConfig,
    pad_slot_id: int,
    err: torch.Tensor,
) -> None:
    """One ``[block_p, dstate]`` tile of one head of ``cfg.rows_per_program(bs)`` rows a
    program."""
    bs = x.shape[0]
    n_slots, nheads, headdim, dstate = state.shape
    ngroups = B.shape[1]
    dev = state.get_device()
    rows = cfg.rows_per_program(bs)
    zs = z.stride() if z is not None else (0, 0, 0)
    ints = (
        headdim, dstate, nheads // ngroups, *state.stride(), *x.stride(), *dt.stride(),
        *B.stride(), *C.stride(), *zs, *out.stride(),
    )  # fmt: skip
    flags = (
        dt_softplus, dt_bias is not None, D is not None, z is not None,
        dst_indices is not None, track_indices is not None, cfg.block_p,
        pow2_ceil(dstate), rows, cfg.late_poison,
    )  # fmt: skip
    ptrs = (
        state.data_ptr(), x.data_ptr(), dt.data_ptr(), _ptr(dt_bias), A.data_ptr(),
        B.data_ptr(), C.data_ptr(), _ptr(D), _ptr(z), out.data_ptr(), src_indices.data_ptr(),
        _ptr(dst_indices), _ptr(track_indices), _ptr(track_mask), err.data_ptr(),
    )  # fmt: skip
    aligned = all(p is None or not p & 15 for p in ptrs)
    # `bs` is not in the key: the kernel never specialises on it (one variant for every batch
    # size); `flags` carries the rows a program.
    key = (
        dev, cfg.num_warps, cfg.max_regs, ints, flags, state.dtype, x.dtype, dt.dtype, A.dtype,
        B.dtype, C.dtype, out.dtype, src_indices.dtype,
        *(None if t is None else t.dtype for t in (D, z, dt_bias, dst_indices, track_indices,
                                                   track_mask)),
    )  # fmt: skip
    var = _TILE_LAUNCHER.lookup(key, aligned)
    grid = (cdiv(headdim, cfg.block_p), cdiv(bs, rows), nheads)
    # ptxas's register cap only when the configuration sets one (the same compile options
    # as before otherwise).
    opts: dict[str, int] = {} if cfg.max_regs is None else {"maxnreg": cfg.max_regs}

    def fast_args() -> tuple[object, ...]:
        return (*ptrs, *dt_limit, *ints, bs, pad_slot_id, n_slots, *flags)

    def slow(g: tuple[int, int, int]) -> object:
        return launchable(_ssm_update_tile_kernel, state.device)[g](
            state, x, dt, dt_bias, A, B, C, D, z, out, src_indices, dst_indices,
            track_indices, track_mask, err, *dt_limit, *ints, bs, pad_slot_id, n_slots,
            DT_SOFTPLUS=dt_softplus, HAS_DT_BIAS=dt_bias is not None, HAS_D=D is not None,
            HAS_Z=z is not None, HAS_DST=dst_indices is not None,
            HAS_TRACK=track_indices is not None, BLOCK_P=cfg.block_p, BLOCK_N=flags[7],
            ROWS=rows, LATE_POISON=cfg.late_poison, num_warps=cfg.num_warps, **opts,
        )  # fmt: skip

    _TILE_LAUNCHER.launch(var, grid, key, dev, aligned, fast_args, slow)


# --------------------------------------------------------------------------- custom op


def _ssm_state_update_impl(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    dt_min: float,
    dt_max: float,
    pad_slot_id: int,
    errors: torch.Tensor,
) -> None:
    # The launcher makes the tensors' device current itself (only when it is not).
    launch_ssm_update(
        state, x, dt, A, B, C, out, src_indices,
        D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dst_indices=dst_indices,
        track_indices=track_indices, track_mask=track_mask, dt_limit=(dt_min, dt_max),
        pad_slot_id=pad_slot_id, errors=errors,
    )  # fmt: skip


_ssm_state_update_op = torch.library.custom_op(
    "hybridmeta::ssm_state_update",
    _ssm_state_update_impl,
    mutates_args=("state", "out", "errors"),
)

_ssm_state_update_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- reference


def ssm_state_update_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dst_indices: torch.Tensor | None = None,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
    dt_limit: tuple[float, float] | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """The pure-torch SSM update: the kernel's contract, in place, on validated tensors.

    Fixed shapes and no device-to-host reads, so it captures into CUDA graphs (and the CPU
    emulation) like the kernel. Math in fp32, cast where the kernel casts: the new state to
    the pool's dtype, the output to ``out``'s. Rows with an invalid id (neither
    ``pad_slot_id`` nor a valid slot) read and write no state, get NaN output and are
    recorded in ``errors`` (default: the device's record), as the kernel does.
    """
    slots = state.shape[0]
    keys, live, write, track_write = ssm_faults(
        slots, pad_slot_id, src_indices, dst_indices, track_indices, track_mask
    )
    safe = torch.where(live, src_indices, 0)
    if slots:
        s = torch.where(live[:, None, None, None], state.index_select(0, safe).float(), 0.0)
    else:
        s = torch.zeros(state.shape[1:], device=state.device).expand(x.shape[0], -1, -1, -1)
    new, y = ssm_step(s, x, discretize(dt, dt_bias, dt_softplus, dt_limit), A, B, C, D, z)
    bad = keys != NO_FAULT
    poison = torch.where(bad, float("nan"), 0.0)[:, None, None]
    out.copy_(torch.where(live[:, None, None], y, poison).to(out.dtype))
    dst = dst_indices if dst_indices is not None else src_indices
    scatter_rows_(state, 0, dst, new, write)
    if track_indices is not None and track_write is not None:
        scatter_rows_(state, 0, track_indices, new, track_write)
    record_(errors if errors is not None else record_for(state), _OP, keys, pad_slot_id, slots)


def ssm_faults(
    slots: int,
    pad: int,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows' ids judged as the kernel judges them, in torch (no sync).

    Returns ``(keys, live, write, track_write)``: the per-row fault keys
    (:func:`hybridmeta.kernels._errors.fault_keys`), the rows that read their source, write
    their destination, write their track slot (``None`` without track fields). A pad row's
    other ids, and an unflagged row's track slot, are never looked at; a row with any
    invalid id reads and writes nothing.
    """
    src_pad, src_ok = slot_kinds(src, slots, pad)
    faults = [(~src_pad & ~src_ok, 0, src)]
    dst_ok = src_ok
    if dst is not None:
        dst_pad, dst_ok = slot_kinds(dst, slots, pad)
        faults.append((src_ok & ~dst_pad & ~dst_ok, 1, dst))
    trk_ok: torch.Tensor | None = None
    if track is not None and mask is not None:
        trk_pad, trk_ok = slot_kinds(track, slots, pad)
        faults.append((src_ok & mask & ~trk_pad & ~trk_ok, 2, track))
        trk_ok = trk_ok & mask
    keys = fault_keys(faults)
    live = src_ok & (keys == NO_FAULT)
    return keys, live, live & dst_ok, None if trk_ok is None else live & trk_ok


# --------------------------------------------------------------------------- public op


def ssm_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    dst_indices: torch.Tensor | None = None,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Mamba2 single-token SSM state update over a slot pool, in place.

    For each live row ``b`` (``state_indices[b]`` a valid slot) and head ``h`` (group
    ``g = h // (nheads // ngroups)``)::

        dt'  = softplus(dt[b, h] + dt_bias[h])          # bias / softplus optional
        dt'  = clamp(dt', *dt_limit)                     # optional
        s    = state[src] * exp(A[h] * dt') + dt' * x[b, h, :, None] * B[b, g, None, :]
        out  = (s @ C[b, g]) + D[h] * x[b, h]            # then * silu(z[b, h]) if z given
        state[dst] = s;  state[track[b]] = s if track_mask[b]

    Slot ids: a pad row (``state_indices[b] == pad_slot_id``) reads and writes no state and
    gets zero output (its other ids are not looked at); a *valid* slot is
    ``0 <= id < slots`` and ``id != pad_slot_id`` (so with vLLM's ``pad_slot_id=0`` slot 0
    is a reserved null slot, never written); ``pad_slot_id`` as a destination or track
    slot means "none". A row holding any other id (source, destination, or the track slot
    of a flagged row) reads and writes no state, gets NaN output, and the fault goes to
    the device's error record (:func:`hybridmeta.kernels.check_errors`); with CPU index
    tensors (nothing to sync) or in debug mode the op raises
    :class:`~hybridmeta.kernels.SlotIndexError` instead, before writing.

    Parameters
    ----------
    state : torch.Tensor
        ``[slots, nheads, headdim, dstate]``, float32 / bfloat16 / float16. Updated in place.
    x : torch.Tensor
        ``[bs, nheads, headdim]``, a float dtype.
    dt : torch.Tensor
        ``[bs, nheads]``.
    A : torch.Tensor
        ``[nheads]`` (negative decay rates).
    B, C : torch.Tensor
        ``[bs, ngroups, dstate]``; ``nheads % ngroups == 0``.
    state_indices : torch.Tensor
        ``[bs]`` int32/int64: source slot of each row, ``pad_slot_id`` for a pad row.
    D, dt_bias : torch.Tensor, optional
        ``[nheads]``.
    z : torch.Tensor, optional
        ``[bs, nheads, headdim]`` gate.
    dt_softplus : bool
        Apply softplus to ``dt + dt_bias``.
    dt_limit : tuple of float, optional
        ``(lo, hi)``: clamp the discretised ``dt`` to ``[lo, hi]`` (Mamba2's
        ``time_step_limit``; a model's ``time_step_min`` floor is ``(min, inf)``), inside
        the kernel, so the caller needs no softplus / clamp kernels of its own. ``lo``
        finite and ``>= 0``, ``lo <= hi`` (``hi`` may be inf).
    dst_indices : torch.Tensor, optional
        ``[bs]`` slot to write the new state to (default: the source slot);
        ``pad_slot_id`` writes no state for that row.
    track_indices, track_mask : torch.Tensor, optional
        Both or neither. ``[bs]`` track slot and bool flag: flagged live rows also store the
        new state into their track slot in the same pass.
    out : torch.Tensor, optional
        ``[bs, nheads, headdim]`` in ``x.dtype``; allocated if not given.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (default: :func:`hybridmeta.kernels.implementation`'s, else
        Triton on CUDA and the reference elsewhere).
    pad_slot_id : int
        The pad id (int32; default ``-1``), also the "none" of ``dst_indices`` and
        ``track_indices``.

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (message names it), including a pool
        that aliases itself. Nothing is written.
    SlotIndexError
        An invalid id, when the ids can be read without a sync (CPU tensors outside a
        graph capture) or in debug mode (which also refuses two rows writing one slot, or
        a row writing a slot another row reads). Nothing is written.
    """
    op = _OP
    lim = NO_DT_LIMIT if dt_limit is None else check_dt_limit(op, dt_limit)
    # One cheap expression first; the detailed checks only run (and name the broken rule)
    # when it fails, so a valid call pays a few microseconds of host time.
    if not ssm_args_ok(state, x, dt, A, B, C, state_indices, D, z, dt_bias, dst_indices,
                       track_indices, track_mask, out, pad_slot_id):  # fmt: skip
        _check_ssm_args(op, state, x, dt, A, B, C, state_indices, D, z, dt_bias, dst_indices,
                        track_indices, track_mask, out, pad_slot_id)  # fmt: skip
    which = resolve(op, impl, state.device)
    seen = observed(state)
    if is_debug() or (not seen and state.device.type == "cpu"):
        _check_ssm_ids(
            op, state.shape[0], pad_slot_id, state_indices, dst_indices, track_indices,
            track_mask,
        )  # fmt: skip
    if out is None:
        out = torch.empty_like(x)
    errors = record_for(state)
    if which == "reference":
        ssm_state_update_reference(
            state, x, dt, A, B, C, out, state_indices, D=D, z=z, dt_bias=dt_bias,
            dt_softplus=dt_softplus, dst_indices=dst_indices, track_indices=track_indices,
            track_mask=track_mask, dt_limit=None if dt_limit is None else lim,
            pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip
        return out
    run = torch.ops.hybridmeta.ssm_state_update if seen else _ssm_state_update_impl
    run(
        state, x, dt, A, B, C, out, state_indices, D, z, dt_bias, dt_softplus,
        dst_indices, track_indices, track_mask, *lim, pad_slot_id, errors,
    )  # fmt: skip
    return out


def _check_ssm_args(
    op: str,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    out: torch.Tensor | None,
    pad_slot_id: object = -1,
) -> None:
    """The detailed checks of :func:`ssm_state_update`: raise naming the broken rule."""
    check_pad_slot_id(op, pad_slot_id)
    state = check_pool(op, "state", state, dims="[slots, nheads, headdim, dstate]")
    dev = state.device
    slots, nheads, headdim, dstate = state.shape
    check_slots(op, "state", slots)
    x = check_tensor(op, "x", x, shape=(None, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, nheads, headdim]")  # fmt: skip
    bs = x.shape[0]
    check_rows(op, bs)
    check_tensor(
        op, "dt", dt, shape=(bs, nheads), dtypes=FLOAT_DTYPES, device=dev, dims="[bs, nheads]"
    )
    check_tensor(op, "A", A, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    B = check_tensor(op, "B", B, shape=(bs, None, dstate), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, ngroups, dstate]")  # fmt: skip
    ngroups = B.shape[1]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"{op}: `B` ngroups={ngroups} must divide nheads={nheads}")
    check_tensor(op, "C", C, shape=(bs, ngroups, dstate), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[bs, ngroups, dstate]")  # fmt: skip
    check_optional(op, "D", D, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    check_optional(op, "dt_bias", dt_bias, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[nheads]")  # fmt: skip
    check_optional(op, "z", z, shape=(bs, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[bs, nheads, headdim]")  # fmt: skip
    check_tensor(op, "state_indices", state_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    check_optional(op, "dst_indices", dst_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if (track_indices is None) != (track_mask is None):
        raise ValueError(
            f"{op}: `track_indices` and `track_mask` must be given together or not at all"
        )
    check_optional(op, "track_indices", track_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    check_optional(op, "track_mask", track_mask, shape=(bs,), dtypes=MASK_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(op, "out", out, shape=(bs, nheads, headdim), dtypes=(x.dtype,), device=dev,
                     dims="[bs, nheads, headdim]")  # fmt: skip


def _check_ssm_ids(
    op: str,
    slots: int,
    pad: int,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> None:
    """Host check of the ids (reads them: CPU tensors, or debug mode): the kernel's rules,
    raised as :class:`SlotIndexError`, then two rows writing one slot or a row writing a
    slot another row reads (``ValueError``)."""
    keys, live, write, track_write = ssm_faults(slots, pad, src, dst, track, mask)
    host_check(op, keys, pad, slots)
    writes = [("dst_indices" if dst is not None else "state_indices",
               dst if dst is not None else src, write)]  # fmt: skip
    if track is not None and track_write is not None:
        writes.append(("track_indices", track, track_write))
    check_disjoint_writes(op, writes, ("state_indices", src, live))


# --------------------------------------------------------------------------- metadata entry


def ssm_state_update_from_metadata(
    md: Mamba2Metadata,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    fuse_track: bool = False,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """:func:`ssm_state_update` of the decode rows of ``md`` (rows after its prefill rows).

    The slots are ``md.mamba_cache_indices`` of the decode rows (the rows of
    ``md.decode_rows()``), the pad id the metadata's declared null slot. With ``fuse_track`` (and a
    forward that saves, ``md.has_mamba_track_mask``), rows flagged in ``mamba_track_mask``
    also store their new SSM state into their ``mamba_track_indices`` slot in the same pass
    (the conv state is then the caller's to save).
    """
    op = "ssm_state_update_from_metadata"
    rows = decode_rows(op, md, x.shape[0])
    track = mask = None
    if fuse_track and md.has_mamba_track_mask:
        assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
        track, mask = md.mamba_track_indices[rows], md.mamba_track_mask[rows]
    return ssm_state_update(
        state, x, dt, A, B, C, state_indices=md.mamba_cache_indices[rows], D=D, z=z,
        dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, track_indices=track,
        track_mask=mask, out=out, impl=impl, pad_slot_id=pad_slot_of(md),
    )  # fmt: skip
