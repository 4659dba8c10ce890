"""Fused Mamba2 decode mixer update: causal-conv1d update + SSM state update, one kernel.

In a Mamba2 layer the conv output of a row feeds the SSM update of the same row: channels
``[0, H*P)`` are ``x``, the next ``G*N`` are ``B``, the last ``G*N`` are ``C``. This kernel
reads and writes both states once per row and never materialises the conv output:

* a program owns a ``[BLOCK_P, dstate]`` tile of one head (a *unit*, as in
  :mod:`hybridmeta.kernels.ssm_update`) and walks a range of rows;
* for each live row it convolves its own ``BLOCK_P`` channels of ``x`` (and writes their new
  conv state: no other program touches them), convolves the ``B`` and ``C`` channels of its
  head's group (every unit of the group computes the same values), then updates its SSM
  tile and writes its share of the output;
* the ``B``/``C`` conv state of a (row, group) is shared by all units of the group, so it may
  only be overwritten once every one of them has read it: each unit increments a per
  (row, group) counter after its reads, and the unit that arrives last writes the new
  ``B``/``C`` conv state and resets the counter to zero for the next call.

Pad rows (slot ``-1``) read and write no state (conv or SSM) and get zero output. ``dt`` is
the raw projection: ``softplus(dt + dt_bias)``, clamped below at ``dt_min`` if given.

The counters live in a small int32 workspace (``[rows * ngroups]``, zero between calls).
By default one per device is kept here and grown outside CUDA-graph capture (call once
eagerly at the largest batch size before capturing); pass ``workspace`` to own it, and give
each stream that runs the op concurrently its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta.kernels._config import SsmLaunchConfig, ssm_launch_config
from hybridmeta.kernels._launch import DirectLauncher, device_capacity
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_optional,
    check_pool,
    check_tensor,
)
from hybridmeta.kernels.ops import _observed
from hybridmeta.kernels.reference import causal_conv1d_update_ref, ssm_state_update_ref

__all__ = ["mixer_update", "mixer_update_reference"]


@triton.jit(do_not_specialize=["bs", "rows_per_prog"])
def _mixer_update_kernel(
    xbc_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    A_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    out_ptr: tl.tensor,
    conv_ptr: tl.tensor,
    conv_w_ptr: tl.tensor,
    conv_b_ptr: tl.tensor,
    state_ptr: tl.tensor,
    src_ptr: tl.tensor,
    counter_ptr: tl.tensor,
    bs: tl.tensor,
    rows_per_prog: tl.tensor,
    dt_min: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    ngroups: tl.tensor,
    x_dim: tl.tensor,
    stride_xbc_b: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_cs_slot: tl.tensor,
    stride_cs_c: tl.tensor,
    stride_cs_w: tl.tensor,
    stride_cw_c: tl.tensor,
    stride_cw_k: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_s_h: tl.tensor,
    stride_s_p: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_MIN: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_CONV_BIAS: tl.constexpr,
    WIDTH: tl.constexpr,
    N_PTILES: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    i_u = tl.program_id(0)
    i_p = i_u % N_PTILES
    i_h = (i_u // N_PTILES).to(tl.int64)
    i_g = i_h // heads_per_group
    units_per_group = N_PTILES * heads_per_group
    row0 = tl.program_id(1).to(tl.int64) * rows_per_prog
    row_end = tl.minimum(row0 + rows_per_prog, bs)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    o_n = tl.arange(0, BLOCK_N)  # [BN]
    o_k = tl.arange(0, BLOCK_K)  # [BK] conv taps
    m_p = o_p < headdim
    m_n = o_n < dstate
    m_s = m_p[:, None] & m_n[None, :]  # [BP, BN]
    o_s = i_h * stride_s_h + o_p[:, None] * stride_s_p + o_n[None, :]  # [BP, BN]
    o_out = i_h * stride_o_h + o_p  # [BP]
    # conv channels of this unit: its x rows, its group's B and C
    c_x = i_h * headdim + o_p  # [BP]
    c_b = x_dim + i_g * dstate + o_n  # [BN]
    c_c = x_dim + ngroups * dstate + i_g * dstate + o_n  # [BN]
    m_tap = o_k < WIDTH - 1  # state columns of the window
    m_wx = m_p[:, None] & m_tap[None, :]  # [BP, BK]
    m_wn = m_n[:, None] & m_tap[None, :]  # [BN, BK]
    last = o_k[None, :] == WIDTH - 1
    m_new_x = m_p[:, None] & (o_k[None, :] >= 1) & (o_k[None, :] < WIDTH)
    m_new_n = m_n[:, None] & (o_k[None, :] >= 1) & (o_k[None, :] < WIDTH)

    # Per unit, once per program: conv weights and biases of its channels, A, D, dt_bias.
    b_wx = tl.load(
        conv_w_ptr + c_x[:, None] * stride_cw_c + o_k[None, :] * stride_cw_k,
        mask=m_p[:, None] & (o_k[None, :] < WIDTH),
        other=0.0,
    ).to(tl.float32)  # [BP, BK]
    b_wb = tl.load(
        conv_w_ptr + c_b[:, None] * stride_cw_c + o_k[None, :] * stride_cw_k,
        mask=m_n[:, None] & (o_k[None, :] < WIDTH),
        other=0.0,
    ).to(tl.float32)  # [BN, BK]
    b_wc = tl.load(
        conv_w_ptr + c_c[:, None] * stride_cw_c + o_k[None, :] * stride_cw_k,
        mask=m_n[:, None] & (o_k[None, :] < WIDTH),
        other=0.0,
    ).to(tl.float32)  # [BN, BK]
    b_A = tl.load(A_ptr + i_h).to(tl.float32)

    for b in tl.range(row0, row_end):
        src = tl.load(src_ptr + b).to(tl.int64)
        if src >= 0:
            p_cs = conv_ptr + src * stride_cs_slot
            # Conv windows [channels, taps]: state columns, then this row's input.
            b_sx = tl.load(
                p_cs + c_x[:, None] * stride_cs_c + o_k[None, :] * stride_cs_w, mask=m_wx, other=0.0
            ).to(tl.float32)
            b_sb = tl.load(
                p_cs + c_b[:, None] * stride_cs_c + o_k[None, :] * stride_cs_w, mask=m_wn, other=0.0
            ).to(tl.float32)
            b_sc = tl.load(
                p_cs + c_c[:, None] * stride_cs_c + o_k[None, :] * stride_cs_w, mask=m_wn, other=0.0
            ).to(tl.float32)
            p_in = xbc_ptr + b * stride_xbc_b
            b_s = tl.load(state_ptr + src * stride_s_slot + o_s, mask=m_s, other=0.0).to(
                tl.float32
            )  # [BP, BN] SSM state tile
            b_inx = tl.load(p_in + c_x, mask=m_p, other=0.0).to(tl.float32)
            b_inb = tl.load(p_in + c_b, mask=m_n, other=0.0).to(tl.float32)
            b_inc = tl.load(p_in + c_c, mask=m_n, other=0.0).to(tl.float32)
            b_winx = tl.where(last, b_inx[:, None], b_sx)  # [BP, BK]
            b_winb = tl.where(last, b_inb[:, None], b_sb)  # [BN, BK]
            b_winc = tl.where(last, b_inc[:, None], b_sc)
            b_x = tl.sum(b_winx * b_wx, axis=1)  # [BP]
            b_B = tl.sum(b_winb * b_wb, axis=1)  # [BN]
            b_C = tl.sum(b_winc * b_wc, axis=1)
            if HAS_CONV_BIAS:
                b_x += tl.load(conv_b_ptr + c_x, mask=m_p, other=0.0).to(tl.float32)
                b_B += tl.load(conv_b_ptr + c_b, mask=m_n, other=0.0).to(tl.float32)
                b_C += tl.load(conv_b_ptr + c_c, mask=m_n, other=0.0).to(tl.float32)
            # As in the two-kernel path: SiLU in fp32, one rounding to the activation dtype
            # (the conv op's output), which the SSM update then reads.
            b_x = b_x * tl.sigmoid(b_x)
            b_B = b_B * tl.sigmoid(b_B)
            b_C = b_C * tl.sigmoid(b_C)
            b_x = b_x.to(xbc_ptr.dtype.element_ty).to(tl.float32)
            b_B = b_B.to(xbc_ptr.dtype.element_ty).to(tl.float32)
            b_C = b_C.to(xbc_ptr.dtype.element_ty).to(tl.float32)
            # Own x channels: the shifted window is this program's alone.
            tl.debug_barrier()
            tl.store(
                p_cs + c_x[:, None] * stride_cs_c + (o_k[None, :] - 1) * stride_cs_w,
                b_winx.to(conv_ptr.dtype.element_ty),
                mask=m_new_x,
            )

            b_dt = tl.load(dt_ptr + b * stride_dt_b + i_h).to(tl.float32)
            if HAS_DT_BIAS:
                b_dt += tl.load(dt_bias_ptr + i_h).to(tl.float32)
            if DT_SOFTPLUS:
                b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
            if HAS_DT_MIN:
                b_dt = tl.maximum(b_dt, dt_min)
            b_dA = tl.exp(b_A * b_dt)
            b_s = b_s * b_dA + (b_x * b_dt)[:, None] * b_B[None, :]  # [BP, BN]
            b_o = tl.sum(b_s * b_C[None, :], axis=1)  # [BP]
            if HAS_D:
                b_o += b_x * tl.load(D_ptr + i_h).to(tl.float32)
            if HAS_Z:
                b_z = tl.load(
                    z_ptr + b * stride_z_b + i_h * stride_z_h + o_p, mask=m_p, other=0.0
                ).to(tl.float32)
                b_o *= b_z * tl.sigmoid(b_z)
            tl.store(out_ptr + b * stride_o_b + o_out, b_o.to(out_ptr.dtype.element_ty), mask=m_p)
            tl.store(
                state_ptr + src * stride_s_slot + o_s,
                b_s.to(state_ptr.dtype.element_ty),
                mask=m_s,
            )

            # Shared B/C conv state: every unit of the group has read it once the counter
            # reaches units_per_group; the last one writes it and resets the counter.
            tl.debug_barrier()
            p_cnt = counter_ptr + b * ngroups + i_g
            seen = tl.atomic_add(p_cnt, 1, sem="acq_rel")
            if seen == units_per_group - 1:
                tl.store(
                    p_cs + c_b[:, None] * stride_cs_c + (o_k[None, :] - 1) * stride_cs_w,
                    b_winb.to(conv_ptr.dtype.element_ty),
                    mask=m_new_n,
                )
                tl.store(
                    p_cs + c_c[:, None] * stride_cs_c + (o_k[None, :] - 1) * stride_cs_w,
                    b_winc.to(conv_ptr.dtype.element_ty),
                    mask=m_new_n,
                )
                tl.atomic_xchg(p_cnt, 0, sem="relaxed")
        else:
            tl.store(
                out_ptr + b * stride_o_b + o_out,
                tl.zeros([BLOCK_P], dtype=out_ptr.dtype.element_ty),
                mask=m_p,
            )


_LAUNCHER = DirectLauncher(_mixer_update_kernel)
_WORKSPACES: dict[int, torch.Tensor] = {}


def _workspace(device: torch.device, n: int) -> torch.Tensor:
    index = device.index if device.type == "cuda" and device.index is not None else -1
    if device.type == "cuda" and index < 0:
        index = torch.cuda.current_device()
    buf = _WORKSPACES.get(index)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mixer_update: the counter workspace must grow to {n} entries during CUDA-graph "
                "capture; call the op once eagerly at the largest batch size before capturing, "
                "or pass `workspace`"
            )
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _WORKSPACES[index] = buf
    return buf


def launch_mixer_update(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    out: torch.Tensor,
    state_indices: torch.Tensor,
    workspace: torch.Tensor,
    *,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float | None,
    ngroups: int,
    row_splits: int | None = None,
) -> None:
    """Launch on validated tensors (no allocation, no checks); see :func:`mixer_update`."""
    bs = xbc.shape[0]
    if bs == 0:
        return
    _, nheads, headdim, dstate = ssm_state.shape
    width = conv_weight.shape[1]
    # The SSM update's tile, on one warp: the kernel as tested and measured on the H200
    # (docs/perf_notes.md, run 2); its counter protocol is written for any warp count.
    cfg = ssm_launch_config(ssm_state.dtype, headdim, dstate)
    cfg = SsmLaunchConfig(block_p=cfg.block_p, num_warps=1)
    block_p = cfg.block_p
    n_ptiles = (headdim + block_p - 1) // block_p
    dev = ssm_state.get_device()
    zs = z.stride() if z is not None else (0, 0, 0)
    ints = (
        headdim, dstate, nheads // ngroups, ngroups, nheads * headdim, xbc.stride(0),
        dt.stride(0), zs[0], zs[1], out.stride(0), out.stride(1), *conv_state.stride(),
        *conv_weight.stride(), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
    )  # fmt: skip
    flags = (
        dt_softplus, dt_min is not None, dt_bias is not None, D is not None, z is not None,
        conv_bias is not None, width, n_ptiles, block_p, triton.next_power_of_2(dstate),
        triton.next_power_of_2(width),
    )  # fmt: skip
    ptrs = tuple(
        None if t is None else t.data_ptr()
        for t in (xbc, dt, dt_bias, A, D, z, out, conv_state, conv_weight, conv_bias,
                  ssm_state, state_indices, workspace)
    )  # fmt: skip
    aligned = all(p is None or p & 15 == 0 for p in ptrs)
    key = (
        dev, cfg.num_warps, ints, flags,
        tuple(None if t is None else t.dtype for t in (xbc, dt, dt_bias, A, D, z, out,
              conv_state, conv_weight, conv_bias, ssm_state, state_indices)),
    )  # fmt: skip
    var = _LAUNCHER.lookup(key, aligned)
    units = n_ptiles * nheads
    if row_splits is None:
        if dev < 0:
            row_splits = 2
        else:
            # As the SSM update (hybridmeta.kernels.ssm_update): about 2.5 full waves.
            cap = device_capacity(dev, cfg.num_warps, 0, 0)
            row_splits = max(1, (5 * cap) // (2 * units))
    rows_per_prog = (bs + min(row_splits, bs) - 1) // min(row_splits, bs)
    grid = (units, (bs + rows_per_prog - 1) // rows_per_prog, 1)
    dmin = float(dt_min) if dt_min is not None else 0.0
    _LAUNCHER.launch(
        var, grid, key, dev, aligned,
        lambda: (*ptrs, bs, rows_per_prog, dmin, *ints, *flags),
        lambda g: _mixer_update_kernel[g](
            xbc, dt, dt_bias, A, D, z, out, conv_state, conv_weight, conv_bias, ssm_state,
            state_indices, workspace, bs, rows_per_prog, dmin, *ints,
            DT_SOFTPLUS=dt_softplus, HAS_DT_MIN=dt_min is not None, HAS_DT_BIAS=dt_bias is not None,
            HAS_D=D is not None, HAS_Z=z is not None, HAS_CONV_BIAS=conv_bias is not None,
            WIDTH=width, N_PTILES=n_ptiles, BLOCK_P=block_p, BLOCK_N=flags[9],
            BLOCK_K=flags[10], num_warps=cfg.num_warps, num_stages=1,
        ),
    )  # fmt: skip


def _impl(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    out: torch.Tensor,
    state_indices: torch.Tensor,
    workspace: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float | None,
    ngroups: int,
) -> None:
    launch_mixer_update(
        xbc, dt, A, conv_state, conv_weight, conv_bias, ssm_state, out, state_indices,
        workspace, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_min=dt_min,
        ngroups=ngroups,
    )  # fmt: skip


_op = torch.library.custom_op(
    "hybridmeta::mixer_update",
    _impl,
    mutates_args=("conv_state", "ssm_state", "out", "workspace"),
)


@_op.register_fake
def _fake(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    out: torch.Tensor,
    state_indices: torch.Tensor,
    workspace: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float | None,
    ngroups: int,
) -> None:
    return None


def mixer_update(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    *,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None = None,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    ngroups: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_min: float | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token of a Mamba2 mixer: conv update (SiLU) then SSM update, one kernel.

    Equals :func:`~hybridmeta.kernels.causal_conv1d_update` (``activation="silu"``) of
    ``xbc`` into a tensor of ``xbc``'s dtype, split into ``x [bs, H, P]``, ``B``, ``C``
    ``[bs, G, N]``, followed by :func:`~hybridmeta.kernels.ssm_state_update` with ``dt``
    clamped below at ``dt_min`` after the softplus (see :func:`mixer_update_reference`).

    Parameters
    ----------
    xbc : torch.Tensor
        ``[bs, conv_dim]`` conv input, ``conv_dim = H*P + 2*G*N``; last dim contiguous.
    dt : torch.Tensor
        ``[bs, H]`` (before bias and softplus); last dim contiguous.
    A : torch.Tensor
        ``[H]``.
    conv_state : torch.Tensor
        ``[slots, conv_dim, k-1]`` pool, updated in place.
    conv_weight : torch.Tensor
        ``[conv_dim, k]``; ``conv_bias`` ``[conv_dim]``.
    ssm_state : torch.Tensor
        ``[slots, H, P, N]`` pool (last dim contiguous), updated in place.
    state_indices : torch.Tensor
        ``[bs]`` contiguous int32/int64 slot of each row in both pools; ``-1`` pads.
    ngroups : int
        ``G``.
    D, dt_bias : torch.Tensor, optional
        ``[H]``.
    z : torch.Tensor, optional
        ``[bs, H, P]`` gate (last dim contiguous).
    out : torch.Tensor, optional
        ``[bs, H, P]`` (last dims contiguous) in ``xbc``'s dtype.
    workspace : torch.Tensor, optional
        int32 counters, at least ``bs * ngroups``, all zero (the kernel leaves them zero).

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    op = "mixer_update"
    ssm_state = check_pool(op, "ssm_state", ssm_state, dims="[slots, nheads, headdim, dstate]")
    dev = ssm_state.device
    slots, nheads, headdim, dstate = ssm_state.shape
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"{op}: `ngroups` {ngroups} must be >= 1 and divide nheads={nheads}")
    conv_dim = nheads * headdim + 2 * ngroups * dstate
    xbc = check_tensor(op, "xbc", xbc, shape=(None, conv_dim), dtypes=FLOAT_DTYPES, device=dev,
                       dims="[bs, H*P + 2*G*N]")  # fmt: skip
    bs = xbc.shape[0]
    conv_state = check_pool(op, "conv_state", conv_state, dims="[slots, conv_dim, k - 1]")
    check_tensor(op, "conv_state", conv_state, shape=(slots, conv_dim, None), dtypes=FLOAT_DTYPES,
                 device=dev, dims="[slots, conv_dim, k - 1]")  # fmt: skip
    width = conv_state.shape[2] + 1
    check_tensor(op, "conv_weight", conv_weight, shape=(conv_dim, width), dtypes=FLOAT_DTYPES,
                 device=dev, dims="[conv_dim, k]")  # fmt: skip
    check_optional(op, "conv_bias", conv_bias, shape=(conv_dim,), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[conv_dim]")  # fmt: skip
    check_tensor(op, "dt", dt, shape=(bs, nheads), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[bs, nheads]")  # fmt: skip
    check_tensor(op, "A", A, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    check_optional(op, "D", D, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    check_optional(op, "dt_bias", dt_bias, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[nheads]")  # fmt: skip
    check_optional(op, "z", z, shape=(bs, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[bs, nheads, headdim]")  # fmt: skip
    check_tensor(op, "state_indices", state_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(op, "out", out, shape=(bs, nheads, headdim), dtypes=(xbc.dtype,),
                     device=dev, dims="[bs, nheads, headdim]")  # fmt: skip
    # The kernel assumes unit strides along these axes (channels, heads of dt, headdim).
    for name, t, dim in (("xbc", xbc, 1), ("dt", dt, 1), ("ssm_state", ssm_state, 3),
                         ("z", z, 2), ("out", out, 2), ("state_indices", state_indices, 0)):  # fmt: skip
        if t is not None and t.shape[dim] > 1 and t.stride(dim) != 1:
            raise ValueError(f"{op}: `{name}` must be contiguous along dim {dim}")
    if workspace is None:
        workspace = _workspace(dev, bs * ngroups)
    else:
        check_tensor(op, "workspace", workspace, shape=(None,), dtypes=(torch.int32,), device=dev,
                     dims="[>= bs * ngroups]")  # fmt: skip
        if workspace.shape[0] < bs * ngroups:
            raise ValueError(f"{op}: `workspace` needs >= bs * ngroups = {bs * ngroups} entries")
    if out is None:
        out = torch.empty(bs, nheads, headdim, dtype=xbc.dtype, device=dev)
    run = torch.ops.hybridmeta.mixer_update if _observed(ssm_state) else _impl
    run(
        xbc, dt, A, conv_state, conv_weight, conv_bias, ssm_state, out, state_indices,
        workspace, D, z, dt_bias, dt_softplus, dt_min, ngroups,
    )  # fmt: skip
    return out


def mixer_update_reference(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    *,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    ngroups: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two-kernel composition in pure torch: ``(new_conv_state, new_ssm_state, out)``."""
    _, nheads, headdim, dstate = ssm_state.shape
    bs = xbc.shape[0]
    new_conv, conv_out = causal_conv1d_update_ref(
        xbc, conv_state, conv_weight, conv_bias, state_indices, silu=True
    )
    x, b, c = torch.split(conv_out, [nheads * headdim, ngroups * dstate, ngroups * dstate], -1)
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = torch.where(d <= 20.0, torch.nn.functional.softplus(d), d)
    if dt_min is not None:
        d = d.clamp(min=dt_min)
    new_ssm, out = ssm_state_update_ref(
        ssm_state, x.reshape(bs, nheads, headdim), d, A,
        b.reshape(bs, ngroups, dstate), c.reshape(bs, ngroups, dstate), state_indices,
        D=D, z=z,
    )  # fmt: skip
    return new_conv, new_ssm, out
