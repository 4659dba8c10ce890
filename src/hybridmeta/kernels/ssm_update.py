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
from hybridmeta.kernels._launch import DirectLauncher, device_capacity
from hybridmeta.kernels._math import discretize, scatter_rows_, ssm_step
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MASK_DTYPES,
    NO_DT_LIMIT,
    check_disjoint_writes,
    check_dt_limit,
    check_index_range,
    check_optional,
    check_pool,
    check_tensor,
    decode_rows,
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


@triton.jit(do_not_specialize=["bs", "rows_per_prog"])
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
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    bs: tl.tensor,
    rows_per_prog: tl.tensor,
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
            v_src = tl.load(src_ptr + o_r, mask=m_r, other=-1)  # [R]
            m_pad = m_r & (v_src < 0)
            tl.store(
                out_ptr + o_r[:, None] * stride_o_b + o_out[None, :],
                tl.zeros([ROW_BLOCK, BLOCK_P], dtype=out_ptr.dtype.element_ty),
                mask=m_pad[:, None] & m_p[None, :],
            )
            v_live = m_r & (v_src >= 0)
            r_lo = tl.min(tl.where(v_live, o_r, r1), axis=0)
            r_hi = tl.max(tl.where(v_live, o_r + 1, r0), axis=0)
        else:
            r_lo = r0
            r_hi = r1
        for b in tl.range(r_lo, r_hi):
            # The row body is the one-program-per-row kernel of docs/kernels.md: every load
            # issued at once, the row's liveness folded into the masks (a pad row's state
            # masks are empty: no state byte moves), no branch around the loads.
            src = tl.load(src_ptr + b).to(tl.int64)
            live = src >= 0
            # Row predicates enter masks as a bound on the headdim offset (a pad row's bound
            # is 0): the Triton interpreter mistypes `block_mask & scalar_mask`.
            lim_read = tl.where(live, headdim, 0)
            dst = tl.load(dst_ptr + b).to(tl.int64) if HAS_DST else src
            lim_write = tl.where(dst >= 0, lim_read, 0)
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
            # it (a pad row in a block with live rows is zeroed twice: same bytes).
            b_o = tl.where(live, b_o, 0.0)
            tl.store(out_ptr + b * stride_o_b + o_out, b_o.to(out_ptr.dtype.element_ty), mask=m_p)

            b_new = b_s.to(state_ptr.dtype.element_ty)
            tl.store(
                state_ptr + dst * stride_s_slot + o_s,
                b_new,
                mask=(o_p < lim_write)[:, None] & m_n[None, :],
            )
            if HAS_TRACK:
                flag = tl.load(track_mask_ptr + b) != 0
                trk = tl.load(track_idx_ptr + b).to(tl.int64)
                lim_track = tl.where(flag, tl.where(trk >= 0, lim_read, 0), 0)
                tl.store(
                    state_ptr + trk * stride_s_slot + o_s,
                    b_new,
                    mask=(o_p < lim_track)[:, None] & m_n[None, :],
                )


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
) -> bool:
    """Fast path of the public op's validation: ``True`` only if every check passes.

    One expression, no messages; stricter than the detailed checks in
    :func:`_check_ssm_args` (which run when this says ``False`` and
    name the broken rule). Reads shapes, dtypes and devices only.
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
    _, nheads, headdim, dstate = state.shape
    bs = x.shape[0]
    ngroups = B.shape[1]
    dev = state.get_device()
    f = _FLOAT
    if not (
        state.dtype in f
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
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    """One ``[BLOCK_P, dstate]`` tile (p-tile ``i_p``) of head ``i_h`` of row ``i_b``
    (int64): every load issued at once, the row's liveness folded into the masks (a pad
    row's state masks are empty: no state byte moves), no branch around the loads."""
    i_g = i_h // heads_per_group

    src = tl.load(src_ptr + i_b).to(tl.int64)
    live = src >= 0
    dst = tl.load(dst_ptr + i_b).to(tl.int64) if HAS_DST else src
    # Row predicates enter masks as a bound on the headdim offset (a pad row's bound is 0):
    # the Triton interpreter mistypes `block_mask & scalar_mask`.
    lim_read = tl.where(live, headdim, 0)
    lim_write = tl.where(dst >= 0, lim_read, 0)

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
    # A pad row's inputs may be garbage (even NaN): select, never multiply, to zero it.
    b_o = tl.where(live, b_o, 0.0)
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
        flag = tl.load(track_mask_ptr + i_b) != 0
        trk = tl.load(track_idx_ptr + i_b).to(tl.int64)
        lim_track = tl.where(flag, tl.where(trk >= 0, lim_read, 0), 0)
        tl.store(
            state_ptr + trk * stride_s_slot + o_s,
            b_new,
            mask=(o_p < lim_track)[:, None] & m_n[None, :],
        )


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
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    """:func:`_ssm_tile_row` as a called function (not inlined): the row loop of the
    multi-row kernel calls it, so the compiler cannot hoist the row body's loop-invariant
    offsets and pointers out of the loop and keep them live across it (their registers
    would cost the resident programs that keep memory busy). Its arguments are mostly the
    kernel's own, which the callee reads from the kernel's parameter space."""
    _ssm_tile_row(
        i_b, i_p, i_h, state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
        z_ptr, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, dt_min, dt_max,
        headdim, dstate, heads_per_group, stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
        stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h, stride_B_b, stride_B_g,
        stride_B_n, stride_C_b, stride_C_g, stride_C_n, stride_z_b, stride_z_h, stride_z_p,
        stride_o_b, stride_o_h, stride_o_p, DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST,
        HAS_TRACK, BLOCK_P, BLOCK_N,
    )  # fmt: skip


@triton.jit(do_not_specialize=["bs"])
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
    # ptxas' fp32 one-warp tracked variant from 96 to 127 registers, Triton 3.6).
    bs: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
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
        v_src = tl.load(src_ptr + o_r, mask=m_r, other=-1)  # [R]
        o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
        tl.store(
            out_ptr + o_r[:, None] * stride_o_b + (i_h * stride_o_h + o_p * stride_o_p)[None, :],
            tl.zeros([ROWS, BLOCK_P], dtype=out_ptr.dtype.element_ty),
            mask=(m_r & (v_src < 0))[:, None] & (o_p < headdim)[None, :],
        )
        v_live = m_r & (v_src >= 0)
        r_lo = tl.min(tl.where(v_live, o_r, row0 + ROWS), axis=0)
        r_hi = tl.max(tl.where(v_live, o_r + 1, row0), axis=0)
        for i_b in tl.range(r_lo, r_hi, num_stages=1):
            _ssm_tile_row_outlined(
                i_b, i_p, i_h, state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
                z_ptr, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, dt_min, dt_max,
                headdim, dstate, heads_per_group, stride_s_slot, stride_s_h, stride_s_p,
                stride_s_n, stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
                stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
                stride_z_b, stride_z_h, stride_z_p, stride_o_b, stride_o_h, stride_o_p,
                DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST, HAS_TRACK, BLOCK_P, BLOCK_N,
            )  # fmt: skip
    else:
        # One row a program, the row body inlined: the same code (and PTX) as before the
        # `ROWS` knob. int64 from here on: slot * per-slot stride overflows int32 for large
        # pools.
        i_b = tl.program_id(1).to(tl.int64)
        i_h = tl.program_id(2).to(tl.int64)
        _ssm_tile_row(
            i_b, i_p, i_h, state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
            z_ptr, out_ptr, src_ptr, dst_ptr, track_idx_ptr, track_mask_ptr, dt_min, dt_max,
            headdim, dstate, heads_per_group, stride_s_slot, stride_s_h, stride_s_p,
            stride_s_n, stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h,
            stride_B_b, stride_B_g, stride_B_n, stride_C_b, stride_C_g, stride_C_n,
            stride_z_b, stride_z_h, stride_z_p, stride_o_b, stride_o_h, stride_o_p,
            DT_SOFTPLUS, HAS_DT_BIAS, HAS_D, HAS_Z, HAS_DST, HAS_TRACK, BLOCK_P, BLOCK_N,
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
        ``[bs]``, contiguous; ``-1`` marks a pad row (source) or "write nothing"
        (destination, track).
    dt_limit : tuple of float
        ``(lo, hi)`` clamp of the discretised ``dt`` (checked: ``lo <= hi``).
    config : SsmLaunchConfig, optional
        Kernel, tile shape, warps, row splits and rows a program; the default is picked
        from the state dtype and shapes (row splits from the device's capacity).
    """
    bs = x.shape[0]
    if bs == 0:
        return
    _, nheads, headdim, dstate = state.shape
    ngroups = B.shape[1]
    cfg = config if config is not None else ssm_launch_config(state.dtype, headdim, dstate)
    if not cfg.walks_rows(bs):
        _launch_tiles(
            state, x, dt, A, B, C, out, src_indices, D, z, dt_bias, dt_softplus, dst_indices,
            track_indices, track_mask, dt_limit, cfg,
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
        _ptr(dst_indices), _ptr(track_indices), _ptr(track_mask),
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
        return (*ptrs, *dt_limit, bs, rows_per_prog, *ints, *flags)

    def slow(g: tuple[int, int, int]) -> object:
        return launchable(_ssm_update_kernel, state.device)[g](
            state, x, dt, dt_bias, A, B, C, D, z, out, src_indices, dst_indices,
            track_indices, track_mask, *dt_limit, bs, rows_per_prog, *ints,
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
) -> None:
    """One ``[block_p, dstate]`` tile of one head of ``cfg.rows_per_program(bs)`` rows a
    program."""
    bs = x.shape[0]
    _, nheads, headdim, dstate = state.shape
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
        pow2_ceil(dstate), rows,
    )  # fmt: skip
    ptrs = (
        state.data_ptr(), x.data_ptr(), dt.data_ptr(), _ptr(dt_bias), A.data_ptr(),
        B.data_ptr(), C.data_ptr(), _ptr(D), _ptr(z), out.data_ptr(), src_indices.data_ptr(),
        _ptr(dst_indices), _ptr(track_indices), _ptr(track_mask),
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
        return (*ptrs, *dt_limit, *ints, bs, *flags)

    def slow(g: tuple[int, int, int]) -> object:
        return launchable(_ssm_update_tile_kernel, state.device)[g](
            state, x, dt, dt_bias, A, B, C, D, z, out, src_indices, dst_indices,
            track_indices, track_mask, *dt_limit, *ints, bs,
            DT_SOFTPLUS=dt_softplus, HAS_DT_BIAS=dt_bias is not None, HAS_D=D is not None,
            HAS_Z=z is not None, HAS_DST=dst_indices is not None,
            HAS_TRACK=track_indices is not None, BLOCK_P=cfg.block_p, BLOCK_N=flags[7],
            ROWS=rows, num_warps=cfg.num_warps, **opts,
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
) -> None:
    # The launcher makes the tensors' device current itself (only when it is not).
    launch_ssm_update(
        state, x, dt, A, B, C, out, src_indices,
        D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dst_indices=dst_indices,
        track_indices=track_indices, track_mask=track_mask, dt_limit=(dt_min, dt_max),
    )  # fmt: skip


_ssm_state_update_op = torch.library.custom_op(
    "hybridmeta::ssm_state_update", _ssm_state_update_impl, mutates_args=("state", "out")
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
) -> None:
    """The pure-torch SSM update: the kernel's contract, in place, on validated tensors.

    Fixed shapes and no device-to-host reads, so it captures into CUDA graphs (and the CPU
    emulation) like the kernel. Math in fp32, cast where the kernel casts: the new state to
    the pool's dtype, the output to ``out``'s.
    """
    live = src_indices >= 0  # [bs]
    safe = torch.where(live, src_indices, 0)
    s = torch.where(live[:, None, None, None], state.index_select(0, safe).float(), 0.0)
    new, y = ssm_step(s, x, discretize(dt, dt_bias, dt_softplus, dt_limit), A, B, C, D, z)
    out.copy_(torch.where(live[:, None, None], y, 0.0).to(out.dtype))
    dst = dst_indices if dst_indices is not None else src_indices
    scatter_rows_(state, 0, dst, new, live & (dst >= 0))
    if track_indices is not None and track_mask is not None:
        scatter_rows_(state, 0, track_indices, new, live & track_mask & (track_indices >= 0))


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
) -> torch.Tensor:
    """Mamba2 single-token SSM state update over a slot pool, in place.

    For each live row ``b`` (``state_indices[b] >= 0``) and head ``h`` (group
    ``g = h // (nheads // ngroups)``)::

        dt'  = softplus(dt[b, h] + dt_bias[h])          # bias / softplus optional
        dt'  = clamp(dt', *dt_limit)                     # optional
        s    = state[src] * exp(A[h] * dt') + dt' * x[b, h, :, None] * B[b, g, None, :]
        out  = (s @ C[b, g]) + D[h] * x[b, h]            # then * silu(z[b, h]) if z given
        state[dst] = s;  state[track[b]] = s if track_mask[b]

    Pad rows (``state_indices[b] == -1``) read and write no state and get zero output.

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
        ``[bs]`` int32/int64: source slot of each row, ``-1`` for a pad row.
    D, dt_bias : torch.Tensor, optional
        ``[nheads]``.
    z : torch.Tensor, optional
        ``[bs, nheads, headdim]`` gate.
    dt_softplus : bool
        Apply softplus to ``dt + dt_bias``.
    dt_limit : tuple of float, optional
        ``(lo, hi)``: clamp the discretised ``dt`` to ``[lo, hi]`` (Mamba2's
        ``time_step_limit``; a model's ``time_step_min`` floor is ``(min, inf)``), inside
        the kernel, so the caller needs no softplus / clamp kernels of its own.
    dst_indices : torch.Tensor, optional
        ``[bs]`` slot to write the new state to (default: the source slot); ``-1`` writes
        no state for that row.
    track_indices, track_mask : torch.Tensor, optional
        Both or neither. ``[bs]`` track slot and bool flag: flagged live rows also store the
        new state into their track slot in the same pass.
    out : torch.Tensor, optional
        ``[bs, nheads, headdim]`` in ``x.dtype``; allocated if not given.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (default: :func:`hybridmeta.kernels.implementation`'s, else
        Triton on CUDA and the reference elsewhere).

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (message names it); in debug mode also
        on an index outside ``[-1, slots)`` or two rows writing one slot. Nothing is written.
    """
    op = "ssm_state_update"
    lim = NO_DT_LIMIT if dt_limit is None else check_dt_limit(op, dt_limit)
    # One cheap expression first; the detailed checks only run (and name the broken rule)
    # when it fails, so a valid call pays a few microseconds of host time.
    if not ssm_args_ok(state, x, dt, A, B, C, state_indices, D, z, dt_bias, dst_indices,
                       track_indices, track_mask, out):  # fmt: skip
        _check_ssm_args(op, state, x, dt, A, B, C, state_indices, D, z, dt_bias, dst_indices,
                        track_indices, track_mask, out)  # fmt: skip
    which = resolve(op, impl, state.device)
    if is_debug():
        _debug_check_ssm(
            op, state.shape[0], state_indices, dst_indices, track_indices, track_mask
        )
    if out is None:
        out = torch.empty_like(x)
    if which == "reference":
        ssm_state_update_reference(
            state, x, dt, A, B, C, out, state_indices, D=D, z=z, dt_bias=dt_bias,
            dt_softplus=dt_softplus, dst_indices=dst_indices, track_indices=track_indices,
            track_mask=track_mask, dt_limit=None if dt_limit is None else lim,
        )  # fmt: skip
        return out
    run = torch.ops.hybridmeta.ssm_state_update if observed(state) else _ssm_state_update_impl
    run(
        state, x, dt, A, B, C, out, state_indices, D, z, dt_bias, dt_softplus,
        dst_indices, track_indices, track_mask, *lim,
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
) -> None:
    """The detailed checks of :func:`ssm_state_update`: raise naming the broken rule."""
    state = check_pool(op, "state", state, dims="[slots, nheads, headdim, dstate]")
    dev = state.device
    _, nheads, headdim, dstate = state.shape
    x = check_tensor(op, "x", x, shape=(None, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, nheads, headdim]")  # fmt: skip
    bs = x.shape[0]
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


def _debug_check_ssm(
    op: str,
    slots: int,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> None:
    check_index_range(op, "state_indices", src, slots)
    live = src >= 0
    writes: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    if dst is not None:
        check_index_range(op, "dst_indices", dst, slots)
        writes.append(("dst_indices", dst, live))
    else:
        writes.append(("state_indices", src, live))
    if track is not None and mask is not None:
        check_index_range(op, "track_indices", track, slots)
        writes.append(("track_indices", track, live & mask))
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

    The slots are ``md.mamba_cache_indices`` of the decode rows. With ``fuse_track`` (and a
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
        track_mask=mask, out=out, impl=impl,
    )  # fmt: skip

