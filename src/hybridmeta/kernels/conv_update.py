"""Causal-conv1d decode update: Triton kernel, launcher, op, reference.

One program handles ``BLOCK_C`` channels of ``ROWS`` rows: it forms each row's window
``[state[:, 0..k-2], x]``, writes the convolved (and optionally SiLU-activated) output and
shifts the window left by one into the row's conv-state slot. Several rows per program
share one load of the weights and put several rows' loads in flight before the first
store. Pad rows (slot ``-1``) read and write no state and write zeros to the output,
never uninitialised memory. Works for any strides of the conv-state pool.

The public op :func:`causal_conv1d_update` validates, then runs the kernel or the pure-torch
:func:`causal_conv1d_update_reference`; :func:`causal_conv1d_update_from_metadata` takes
the slots from a ``Mamba2Metadata``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import ConvLaunchConfig, cdiv, conv_launch_config, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, resolve
from hybridmeta.kernels._launch import DirectLauncher
from hybridmeta.kernels._math import conv_step, scatter_rows_
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_disjoint_writes,
    check_index_range,
    check_optional,
    check_pool,
    check_tensor,
    decode_rows,
)
from hybridmeta.model import Mamba2Metadata

__all__ = [
    "causal_conv1d_update",
    "causal_conv1d_update_from_metadata",
    "causal_conv1d_update_reference",
    "launch_conv_update",
]


@triton.jit(do_not_specialize=["bs"])
def _conv_update_kernel(
    x_ptr: tl.tensor,
    conv_state_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    bs: tl.tensor,
    dim: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_c: tl.tensor,
    stride_cs_slot: tl.tensor,
    stride_cs_c: tl.tensor,
    stride_cs_w: tl.tensor,
    stride_w_c: tl.tensor,
    stride_w_k: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_c: tl.tensor,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    i_c = tl.program_id(0)
    i_r = tl.program_id(1)
    o_b = (i_r * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [R]
    m_b = o_b < bs
    slot = tl.load(slot_ptr + o_b, mask=m_b, other=-1).to(tl.int64)  # [R]
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [C]
    o_k = tl.arange(0, BLOCK_K)  # [K]
    m_c = o_c < dim
    m_rc = m_b[:, None] & m_c[None, :]  # [R, C] rows < bs
    m_live = (m_b & (slot >= 0))[:, None] & m_c[None, :]  # [R, C] live rows
    # Window column j < WIDTH-1 is state column j; column WIDTH-1 is the new input.
    # (Tiles ordered [R, K, C] instead measured the same on the H200 for both pool
    # layouts: docs/kernels.md.)
    p_s = (
        conv_state_ptr
        + slot[:, None, None] * stride_cs_slot
        + o_c[None, :, None] * stride_cs_c
        + o_k[None, None, :] * stride_cs_w
    )  # [R, C, K]
    m_s = m_live[:, :, None] & (o_k[None, None, :] < WIDTH - 1)
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)  # [R, C, K]
    b_x = tl.load(
        x_ptr + o_b[:, None] * stride_x_b + o_c[None, :] * stride_x_c, mask=m_rc, other=0.0
    ).to(tl.float32)  # [R, C]
    b_win = tl.where(o_k[None, None, :] == WIDTH - 1, b_x[:, :, None], b_s)  # [R, C, K]
    b_w = tl.load(
        weight_ptr + o_c[:, None] * stride_w_c + o_k[None, :] * stride_w_k,
        mask=m_c[:, None] & (o_k[None, :] < WIDTH),
        other=0.0,
    ).to(tl.float32)  # [C, K], shared by the ROWS rows
    b_o = tl.sum(b_win * b_w[None, :, :], axis=2)  # [R, C]
    if HAS_BIAS:
        b_o += tl.load(bias_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        b_o = b_o * tl.sigmoid(b_o)
    # A pad row's x may be garbage (even NaN): select, never multiply, to zero it.
    b_o = tl.where(m_live, b_o, 0.0)
    tl.store(
        out_ptr + o_b[:, None] * stride_o_b + o_c[None, :] * stride_o_c,
        b_o.to(out_ptr.dtype.element_ty),
        mask=m_rc,
    )

    # The shifted store overwrites cells other threads of this program read: wait for all.
    tl.debug_barrier()
    # Window column j (1 <= j <= WIDTH-1) becomes state column j-1.
    m_new = m_live[:, :, None] & (o_k[None, None, :] >= 1) & (o_k[None, None, :] < WIDTH)
    tl.store(p_s - stride_cs_w, b_win.to(conv_state_ptr.dtype.element_ty), mask=m_new)


def launch_conv_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    *,
    silu: bool,
    config: ConvLaunchConfig | None = None,
) -> None:
    """Launch the conv update on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    x, out : torch.Tensor
        ``[bs, conv_dim]``.
    conv_state : torch.Tensor
        ``[slots, conv_dim, k - 1]`` pool (any strides), updated in place.
    weight : torch.Tensor
        ``[conv_dim, k]``.
    bias : torch.Tensor or None
        ``[conv_dim]``.
    slot_indices : torch.Tensor
        ``[bs]`` slot of each row; ``-1`` marks a pad row.
    silu : bool
        Apply SiLU to the output.
    config : ConvLaunchConfig, optional
        Channels and rows per program, warps; default from ``conv_dim``.
    """
    bs, dim = x.shape
    width = weight.shape[1]
    if bs == 0:
        return
    cfg = (
        config
        if config is not None
        else conv_launch_config(dim, channels_contiguous=conv_state.stride(1) == 1)
    )
    grid = (cdiv(dim, cfg.block_c), cdiv(bs, cfg.rows), 1)
    ints = (
        dim, x.stride(0), x.stride(1), *conv_state.stride(), weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1),
    )  # fmt: skip
    flags = (width, bias is not None, silu, cfg.rows, cfg.block_c, pow2_ceil(width))
    ptrs = (
        x.data_ptr(), conv_state.data_ptr(), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), slot_indices.data_ptr(),
    )  # fmt: skip
    aligned = all(p is None or p & 15 == 0 for p in ptrs)
    dev = conv_state.get_device()
    key = (
        dev, cfg.num_warps, ints, flags, x.dtype, conv_state.dtype, weight.dtype,
        None if bias is None else bias.dtype, out.dtype, slot_indices.dtype,
    )  # fmt: skip
    var = _LAUNCHER.lookup(key, aligned)
    _LAUNCHER.launch(
        var, grid, key, dev, aligned,
        lambda: (*ptrs, bs, *ints, *flags),
        lambda g: launchable(_conv_update_kernel, x.device)[g](
            x, conv_state, weight, bias, out, slot_indices, bs, *ints,
            WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, ROWS=cfg.rows,
            BLOCK_C=cfg.block_c, BLOCK_K=flags[5], num_warps=cfg.num_warps,
        ),
    )  # fmt: skip


_LAUNCHER = DirectLauncher(_conv_update_kernel)


# --------------------------------------------------------------------------- custom op


def _conv_update_impl(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    silu: bool,
) -> None:
    # The launcher makes the tensors' device current itself (only when it is not).
    launch_conv_update(x, conv_state, weight, bias, out, slot_indices, silu=silu)


_conv_update_op = torch.library.custom_op(
    "hybridmeta::causal_conv1d_update", _conv_update_impl, mutates_args=("conv_state", "out")
)

_conv_update_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- reference


def causal_conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    *,
    silu: bool,
) -> None:
    """The pure-torch conv update: the kernel's contract, in place, on validated tensors.

    Fixed shapes, no device-to-host reads (capturable like the kernel); fp32 math, the new
    window cast to the pool's dtype and the output to ``out``'s.
    """
    live = slot_indices >= 0
    safe = torch.where(live, slot_indices, 0)
    window = torch.where(live[:, None, None], conv_state.index_select(0, safe).float(), 0.0)
    y, new = conv_step(window, x, weight, bias, silu=silu)
    out.copy_(torch.where(live[:, None], y, 0.0).to(out.dtype))
    scatter_rows_(conv_state, 0, slot_indices, new, live)


# --------------------------------------------------------------------------- public op


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cache_indices: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """Causal-conv1d decode update over a conv-state pool, in place.

    For each live row ``b`` with slot ``s = cache_indices[b] >= 0``::

        win = [conv_state[s, :, 0], ..., conv_state[s, :, k-2], x[b]]    # [conv_dim, k]
        out[b] = act(sum_j win[:, j] * weight[:, j] + bias)
        conv_state[s] = win[:, 1:]

    Pad rows (``cache_indices[b] == -1``) read and write no state and get zero output.

    Parameters
    ----------
    x : torch.Tensor
        ``[bs, conv_dim]``.
    conv_state : torch.Tensor
        ``[slots, conv_dim, k - 1]``, updated in place.
    weight : torch.Tensor
        ``[conv_dim, k]``.
    bias : torch.Tensor, optional
        ``[conv_dim]``.
    cache_indices : torch.Tensor
        ``[bs]`` int32/int64 slot of each row; ``-1`` for a pad row.
    activation : {"silu", "swish", None}
        Output activation.
    out : torch.Tensor, optional
        ``[bs, conv_dim]`` in ``x.dtype``; allocated if not given.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    op = "causal_conv1d_update"
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{op}: `activation` must be None, 'silu' or 'swish', got {activation!r}")
    conv_state = check_pool(op, "conv_state", conv_state, dims="[slots, conv_dim, k - 1]")
    dev = conv_state.device
    slots, dim, wm1 = conv_state.shape
    x = check_tensor(
        op, "x", x, shape=(None, dim), dtypes=FLOAT_DTYPES, device=dev, dims="[bs, conv_dim]"
    )
    bs = x.shape[0]
    check_tensor(op, "weight", weight, shape=(dim, wm1 + 1), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[conv_dim, k]")  # fmt: skip
    check_optional(
        op, "bias", bias, shape=(dim,), dtypes=FLOAT_DTYPES, device=dev, dims="[conv_dim]"
    )
    check_tensor(op, "cache_indices", cache_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(
            op, "out", out, shape=(bs, dim), dtypes=(x.dtype,), device=dev, dims="[bs, conv_dim]"
        )
    which = resolve(op, impl, dev)
    if is_debug():
        check_index_range(op, "cache_indices", cache_indices, slots)
        live = cache_indices >= 0
        check_disjoint_writes(op, [("cache_indices", cache_indices, live)], None)
    if out is None:
        out = torch.empty_like(x)
    silu = activation is not None
    if which == "reference":
        causal_conv1d_update_reference(x, conv_state, weight, bias, out, cache_indices, silu=silu)
        return out
    run = torch.ops.hybridmeta.causal_conv1d_update if observed(conv_state) else _conv_update_impl
    run(x, conv_state, weight, bias, out, cache_indices, silu)
    return out


def causal_conv1d_update_from_metadata(
    md: Mamba2Metadata,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """:func:`causal_conv1d_update` of the decode rows of ``md`` (their working slots)."""
    rows = decode_rows("causal_conv1d_update_from_metadata", md, x.shape[0])
    return causal_conv1d_update(
        x, conv_state, weight, bias, cache_indices=md.mamba_cache_indices[rows],
        activation=activation, out=out, impl=impl,
    )  # fmt: skip
