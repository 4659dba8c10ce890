"""Speculative-decoding SSM verify update: ``T`` draft tokens per row, chains and trees.

For each live row the kernel runs the Mamba2 single-token update once per draft token,
starting from the row's working slot, and stores the state after every token into a
per-row intermediate buffer ``inter[b, t]``. The working slot itself is never written:
:mod:`hybridmeta.kernels.spec_commit` copies the state of the last accepted token back
once the draft has been judged.

Chains and trees: with a parent array (``retrieve_parent_token`` convention, ``-1`` for a
root) token ``t`` starts from the state after token ``parent[b, t]``, a root from the
working slot; without one token ``t`` starts from token ``t - 1``. The state is rounded to
the pool's dtype after every token, exactly as ``T`` sequential single-token updates
through the pool would round it, so a chain and the same path through a tree give the
same bits whether the parent state came from registers or from the buffer.

This module holds the Triton kernel, its launcher, the ``torch.library`` op, the public
function :func:`ssm_verify_update`, its metadata entry :func:`ssm_verify_update_from_metadata`
(slots, tree and draft length from the verify forward's ``Mamba2Metadata``) and the
pure-torch :func:`ssm_verify_update_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import SsmLaunchConfig, cdiv, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, on_device, resolve
from hybridmeta.kernels._errors import (
    NO_FAULT,
    TAG,
    SlotIndexError,
    fault_key,
    fault_keys,
    least_fault,
    record_,
    record_for,
    report_key_inline,
    valid_slot,
)
from hybridmeta.kernels._math import discretize, ssm_step
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    NO_DT_LIMIT,
    check_dt_limit,
    check_no_alias,
    check_optional,
    check_pad_slot_id,
    check_pool,
    check_rows,
    check_slot_contiguous,
    check_slots,
    check_tensor,
    pad_slot_of,
    slot_kinds,
    verify_rows,
)
from hybridmeta.model import Mamba2Metadata

__all__ = [
    "launch_ssm_verify",
    "ssm_verify_launch_config",
    "ssm_verify_update",
    "ssm_verify_update_from_metadata",
    "ssm_verify_update_reference",
]


def ssm_verify_launch_config(headdim: int, dstate: int) -> SsmLaunchConfig:
    """Pick the verify tile: 32 state elements per thread of one warp, whatever the dtype.

    Unlike the single-token update (4 KiB of state per tile), the verify runs ``T`` updates
    on the tile it holds, so per-token work per thread, not bytes per tile, sets the pace.
    The H200 sweep (``benchmarks/bench_spec.py``, docs/spec_decode.md) at Nano-9B-v2 shapes
    put 8 headdim rows x 128 dstate on one warp on top for both dtypes: bf16 state 81% of
    the copy ceiling against 71% with the decode rule's 16 rows (T = 4, bs = 64); fp32
    87.4% (the same tile as the decode rule).
    """
    rows = max(1, 1024 // max(dstate, 1))
    block_p = min(1 << (rows.bit_length() - 1), 1 << max(headdim - 1, 0).bit_length())
    return SsmLaunchConfig(block_p=max(block_p, 1), num_warps=1)


_OP = "ssm_verify_update"
_TAG: tl.constexpr = tl.constexpr(TAG[_OP])


@triton.jit  # type: ignore[arg-type]  # a helper returning values; the stub types kernels
def verify_row_check(
    i_b: tl.tensor,
    src: tl.tensor,
    ndraft_ptr: tl.tensor,
    parent_ptr: tl.tensor,
    T: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    stride_par_b: tl.tensor,
    stride_par_t: tl.tensor,
    HAS_PARENT: tl.constexpr,
    HAS_NDRAFT: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """A verify row's ids judged (per-row scalars; shared by the SSM and conv verify).

    Returns ``(live, bad, n_live, key, bound)``: the row reads its working slot (``src``
    valid, its live count in ``[0, T]``, every live column's parent ``-1`` or an earlier
    column), it holds an invalid id (NaN output, nothing stored), its live columns (``0``
    unless ``live``), and the fault's :func:`fault_key` and bound, which one program of the
    row reports after its stores: a report here, before the row's loads, would serialise
    them behind it. The SSM verify uses only the first three on its hot path and calls this
    again in its cold branch for the key; the conv verify carries the key.
    """
    src_ok = valid_slot(src, pad_id, n_slots)
    bad_s = (src != pad_id) & (src_ok == 0)
    T64 = T.to(tl.int64)
    if HAS_NDRAFT:
        n_live = tl.load(ndraft_ptr + i_b).to(tl.int64)
        bad_n = src_ok & ((n_live < 0) | (n_live > T64))
    else:
        n_live = T64
        bad_n = bad_s & (bad_s == 0)
    bad_p = bad_s & (bad_s == 0)
    v_p = src * 0
    if HAS_PARENT:
        # Every live column's parent, before anything is stored: a bad one poisons the row.
        for t in tl.range(0, T):
            par = tl.load(parent_ptr + i_b * stride_par_b + t * stride_par_t).to(tl.int64)
            here = src_ok & (bad_n == 0) & (t < n_live) & ((par < -1) | (par >= t))
            v_p = tl.where(here & (bad_p == 0), par, v_p)
            bad_p = bad_p | here
    bad = bad_s | bad_n | bad_p
    key = fault_key(
        i_b, tl.where(bad_s, 0, tl.where(bad_n, 1, 2)),
        tl.where(bad_s, src, tl.where(bad_n, n_live, v_p)),
    )  # fmt: skip
    live = src_ok & (bad == 0)
    return live, bad, tl.where(live, n_live, 0), key, tl.where(bad_s, n_slots, T64)


# T and the parent array's row stride (T when dense) are runtime values: a new draft
# length must not compile a new variant (Triton specialises integers equal to 1).
@triton.jit(do_not_specialize=["T", "stride_par_b", "pad_id", "n_slots"])
def _ssm_verify_kernel(
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
    inter_ptr: tl.tensor,
    src_ptr: tl.tensor,
    parent_ptr: tl.tensor,
    ndraft_ptr: tl.tensor,
    err_ptr: tl.tensor,
    dt_min: tl.tensor,
    dt_max: tl.tensor,
    T: tl.tensor,
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
    stride_x_t: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_t: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_t: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_t: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_t: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_t: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    stride_i_b: tl.tensor,
    stride_i_t: tl.tensor,
    stride_par_b: tl.tensor,
    stride_par_t: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_PARENT: tl.constexpr,
    HAS_NDRAFT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    i_p = tl.program_id(0)
    # int64 from here on: slot * per-slot stride overflows int32 for large pools.
    i_b = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2).to(tl.int64)
    i_g = i_h // heads_per_group

    src = tl.load(src_ptr + i_b).to(tl.int64)
    # A pad row has no live column: nothing is read or stored, its output is zero; a row
    # with an invalid id neither (its output is NaN). One program of the row reports it,
    # after its stores.
    live, bad, n_live, _, _ = verify_row_check(
        i_b, src, ndraft_ptr, parent_ptr, T, pad_id, n_slots, stride_par_b, stride_par_t,
        HAS_PARENT, HAS_NDRAFT,
    )  # fmt: skip
    # Row predicates enter masks as a bound on the headdim offset (a pad row's bound is 0):
    # the Triton interpreter mistypes `block_mask & scalar_mask`.
    lim_read = tl.where(live, headdim, 0)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    o_n = tl.arange(0, BLOCK_N)  # [BN]
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_s = i_h * stride_s_h + o_p[:, None] * stride_s_p + o_n[None, :] * stride_s_n  # [BP, BN]
    # The intermediate buffer is dense within each [row, token] block: [nheads, headdim, dstate].
    o_i = (i_h * headdim + o_p[:, None]) * dstate + o_n[None, :]  # [BP, BN]
    p_inter = inter_ptr + i_b * stride_i_b
    p_work = state_ptr + src * stride_s_slot + o_s

    b_s = tl.load(p_work, mask=(o_p < lim_read)[:, None] & m_n[None, :], other=0.0).to(
        tl.float32
    )  # [BP, BN]
    b_A = tl.load(A_ptr + i_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt_bias = tl.load(dt_bias_ptr + i_h).to(tl.float32)
    if HAS_D:
        b_D = tl.load(D_ptr + i_h).to(tl.float32)

    for t in tl.range(0, T):
        if HAS_PARENT:
            par = tl.load(parent_ptr + i_b * stride_par_b + t * stride_par_t).to(tl.int64)
            # Anything but an earlier token reads as a root (memory-safe; debug mode refuses it).
            par = tl.where(par < t, par, -1)
            par = tl.maximum(par, -1)
            if par != t - 1:
                # The parent's block was stored by this program's own threads: make the
                # stores visible before reading them back.
                tl.debug_barrier()
                lim_inter = tl.where(par >= 0, lim_read, 0)
                lim_work = tl.where(par >= 0, 0, lim_read)
                b_from_inter = tl.load(
                    p_inter + tl.maximum(par, 0) * stride_i_t + o_i,
                    mask=(o_p < lim_inter)[:, None] & m_n[None, :],
                    other=0.0,
                ).to(tl.float32)
                b_from_work = tl.load(
                    p_work, mask=(o_p < lim_work)[:, None] & m_n[None, :], other=0.0
                ).to(tl.float32)
                b_s = tl.where(par >= 0, b_from_inter, b_from_work)
        b_x = tl.load(
            x_ptr + i_b * stride_x_b + t * stride_x_t + i_h * stride_x_h + o_p * stride_x_p,
            mask=m_p,
            other=0.0,
        ).to(tl.float32)  # [BP]
        b_dt = tl.load(dt_ptr + i_b * stride_dt_b + t * stride_dt_t + i_h * stride_dt_h).to(
            tl.float32
        )
        if HAS_DT_BIAS:
            b_dt += b_dt_bias
        if DT_SOFTPLUS:
            # softplus(x) equals x in fp32 above 20; the threshold also keeps exp from overflowing.
            b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
        # dt limits ((-inf, inf) when the call gives none); NaN stays NaN, as in torch.
        b_dt = tl.maximum(b_dt, dt_min, propagate_nan=tl.PropagateNan.ALL)
        b_dt = tl.minimum(b_dt, dt_max, propagate_nan=tl.PropagateNan.ALL)
        b_dA = tl.exp(b_A * b_dt)
        b_B = tl.load(
            B_ptr + i_b * stride_B_b + t * stride_B_t + i_g * stride_B_g + o_n * stride_B_n,
            mask=m_n,
            other=0.0,
        ).to(tl.float32)  # [BN]
        b_C = tl.load(
            C_ptr + i_b * stride_C_b + t * stride_C_t + i_g * stride_C_g + o_n * stride_C_n,
            mask=m_n,
            other=0.0,
        ).to(tl.float32)  # [BN]

        b_s = b_s * b_dA + (b_x * b_dt)[:, None] * b_B[None, :]  # [BP, BN]
        b_o = tl.sum(b_s * b_C[None, :], axis=1)  # [BP]
        if HAS_D:
            b_o += b_x * b_D
        if HAS_Z:
            b_z = tl.load(
                z_ptr + i_b * stride_z_b + t * stride_z_t + i_h * stride_z_h + o_p * stride_z_p,
                mask=m_p,
                other=0.0,
            ).to(tl.float32)
            b_o *= b_z * tl.sigmoid(b_z)
        # Pad rows and columns past the live count: select, never multiply (inputs may be NaN).
        b_o = tl.where(t < n_live, b_o, tl.where(bad, float("nan"), 0.0))
        tl.store(
            out_ptr + i_b * stride_o_b + t * stride_o_t + i_h * stride_o_h + o_p * stride_o_p,
            b_o.to(out_ptr.dtype.element_ty),
            mask=m_p,
        )
        b_new = b_s.to(inter_ptr.dtype.element_ty)
        lim_store = tl.where(t < n_live, headdim, 0)
        tl.store(
            p_inter + t * stride_i_t + o_i,
            b_new,
            mask=(o_p < lim_store)[:, None] & m_n[None, :],
        )
        # Carry what was stored: the next token starts from the state a sequential update
        # would read back from the pool.
        b_s = b_new.to(tl.float32)
    if bad & (i_p == 0) & (i_h == 0):
        # The fault's key worked out again from the ids, off the hot path (on the H200 the
        # same time as carrying it through the token loop); the report inlined, which is
        # what removed the bf16 verify's 3-10% (docs/perf_notes.md, "Round 3, third GPU
        # session").
        _, _, _, key, bound = verify_row_check(
            i_b, tl.load(src_ptr + i_b).to(tl.int64), ndraft_ptr, parent_ptr, T, pad_id,
            n_slots, stride_par_b, stride_par_t, HAS_PARENT, HAS_NDRAFT,
        )  # fmt: skip
        report_key_inline(err_ptr, _TAG, key, pad_id, bound)


def launch_ssm_verify(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    inter: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    parent: torch.Tensor | None,
    num_draft: torch.Tensor | None,
    dt_limit: tuple[float, float] = NO_DT_LIMIT,
    config: SsmLaunchConfig | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch the verify update on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    state : torch.Tensor
        ``[slots, nheads, headdim, dstate]`` pool; only read.
    x, z, out : torch.Tensor
        ``[bs, T, nheads, headdim]``.
    dt : torch.Tensor
        ``[bs, T, nheads]``.
    A, D, dt_bias : torch.Tensor
        ``[nheads]``.
    B, C : torch.Tensor
        ``[bs, T, ngroups, dstate]``.
    inter : torch.Tensor
        ``[bs, T, nheads, headdim, dstate]``, each ``[b, t]`` block dense; written.
    state_indices : torch.Tensor
        ``[bs]`` working slot of each row, ``pad_slot_id`` for a pad row.
    parent, num_draft : torch.Tensor or None
        ``[bs, T]`` parent token (``-1`` root) and ``[bs]`` live draft columns.
    dt_limit : tuple of float
        ``(lo, hi)`` clamp of the discretised ``dt`` (checked: ``lo <= hi``).
    config : SsmLaunchConfig, optional
        Tile shape and warps; default :func:`ssm_verify_launch_config`.
    pad_slot_id : int
        The pad id (int32).
    errors : torch.Tensor, optional
        The error record (default: the device's).
    """
    bs, T = x.shape[:2]
    n_slots, nheads, headdim, dstate = state.shape
    ngroups = B.shape[2]
    if bs == 0 or T == 0:
        return
    err = errors if errors is not None else record_for(state)
    cfg = config if config is not None else ssm_verify_launch_config(headdim, dstate)
    z_strides = z.stride() if z is not None else (0, 0, 0, 0)
    par_strides = parent.stride() if parent is not None else (0, 0)
    grid = (cdiv(headdim, cfg.block_p), bs, nheads)
    launchable(_ssm_verify_kernel, state.device)[grid](
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
        inter_ptr=inter,
        src_ptr=state_indices,
        parent_ptr=parent,
        ndraft_ptr=num_draft,
        err_ptr=err,
        dt_min=dt_limit[0],
        dt_max=dt_limit[1],
        T=T,
        pad_id=pad_slot_id,
        n_slots=n_slots,
        headdim=headdim,
        dstate=dstate,
        heads_per_group=nheads // ngroups,
        stride_s_slot=state.stride(0),
        stride_s_h=state.stride(1),
        stride_s_p=state.stride(2),
        stride_s_n=state.stride(3),
        stride_x_b=x.stride(0),
        stride_x_t=x.stride(1),
        stride_x_h=x.stride(2),
        stride_x_p=x.stride(3),
        stride_dt_b=dt.stride(0),
        stride_dt_t=dt.stride(1),
        stride_dt_h=dt.stride(2),
        stride_B_b=B.stride(0),
        stride_B_t=B.stride(1),
        stride_B_g=B.stride(2),
        stride_B_n=B.stride(3),
        stride_C_b=C.stride(0),
        stride_C_t=C.stride(1),
        stride_C_g=C.stride(2),
        stride_C_n=C.stride(3),
        stride_z_b=z_strides[0],
        stride_z_t=z_strides[1],
        stride_z_h=z_strides[2],
        stride_z_p=z_strides[3],
        stride_o_b=out.stride(0),
        stride_o_t=out.stride(1),
        stride_o_h=out.stride(2),
        stride_o_p=out.stride(3),
        stride_i_b=inter.stride(0),
        stride_i_t=inter.stride(1),
        stride_par_b=par_strides[0],
        stride_par_t=par_strides[1],
        DT_SOFTPLUS=dt_softplus,
        HAS_DT_BIAS=dt_bias is not None,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_PARENT=parent is not None,
        HAS_NDRAFT=num_draft is not None,
        BLOCK_P=cfg.block_p,
        BLOCK_N=pow2_ceil(dstate),
        num_warps=cfg.num_warps,
    )


# --------------------------------------------------------------------------- custom op


def _ssm_verify_impl(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    inter: torch.Tensor,
    state_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    parent: torch.Tensor | None,
    num_draft: torch.Tensor | None,
    dt_min: float,
    dt_max: float,
    pad_slot_id: int,
    errors: torch.Tensor,
) -> None:
    with on_device(state.device):
        launch_ssm_verify(
            state, x, dt, A, B, C, out, inter, state_indices, D=D, z=z, dt_bias=dt_bias,
            dt_softplus=dt_softplus, parent=parent, num_draft=num_draft,
            dt_limit=(dt_min, dt_max), pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip


_ssm_verify_op = torch.library.custom_op(
    "hybridmeta::ssm_verify_update", _ssm_verify_impl, mutates_args=("out", "inter", "errors")
)

_ssm_verify_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- public op


def ssm_verify_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    inter: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    parent: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
    pad_slot_id: int = -1,
) -> torch.Tensor:
    """Mamba2 SSM verify update: ``T`` draft tokens per row, the state after each kept.

    For each live row ``b`` (``state_indices[b]`` a valid slot), each live column
    ``t < num_draft[b]`` in order, and head ``h`` (group ``g = h // (nheads // ngroups)``)::

        s0   = state[state_indices[b]]                    # the working slot, never written
        prev = s0 if root(t) else inter[b, parent(t)]     # parent(t) = parent[b, t] or t - 1
        dt'  = softplus(dt[b, t, h] + dt_bias[h])         # bias / softplus optional
        dt'  = clamp(dt', *dt_limit)                      # optional
        s    = prev * exp(A[h] * dt') + dt' * x[b, t, h, :, None] * B[b, t, g, None, :]
        out[b, t] = (s @ C[b, t, g]) + D[h] * x[b, t, h]  # then * silu(z[b, t, h]) if z given
        inter[b, t] = s                                   # rounded to the state dtype

    A chain (``parent`` not given) is the tree ``parent[b, t] = t - 1``; the root of a tree
    (``parent[b, t] == -1``, ``retrieve_parent_token`` convention) starts from the working
    slot, and several roots are allowed. Pad rows (``state_indices[b] == pad_slot_id``) and
    columns ``t >= num_draft[b]`` read no state, write nothing to ``inter`` and get zero
    output. The pool is only read. A row whose working slot is neither the pad id nor
    valid (``0 <= id < slots``, ``id != pad_slot_id``), whose ``num_draft`` lies outside
    ``[0, T]``, or whose live column has a parent that is neither ``-1`` nor an earlier
    column, reads no state, writes nothing to ``inter``, gets NaN output in every column,
    and the fault goes to the device's error record
    (:func:`hybridmeta.kernels.check_errors`); with CPU index tensors (outside a graph
    capture) or in debug mode the op raises :class:`~hybridmeta.kernels.SlotIndexError`
    instead, before writing.

    Parameters
    ----------
    state : torch.Tensor
        ``[slots, nheads, headdim, dstate]``, float32 / bfloat16 / float16; only read.
    x : torch.Tensor
        ``[bs, T, nheads, headdim]``, a float dtype; ``T >= 1`` draft columns.
    dt : torch.Tensor
        ``[bs, T, nheads]``.
    A : torch.Tensor
        ``[nheads]``.
    B, C : torch.Tensor
        ``[bs, T, ngroups, dstate]``; ``nheads % ngroups == 0``.
    state_indices : torch.Tensor
        ``[bs]`` int32/int64: working slot of each row, ``pad_slot_id`` for a pad row.
    inter : torch.Tensor
        ``[bs, T, nheads, headdim, dstate]`` in ``state.dtype``, each ``[b, t]`` block dense
        (e.g. the ``[:bs, :T]`` view of a ``[max_bs, max_draft, ...]`` buffer); the state
        after each live token is written to ``inter[b, t]``, nothing else is.
    D, dt_bias : torch.Tensor, optional
        ``[nheads]``.
    z : torch.Tensor, optional
        ``[bs, T, nheads, headdim]`` gate.
    dt_softplus : bool
        Apply softplus to ``dt + dt_bias``.
    dt_limit : tuple of float, optional
        ``(lo, hi)``: clamp the discretised ``dt`` to ``[lo, hi]`` (as
        :func:`~hybridmeta.kernels.ssm_state_update`).
    parent : torch.Tensor, optional
        ``[bs, T]`` int32/int64 parent of each draft token: ``-1`` (a root, starts from the
        working slot) or an earlier column ``0 <= parent[b, t] < t`` (tokens topologically
        ordered). Default: a chain.
    num_draft : torch.Tensor, optional
        ``[bs]`` int32/int64 live draft columns of each row, in ``[0, T]`` (default ``T``).
    out : torch.Tensor, optional
        ``[bs, T, nheads, headdim]`` in ``x.dtype``; allocated if not given.
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
        On any argument that breaks the rules above (the message names it), including a
        pool or ``inter`` that aliases itself. Nothing is written.
    SlotIndexError
        An invalid id, count or parent, when they can be read without a sync (CPU tensors
        outside a graph capture) or in debug mode. Nothing is written.
    """
    op = _OP
    lim = NO_DT_LIMIT if dt_limit is None else check_dt_limit(op, dt_limit)
    check_pad_slot_id(op, pad_slot_id)
    state = check_pool(op, "state", state, dims="[slots, nheads, headdim, dstate]")
    dev = state.device
    slots, nheads, headdim, dstate = state.shape
    check_slots(op, "state", slots)
    x = check_tensor(op, "x", x, shape=(None, None, nheads, headdim), dtypes=FLOAT_DTYPES,
                     device=dev, dims="[bs, T, nheads, headdim]")  # fmt: skip
    bs, T = x.shape[:2]
    check_rows(op, bs)
    if T < 1:
        raise ValueError(f"{op}: `x` must have at least one draft column (T >= 1), got T={T}")
    check_tensor(op, "dt", dt, shape=(bs, T, nheads), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[bs, T, nheads]")  # fmt: skip
    check_tensor(op, "A", A, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    B = check_tensor(op, "B", B, shape=(bs, T, None, dstate), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, T, ngroups, dstate]")  # fmt: skip
    ngroups = B.shape[2]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"{op}: `B` ngroups={ngroups} must divide nheads={nheads}")
    check_tensor(op, "C", C, shape=(bs, T, ngroups, dstate), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[bs, T, ngroups, dstate]")  # fmt: skip
    check_optional(op, "D", D, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    check_optional(op, "dt_bias", dt_bias, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[nheads]")  # fmt: skip
    check_optional(op, "z", z, shape=(bs, T, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[bs, T, nheads, headdim]")  # fmt: skip
    check_tensor(op, "state_indices", state_indices, shape=(bs,), dtypes=INDEX_DTYPES,
                 device=dev, dims="[bs]")  # fmt: skip
    check_tensor(op, "inter", inter, shape=(bs, T, nheads, headdim, dstate), dtypes=(state.dtype,),
                 device=dev, dims="[bs, T, nheads, headdim, dstate]")  # fmt: skip
    check_slot_contiguous(op, "inter", inter, 2)
    check_no_alias(op, "inter", inter)
    check_optional(op, "parent", parent, shape=(bs, T), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs, T]")  # fmt: skip
    check_optional(op, "num_draft", num_draft, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(op, "out", out, shape=(bs, T, nheads, headdim), dtypes=(x.dtype,),
                     device=dev, dims="[bs, T, nheads, headdim]")  # fmt: skip
    which = resolve(op, impl, dev)
    seen = observed(state)
    if is_debug() or (not seen and dev.type == "cpu"):
        check_verify_ids(op, slots, pad_slot_id, T, state_indices, parent, num_draft)
    if out is None:
        out = torch.empty_like(x)
    errors = record_for(state)
    if which == "reference":
        ssm_verify_update_reference(
            state, x, dt, A, B, C, out, inter, state_indices, D=D, z=z, dt_bias=dt_bias,
            dt_softplus=dt_softplus, parent=parent, num_draft=num_draft,
            dt_limit=None if dt_limit is None else lim, pad_slot_id=pad_slot_id,
            errors=errors,
        )  # fmt: skip
        return out
    run = torch.ops.hybridmeta.ssm_verify_update if seen else _ssm_verify_impl
    run(
        state, x, dt, A, B, C, out, inter, state_indices, D, z, dt_bias, dt_softplus, parent,
        num_draft, *lim, pad_slot_id, errors,
    )  # fmt: skip
    return out


def ssm_verify_update_from_metadata(
    md: Mamba2Metadata,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    inter: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] | None = None,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """:func:`ssm_verify_update` of a target-verify forward, everything it indexes by from ``md``.

    The working slots are ``md.mamba_cache_indices`` (pad rows ``-1``), the tree is
    ``md.retrieve_parent_token`` (``None``: chains) and ``T`` is ``md.draft_token_num``,
    which must be ``x``'s second dimension; every row of ``md`` is a verify row. Every
    draft column is live (``num_draft`` is not used: a graph captures one exact ``T`` per
    bucket). ``inter`` is state storage, like the pool: ``[bs, T, nheads, headdim, dstate]``
    (the ``[:bs, :T]`` view of the engine's intermediate-state buffer).

    Raises
    ------
    ValueError
        ``md`` is not a target-verify forward (``prepare_target_verify``), or its rows or
        ``draft_token_num`` do not match ``x``; then every check of
        :func:`ssm_verify_update`.
    """
    verify_rows("ssm_verify_update_from_metadata", md, x)
    return ssm_verify_update(
        state, x, dt, A, B, C, state_indices=md.mamba_cache_indices, inter=inter, D=D, z=z,
        dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        parent=md.retrieve_parent_token, out=out, impl=impl, pad_slot_id=pad_slot_of(md),
    )  # fmt: skip


def verify_faults(
    slots: int,
    pad: int,
    T: int,
    src: torch.Tensor,
    parent: torch.Tensor | None,
    num_draft: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify's rows judged as the kernels judge them, in torch (no sync).

    Returns ``(keys, live, n)``: per-row fault keys (fields: the working slot, the live
    count, the first bad parent of a live column), the rows that read their working slot,
    and their live columns (``0`` unless live).
    """
    src_pad, src_ok = slot_kinds(src, slots, pad)
    faults = [(~src_pad & ~src_ok, 0, src)]
    n = num_draft.long() if num_draft is not None else torch.full_like(src, T).long()
    ok_n = src_ok
    if num_draft is not None:
        bad_n = src_ok & ((n < 0) | (n > T))
        faults.append((bad_n, 1, n))
        ok_n = src_ok & ~bad_n
    if parent is not None:
        cols = torch.arange(T, device=src.device)
        par = parent.long()
        bad_c = (ok_n[:, None] & (cols[None, :] < n[:, None])) & (
            (par < -1) | (par >= cols[None, :])
        )  # [bs, T]
        first = torch.where(bad_c, cols[None, :], T).amin(1).clamp(max=T - 1)  # [bs]
        faults.append((bad_c.any(1), 2, par.gather(1, first[:, None])[:, 0]))
    keys = fault_keys(faults)
    live = src_ok & (keys == NO_FAULT)
    return keys, live, torch.where(live, n, 0)


def check_verify_ids(
    op: str,
    slots: int,
    pad: int,
    T: int,
    src: torch.Tensor,
    parent: torch.Tensor | None,
    num_draft: torch.Tensor | None,
) -> None:
    """Host check of a verify's ids (reads them: CPU tensors, or debug mode): the kernels'
    rules, the least faulty row raised as :class:`SlotIndexError` (a parent names its
    column)."""
    keys, _, _ = verify_faults(slots, pad, T, src, parent, num_draft)
    fault = least_fault(op, keys, pad, (slots, T, T))
    if fault is None:
        return
    if fault.field == "parent" and parent is not None:
        row = fault.row
        cols = [t for t, p in enumerate(parent[row].tolist()) if not -1 <= p < t]
        raise SlotIndexError(
            f"{op}: `parent` values must be -1 (a root) or an earlier column (tokens "
            f"topologically ordered); row {row} column {cols[0]} holds {fault.value} (nothing "
            "was written)",
            op=op, field="parent", row=row, value=fault.value,
        )  # fmt: skip
    raise fault.error("host")


# --------------------------------------------------------------------------- reference


def ssm_verify_update_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    inter: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    parent: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
    dt_limit: tuple[float, float] | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """The pure-torch verify update: the kernel's contract, in place, on validated tensors.

    Token by token through :func:`hybridmeta.kernels._math.ssm_step`, each token's state
    rounded to the pool's dtype as the kernel stores it; writes ``out`` and the live
    ``inter[b, t]``, never the pool. Fixed shapes, no device-to-host reads (capturable).
    A row with an invalid id, count or parent writes nothing to ``inter``, gets NaN output
    and is recorded in ``errors`` (default: the device's record), as the kernel does.
    """
    bs, T = x.shape[:2]
    slots = state.shape[0]
    keys, live, n = verify_faults(slots, pad_slot_id, T, state_indices, parent, num_draft)
    poison = torch.where(keys != NO_FAULT, float("nan"), 0.0)[:, None, None]
    safe = torch.where(live, state_indices, 0)
    if slots:
        s0 = torch.where(live[:, None, None, None], state.index_select(0, safe).float(), 0.0)
    else:
        s0 = torch.zeros(state.shape[1:], device=x.device).expand(bs, -1, -1, -1)
    rows = torch.arange(bs, device=x.device)
    dt_p = discretize(dt, dt_bias, dt_softplus, dt_limit)  # [bs, T, H]
    after: list[torch.Tensor] = []  # fp32 copies of the stored (rounded) state per token
    for t in range(T):
        prev = s0 if t == 0 else after[t - 1]
        if parent is not None and t > 0:
            par = parent[:, t].long()
            par = torch.where((par >= 0) & (par < t), par, -1)
            from_inter = torch.stack(after, dim=1)[rows, par.clamp(min=0)]  # [bs, H, P, N]
            prev = torch.where((par >= 0)[:, None, None, None], from_inter, s0)
        zt = z[:, t] if z is not None else None
        new, y = ssm_step(prev, x[:, t], dt_p[:, t], A, B[:, t], C[:, t], D, zt)
        keep = t < n  # [bs]
        out[:, t].copy_(torch.where(keep[:, None, None], y, poison).to(out.dtype))
        stored = new.to(state.dtype)
        after.append(stored.float())
        inter[:, t].copy_(torch.where(keep[:, None, None, None], stored, inter[:, t]))
    record_(
        errors if errors is not None else record_for(state), _OP, keys, pad_slot_id,
        (slots, T, T),
    )  # fmt: skip
