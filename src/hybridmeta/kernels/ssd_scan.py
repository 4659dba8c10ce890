"""Chunked SSD scan (Mamba2 prefill) over the flattened variable-length batch.

Two implementations of one contract, :func:`ssd_chunked_scan` (the op call's ``impl``
picks one): the Triton kernels, and the vectorised pure-torch reference
:func:`ssd_chunked_scan_reference`. Both read the plan from the forward's
``Mamba2Metadata`` (``md.mixed.chunks``, ``md.mixed.track``, ``md.prefill_slots``).

**The reference.** No Python loop over rows or chunks, no device-to-host sync. The
flattened prefill tokens are cut into *logical* chunks (a new one at every physical chunk
boundary of the global grid and at every row start, see :mod:`hybridmeta.chunks`); each
logical chunk is padded to ``chunk_size`` tokens with ``dt = 0`` (decay 1, no input), so:

1. intra-chunk outputs are a masked ``[L, L]`` attention-like product per chunk;
2. each chunk's own state contribution ``S_c`` and total decay ``a_c`` follow;
3. the state entering each chunk is an inclusive scan of the affine maps
   ``s -> a_c * s + S_c``, with the map of a row's first chunk replaced by the constant
   ``a_c * h0 + S_c`` (``h0`` the row's initial state or zero): ``log2(num_chunks)``
   vectorised doubling steps (Hillis-Steele);
4. outputs add the entering state's contribution; row final states are written to the
   rows' working slots.

All arithmetic is fp32; outputs take ``x``'s dtype, the pool keeps its own.

**The Triton scan.** Three kernels over the logical chunks of the global grid, so the ``[NL, H, L, L]`` decay
and score tensors of the torch version are never materialised:

1. ``_chunk_state_kernel``: per (chunk, head, P block), the chunk's own contribution to
   the state at its end, ``S_c = sum_j exp(Acum_last - Acum_j) dt_j x_j B_j^T``;
2. ``_state_passing_kernel``: per (head, block of P*N), a sequential pass over the chunks:
   ``state_in = h0`` (or zero) at a row's first chunk, else the previous ``state_out``;
   ``state_out = exp(Acum_last) state_in + S_c``;
3. ``_chunk_scan_kernel``: per (chunk, head, M block, P block), the outputs
   ``y_i = exp(Acum_i) C_i . state_in + sum_{j<=i} (C_i . B_j) exp(Acum_i - Acum_j) dt_j x_j
   + D x_i``, tiled over ``j`` up to the diagonal.

The padded per-chunk ``dt`` and ``Acum`` (``[NL, H, L]``, small) and the off-grid
recomputation (a few chunks) stay in torch. With bf16 activations on the GPU, products of
two activations (``C . B``) take bf16 tensor-core operands (exact: the activations are
bf16) and products with an fp32 operand (decayed scores, states) take 3-pass tf32
(``tf32x3``, about fp32 accuracy): rounding those to bf16, as mamba_ssm does, measured
up to 0.49 absolute error on a 150-token row against the oracle (bf16 tolerance
``5e-2 + 1e-2 |y|``). Otherwise every product is exact fp32 (``ieee``), which is also what
the interpreter runs.

**The op.** Both implementations run inside the ``torch.library`` op
``hybridmeta::ssd_chunked_scan`` (the plan's tensors and the layer's parameters as
arguments, the pool declared mutated, a fake that gives the outputs' shapes from the
plan's), so ``torch.compile`` sees one opaque op and never specialises on the plan's host
values (chunk counts, the doubling steps); the public function wraps the op's tensors into
:class:`SSDScanOutput` after it. Without an observer (no ``torch.compile``, dispatch mode
or tensor subclass) the implementation is called directly.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable, runs_interpreted
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import cdiv, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, observed, resolve
from hybridmeta.kernels._errors import NO_FAULT, host_check, record_, record_for
from hybridmeta.kernels._math import SSMParams, index_copy_rows_, process_dt
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    check_pool,
    check_slots,
    check_tensor,
    pad_slot_of,
    prefill_slot_faults,
)
from hybridmeta.model import ChunkPlan, Mamba2Metadata, MixedMetadata

_OP = "ssd_chunked_scan"


@attrs.frozen
class _SlotGuard:
    """The prefill rows' working slots judged (``prefill_slot_faults``, no sync): fault
    keys, the pad id, slots safe to index with, the rows that read an initial state, the
    rows that write their final state and the rows poisoned (an invalid slot: their
    initial state is NaN, they write nothing)."""

    keys: torch.Tensor
    pad: int
    safe: torch.Tensor
    has_init: torch.Tensor
    write: torch.Tensor
    bad: torch.Tensor

    @staticmethod
    def of(plan: ScanPlan, ssm_state: torch.Tensor) -> _SlotGuard:
        slots, pad = plan.slots, plan.pad
        keys, read, write = prefill_slot_faults(ssm_state.shape[0], pad, slots)
        return _SlotGuard(
            keys=keys, pad=pad, safe=torch.where(read, slots, 0),
            has_init=plan.has_initial_states & read, write=write, bad=keys != NO_FAULT,
        )  # fmt: skip


__all__ = [
    "SSDScanOutput",
    "ssd_chunked_scan",
    "ssd_chunked_scan_reference",
]


class SSDScanOutput(NamedTuple):
    """What the scan returns besides the state written to the pool (a named tuple:
    ``torch.compile`` builds it).

    Attributes
    ----------
    y : torch.Tensor
        ``[T, H, P]`` outputs, ``x``'s dtype.
    final_states : torch.Tensor
        ``[num_prefills, H, P, N]`` fp32, also written to the rows' working slots.
    tracked_h : torch.Tensor
        ``[n_h, H, P, N]`` fp32 states at the extend track plan's on-grid boundaries
        (``md.mixed.track.h_chunk``).
    recomputed : torch.Tensor
        ``[n_rc, H, P, N]`` fp32 states at the plan's off-grid boundaries (``recompute_*``).
    chunk_states : torch.Tensor or None
        ``[num_physical_chunks, H, P, N]`` fp32 state after every physical chunk of the
        global grid, when asked for (``return_chunk_states=True``).
    """

    y: torch.Tensor
    final_states: torch.Tensor
    tracked_h: torch.Tensor
    recomputed: torch.Tensor
    chunk_states: torch.Tensor | None


class ScanPlan(NamedTuple):
    """What the scan reads from the forward's metadata: the prefill rows' working slots and
    initial-state flags, the chunk plan, and the track plan's boundary chunks.

    :meth:`of` takes them from a forward's ``MixedMetadata`` and prefill slots (no copies);
    the op rebuilds one from its tensor arguments.
    """

    chunks: ChunkPlan
    slots: torch.Tensor
    has_initial_states: torch.Tensor
    h_chunk: torch.Tensor
    recompute_chunk: torch.Tensor
    recompute_len: torch.Tensor
    pad: int  # the metadata's pad slot id
    errors: torch.Tensor  # the error record faults go to

    @staticmethod
    def of(mixed: MixedMetadata, slots: torch.Tensor, pad: int, errors: torch.Tensor) -> ScanPlan:
        tr = mixed.track
        return ScanPlan(
            mixed.chunks, slots, mixed.has_initial_states, tr.h_chunk, tr.recompute_chunk,
            tr.recompute_len, pad, errors,
        )  # fmt: skip


def chunk_grid(
    dt: torch.Tensor, params: SSMParams, chunks: ChunkPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of each logical chunk padded to ``chunk_size``, their ``dt`` and ``cumsum(dt*A)``.

    Returns
    -------
    tok : torch.Tensor
        ``[NL, L]`` token index (pad positions point at token 0 and carry ``dt = 0``).
    dtc : torch.Tensor
        ``[NL, L, H]`` processed ``dt`` (fp32), zero on pad positions.
    Acum : torch.Tensor
        ``[NL, L, H]`` within-chunk cumulative ``dt * A`` (constant over the padding).
    """
    L = chunks.chunk_size
    ar = torch.arange(L, device=dt.device)
    tok = chunks.start[:, None] + ar[None, :]  # [NL, L]
    valid = ar[None, :] < chunks.length[:, None]  # [NL, L]
    tok = torch.where(valid, tok, 0)
    dtc = process_dt(dt, params)[tok] * valid[..., None].float()  # [NL, L, H]
    Acum = torch.cumsum(dtc * params.A.float().to(dt.device), dim=1)  # [NL, L, H]
    return tok, dtc, Acum


def recompute_states(
    x: torch.Tensor,
    B: torch.Tensor,
    tok: torch.Tensor,
    dtc: torch.Tensor,
    Acum: torch.Tensor,
    state_in: torch.Tensor,
    plan: ScanPlan,
) -> torch.Tensor:
    """States at the plan's off-grid boundaries: ``[n_rc, H, P, N]`` fp32.

    The state entering the boundary's logical chunk, decayed to position ``k-1``, plus the
    chunk's first ``k`` tokens: ``exp(Acum_{k-1}) s_in + sum_{j<k} exp(Acum_{k-1} - Acum_j)
    dt_j x_j B_j^T``. Only the recompute chunks are gathered.
    """
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    rep = H // G
    L = plan.chunks.chunk_size
    c_rc = plan.recompute_chunk  # [n_rc]
    n_rc = c_rc.shape[0]
    t_rc = tok.index_select(0, c_rc)  # [n_rc, L]
    d_rc = dtc.index_select(0, c_rc)  # [n_rc, L, H]
    A_rc = Acum.index_select(0, c_rc)  # [n_rc, L, H]
    last = (plan.recompute_len - 1).clamp(min=0)  # [n_rc]
    A_k = A_rc.gather(1, last[:, None, None].expand(-1, 1, H))  # [n_rc, 1, H]
    keep = torch.arange(L, device=x.device)[None, :] < plan.recompute_len[:, None]  # [n_rc, L]
    w = torch.exp(torch.where(keep[..., None], A_k - A_rc, float("-inf"))) * d_rc  # [n_rc, L, H]
    # gather, then convert: only the recompute chunks' tokens, never all T of them
    xw = x[t_rc].float() * w[..., None]  # [n_rc, L, H, P]
    S_rc = torch.einsum("rlgn,rlgqp->rgqpn", B[t_rc].float(), xw.view(n_rc, L, G, rep, P)).reshape(
        n_rc, H, P, N
    )
    s_in = state_in.index_select(0, c_rc).float()
    return torch.exp(A_k[:, 0, :])[:, :, None, None] * s_in + S_rc


def finish_scan(
    x: torch.Tensor,
    B: torch.Tensor,
    y: torch.Tensor,
    grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    *,
    plan: ScanPlan,
    ssm_state: torch.Tensor,
    return_chunk_states: bool,
) -> SSDScanOutput:
    """The end both scans share: write the rows' final states to their working slots and
    gather the tracked, recomputed and (optionally) per-physical-chunk states.

    ``grid`` is :func:`chunk_grid`'s result; ``state_in`` / ``state_out`` are
    ``[NL, H, P, N]`` fp32, the states entering and leaving every logical chunk.
    """
    final = state_out.index_select(0, plan.chunks.row_last_chunk)  # [R, H, P, N]
    guard = _SlotGuard.of(plan, ssm_state)
    # Rows with a valid slot only: a pad row writes nothing, nor does an invalid one.
    index_copy_rows_(ssm_state, plan.slots, final, guard.write)
    record_(plan.errors, _OP, guard.keys, plan.pad, ssm_state.shape[0])
    tracked_h = state_out.index_select(0, plan.h_chunk)
    if plan.recompute_chunk.shape[0]:  # host-side: most steps have no off-grid boundary
        recomputed = recompute_states(x, B, *grid, state_in, plan)
    else:
        recomputed = state_out.new_zeros(0, *state_out.shape[1:])
    chunk_states = (
        state_out.index_select(0, plan.chunks.phys_last_chunk) if return_chunk_states else None
    )
    return SSDScanOutput(
        y=y,
        final_states=final,
        tracked_h=tracked_h,
        recomputed=recomputed,
        chunk_states=chunk_states,
    )


def empty_scan(x: torch.Tensor, N: int, *, return_chunk_states: bool) -> SSDScanOutput:
    """What both scans return for a plan without prefill tokens (a decode-only batch)."""
    _, H, P = x.shape
    empty = torch.zeros(0, H, P, N, device=x.device)
    return SSDScanOutput(
        y=x.new_zeros(0, H, P),
        final_states=empty,
        tracked_h=empty,
        recomputed=empty,
        chunk_states=empty if return_chunk_states else None,
    )


def _check_scan_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    md: Mamba2Metadata,
    ssm_state: torch.Tensor,
) -> tuple[int, int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"ssd_chunked_scan: x must be [T, H, P], got shape {tuple(x.shape)}")
    T, H, P = x.shape
    if md.num_prefill_tokens != T:
        raise ValueError(
            f"ssd_chunked_scan: x has {T} tokens but the metadata has {md.num_prefill_tokens} "
            "prefill tokens (pass the prefill rows only; decode rows take the decode kernel)"
        )
    if dt.shape != (T, H):
        raise ValueError(f"ssd_chunked_scan: dt must be [T, H] = {(T, H)}, got {tuple(dt.shape)}")
    if B.dim() != 3 or B.shape[0] != T or B.shape != C.shape:
        raise ValueError(
            f"ssd_chunked_scan: B and C must be [T, G, N] with T = {T}, got "
            f"{tuple(B.shape)} and {tuple(C.shape)}"
        )
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"ssd_chunked_scan: nheads {H} is not a multiple of ngroups {G}")
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (H, P, N):
        raise ValueError(
            f"ssd_chunked_scan: ssm_state must be [slots, H, P, N] = [*, {H}, {P}, {N}], got "
            f"{tuple(ssm_state.shape)}"
        )
    check_pool(_OP, "ssm_state", ssm_state, dims="[slots, H, P, N]")
    check_slots(_OP, "ssm_state", ssm_state.shape[0])
    dev = ssm_state.device
    for name, t, shape, dims in (
        ("x", x, (T, H, P), "[T, H, P]"), ("dt", dt, (T, H), "[T, H]"),
        ("B", B, (T, G, N), "[T, G, N]"), ("C", C, (T, G, N), "[T, G, N]"),
    ):  # fmt: skip
        check_tensor(_OP, name, t, shape=shape, dtypes=FLOAT_DTYPES, device=dev, dims=dims)
    if md.prefill_slots.device != dev:
        raise ValueError(
            f"{_OP}: the metadata's slots must be on the pool's device {dev}, got "
            f"{md.prefill_slots.device}"
        )
    return H, P, G, N


def _check_params(params: object, H: int, dev: torch.device) -> None:
    """The layer's parameters: :class:`SSMParams` of ``[H]`` float tensors on ``dev``."""
    if not isinstance(params, SSMParams):
        raise TypeError(f"{_OP}: `params` must be an SSMParams, got {type(params).__name__}")
    for name in ("A", "D", "dt_bias"):
        check_tensor(_OP, f"params.{name}", getattr(params, name), shape=(H,),
                     dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")  # fmt: skip


def ssd_chunked_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    params: SSMParams,
    md: Mamba2Metadata,
    ssm_state: torch.Tensor,
    return_chunk_states: bool = False,
) -> SSDScanOutput:
    """The vectorised pure-torch SSD scan (the reference of :func:`ssd_chunked_scan`).

    No Python loop over rows or chunks, no device-to-host read (see the module docstring
    for the four steps).

    Arguments and result as :func:`ssd_chunked_scan`, already checked.
    """
    mixed = md.mixed
    if mixed is None or x.shape[0] == 0:
        return empty_scan(x, B.shape[2], return_chunk_states=return_chunk_states)
    return _reference_scan(
        x, dt, B, C, params=params,
        plan=ScanPlan.of(mixed, md.prefill_slots, pad_slot_of(md), record_for(ssm_state)),
        ssm_state=ssm_state, return_chunk_states=return_chunk_states,
    )  # fmt: skip


def _reference_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    params: SSMParams,
    plan: ScanPlan,
    ssm_state: torch.Tensor,
    return_chunk_states: bool,
) -> SSDScanOutput:
    H, P, G, N = x.shape[1], x.shape[2], B.shape[1], B.shape[2]
    chunks = plan.chunks
    dev = x.device
    L = chunks.chunk_size
    NL = chunks.num_logical
    rep = H // G

    D = params.D.float().to(dev)  # [H]
    grid = chunk_grid(dt, params, chunks)
    tok, dtc, Acum = grid
    xc = x.float()[tok]  # [NL, L, H, P]
    Bc = B.float()[tok]  # [NL, L, G, N]
    Cc = C.float()[tok]  # [NL, L, G, N]
    xdt = xc * dtc[..., None]  # [NL, L, H, P]

    # 1. intra-chunk: y_i = sum_{j<=i} (C_i . B_j) exp(Acum_i - Acum_j) dt_j x_j
    Ah = Acum.permute(0, 2, 1)  # [NL, H, L]
    seg = Ah[:, :, :, None] - Ah[:, :, None, :]  # [NL, H, L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))  # [NL, H, L, L]
    CB = torch.einsum("clgn,csgn->cgls", Cc, Bc)  # [NL, G, L, L]
    scores = CB[:, :, None] * decay.view(NL, G, rep, L, L)  # [NL, G, rep, L, L]
    y = torch.einsum("cgrls,csgrp->clgrp", scores, xdt.view(NL, L, G, rep, P))
    y = y.reshape(NL, L, H, P)

    # 2. each chunk's own contribution to the state at its end, and its total decay.
    to_end = torch.exp(Acum[:, -1:, :] - Acum)  # [NL, L, H]
    S = torch.einsum(
        "clgn,clgrp->cgrpn", Bc, (xdt * to_end[..., None]).view(NL, L, G, rep, P)
    ).reshape(NL, H, P, N)
    a = torch.exp(Acum[:, -1, :])  # [NL, H]

    # 3. initial states: pool rows gathered (zero where the row has none, or has the pad
    # id; NaN where its slot is invalid: nothing read), then the scan.
    guard = _SlotGuard.of(plan, ssm_state)
    if ssm_state.shape[0]:
        h0 = ssm_state.index_select(0, guard.safe).float()  # [R, H, P, N]
    else:
        h0 = torch.zeros(guard.safe.shape[0], H, P, N, device=dev)
    h0 = torch.where(guard.has_init[:, None, None, None], h0, 0.0)
    h0 = torch.where(guard.bad[:, None, None, None], float("nan"), h0)
    h0c = h0.index_select(0, chunks.row)  # [NL, H, P, N]
    first = chunks.first
    S = torch.where(first[:, None, None, None], S + a[:, :, None, None] * h0c, S)
    a = torch.where(first[:, None], 0.0, a)
    out = S
    d = 1
    while d < NL:  # log2(NL) steps; NL is a host int (plan shape), no sync
        out = torch.cat([out[:d], out[d:] + a[d:, :, None, None] * out[:-d]])
        a = torch.cat([a[:d], a[d:] * a[:-d]])
        d *= 2
    state_out = out  # [NL, H, P, N]
    prev = torch.cat([torch.zeros_like(state_out[:1]), state_out[:-1]])
    state_in = torch.where(first[:, None, None, None], h0c, prev)  # [NL, H, P, N]

    # 4. entering state's contribution: exp(Acum_i) C_i . state_in
    y_off = torch.einsum("clgn,cgrpn->clgrp", Cc, state_in.view(NL, G, rep, P, N))
    y = y + (y_off * torch.exp(Acum).view(NL, L, G, rep)[..., None]).reshape(NL, L, H, P)
    y = y + D[None, None, :, None] * xc
    y_tok = y[chunks.token_chunk, chunks.token_pos].to(x.dtype)  # [T, H, P]
    return finish_scan(
        x,
        B,
        y_tok,
        grid,
        state_in,
        state_out,
        plan=plan,
        ssm_state=ssm_state,
        return_chunk_states=return_chunk_states,
    )


# --------------------------------------------------------------------------- Triton


@triton.jit  # type: ignore[arg-type]  # a helper returning a block; the stub types kernels
def _dot_act(a: tl.tensor, b: tl.tensor, NATIVE_BF16: tl.constexpr) -> tl.tensor:
    # Both operands are activations: with bf16 activations they are exact in bf16, so the
    # tensor cores lose nothing (fp32 accumulate). Otherwise exact fp32.
    if NATIVE_BF16:
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return c


@triton.jit  # type: ignore[arg-type]  # a helper returning a block; the stub types kernels
def _dot_f32(a: tl.tensor, b: tl.tensor, FAST_F32: tl.constexpr) -> tl.tensor:
    # An fp32 operand (decayed scores, states): rounding it to bf16 costs about 1e-2
    # relative error on long rows, so it stays fp32: 3-pass tf32 on the tensor cores
    # (about fp32 accuracy) on the GPU, exact fp32 otherwise.
    if FAST_F32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return c


@triton.jit
def _chunk_state_kernel(
    x_ptr: tl.tensor,
    B_ptr: tl.tensor,
    dtc_ptr: tl.tensor,
    acum_ptr: tl.tensor,
    start_ptr: tl.tensor,
    len_ptr: tl.tensor,
    S_ptr: tl.tensor,
    nheads: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    chunk_size: tl.tensor,
    stride_x_t: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_B_t: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    FAST_F32: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    i_ch = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1)
    i_c = i_ch // nheads
    i_h = i_ch % nheads
    i_g = i_h // heads_per_group
    start = tl.load(start_ptr + i_c).to(tl.int64)
    n = tl.load(len_ptr + i_c).to(tl.int32)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_row = i_ch * chunk_size  # [NL, H, L] row of this (chunk, head)
    a_last = tl.load(acum_ptr + o_row + chunk_size - 1)
    b_acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, n, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n
        tok = start + o_k.to(tl.int64)
        b_a = tl.load(acum_ptr + o_row + o_k, mask=m_k, other=0.0)
        b_dt = tl.load(dtc_ptr + o_row + o_k, mask=m_k, other=0.0)
        b_w = tl.exp(a_last - b_a) * b_dt  # [BK]; zero past the chunk (dt = 0)
        p_x = x_ptr + tok[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :] * stride_x_p
        b_x = tl.load(p_x, mask=m_k[:, None] & m_p[None, :], other=0.0).to(tl.float32)
        p_b = B_ptr + tok[:, None] * stride_B_t + i_g * stride_B_g + o_n[None, :] * stride_B_n
        b_b = tl.load(p_b, mask=m_k[:, None] & m_n[None, :], other=0.0).to(tl.float32)
        b_acc += _dot_f32((b_x * b_w[:, None]).T, b_b, FAST_F32)  # [BP, BK] @ [BK, BN]
    # S is [NL, H, P, N] contiguous
    p_s = S_ptr + (i_ch * headdim + o_p[:, None]) * dstate + o_n[None, :]
    tl.store(p_s, b_acc, mask=m_p[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["num_chunks"])  # varies with the batch: one variant
def _state_passing_kernel(
    S_ptr: tl.tensor,
    acum_ptr: tl.tensor,
    first_ptr: tl.tensor,
    row_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    has_init_ptr: tl.tensor,
    bad_ptr: tl.tensor,
    pool_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    sout_ptr: tl.tensor,
    num_chunks: tl.tensor,
    nheads: tl.tensor,
    dstate: tl.tensor,
    dim: tl.tensor,
    chunk_size: tl.tensor,
    stride_pool_slot: tl.tensor,
    stride_pool_h: tl.tensor,
    stride_pool_p: tl.tensor,
    stride_pool_n: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    i_h = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    o = i_b * BLOCK + tl.arange(0, BLOCK)
    m = o < dim
    o_p = (o // dstate).to(tl.int64)
    o_n = (o % dstate).to(tl.int64)
    b_state = tl.zeros([BLOCK], dtype=tl.float32)
    for c in tl.range(0, num_chunks):
        i_ch = i_h + c * nheads  # int64 (i_h is)
        first = tl.load(first_ptr + c)
        row = tl.load(row_ptr + c)
        has = tl.load(has_init_ptr + row)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        # Scalar predicates enter the mask as a bound (the interpreter mistypes
        # `block_mask & scalar_mask`): a fresh row's slot is never read.
        lim = tl.where((first != 0) & (has != 0), dim, 0)
        p_h0 = pool_ptr + slot * stride_pool_slot + i_h * stride_pool_h
        b_h0 = tl.load(p_h0 + o_p * stride_pool_p + o_n * stride_pool_n, mask=o < lim, other=0.0)
        # A row with an invalid slot (never read: `has` is false there) starts from NaN.
        b_h0 = tl.where(tl.load(bad_ptr + row) != 0, float("nan"), b_h0.to(tl.float32))
        b_prev = tl.where(first != 0, b_h0, b_state)
        a = tl.exp(tl.load(acum_ptr + i_ch * chunk_size + chunk_size - 1))
        b_s = tl.load(S_ptr + i_ch * dim + o, mask=m, other=0.0)
        b_state = a * b_prev + b_s
        tl.store(sin_ptr + i_ch * dim + o, b_prev, mask=m)
        tl.store(sout_ptr + i_ch * dim + o, b_state, mask=m)


@triton.jit
def _chunk_scan_kernel(
    x_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    dtc_ptr: tl.tensor,
    acum_ptr: tl.tensor,
    start_ptr: tl.tensor,
    len_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    D_ptr: tl.tensor,
    y_ptr: tl.tensor,
    nheads: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    chunk_size: tl.tensor,
    num_p_blocks: tl.tensor,
    stride_x_t: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_B_t: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_t: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_y_t: tl.tensor,
    stride_y_h: tl.tensor,
    stride_y_p: tl.tensor,
    NATIVE_BF16: tl.constexpr,
    FAST_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    i_ch = tl.program_id(0).to(tl.int64)
    i_mp = tl.program_id(1)
    i_m = i_mp // num_p_blocks
    i_p = i_mp % num_p_blocks
    i_c = i_ch // nheads
    i_h = i_ch % nheads
    i_g = i_h // heads_per_group
    start = tl.load(start_ptr + i_c).to(tl.int64)
    n = tl.load(len_ptr + i_c).to(tl.int32)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_m = o_m < n
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_row = i_ch * chunk_size
    tok_m = start + o_m.to(tl.int64)

    b_am = tl.load(acum_ptr + o_row + o_m, mask=m_m, other=0.0)  # [BM]
    p_c = C_ptr + tok_m[:, None] * stride_C_t + i_g * stride_C_g + o_n[None, :] * stride_C_n
    b_c = tl.load(p_c, mask=m_m[:, None] & m_n[None, :], other=0.0)  # [BM, BN]
    # state entering the chunk, read as [BN, BP] (S_in is [NL, H, P, N] contiguous)
    p_sin = sin_ptr + (i_ch * headdim + o_p[None, :]) * dstate + o_n[:, None]
    b_sin = tl.load(p_sin, mask=m_n[:, None] & m_p[None, :], other=0.0)
    b_acc = _dot_f32(b_c, b_sin, FAST_F32) * tl.exp(b_am)[:, None]  # [BM, BP]

    hi = tl.minimum((i_m + 1) * BLOCK_M, n)
    for k0 in tl.range(0, hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < n
        tok_k = start + o_k.to(tl.int64)
        b_ak = tl.load(acum_ptr + o_row + o_k, mask=m_k, other=0.0)
        b_dt = tl.load(dtc_ptr + o_row + o_k, mask=m_k, other=0.0)
        p_b = B_ptr + tok_k[:, None] * stride_B_t + i_g * stride_B_g + o_n[None, :] * stride_B_n
        b_b = tl.load(p_b, mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
        b_cb = _dot_act(b_c, b_b.T, NATIVE_BF16)  # [BM, BK]
        causal = (o_k[None, :] <= o_m[:, None]) & m_k[None, :]
        seg = tl.where(causal, b_am[:, None] - b_ak[None, :], float("-inf"))
        b_cb = b_cb * tl.exp(seg) * b_dt[None, :]
        p_x = x_ptr + tok_k[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :] * stride_x_p
        b_x = tl.load(p_x, mask=m_k[:, None] & m_p[None, :], other=0.0)  # [BK, BP]
        b_acc += _dot_f32(b_cb, b_x, FAST_F32)

    p_xm = x_ptr + tok_m[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :] * stride_x_p
    b_xm = tl.load(p_xm, mask=m_m[:, None] & m_p[None, :], other=0.0).to(tl.float32)
    b_acc += tl.load(D_ptr + i_h) * b_xm
    p_y = y_ptr + tok_m[:, None] * stride_y_t + i_h * stride_y_h + o_p[None, :] * stride_y_p
    tl.store(p_y, b_acc.to(y_ptr.dtype.element_ty), mask=m_m[:, None] & m_p[None, :])


def _block(n: int, lo: int, hi: int) -> int:
    return min(hi, max(lo, pow2_ceil(n)))


def _ssd_chunked_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    params: SSMParams,
    plan: ScanPlan,
    ssm_state: torch.Tensor,
    return_chunk_states: bool = False,
) -> SSDScanOutput:
    """The Triton scan: the kernels write ``y`` and the per-chunk states; final states go
    to the rows' working slots in place. Arguments as :func:`ssd_chunked_scan`, checked
    (at least one prefill token)."""
    chunks = plan.chunks
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    dev = x.device
    L = chunks.chunk_size
    NL = chunks.num_logical
    grid = chunk_grid(dt, params, chunks)
    _, dtc, Acum = grid  # [NL, L, H] x2
    dtc_t = dtc.permute(0, 2, 1).contiguous()  # [NL, H, L]
    acum_t = Acum.permute(0, 2, 1).contiguous()  # [NL, H, L]
    D = params.D.float().to(dev).contiguous()
    # bf16 activations on the GPU: tensor cores (see _dot_act / _dot_f32)
    interpreted = runs_interpreted(_chunk_scan_kernel, dev)
    fast = x.dtype == torch.bfloat16 and not interpreted
    BLOCK_N = _block(N, 16, 256)
    BLOCK_P = _block(P, 16, 64)
    BLOCK_K = _block(L, 16, 64)
    BLOCK_M = _block(L, 16, 64)
    n_p = cdiv(P, BLOCK_P)

    S = torch.empty(NL, H, P, N, device=dev, dtype=torch.float32)
    launchable(_chunk_state_kernel, dev)[(NL * H, n_p)](
        x_ptr=x,
        B_ptr=B,
        dtc_ptr=dtc_t,
        acum_ptr=acum_t,
        start_ptr=chunks.start,
        len_ptr=chunks.length,
        S_ptr=S,
        nheads=H,
        headdim=P,
        dstate=N,
        heads_per_group=H // G,
        chunk_size=L,
        stride_x_t=x.stride(0),
        stride_x_h=x.stride(1),
        stride_x_p=x.stride(2),
        stride_B_t=B.stride(0),
        stride_B_g=B.stride(1),
        stride_B_n=B.stride(2),
        FAST_F32=fast,
        BLOCK_K=BLOCK_K,
        BLOCK_P=BLOCK_P,
        BLOCK_N=BLOCK_N,
    )
    state_in = torch.empty_like(S)
    state_out = torch.empty_like(S)
    guard = _SlotGuard.of(plan, ssm_state)  # the slots the kernel may read, the rows poisoned
    BLOCK = 1024 if not interpreted else 64
    launchable(_state_passing_kernel, dev)[(H, cdiv(P * N, BLOCK))](
        S_ptr=S,
        acum_ptr=acum_t,
        first_ptr=chunks.first,
        row_ptr=chunks.row,
        slot_ptr=guard.safe,
        has_init_ptr=guard.has_init,
        bad_ptr=guard.bad,
        pool_ptr=ssm_state,
        sin_ptr=state_in,
        sout_ptr=state_out,
        num_chunks=NL,
        nheads=H,
        dstate=N,
        dim=P * N,
        chunk_size=L,
        stride_pool_slot=ssm_state.stride(0),
        stride_pool_h=ssm_state.stride(1),
        stride_pool_p=ssm_state.stride(2),
        stride_pool_n=ssm_state.stride(3),
        BLOCK=BLOCK,
    )
    y = torch.empty(T, H, P, device=dev, dtype=x.dtype)
    launchable(_chunk_scan_kernel, dev)[(NL * H, cdiv(L, BLOCK_M) * n_p)](
        x_ptr=x,
        B_ptr=B,
        C_ptr=C,
        dtc_ptr=dtc_t,
        acum_ptr=acum_t,
        start_ptr=chunks.start,
        len_ptr=chunks.length,
        sin_ptr=state_in,
        D_ptr=D,
        y_ptr=y,
        nheads=H,
        headdim=P,
        dstate=N,
        heads_per_group=H // G,
        chunk_size=L,
        num_p_blocks=n_p,
        stride_x_t=x.stride(0),
        stride_x_h=x.stride(1),
        stride_x_p=x.stride(2),
        stride_B_t=B.stride(0),
        stride_B_g=B.stride(1),
        stride_B_n=B.stride(2),
        stride_C_t=C.stride(0),
        stride_C_g=C.stride(1),
        stride_C_n=C.stride(2),
        stride_y_t=y.stride(0),
        stride_y_h=y.stride(1),
        stride_y_p=y.stride(2),
        NATIVE_BF16=fast,
        FAST_F32=fast,
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K,
        BLOCK_P=BLOCK_P,
        BLOCK_N=BLOCK_N,
    )
    return finish_scan(
        x,
        B,
        y,
        grid,
        state_in,
        state_out,
        plan=plan,
        ssm_state=ssm_state,
        return_chunk_states=return_chunk_states,
    )


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    params: SSMParams,
    md: Mamba2Metadata,
    ssm_state: torch.Tensor,
    return_chunk_states: bool = False,
    impl: Impl | None = None,
) -> SSDScanOutput:
    """Mamba2 SSD prefill over the prefill rows of a planned forward.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H, P]`` prefill tokens (rows concatenated in batch order).
    dt : torch.Tensor
        ``[T, H]`` raw ``dt`` (bias and softplus applied here, per ``params``).
    B, C : torch.Tensor
        ``[T, G, N]``.
    params : SSMParams
    md : Mamba2Metadata
        The forward's metadata (from :func:`hybridmeta.planner.plan_mixed_batch`); its
        ``mixed`` part is the chunk plan, ``prefill_slots`` the rows' working slots.
    ssm_state : torch.Tensor
        ``[num_slots, H, P, N]`` state pool. Rows with an initial state read it from their
        working slot; every prefill row's final state is written back there (in place).
    return_chunk_states : bool
        Also return the state after every physical chunk of the global grid.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).

    Returns
    -------
    SSDScanOutput

    Raises
    ------
    TypeError, ValueError
        A bad argument (the message names it), including a pool of a non-float dtype, on
        another device or aliasing itself, or parameters that are not ``[H]``. Nothing is
        written.
    SlotIndexError
        A prefill slot that is neither the metadata's pad id nor in ``[0, slots)``, when the
        slots can be read without a sync (CPU tensors outside a graph capture) or in debug
        mode. Nothing is written. Otherwise (on the device) such a row reads and writes no
        state, its outputs are NaN, and the fault goes to the device's error record.
    """
    H = _check_scan_inputs(x, dt, B, C, md, ssm_state)[0]
    _check_params(params, H, ssm_state.device)
    triton_impl = resolve("ssd_chunked_scan", impl, x.device) == "triton"
    mixed = md.mixed
    if mixed is None or x.shape[0] == 0:
        return empty_scan(x, B.shape[2], return_chunk_states=return_chunk_states)
    plan = ScanPlan.of(mixed, md.prefill_slots, pad_slot_of(md), record_for(ssm_state))
    if is_debug() or (ssm_state.device.type == "cpu" and not observed(ssm_state)):
        guard = _SlotGuard.of(plan, ssm_state)
        host_check(_OP, guard.keys, guard.pad, ssm_state.shape[0])
    if not observed(ssm_state):
        run = _ssd_chunked_scan_triton if triton_impl else _reference_scan
        return run(
            x, dt, B, C, params=params, plan=plan, ssm_state=ssm_state,
            return_chunk_states=return_chunk_states,
        )  # fmt: skip
    ch = plan.chunks
    y, final, tracked_h, recomputed, chunk_states = torch.ops.hybridmeta.ssd_chunked_scan(
        x, dt, B, C, params.A, params.D, params.dt_bias, params.dt_softplus, ssm_state,
        plan.slots, plan.has_initial_states, ch.chunk_size, ch.start, ch.length, ch.row,
        ch.first, ch.token_chunk, ch.token_pos, ch.row_last_chunk, ch.phys_last_chunk,
        plan.h_chunk, plan.recompute_chunk, plan.recompute_len, return_chunk_states,
        triton_impl, plan.pad, plan.errors,
    )  # fmt: skip
    return SSDScanOutput(
        y=y,
        final_states=final,
        tracked_h=tracked_h,
        recomputed=recomputed,
        chunk_states=chunk_states if return_chunk_states else None,
    )


# --------------------------------------------------------------------------- custom op


def _ssd_scan_impl(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_softplus: bool,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    has_initial_states: torch.Tensor,
    chunk_size: int,
    start: torch.Tensor,
    length: torch.Tensor,
    row: torch.Tensor,
    first: torch.Tensor,
    token_chunk: torch.Tensor,
    token_pos: torch.Tensor,
    row_last_chunk: torch.Tensor,
    phys_last_chunk: torch.Tensor,
    h_chunk: torch.Tensor,
    recompute_chunk: torch.Tensor,
    recompute_len: torch.Tensor,
    return_chunk_states: bool,
    triton_impl: bool,
    pad: int,
    errors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan on checked arguments (at least one prefill token): ``(y, final_states,
    tracked_h, recomputed, chunk_states)``, ``chunk_states`` empty unless asked for."""
    chunks = ChunkPlan(
        chunk_size=chunk_size, start=start, length=length, row=row, first=first,
        token_chunk=token_chunk, token_pos=token_pos, row_last_chunk=row_last_chunk,
        phys_last_chunk=phys_last_chunk,
    )  # fmt: skip
    plan = ScanPlan(
        chunks, slots, has_initial_states, h_chunk, recompute_chunk, recompute_len, pad, errors
    )
    params = SSMParams(A=A, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)
    run = _ssd_chunked_scan_triton if triton_impl else _reference_scan
    res = run(
        x, dt, B, C, params=params, plan=plan, ssm_state=ssm_state,
        return_chunk_states=return_chunk_states,
    )  # fmt: skip
    states = res.chunk_states
    if states is None:
        states = res.final_states.new_zeros(0, *res.final_states.shape[1:])
    return res.y, res.final_states, res.tracked_h, res.recomputed, states


def _ssd_scan_fake(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_softplus: bool,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    has_initial_states: torch.Tensor,
    chunk_size: int,
    start: torch.Tensor,
    length: torch.Tensor,
    row: torch.Tensor,
    first: torch.Tensor,
    token_chunk: torch.Tensor,
    token_pos: torch.Tensor,
    row_last_chunk: torch.Tensor,
    phys_last_chunk: torch.Tensor,
    h_chunk: torch.Tensor,
    recompute_chunk: torch.Tensor,
    recompute_len: torch.Tensor,
    return_chunk_states: bool,
    triton_impl: bool,
    pad: int,
    errors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, H, P = x.shape
    N = B.shape[2]

    def states(n: int | torch.SymInt) -> torch.Tensor:
        return x.new_empty(n, H, P, N, dtype=torch.float32)

    n_phys = phys_last_chunk.shape[0] if return_chunk_states else 0
    return (
        x.new_empty(T, H, P), states(slots.shape[0]), states(h_chunk.shape[0]),
        states(recompute_chunk.shape[0]), states(n_phys),
    )  # fmt: skip


_ssd_scan_op = torch.library.custom_op(
    "hybridmeta::ssd_chunked_scan", _ssd_scan_impl, mutates_args=("ssm_state", "errors")
)
_ssd_scan_op.register_fake(_ssd_scan_fake)
