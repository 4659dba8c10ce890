"""Chunked SSD scan in Triton: the same plan and math as :mod:`hybridmeta.prefill.scan`.

Three kernels over the logical chunks of the global grid, so the ``[NL, H, L, L]`` decay
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
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hybridmeta.prefill.oracle import SSMParams
from hybridmeta.prefill.planner import PrefillPlan
from hybridmeta.prefill.scan import (
    SSDScanOutput,
    check_scan_inputs,
    chunk_grid,
    empty_scan,
    finish_scan,
)

__all__ = ["ssd_chunked_scan_triton"]


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


@triton.jit
def _state_passing_kernel(
    S_ptr: tl.tensor,
    acum_ptr: tl.tensor,
    first_ptr: tl.tensor,
    row_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    has_init_ptr: tl.tensor,
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
        b_prev = tl.where(first != 0, b_h0.to(tl.float32), b_state)
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _block(n: int, lo: int, hi: int) -> int:
    return min(hi, max(lo, triton.next_power_of_2(n)))


def ssd_chunked_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    params: SSMParams,
    plan: PrefillPlan,
    ssm_state: torch.Tensor,
    return_chunk_states: bool = False,
) -> SSDScanOutput:
    """Triton version of :func:`hybridmeta.prefill.ssd_chunked_scan` (same contract).

    Parameters and return value as :func:`~hybridmeta.prefill.ssd_chunked_scan`. The
    kernels write ``y`` and the per-chunk states; final states go to the rows' working
    slots in place.
    """
    H, P, G, N = check_scan_inputs(x, dt, B, C, plan, ssm_state)
    T = x.shape[0]
    dev = x.device
    L = plan.chunk_size
    NL = plan.num_logical_chunks
    if T == 0:
        return empty_scan(x, N, return_chunk_states=return_chunk_states)
    grid = chunk_grid(dt, params, plan)
    _, dtc, Acum = grid  # [NL, L, H] x2
    dtc_t = dtc.permute(0, 2, 1).contiguous()  # [NL, H, L]
    acum_t = Acum.permute(0, 2, 1).contiguous()  # [NL, H, L]
    D = params.D.float().to(dev).contiguous()
    # bf16 activations on the GPU: tensor cores (see _dot_act / _dot_f32)
    fast = x.dtype == torch.bfloat16 and not _interpreting()
    BLOCK_N = _block(N, 16, 256)
    BLOCK_P = _block(P, 16, 64)
    BLOCK_K = _block(L, 16, 64)
    BLOCK_M = _block(L, 16, 64)
    n_p = triton.cdiv(P, BLOCK_P)

    S = torch.empty(NL, H, P, N, device=dev, dtype=torch.float32)
    _chunk_state_kernel[(NL * H, n_p)](
        x_ptr=x,
        B_ptr=B,
        dtc_ptr=dtc_t,
        acum_ptr=acum_t,
        start_ptr=plan.chunk_start,
        len_ptr=plan.chunk_len,
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
    BLOCK = 1024 if not _interpreting() else 64
    _state_passing_kernel[(H, triton.cdiv(P * N, BLOCK))](
        S_ptr=S,
        acum_ptr=acum_t,
        first_ptr=plan.chunk_first,
        row_ptr=plan.chunk_row,
        slot_ptr=plan.slots,
        has_init_ptr=plan.has_initial_states,
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
    _chunk_scan_kernel[(NL * H, triton.cdiv(L, BLOCK_M) * n_p)](
        x_ptr=x,
        B_ptr=B,
        C_ptr=C,
        dtc_ptr=dtc_t,
        acum_ptr=acum_t,
        start_ptr=plan.chunk_start,
        len_ptr=plan.chunk_len,
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
