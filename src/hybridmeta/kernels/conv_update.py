"""Causal-conv1d decode update: Triton kernel, launcher, op, reference.

One program handles ``BLOCK_C`` channels of ``ROWS`` rows: it forms each row's window
``[state[:, 0..k-2], x]``, writes the convolved (and optionally SiLU-activated) output and
shifts the window left by one into the row's conv-state slot. Several rows per program
share one load of the weights and put several rows' loads in flight before the first
store. Pad rows (slot ``pad_slot_id``) read and write no state and write zeros to the
output, never uninitialised memory; a row with an invalid slot (neither the pad id nor in
``[0, slots)``) reads and writes no state, gets NaN output and sets the device's error
record (:mod:`hybridmeta.kernels._errors`). Works for any non-aliasing strides of the
conv-state pool.

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
from hybridmeta.kernels._errors import (
    NO_FAULT,
    TAG,
    fault_keys,
    host_check,
    record_,
    record_for,
    report,
    valid_slot,
)
from hybridmeta.kernels._launch import DirectLauncher
from hybridmeta.kernels._math import conv_step, scatter_rows_
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_disjoint_writes,
    check_optional,
    check_pad_slot_id,
    check_pool,
    check_rows,
    check_slots,
    check_tensor,
    decode_rows,
    pad_slot_of,
    slot_kinds,
)
from hybridmeta.model import Mamba2Metadata

__all__ = [
    "causal_conv1d_update",
    "causal_conv1d_update_from_metadata",
    "causal_conv1d_update_reference",
    "launch_conv_update",
]


_OP = "causal_conv1d_update"
_TAG: tl.constexpr = tl.constexpr(TAG[_OP])


@triton.jit(noinline=True)
def _poison_rows(
    out_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    err_ptr: tl.tensor,
    bs: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    dim: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_c: tl.tensor,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> None:
    """A program of several rows: its bad rows (an id neither the pad id nor a slot), after
    its stores: their NaN output over the zeros it stored (after a barrier: other threads
    stored those), and the least one's fault reported by the first channel block. Called
    only when the program has a bad row; its ids are read again here, so nothing of the
    check but one flag is live on the hot path."""
    i_c = tl.program_id(0)
    o_b = (tl.program_id(1) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [R]
    m_b = o_b < bs
    slot = tl.load(slot_ptr + o_b, mask=m_b, other=pad_id).to(tl.int64)
    bad = (slot != pad_id) & (valid_slot(slot, pad_id, n_slots) == 0)  # [R]
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [C]
    tl.debug_barrier()
    tl.store(
        out_ptr + o_b[:, None] * stride_o_b + o_c[None, :] * stride_o_c,
        tl.full([ROWS, BLOCK_C], float("nan"), out_ptr.dtype.element_ty),
        mask=bad[:, None] & (o_c < dim)[None, :],
    )
    if i_c == 0:  # one report per bad row: the least one
        r_bad = tl.min(tl.where(bad, o_b, bs), axis=0)
        v_bad = tl.sum(tl.where(o_b == r_bad, slot, 0), axis=0)
        report(err_ptr, _TAG, r_bad, 0, v_bad, pad_id, n_slots)


@triton.jit(do_not_specialize=["bs", "pad_id", "n_slots"])
def _conv_update_kernel(
    x_ptr: tl.tensor,
    conv_state_ptr: tl.tensor,
    weight_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    out_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    err_ptr: tl.tensor,
    bs: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
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
    # What the check leaves on the hot path was measured on the H200 against the kernel
    # without checks (docs/perf_notes.md, "Round 3, fifth GPU session"): 0.94-1.00x.
    if ROWS < 2:  # one row a program
        # One row a program (i_r < bs): its id a scalar, judged as one. A non-live row's
        # output comes from the output select (NaN for a bad id), its report from the
        # first channel block. Judged from a [1] tile instead, the flag is a reduction that
        # Triton feeds from a second load of the id; that and a cold block after the stores
        # cost 1-3% at 16-512 rows.
        s_id = tl.load(slot_ptr + i_r).to(tl.int64)
        any_bad = (s_id != pad_id) & (valid_slot(s_id, pad_id, n_slots) == 0)
        slot = tl.full([ROWS], 0, tl.int64) + s_id  # [R]
        fill = tl.where(s_id != pad_id, float("nan"), 0.0)  # a non-live row's output
    else:
        # Several rows: only a flag of the check crosses the kernel. A bad row stores zeros
        # here as a pad row does; _poison_rows stores its NaN after the stores (a NaN select
        # of [R, C] and the report in this body cost 2-3.5% at 1-64 rows). Rows past bs
        # read as pad rows.
        slot = tl.load(slot_ptr + o_b, mask=m_b, other=pad_id).to(tl.int64)  # [R]
        bad = (slot != pad_id) & (valid_slot(slot, pad_id, n_slots) == 0)  # [R]
        any_bad = tl.max(bad.to(tl.int32), axis=0) != 0
        fill = 0.0  # type: ignore[assignment]  # a constant (the tile case is a tensor)
    ok = valid_slot(slot, pad_id, n_slots)  # [R] live rows
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [C]
    o_k = tl.arange(0, BLOCK_K)  # [K]
    m_c = o_c < dim
    m_rc = m_b[:, None] & m_c[None, :]  # [R, C] rows < bs
    m_live = ok[:, None] & m_c[None, :]  # [R, C] live rows
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
    b_o = tl.where(m_live, b_o, fill)
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
    if ROWS < 2:
        # One comparison, not `a & b` of scalars (the interpreter mistypes those).
        if tl.where(any_bad, i_c, 1) == 0:
            report(err_ptr, _TAG, i_r, 0, s_id, pad_id, n_slots)
    else:
        if any_bad:
            _poison_rows(
                out_ptr, slot_ptr, err_ptr, bs, pad_id, n_slots, dim, stride_o_b, stride_o_c,
                ROWS, BLOCK_C,
            )  # fmt: skip


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
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
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
        ``[bs]`` slot of each row; ``pad_slot_id`` marks a pad row, any other id outside
        ``[0, slots)`` is a fault (no state, NaN output, recorded in ``errors``).
    silu : bool
        Apply SiLU to the output.
    config : ConvLaunchConfig, optional
        Channels and rows per program, warps; default from ``conv_dim``.
    pad_slot_id : int
        The pad id (int32).
    errors : torch.Tensor, optional
        The error record (default: the device's).
    """
    bs, dim = x.shape
    width = weight.shape[1]
    if bs == 0:
        return
    err = errors if errors is not None else record_for(conv_state)
    n_slots = conv_state.shape[0]
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
        err.data_ptr(),
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
        lambda: (*ptrs, bs, pad_slot_id, n_slots, *ints, *flags),
        lambda g: launchable(_conv_update_kernel, x.device)[g](
            x, conv_state, weight, bias, out, slot_indices, err, bs, pad_slot_id, n_slots, *ints,
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
    pad_slot_id: int,
    errors: torch.Tensor,
) -> None:
    # The launcher makes the tensors' device current itself (only when it is not).
    launch_conv_update(
        x, conv_state, weight, bias, out, slot_indices, silu=silu, pad_slot_id=pad_slot_id,
        errors=errors,
    )  # fmt: skip


_conv_update_op = torch.library.custom_op(
    "hybridmeta::causal_conv1d_update",
    _conv_update_impl,
    mutates_args=("conv_state", "out", "errors"),
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
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """The pure-torch conv update: the kernel's contract, in place, on validated tensors.

    Fixed shapes, no device-to-host reads (capturable like the kernel); fp32 math, the new
    window cast to the pool's dtype and the output to ``out``'s. A row with an invalid slot
    reads and writes no state, gets NaN output and is recorded in ``errors`` (default: the
    device's record), as the kernel does.
    """
    slots = conv_state.shape[0]
    keys, live = conv_faults(slots, pad_slot_id, slot_indices)
    safe = torch.where(live, slot_indices, 0)
    if slots:
        window = torch.where(live[:, None, None], conv_state.index_select(0, safe).float(), 0.0)
    else:
        window = torch.zeros(conv_state.shape[1:], device=x.device).expand(x.shape[0], -1, -1)
    y, new = conv_step(window, x, weight, bias, silu=silu)
    poison = torch.where(keys != NO_FAULT, float("nan"), 0.0)[:, None]
    out.copy_(torch.where(live[:, None], y, poison).to(out.dtype))
    scatter_rows_(conv_state, 0, slot_indices, new, live)
    record_(errors if errors is not None else record_for(conv_state), _OP, keys, pad_slot_id, slots)


def conv_faults(
    slots: int, pad: int, idx: torch.Tensor, field: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, live)``: the rows' fault keys and the rows with a valid slot (no sync)."""
    pad_rows, ok = slot_kinds(idx, slots, pad)
    return fault_keys([(~pad_rows & ~ok, field, idx)]), ok


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
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Causal-conv1d decode update over a conv-state pool, in place.

    For each live row ``b`` with a valid slot ``s = cache_indices[b]``::

        win = [conv_state[s, :, 0], ..., conv_state[s, :, k-2], x[b]]    # [conv_dim, k]
        out[b] = act(sum_j win[:, j] * weight[:, j] + bias)
        conv_state[s] = win[:, 1:]

    A valid slot is ``0 <= s < slots`` and ``s != pad_slot_id``. Pad rows
    (``cache_indices[b] == pad_slot_id``) read and write no state and get zero output. A
    row holding any other id reads and writes no state, gets NaN output, and the fault goes
    to the device's error record (:func:`hybridmeta.kernels.check_errors`); with CPU index
    tensors (outside a graph capture) or in debug mode the op raises
    :class:`~hybridmeta.kernels.SlotIndexError` instead, before writing.

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
        ``[bs]`` int32/int64 slot of each row; ``pad_slot_id`` for a pad row.
    activation : {"silu", "swish", None}
        Output activation.
    out : torch.Tensor, optional
        ``[bs, conv_dim]`` in ``x.dtype``; allocated if not given.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).
    pad_slot_id : int
        The pad id (int32; default ``-1``).

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above, including a pool that aliases itself.
    SlotIndexError
        An invalid slot, when the ids can be read without a sync (CPU tensors outside a
        graph capture) or in debug mode (which also refuses two rows writing one slot).
        Nothing is written.
    """
    op = _OP
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{op}: `activation` must be None, 'silu' or 'swish', got {activation!r}")
    check_pad_slot_id(op, pad_slot_id)
    conv_state = check_pool(op, "conv_state", conv_state, dims="[slots, conv_dim, k - 1]")
    dev = conv_state.device
    slots, dim, wm1 = conv_state.shape
    check_slots(op, "conv_state", slots)
    x = check_tensor(
        op, "x", x, shape=(None, dim), dtypes=FLOAT_DTYPES, device=dev, dims="[bs, conv_dim]"
    )
    bs = x.shape[0]
    check_rows(op, bs)
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
    seen = observed(conv_state)
    if is_debug() or (not seen and dev.type == "cpu"):
        keys, live = conv_faults(slots, pad_slot_id, cache_indices)
        host_check(op, keys, pad_slot_id, slots)
        if is_debug():
            check_disjoint_writes(op, [("cache_indices", cache_indices, live)], None)
    if out is None:
        out = torch.empty_like(x)
    silu = activation is not None
    errors = record_for(conv_state)
    if which == "reference":
        causal_conv1d_update_reference(
            x, conv_state, weight, bias, out, cache_indices, silu=silu, pad_slot_id=pad_slot_id,
            errors=errors,
        )  # fmt: skip
        return out
    run = torch.ops.hybridmeta.causal_conv1d_update if seen else _conv_update_impl
    run(x, conv_state, weight, bias, out, cache_indices, silu, pad_slot_id, errors)
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
    """:func:`causal_conv1d_update` of the decode rows of ``md`` (their working slots; the
    pad id the metadata's declared null slot)."""
    rows = decode_rows("causal_conv1d_update_from_metadata", md, x.shape[0])
    return causal_conv1d_update(
        x, conv_state, weight, bias, cache_indices=md.mamba_cache_indices[rows],
        activation=activation, out=out, impl=impl, pad_slot_id=pad_slot_of(md),
    )  # fmt: skip
