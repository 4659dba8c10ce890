"""Speculative-decoding causal-conv1d verify update: ``T`` draft tokens per row, chains and trees.

Token ``t``'s window is its parent's window shifted left by one with ``x[b, t]`` appended;
a root's parent window is the row's working slot. Unrolled, the ``k`` columns of token
``t``'s window are the inputs of ``t`` and its ``k - 1`` nearest ancestors, continued into
the working window's columns once the walk passes a root (the walk vLLM's tree path does).
So each token's window is one gather: every (token, channel block) is an independent
program, with no dependency between the tokens of a row. The window after every token (its
last ``k - 1`` columns) is stored into ``inter[b, t]``; the working slot is never written.
Inputs that a sequential update would have stored in the pool before reading them back
are rounded through the pool's dtype, so a chain equals ``T`` sequential
:func:`~hybridmeta.kernels.causal_conv1d_update` calls bit for bit in the state.

This module holds the Triton kernel, its launcher, the ``torch.library`` op, the public
function :func:`conv_verify_update`, its metadata entry
:func:`conv_verify_update_from_metadata` and the pure-torch
:func:`conv_verify_update_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import ConvLaunchConfig, cdiv, conv_launch_config, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, on_device, resolve
from hybridmeta.kernels._errors import NO_FAULT, TAG, record_, record_for, report_key
from hybridmeta.kernels._math import conv_step
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_no_alias,
    check_optional,
    check_pad_slot_id,
    check_pool,
    check_rows,
    check_slots,
    check_tensor,
    pad_slot_of,
    verify_rows,
)
from hybridmeta.kernels.ssm_verify import check_verify_ids, verify_faults, verify_row_check
from hybridmeta.model import Mamba2Metadata

__all__ = [
    "conv_verify_update",
    "conv_verify_update_from_metadata",
    "conv_verify_update_reference",
    "launch_conv_verify",
]


_OP = "conv_verify_update"
_TAG: tl.constexpr = tl.constexpr(TAG[_OP])


# T and the parent array's row stride (T when dense) are runtime values: a new draft
# length must not compile a new variant (Triton specialises integers equal to 1).
@triton.jit(do_not_specialize=["T", "stride_par_b", "pad_id", "n_slots"])
def _conv_verify_kernel(
    x_ptr: tl.tensor,
    conv_state_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    inter_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    parent_ptr: tl.tensor,
    ndraft_ptr: tl.tensor,
    err_ptr: tl.tensor,
    T: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    dim: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_t: tl.tensor,
    stride_x_c: tl.tensor,
    stride_cs_slot: tl.tensor,
    stride_cs_c: tl.tensor,
    stride_cs_w: tl.tensor,
    stride_w_c: tl.tensor,
    stride_w_k: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_t: tl.tensor,
    stride_o_c: tl.tensor,
    stride_i_b: tl.tensor,
    stride_i_t: tl.tensor,
    stride_i_c: tl.tensor,
    stride_i_w: tl.tensor,
    stride_par_b: tl.tensor,
    stride_par_t: tl.tensor,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    HAS_PARENT: tl.constexpr,
    HAS_NDRAFT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    i_c = tl.program_id(0)
    i_t = tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    # A pad row, a row with an invalid id (NaN output) or a column past the live count:
    # bound 0, so no state is read or stored. One program of the row reports a fault, after
    # its stores.
    _live, bad, n_live, key, bound = verify_row_check(
        i_b, slot, ndraft_ptr, parent_ptr, T, pad_id, n_slots, stride_par_b, stride_par_t,
        HAS_PARENT, HAS_NDRAFT,
    )  # fmt: skip
    lim_c = tl.where(i_t < n_live, dim, 0)

    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [C]
    o_k = tl.arange(0, BLOCK_K)  # [K]
    m_c = o_c < dim
    m_live = o_c < lim_c

    # Window column k of token t holds the input of the (WIDTH-1-k)-th ancestor of t
    # (column WIDTH-1: t itself). Past a root the walk continues into the working
    # window: node -j (j >= 1) is its column WIDTH-1-j. Unused lanes get a node that
    # matches neither source.
    nodes = tl.full([BLOCK_K], -2 * BLOCK_K - WIDTH, tl.int64)  # [K]
    node = i_t
    for j in tl.static_range(WIDTH):
        nodes = tl.where(o_k == WIDTH - 1 - j, node, nodes)
        if HAS_PARENT:
            par = tl.load(parent_ptr + i_b * stride_par_b + tl.maximum(node, 0) * stride_par_t).to(
                tl.int64
            )
            # Anything but an earlier token reads as a root (memory-safe; debug mode refuses it).
            par = tl.maximum(tl.where(par < node, par, -1), -1)
            node = tl.where(node >= 0, par, node - 1)
        else:
            node = node - 1
    col = WIDTH - 1 + nodes  # [K] working-window column of nodes < 0
    m_x = m_live[:, None] & (nodes >= 0)[None, :]  # [C, K]
    m_s = m_live[:, None] & ((nodes < 0) & (col >= 0))[None, :]
    b_xw = tl.load(
        x_ptr
        + i_b * stride_x_b
        + tl.maximum(nodes, 0)[None, :] * stride_x_t
        + o_c[:, None] * stride_x_c,
        mask=m_x,
        other=0.0,
    )  # [C, K]
    b_sw = tl.load(
        conv_state_ptr
        + slot * stride_cs_slot
        + o_c[:, None] * stride_cs_c
        + tl.maximum(col, 0)[None, :] * stride_cs_w,
        mask=m_s,
        other=0.0,
    ).to(tl.float32)  # [C, K]
    # An ancestor's input reached this window through a stored window in sequential
    # decode: round it through the state dtype; the token's own input is used as given.
    b_xr = b_xw.to(conv_state_ptr.dtype.element_ty).to(tl.float32)
    b_x = tl.where((o_k == WIDTH - 1)[None, :], b_xw.to(tl.float32), b_xr)
    b_win = tl.where((nodes >= 0)[None, :], b_x, b_sw)  # [C, K]

    b_w = tl.load(
        weight_ptr + o_c[:, None] * stride_w_c + o_k[None, :] * stride_w_k,
        mask=m_c[:, None] & (o_k < WIDTH)[None, :],
        other=0.0,
    ).to(tl.float32)  # [C, K]
    b_o = tl.sum(b_win * b_w, axis=1)  # [C]
    if HAS_BIAS:
        b_o += tl.load(bias_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    if SILU:
        b_o = b_o * tl.sigmoid(b_o)
    # Pad rows and dead columns: select, never multiply (their inputs may be NaN).
    b_o = tl.where(m_live, b_o, tl.where(bad, float("nan"), 0.0))
    tl.store(
        out_ptr + i_b * stride_o_b + i_t * stride_o_t + o_c * stride_o_c,
        b_o.to(out_ptr.dtype.element_ty),
        mask=m_c,
    )
    # Window column k (1 <= k <= WIDTH-1) becomes column k-1 of the stored window.
    m_new = m_live[:, None] & ((o_k >= 1) & (o_k < WIDTH))[None, :]
    tl.store(
        inter_ptr
        + i_b * stride_i_b
        + i_t * stride_i_t
        + o_c[:, None] * stride_i_c
        + (o_k[None, :] - 1) * stride_i_w,
        b_win.to(inter_ptr.dtype.element_ty),
        mask=m_new,
    )
    if bad & (i_c == 0) & (i_t == 0):
        report_key(err_ptr, _TAG, key, pad_id, bound)


def launch_conv_verify(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    inter: torch.Tensor,
    cache_indices: torch.Tensor,
    *,
    silu: bool,
    parent: torch.Tensor | None,
    num_draft: torch.Tensor | None,
    config: ConvLaunchConfig | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch the conv verify update on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    x, out : torch.Tensor
        ``[bs, T, conv_dim]``.
    conv_state : torch.Tensor
        ``[slots, conv_dim, k - 1]`` pool (any strides); only read.
    weight : torch.Tensor
        ``[conv_dim, k]``.
    bias : torch.Tensor or None
        ``[conv_dim]``.
    inter : torch.Tensor
        ``[bs, T, conv_dim, k - 1]`` (any strides); written.
    cache_indices : torch.Tensor
        ``[bs]`` working slot of each row; ``pad_slot_id`` marks a pad row.
    silu : bool
        Apply SiLU to the output.
    parent, num_draft : torch.Tensor or None
        ``[bs, T]`` parent token (``-1`` root) and ``[bs]`` live draft columns.
    config : ConvLaunchConfig, optional
        Channels per program and warps (``rows`` is not used); default from ``conv_dim``.
    pad_slot_id : int
        The pad id (int32).
    errors : torch.Tensor, optional
        The error record (default: the device's).
    """
    bs, T, dim = x.shape
    width = weight.shape[1]
    if bs == 0 or T == 0:
        return
    err = errors if errors is not None else record_for(conv_state)
    cfg = config if config is not None else conv_launch_config(dim)
    par_strides = parent.stride() if parent is not None else (0, 0)
    grid = (cdiv(dim, cfg.block_c), T, bs)
    launchable(_conv_verify_kernel, x.device)[grid](
        x_ptr=x,
        conv_state_ptr=conv_state,
        weight_ptr=weight,
        bias_ptr=bias,
        out_ptr=out,
        inter_ptr=inter,
        slot_ptr=cache_indices,
        parent_ptr=parent,
        ndraft_ptr=num_draft,
        err_ptr=err,
        T=T,
        pad_id=pad_slot_id,
        n_slots=conv_state.shape[0],
        dim=dim,
        stride_x_b=x.stride(0),
        stride_x_t=x.stride(1),
        stride_x_c=x.stride(2),
        stride_cs_slot=conv_state.stride(0),
        stride_cs_c=conv_state.stride(1),
        stride_cs_w=conv_state.stride(2),
        stride_w_c=weight.stride(0),
        stride_w_k=weight.stride(1),
        stride_o_b=out.stride(0),
        stride_o_t=out.stride(1),
        stride_o_c=out.stride(2),
        stride_i_b=inter.stride(0),
        stride_i_t=inter.stride(1),
        stride_i_c=inter.stride(2),
        stride_i_w=inter.stride(3),
        stride_par_b=par_strides[0],
        stride_par_t=par_strides[1],
        WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=silu,
        HAS_PARENT=parent is not None,
        HAS_NDRAFT=num_draft is not None,
        BLOCK_C=cfg.block_c,
        BLOCK_K=pow2_ceil(width),
        num_warps=cfg.num_warps,
    )


# --------------------------------------------------------------------------- custom op


def _conv_verify_impl(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    inter: torch.Tensor,
    cache_indices: torch.Tensor,
    silu: bool,
    parent: torch.Tensor | None,
    num_draft: torch.Tensor | None,
    pad_slot_id: int,
    errors: torch.Tensor,
) -> None:
    with on_device(conv_state.device):
        launch_conv_verify(
            x, conv_state, weight, bias, out, inter, cache_indices, silu=silu, parent=parent,
            num_draft=num_draft, pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip


_conv_verify_op = torch.library.custom_op(
    "hybridmeta::conv_verify_update",
    _conv_verify_impl,
    mutates_args=("out", "inter", "errors"),
)

_conv_verify_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- public op


def conv_verify_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cache_indices: torch.Tensor,
    inter: torch.Tensor,
    activation: str | None = "silu",
    parent: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Causal-conv1d verify update: ``T`` draft tokens per row, the window after each kept.

    For each live row ``b`` (a valid slot ``s = cache_indices[b]``) and live column
    ``t < num_draft[b]``::

        prev = conv_state[s] if root(t) else inter[b, parent(t)]    # [conv_dim, k-1]
        win  = [prev[:, 0], ..., prev[:, k-2], x[b, t]]              # [conv_dim, k]
        out[b, t] = act(sum_j win[:, j] * weight[:, j] + bias)
        inter[b, t] = win[:, 1:]                                     # in the pool's dtype

    ``parent(t)`` is ``parent[b, t]`` (``-1``: a root) or, without ``parent``, ``t - 1``
    (a chain). The pool is only read. Pad rows (``cache_indices[b] == pad_slot_id``) and
    columns ``t >= num_draft[b]`` read no state, write nothing to ``inter`` and get zero
    output. Invalid ids, counts and parents are handled as :func:`ssm_verify_update`
    handles them (NaN output, nothing stored, the device's error record; CPU tensors or
    debug mode: :class:`~hybridmeta.kernels.SlotIndexError` before writing).

    Parameters
    ----------
    x : torch.Tensor
        ``[bs, T, conv_dim]``, ``T >= 1``.
    conv_state : torch.Tensor
        ``[slots, conv_dim, k - 1]`` (any strides); only read.
    weight : torch.Tensor
        ``[conv_dim, k]``.
    bias : torch.Tensor, optional
        ``[conv_dim]``.
    cache_indices : torch.Tensor
        ``[bs]`` int32/int64 working slot of each row; ``pad_slot_id`` for a pad row.
    inter : torch.Tensor
        ``[bs, T, conv_dim, k - 1]`` in ``conv_state.dtype`` (any strides); receives the
        window after each live token.
    activation : {"silu", "swish", None}
        Output activation.
    parent : torch.Tensor, optional
        ``[bs, T]`` int32/int64: ``-1`` or an earlier column (see :func:`ssm_verify_update`).
    num_draft : torch.Tensor, optional
        ``[bs]`` live draft columns of each row, in ``[0, T]`` (default ``T``).
    out : torch.Tensor, optional
        ``[bs, T, conv_dim]`` in ``x.dtype``; allocated if not given.
    pad_slot_id : int
        The pad id (int32; default ``-1``).

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (the message names it), including a
        pool or ``inter`` that aliases itself. Nothing is written.
    SlotIndexError
        An invalid slot, count or parent, when they can be read without a sync or in
        debug mode. Nothing is written.
    """
    op = _OP
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{op}: `activation` must be None, 'silu' or 'swish', got {activation!r}")
    check_pad_slot_id(op, pad_slot_id)
    conv_state = check_pool(op, "conv_state", conv_state, dims="[slots, conv_dim, k - 1]")
    dev = conv_state.device
    slots, dim, wm1 = conv_state.shape
    check_slots(op, "conv_state", slots)
    x = check_tensor(op, "x", x, shape=(None, None, dim), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, T, conv_dim]")  # fmt: skip
    bs, T = x.shape[:2]
    check_rows(op, bs)
    if T < 1:
        raise ValueError(f"{op}: `x` must have at least one draft column (T >= 1), got T={T}")
    check_tensor(op, "weight", weight, shape=(dim, wm1 + 1), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[conv_dim, k]")  # fmt: skip
    check_optional(
        op, "bias", bias, shape=(dim,), dtypes=FLOAT_DTYPES, device=dev, dims="[conv_dim]"
    )
    check_tensor(op, "cache_indices", cache_indices, shape=(bs,), dtypes=INDEX_DTYPES,
                 device=dev, dims="[bs]")  # fmt: skip
    check_tensor(op, "inter", inter, shape=(bs, T, dim, wm1), dtypes=(conv_state.dtype,),
                 device=dev, dims="[bs, T, conv_dim, k - 1]")  # fmt: skip
    check_no_alias(op, "inter", inter)
    check_optional(op, "parent", parent, shape=(bs, T), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs, T]")  # fmt: skip
    check_optional(op, "num_draft", num_draft, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(op, "out", out, shape=(bs, T, dim), dtypes=(x.dtype,), device=dev,
                     dims="[bs, T, conv_dim]")  # fmt: skip
    which = resolve(op, impl, dev)
    seen = observed(conv_state)
    if is_debug() or (not seen and dev.type == "cpu"):
        check_verify_ids(op, slots, pad_slot_id, T, cache_indices, parent, num_draft)
    if out is None:
        out = torch.empty_like(x)
    errors = record_for(conv_state)
    if which == "reference":
        conv_verify_update_reference(
            x, conv_state, weight, bias, out, inter, cache_indices,
            silu=activation is not None, parent=parent, num_draft=num_draft,
            pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip
        return out
    run = torch.ops.hybridmeta.conv_verify_update if seen else _conv_verify_impl
    run(x, conv_state, weight, bias, out, inter, cache_indices, activation is not None, parent,
        num_draft, pad_slot_id, errors)  # fmt: skip
    return out


def conv_verify_update_from_metadata(
    md: Mamba2Metadata,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    inter: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """:func:`conv_verify_update` of a target-verify forward, everything it indexes by from ``md``.

    Slots ``md.mamba_cache_indices``, tree ``md.retrieve_parent_token`` (``None``: chains),
    ``T = md.draft_token_num`` (``x`` is ``[bs, T, conv_dim]``); ``inter`` is state
    storage, ``[bs, T, conv_dim, k - 1]``.

    Raises
    ------
    ValueError
        ``md`` is not a target-verify forward, or its rows or ``draft_token_num`` do not
        match ``x``; then every check of :func:`conv_verify_update`.
    """
    verify_rows("conv_verify_update_from_metadata", md, x)
    return conv_verify_update(
        x, conv_state, weight, bias, cache_indices=md.mamba_cache_indices, inter=inter,
        activation=activation, parent=md.retrieve_parent_token, out=out, impl=impl,
        pad_slot_id=pad_slot_of(md),
    )  # fmt: skip


# --------------------------------------------------------------------------- reference


def conv_verify_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    inter: torch.Tensor,
    cache_indices: torch.Tensor,
    *,
    silu: bool,
    parent: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """The pure-torch conv verify update: the kernel's contract, in place.

    Token by token through :func:`hybridmeta.kernels._math.conv_step`; writes ``out`` and
    the live ``inter[b, t]`` windows (in the pool's dtype), never the pool. Fixed shapes,
    no device-to-host reads (capturable). A row with an invalid id, count or parent
    writes nothing to ``inter``, gets NaN output and is recorded in ``errors`` (default:
    the device's record), as the kernel does.
    """
    bs, T, _ = x.shape
    slots = conv_state.shape[0]
    keys, live, n = verify_faults(slots, pad_slot_id, T, cache_indices, parent, num_draft)
    poison = torch.where(keys != NO_FAULT, float("nan"), 0.0)[:, None]
    safe = torch.where(live, cache_indices, 0)
    if slots:
        w0 = torch.where(live[:, None, None], conv_state.index_select(0, safe).float(), 0.0)
    else:
        w0 = torch.zeros(conv_state.shape[1:], device=x.device).expand(bs, -1, -1)
    rows = torch.arange(bs, device=x.device)
    after: list[torch.Tensor] = []  # fp32 copies of the stored windows per token
    for t in range(T):
        prev = w0 if t == 0 else after[t - 1]
        if parent is not None and t > 0:
            par = parent[:, t].long()
            par = torch.where((par >= 0) & (par < t), par, -1)
            from_inter = torch.stack(after, dim=1)[rows, par.clamp(min=0)]  # [bs, D, k-1]
            prev = torch.where((par >= 0)[:, None, None], from_inter, w0)
        y, new = conv_step(prev, x[:, t], weight, bias, silu=silu)
        keep = t < n
        out[:, t].copy_(torch.where(keep[:, None], y, poison).to(out.dtype))
        stored = new.to(conv_state.dtype)
        after.append(stored.float())
        inter[:, t].copy_(torch.where(keep[:, None, None], stored, inter[:, t]))
    record_(
        errors if errors is not None else record_for(conv_state), _OP, keys, pad_slot_id,
        (slots, T, T),
    )  # fmt: skip
