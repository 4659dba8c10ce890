"""Mamba2 single-token SSM state update: Triton kernel and its launcher.

One program updates a ``[BLOCK_P, dstate]`` tile of one head of one row, in place in the
state pool (or into a separate destination slot), and writes the tile's share of the
output. Pad rows (source slot ``-1``) read no state, write no state and write zeros.
Flagged rows may also store the new state into their track slot in the same pass.

The launcher never allocates and never validates; the public op in
:mod:`hybridmeta.kernels.ops` does both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta.kernels._config import SsmLaunchConfig, ssm_launch_config


@triton.jit
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
    i_p = tl.program_id(0)
    # int64 from here on: slot * per-slot stride overflows int32 for large pools.
    i_b = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2).to(tl.int64)
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
        ``[bs]``; ``-1`` marks a pad row (source) or "write nothing" (destination, track).
    config : SsmLaunchConfig, optional
        Tile shape and warps; the default is picked from the state dtype and shapes.
    """
    bs = x.shape[0]
    _, nheads, headdim, dstate = state.shape
    ngroups = B.shape[1]
    if bs == 0:
        return
    cfg = config if config is not None else ssm_launch_config(state.dtype, headdim, dstate)
    block_n = triton.next_power_of_2(dstate)
    z_strides = (z.stride(0), z.stride(1), z.stride(2)) if z is not None else (0, 0, 0)
    grid = (triton.cdiv(headdim, cfg.block_p), bs, nheads)
    _ssm_update_kernel[grid](
        state_ptr=state,
        x_ptr=x,
        dt_ptr=dt,
        dt_bias_ptr=dt_bias,
        A_ptr=A,
        B_ptr=B,
        C_ptr=C,
        D_ptr=D,
        z_ptr=z,
        out_ptr=out,
        src_ptr=src_indices,
        dst_ptr=dst_indices,
        track_idx_ptr=track_indices,
        track_mask_ptr=track_mask,
        headdim=headdim,
        dstate=dstate,
        heads_per_group=nheads // ngroups,
        stride_s_slot=state.stride(0),
        stride_s_h=state.stride(1),
        stride_s_p=state.stride(2),
        stride_s_n=state.stride(3),
        stride_x_b=x.stride(0),
        stride_x_h=x.stride(1),
        stride_x_p=x.stride(2),
        stride_dt_b=dt.stride(0),
        stride_dt_h=dt.stride(1),
        stride_B_b=B.stride(0),
        stride_B_g=B.stride(1),
        stride_B_n=B.stride(2),
        stride_C_b=C.stride(0),
        stride_C_g=C.stride(1),
        stride_C_n=C.stride(2),
        stride_z_b=z_strides[0],
        stride_z_h=z_strides[1],
        stride_z_p=z_strides[2],
        stride_o_b=out.stride(0),
        stride_o_h=out.stride(1),
        stride_o_p=out.stride(2),
        DT_SOFTPLUS=dt_softplus,
        HAS_DT_BIAS=dt_bias is not None,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DST=dst_indices is not None,
        HAS_TRACK=track_indices is not None,
        BLOCK_P=cfg.block_p,
        BLOCK_N=block_n,
        num_warps=cfg.num_warps,
    )
