"""Decode attention over the slot pool's KV caches: the KV write and the attention, one launch each.

* :func:`kv_cache_write` - ``cache[slot, pos] = k / v`` for every token of every live row
  (cast to the caches' dtype); a pad row (slot ``-1``) writes nothing. One kernel writes
  both caches.
* :func:`decode_attention` - grouped-query attention of ``T`` tokens per row (decode:
  ``T = 1``; speculative verify: ``T = draft_token_num``) over the row's cache slot: token
  ``(b, t)`` attends to keys ``0 .. positions[b, t]`` of slot ``slots[b]``. A pad row
  reads nothing and outputs zeros.

Together they replace the runtime's torch decode attention (an ``index_put_`` per cache,
the mask, two einsums and the softmax: about 18 small kernels per layer and step). The
arithmetic is the runtime's (``decode_attention_reference``, the executable
specification): scores ``q . k`` in the caches' dtype, then fp32 times ``scale``; softmax
in fp32; probabilities rounded to the caches' dtype before the ``p . v`` product; fp32
accumulation, rounded to the caches' dtype, then cast to ``out``'s. The kernel computes the
softmax online (running max and sum per query head), so it rounds the unnormalised
probabilities and divides at the end: equal to the reference within rounding, not bit
for bit.

Kernel: one program per (token, KV head) walks the token's keys in ``BLOCK_N`` tiles up
to its position (a runtime bound read from ``positions``: no host read, and a new batch
size, draft length or position never compiles a new variant), with the GQA group of query
heads as one ``[BLOCK_Q, head_dim]`` tile (``BLOCK_Q = max(16, pow2(group))``, the least
``tl.dot`` takes). Index arithmetic is int64; every tensor is read at its strides. When
``B * T * kv_heads`` programs would leave the GPU idle (few rows of long context), the
keys axis is split (flash-decoding, :func:`attention_splits`, from shapes only): each
(token, KV head, split) program stores its unnormalised partial to an fp32 workspace and
``_attention_combine_kernel`` merges the splits.

Left for later (not done here):

* the ``T`` tokens of a verify row each read the row's keys: packing them into one query
  tile would read the keys once;
* the combine kernel walks its splits one after another;
* the launch configuration (``BLOCK_N`` 64, 4 warps, splits of >= 128 keys up to 512
  programs) is a rule, measured at Nemotron shapes (``benchmarks/bench_attention.py``) but
  not swept.

This module holds the two Triton kernels, their launchers, the ``torch.library`` ops, the
public functions and the pure-torch references ``*_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable, runs_interpreted
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import TL_DTYPE, cdiv, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, resolve
from hybridmeta.kernels._errors import (
    NO_FAULT,
    TAG,
    SlotIndexError,
    fault_keys,
    record_,
    record_for,
    report,
)
from hybridmeta.kernels._launch import DirectLauncher
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_index_range,
    check_pool,
    check_rows,
    check_tensor,
)

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "kv_cache_write",
    "kv_cache_write_reference",
]

_CACHE_DIMS = "[slots + 1, max_len, kv_heads, head_dim]"
_WRITE_TAG: tl.constexpr = tl.constexpr(TAG["kv_cache_write"])
_ATTN_TAG: tl.constexpr = tl.constexpr(TAG["decode_attention"])


@triton.jit  # type: ignore[arg-type]  # a helper returning values; the stub types kernels
def _token_check(
    i_b: tl.tensor,
    slot: tl.tensor,
    pos: tl.tensor,
    err_ptr: tl.tensor,
    n_slots: tl.tensor,
    max_len: tl.tensor,
    REPORT: tl.tensor,
    TAG_: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """``(live, bad)`` of one token: its row's slot in ``[0, n_slots)`` and its position in
    ``[0, max_len)``; ``bad``: neither a pad row (slot ``-1``) nor that (recorded when
    ``REPORT``)."""
    slot_ok = (slot >= 0) & (slot < n_slots)
    pos_ok = (pos >= 0) & (pos < max_len)
    bad = ((slot != -1) & (slot_ok == 0)) | (slot_ok & (pos_ok == 0))
    if bad & REPORT:
        report(
            err_ptr, TAG_, i_b, tl.where(slot_ok, 1, 0), tl.where(slot_ok, pos, slot), -1,
            tl.where(slot_ok, max_len, n_slots),
        )  # fmt: skip
    return slot_ok & pos_ok, bad


# --------------------------------------------------------------------------- kernels


# T and the positions' row stride (T when dense) are runtime values: a new draft length
# must not compile a new variant (Triton specialises integers equal to 1).
@triton.jit(do_not_specialize=["T", "stride_p_b", "n_slots", "max_len"])
def _kv_cache_write_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    kc_ptr: tl.tensor,
    vc_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    pos_ptr: tl.tensor,
    err_ptr: tl.tensor,
    T: tl.tensor,
    n_slots: tl.tensor,
    max_len: tl.tensor,
    kv_heads: tl.tensor,
    stride_k_b: tl.tensor,
    stride_k_t: tl.tensor,
    stride_k_h: tl.tensor,
    stride_k_d: tl.tensor,
    stride_v_b: tl.tensor,
    stride_v_t: tl.tensor,
    stride_v_h: tl.tensor,
    stride_v_d: tl.tensor,
    stride_kc_s: tl.tensor,
    stride_kc_m: tl.tensor,
    stride_kc_h: tl.tensor,
    stride_kc_d: tl.tensor,
    stride_vc_s: tl.tensor,
    stride_vc_m: tl.tensor,
    stride_vc_h: tl.tensor,
    stride_vc_d: tl.tensor,
    stride_p_b: tl.tensor,
    stride_p_t: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    i_bt = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1).to(tl.int64)
    i_b = i_bt // T
    i_t = i_bt - i_b * T
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    pos = tl.load(pos_ptr + i_b * stride_p_b + i_t * stride_p_t).to(tl.int64)
    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [H] KV heads of this program
    o_d = tl.arange(0, BLOCK_D)  # [D]
    # A pad row, or a slot / position outside the caches (recorded): bound 0, so nothing
    # is read or stored (not even the scratch row). The row predicate enters the mask as a
    # bound on the offsets (interpreter notes).
    live, _bad = _token_check(i_b, slot, pos, err_ptr, n_slots, max_len, i_hb == 0, _WRITE_TAG)
    lim_h = tl.where(live, kv_heads, 0)
    m = (o_h < lim_h)[:, None] & (o_d < HEAD_DIM)[None, :]  # [H, D]
    b_k = tl.load(
        k_ptr
        + i_b * stride_k_b
        + i_t * stride_k_t
        + o_h[:, None] * stride_k_h
        + o_d[None, :] * stride_k_d,
        mask=m,
    )
    b_v = tl.load(
        v_ptr
        + i_b * stride_v_b
        + i_t * stride_v_t
        + o_h[:, None] * stride_v_h
        + o_d[None, :] * stride_v_d,
        mask=m,
    )
    tl.store(
        kc_ptr
        + slot * stride_kc_s
        + pos * stride_kc_m
        + o_h[:, None] * stride_kc_h
        + o_d[None, :] * stride_kc_d,
        b_k.to(kc_ptr.dtype.element_ty),
        mask=m,
    )
    tl.store(
        vc_ptr
        + slot * stride_vc_s
        + pos * stride_vc_m
        + o_h[:, None] * stride_vc_h
        + o_d[None, :] * stride_vc_d,
        b_v.to(vc_ptr.dtype.element_ty),
        mask=m,
    )


@triton.jit(do_not_specialize=["T", "stride_p_b", "split_keys", "n_slots", "max_len"])
def _decode_attention_kernel(
    q_ptr: tl.tensor,
    kc_ptr: tl.tensor,
    vc_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    pos_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_o_ptr: tl.tensor,
    part_ml_ptr: tl.tensor,
    err_ptr: tl.tensor,
    T: tl.tensor,
    n_slots: tl.tensor,
    max_len: tl.tensor,
    scale: tl.tensor,
    split_keys: tl.tensor,
    stride_q_b: tl.tensor,
    stride_q_t: tl.tensor,
    stride_q_h: tl.tensor,
    stride_q_d: tl.tensor,
    stride_kc_s: tl.tensor,
    stride_kc_m: tl.tensor,
    stride_kc_h: tl.tensor,
    stride_kc_d: tl.tensor,
    stride_vc_s: tl.tensor,
    stride_vc_m: tl.tensor,
    stride_vc_h: tl.tensor,
    stride_vc_d: tl.tensor,
    stride_p_b: tl.tensor,
    stride_p_t: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_t: tl.tensor,
    stride_o_c: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
) -> None:
    i_bt = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)  # KV head
    i_b = i_bt // T
    i_t = i_bt - i_b * T
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    pos = tl.load(pos_ptr + i_b * stride_p_b + i_t * stride_p_t).to(tl.int64)
    # Keys 0 .. pos of the slot; a pad row walks none (and reads no K/V), nor does a token
    # whose slot or position lies outside the caches (its output is NaN, it is recorded).
    report_here = i_h == 0
    if SPLIT:
        report_here = report_here & (tl.program_id(2) == 0)
    live, bad = _token_check(i_b, slot, pos, err_ptr, n_slots, max_len, report_here, _ATTN_TAG)
    n_keys = tl.where(live, pos + 1, 0)
    if SPLIT:
        # Flash-decoding: this program takes keys [k_lo, k_hi) of the token (split i_s of
        # a grid sized from the caches' max_len, so a split past the position walks none)
        # and stores its unnormalised partial result for _attention_combine_kernel.
        i_s = tl.program_id(2).to(tl.int64)
        k_lo = i_s * split_keys
        k_hi = tl.minimum(k_lo + split_keys, n_keys)
    else:
        k_lo = 0  # type: ignore[assignment]
        k_hi = n_keys

    o_q = tl.arange(0, BLOCK_Q)  # [Q] query head within the group
    o_n = tl.arange(0, BLOCK_N)  # [N]
    o_d = tl.arange(0, BLOCK_D)  # [D]
    m_q = o_q < GROUP
    m_d = o_d < HEAD_DIM
    h_q = i_h * GROUP + o_q  # [Q] query heads of KV head i_h (consecutive, as in GQA)
    b_q = tl.load(
        q_ptr
        + i_b * stride_q_b
        + i_t * stride_q_t
        + h_q[:, None] * stride_q_h
        + o_d[None, :] * stride_q_d,
        mask=m_q[:, None] & m_d[None, :],
        other=0.0,
    )  # [Q, D] in the caches' dtype
    if DOT_F32:
        b_q = b_q.to(tl.float32)
    kc_row = kc_ptr + slot * stride_kc_s + i_h * stride_kc_h
    vc_row = vc_ptr + slot * stride_vc_s + i_h * stride_vc_h

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_Q], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for start in tl.range(k_lo, k_hi, BLOCK_N):
        keys = start + o_n  # [N] int64
        m_n = keys < k_hi
        # Keys past the position are never read (masked loads).
        b_kt = tl.load(
            kc_row + keys[None, :] * stride_kc_m + o_d[:, None] * stride_kc_d,
            mask=m_d[:, None] & m_n[None, :],
            other=0.0,
        )  # [D, N]: K transposed
        if DOT_F32:
            b_s = tl.dot(b_q, b_kt.to(tl.float32), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, b_kt)  # [Q, N] fp32 accumulate
        # The reference's scores are the product in the caches' dtype, then fp32 * scale.
        b_s = b_s.to(kc_ptr.dtype.element_ty).to(tl.float32) * scale
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        # Every tile holds at least one key (start < n_keys), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
        alpha = tl.exp(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        b_p = tl.exp(b_s - m_new[:, None])  # [Q, N]; 0 for masked keys
        l_i = l_i * alpha + tl.sum(b_p, axis=1)
        b_v = tl.load(
            vc_row + keys[:, None] * stride_vc_m + o_d[None, :] * stride_vc_d,
            mask=m_n[:, None] & m_d[None, :],
            other=0.0,
        )  # [N, D]
        # The reference rounds the probabilities to v's dtype before the product.
        b_pr = b_p.to(vc_ptr.dtype.element_ty)
        if DOT_F32:
            b_pv = tl.dot(b_pr.to(tl.float32), b_v.to(tl.float32), input_precision="ieee")
        else:
            b_pv = tl.dot(b_pr, b_v)
        acc = acc * alpha[:, None] + b_pv
        m_i = m_new
    if SPLIT:
        # partials: [B*T, KVH, splits, BLOCK_Q, BLOCK_D] (acc) and [.., 2, BLOCK_Q] (m, l);
        # a split without keys stores m = -inf, l = 0, acc = 0
        i_part = (i_bt * tl.num_programs(1) + i_h) * tl.num_programs(2) + i_s
        # A bad token's partials are NaN: the combine's weighted sum keeps NaN.
        tl.store(
            part_o_ptr + i_part * (BLOCK_Q * BLOCK_D) + o_q[:, None] * BLOCK_D + o_d[None, :],
            tl.where(bad, float("nan"), acc),
        )
        tl.store(part_ml_ptr + i_part * (2 * BLOCK_Q) + o_q, m_i)
        tl.store(part_ml_ptr + i_part * (2 * BLOCK_Q) + BLOCK_Q + o_q, l_i)
    else:
        # A pad row: no key, l_i = 0 and acc = 0 -> zeros (defined output); a bad token NaN.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        b_o = tl.where(bad, float("nan"), acc / l_safe[:, None]).to(vc_ptr.dtype.element_ty)
        tl.store(
            out_ptr
            + i_b * stride_o_b
            + i_t * stride_o_t
            + (h_q[:, None] * HEAD_DIM + o_d[None, :]) * stride_o_c,
            b_o.to(out_ptr.dtype.element_ty),
            mask=m_q[:, None] & m_d[None, :],
        )


@triton.jit(do_not_specialize=["T", "n_splits"])
def _attention_combine_kernel(
    part_o_ptr: tl.tensor,
    part_ml_ptr: tl.tensor,
    out_ptr: tl.tensor,
    T: tl.tensor,
    n_splits: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_t: tl.tensor,
    stride_o_c: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE_DTYPE: tl.constexpr,
) -> None:
    """Merge the splits of one (token, KV head): ``sum_s e^(m_s - M) acc_s / sum_s
    e^(m_s - M) l_s`` with ``M = max_s m_s``; a token without keys (a pad row) gets zeros."""
    i_bt = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_b = i_bt // T
    i_t = i_bt - i_b * T
    o_q = tl.arange(0, BLOCK_Q)
    o_d = tl.arange(0, BLOCK_D)
    base = (i_bt * tl.num_programs(1) + i_h) * n_splits
    m_tot = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_tot = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for i_s in tl.range(0, n_splits):
        p = base + i_s
        m_s = tl.load(part_ml_ptr + p * (2 * BLOCK_Q) + o_q)
        l_s = tl.load(part_ml_ptr + p * (2 * BLOCK_Q) + BLOCK_Q + o_q)
        a_s = tl.load(part_o_ptr + p * (BLOCK_Q * BLOCK_D) + o_q[:, None] * BLOCK_D + o_d[None, :])
        m_new = tl.maximum(m_tot, m_s)
        # a side without keys (m = -inf) scales by exp(-inf) = 0; while both are -inf the
        # reference point is 0, so no -inf - -inf (NaN) is formed
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        f_old = tl.exp(m_tot - m_ref)
        f_new = tl.exp(m_s - m_ref)
        l_tot = l_tot * f_old + l_s * f_new
        acc = acc * f_old[:, None] + a_s * f_new[:, None]
        m_tot = m_new
    l_safe = tl.where(l_tot > 0.0, l_tot, 1.0)
    b_o = (acc / l_safe[:, None]).to(CACHE_DTYPE)  # type: ignore[arg-type]
    h_q = i_h * GROUP + o_q
    tl.store(
        out_ptr
        + i_b * stride_o_b
        + i_t * stride_o_t
        + (h_q[:, None] * HEAD_DIM + o_d[None, :]) * stride_o_c,
        b_o.to(out_ptr.dtype.element_ty),
        mask=(o_q < GROUP)[:, None] & (o_d < HEAD_DIM)[None, :],
    )


_WRITE_LAUNCHER = DirectLauncher(_kv_cache_write_kernel)
_ATTN_LAUNCHER = DirectLauncher(_decode_attention_kernel)
_COMBINE_LAUNCHER = DirectLauncher(_attention_combine_kernel)
#: Programs a split launch aims at (about four per SM of an H100 / H200)
_SPLIT_TARGET_PROGRAMS = 512
#: Fewest keys a split takes (below it a split's fixed cost dominates)
_MIN_SPLIT_KEYS = 128


def _write_blocks(kv_heads: int, head_dim: int) -> tuple[int, int]:
    # At most 1024 elements a program (8 KV heads of 128: one program a token).
    block_d = pow2_ceil(head_dim)
    block_h = min(pow2_ceil(kv_heads), max(1, 1024 // block_d))
    return block_h, block_d


def attention_splits(rows: int, kv_heads: int, max_len: int, block_n: int) -> tuple[int, int]:
    """``(splits, keys per split)`` of the keys axis, from shapes only (a captured graph
    keeps its grid whatever the positions): one split when ``rows * kv_heads`` programs
    already fill the GPU, else up to ``512 / (rows * kv_heads)`` splits of at least 128
    keys (a multiple of ``block_n``). Flash-decoding: one row of long context otherwise
    runs on ``kv_heads`` programs."""
    n = min(_SPLIT_TARGET_PROGRAMS // max(1, rows * kv_heads), cdiv(max_len, _MIN_SPLIT_KEYS))
    if n <= 1:
        return 1, max_len
    keys = cdiv(cdiv(max_len, n), block_n) * block_n
    return cdiv(max_len, keys), keys


def attention_block_n(head_dim: int) -> int:
    """Keys per tile of the attention kernel: 64 up to head_dim 128, else 32 (>= 16 for
    ``tl.dot``)."""
    return 64 if head_dim <= 128 else 32


def launch_kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch the KV write on validated tensors (no allocation, no checks, any strides).

    A token whose row's slot is neither ``-1`` nor in ``[0, S)``, or a live row's token
    whose position lies outside ``[0, max_len)``, writes nothing and is recorded in
    ``errors`` (default: the device's record)."""
    B, T, kv_heads, head_dim = k.shape
    if B == 0 or T == 0:
        return
    err = errors if errors is not None else record_for(k_cache)
    n_slots, max_len = k_cache.shape[0] - 1, k_cache.shape[1]
    block_h, block_d = _write_blocks(kv_heads, head_dim)
    strides = (*k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *positions.stride())
    ptrs = (
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        positions.data_ptr(), err.data_ptr(),
    )  # fmt: skip
    aligned = all(p & 15 == 0 for p in ptrs)
    dev = k_cache.get_device()
    key = (
        dev, T, kv_heads, head_dim, strides, k.dtype, v.dtype, k_cache.dtype, v_cache.dtype,
        slots.dtype, positions.dtype,
    )  # fmt: skip
    var = _WRITE_LAUNCHER.lookup(key, aligned)
    _WRITE_LAUNCHER.launch(
        var, (B * T, cdiv(kv_heads, block_h), 1), key, dev, aligned,
        lambda: (*ptrs, T, n_slots, max_len, kv_heads, *strides, head_dim, block_h, block_d),
        lambda g: launchable(_kv_cache_write_kernel, k.device)[g](
            k, v, k_cache, v_cache, slots, positions, err, T, n_slots, max_len, kv_heads,
            *strides,
            HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        ),
    )  # fmt: skip


def launch_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    block_n: int | None = None,
    splits: tuple[int, int] | None = None,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch the attention on validated tensors (no allocation, no checks, any strides).

    ``block_n``: keys per tile, a power of two >= 16 (default :func:`attention_block_n`).
    ``splits``: ``(splits, keys per split)`` of the keys axis (default
    :func:`attention_splits`; ``keys * splits >= max_len``, keys a multiple of ``block_n``).
    A token whose row's slot is neither ``-1`` nor in ``[0, S)``, or a live row's token
    whose position lies outside ``[0, max_len)``, reads nothing, gets NaN output and is
    recorded in ``errors`` (default: the device's record).
    """
    B, T, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if B == 0 or T == 0:
        return
    err = errors if errors is not None else record_for(k_cache)
    n_slots, max_len = k_cache.shape[0] - 1, k_cache.shape[1]
    group = heads // kv_heads
    bn = attention_block_n(head_dim) if block_n is None else block_n
    block_q = max(16, pow2_ceil(group))
    block_d = max(16, pow2_ceil(head_dim))
    # bf16 / fp16 caches on a GPU: tensor-core products of the cache dtype, fp32
    # accumulate. fp32 caches: exact fp32 products (tl.dot would take TF32 inputs by
    # default); so under the interpreter too, whose bf16 tl.dot is wrong (it multiplies
    # the raw bits), with the operands widened exactly.
    dot_f32 = k_cache.dtype == torch.float32 or runs_interpreted(_decode_attention_kernel, q.device)
    strides = (
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *positions.stride(), *out.stride(),
    )  # fmt: skip
    ptrs = (
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        positions.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    n_split, split_keys = (
        splits if splits is not None else attention_splits(B * T, kv_heads, k_cache.shape[1], bn)
    )
    split = n_split > 1
    part_o = part_ml = None
    if split:
        # fp32 partials of every (token, KV head, split): at most ~512 programs' worth
        part_o = torch.empty(B * T * kv_heads * n_split * block_q * block_d, dtype=torch.float32,
                             device=q.device)  # fmt: skip
        part_ml = torch.empty(B * T * kv_heads * n_split * 2 * block_q, dtype=torch.float32,
                              device=q.device)  # fmt: skip
    all_ptrs = (*ptrs, None if part_o is None else part_o.data_ptr(),
                None if part_ml is None else part_ml.data_ptr(), err.data_ptr())  # fmt: skip
    aligned = all(p is None or p & 15 == 0 for p in all_ptrs)
    dev = q.get_device()
    key = (
        dev, T, group, head_dim, bn, dot_f32, split, strides, q.dtype, k_cache.dtype,
        v_cache.dtype, slots.dtype, positions.dtype, out.dtype,
    )  # fmt: skip
    var = _ATTN_LAUNCHER.lookup(key, aligned)
    _ATTN_LAUNCHER.launch(
        var, (B * T, kv_heads, n_split), key, dev, aligned,
        lambda: (*all_ptrs, T, n_slots, max_len, scale, split_keys, *strides, group, head_dim,
                 dot_f32, block_q, bn, block_d, split),
        lambda g: launchable(_decode_attention_kernel, q.device)[g](
            q, k_cache, v_cache, slots, positions, out, part_o, part_ml, err, T, n_slots,
            max_len, scale, split_keys, *strides, GROUP=group, HEAD_DIM=head_dim, DOT_F32=dot_f32, BLOCK_Q=block_q,
            BLOCK_N=bn, BLOCK_D=block_d, SPLIT=split, num_warps=4,
        ),
    )  # fmt: skip
    if not split:
        return
    assert part_o is not None and part_ml is not None
    o_strides = out.stride()
    cache_dtype = TL_DTYPE[v_cache.dtype]
    cptrs = (part_o.data_ptr(), part_ml.data_ptr(), out.data_ptr())
    caligned = all(p & 15 == 0 for p in cptrs)
    ckey = (dev, T, group, head_dim, o_strides, v_cache.dtype, out.dtype)
    cvar = _COMBINE_LAUNCHER.lookup(ckey, caligned)
    _COMBINE_LAUNCHER.launch(
        cvar, (B * T, kv_heads, 1), ckey, dev, caligned,
        lambda: (*cptrs, T, n_split, *o_strides, group, head_dim, block_q, block_d, cache_dtype),
        lambda g: launchable(_attention_combine_kernel, out.device)[g](
            part_o, part_ml, out, T, n_split, *o_strides, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_Q=block_q, BLOCK_D=block_d, CACHE_DTYPE=cache_dtype, num_warps=4,
        ),
    )  # fmt: skip


# --------------------------------------------------------------------------- custom ops


def _kv_cache_write_impl(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    launch_kv_cache_write(k, v, k_cache, v_cache, slots, positions, errors)


_kv_cache_write_op = torch.library.custom_op(
    "hybridmeta::kv_cache_write",
    _kv_cache_write_impl,
    mutates_args=("k_cache", "v_cache", "errors"),
)

_kv_cache_write_op.register_fake(no_output_fake)


def _decode_attention_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    launch_decode_attention(q, k_cache, v_cache, slots, positions, scale, out, errors=errors)


_decode_attention_op = torch.library.custom_op(
    "hybridmeta::decode_attention", _decode_attention_impl, mutates_args=("out", "errors")
)

_decode_attention_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- public ops


def _check_caches(op: str, k_cache: object, v_cache: object) -> torch.Tensor:
    """The caches: ``[S + 1, M, KVH, hd]`` of one float dtype, one shape, one device."""
    kc = check_pool(op, "k_cache", k_cache, dims=_CACHE_DIMS)
    if kc.shape[0] < 1:
        raise ValueError(
            f"{op}: `k_cache` must hold at least its scratch row, got {list(kc.shape)}"
        )
    check_tensor(op, "v_cache", v_cache, shape=kc.shape, dtypes=(kc.dtype,), device=kc.device,
                 dims=_CACHE_DIMS)  # fmt: skip
    return kc


def _check_rows(
    op: str, slots: object, positions: object, B: int, T: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    s = check_tensor(
        op, "slots", slots, shape=(B,), dtypes=INDEX_DTYPES, device=dev, dims="[batch]"
    )
    p = check_tensor(op, "positions", positions, shape=(B, T), dtypes=INDEX_DTYPES, device=dev,
                     dims="[batch, tokens]")  # fmt: skip
    return s, p


def _check_values(
    op: str, slots: torch.Tensor, positions: torch.Tensor, num_slots: int, max_len: int
) -> None:
    """The value rules (they read the tensors: debug mode, or CPU tensors outside capture).

    ``slots`` in ``[-1, S)``; each live row's positions in ``[0, M)``.
    """
    try:
        check_index_range(op, "slots", slots, num_slots)
    except ValueError as e:
        row = int(((slots != -1) & ((slots < 0) | (slots >= num_slots))).nonzero()[0, 0])
        raise SlotIndexError(str(e), op=op, field="slots", row=row, value=int(slots[row])) from None
    bad = (slots >= 0)[:, None] & ((positions < 0) | (positions >= max_len))
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        value = int(positions[b, t])
        raise SlotIndexError(
            f"{op}: `positions` of a live row must be in [0, {max_len}) (the caches' max_len); "
            f"row {b} token {t} holds {value}",
            op=op, field="positions", row=b, value=value,
        )  # fmt: skip


def _reads_values(t: torch.Tensor) -> bool:
    """Whether the value rules are checked: in debug mode, and on CPU tensors whenever
    nothing observes the call (a graph capture or fake tensors must not read values)."""
    return is_debug() or (t.device.type == "cpu" and not observed(t))


def kv_cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    *,
    impl: Impl | None = None,
) -> None:
    """Store each token's K and V at its position in its row's cache slot, in place.

    For every live row ``b`` (``slots[b] >= 0``) and token ``t``::

        k_cache[slots[b], positions[b, t]] = k[b, t]      # cast to the caches' dtype
        v_cache[slots[b], positions[b, t]] = v[b, t]

    A pad row (``slots[b] == -1``) writes nothing, not even the scratch row.

    Parameters
    ----------
    k, v : torch.Tensor
        ``[B, T, kv_heads, head_dim]``, float dtypes (any strides).
    k_cache, v_cache : torch.Tensor
        ``[S + 1, max_len, kv_heads, head_dim]``, one float dtype (any strides); row ``S``
        is the pool's scratch row. Updated in place.
    slots : torch.Tensor
        ``[B]`` int32/int64 working slot of each row in ``[0, S)``; ``-1``: a pad row.
    positions : torch.Tensor
        ``[B, T]`` int32/int64 position of each token, in ``[0, max_len)`` for live rows.
        Written cells must be distinct.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (the message names it). The value
        rules (slot and position ranges) read the tensors: they are checked for CPU
        tensors (outside a graph capture) and in debug mode. Nothing is written.
    """
    op = "kv_cache_write"
    kc = _check_caches(op, k_cache, v_cache)
    dev = kc.device
    _, max_len, kv_heads, head_dim = kc.shape
    k = check_tensor(op, "k", k, shape=(None, None, kv_heads, head_dim), dtypes=FLOAT_DTYPES,
                     device=dev, dims="[batch, tokens, kv_heads, head_dim]")  # fmt: skip
    B, T = k.shape[:2]
    check_tensor(op, "v", v, shape=(B, T, kv_heads, head_dim), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[batch, tokens, kv_heads, head_dim]")  # fmt: skip
    _check_rows(op, slots, positions, B, T, dev)
    check_rows(op, B)
    which = resolve(op, impl, dev)
    if _reads_values(slots):
        _check_values(op, slots, positions, kc.shape[0] - 1, max_len)
    errors = record_for(kc)
    if which == "reference":
        kv_cache_write_reference(k, v, k_cache, v_cache, slots, positions, errors=errors)
        return
    run = torch.ops.hybridmeta.kv_cache_write if observed(k_cache) else _kv_cache_write_impl
    run(k, v, k_cache, v_cache, slots, positions, errors)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """Grouped-query attention of ``T`` tokens per row over the row's cache slot.

    Token ``(b, t)`` of a live row attends to keys ``0 .. positions[b, t]`` (inclusive) of
    slot ``slots[b]``; query head ``h`` reads KV head ``h // (Hq // kv_heads)``::

        s   = fp32(q[b, t, h] . k_cache[slot, j, g]) * scale       # product in the cache dtype
        p   = softmax_j(s)  (fp32), rounded to the caches' dtype
        out[b, t, h * hd : (h + 1) * hd] = sum_j p[j] * v_cache[slot, j, g]   # fp32 accumulate

    (:func:`decode_attention_reference` states it exactly). Cache cells past a token's
    position are never read (they may hold anything, NaN included). A pad row
    (``slots[b] == -1``) reads nothing and outputs zeros.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, T, Hq, head_dim]`` in the caches' dtype (any strides); ``Hq`` a multiple of
        ``kv_heads``.
    k_cache, v_cache : torch.Tensor
        ``[S + 1, max_len, kv_heads, head_dim]``, one float dtype (any strides); only read.
    slots : torch.Tensor
        ``[B]`` int32/int64 working slot of each row in ``[0, S)``; ``-1``: a pad row.
    positions : torch.Tensor
        ``[B, T]`` int32/int64 position of each token, in ``[0, max_len)`` for live rows.
    scale : float
        Score scale (``head_dim ** -0.5`` in the model).
    out : torch.Tensor, optional
        ``[B, T, Hq * head_dim]``, any float dtype (any strides); default: a new tensor in
        ``q``'s dtype.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (the message names it); the value
        rules (slot and position ranges) are checked for CPU tensors (outside a graph
        capture) and in debug mode. Nothing is written.
    """
    op = "decode_attention"
    kc = _check_caches(op, k_cache, v_cache)
    dev = kc.device
    _, max_len, kv_heads, head_dim = kc.shape
    q = check_tensor(op, "q", q, shape=(None, None, None, head_dim), dtypes=(kc.dtype,),
                     device=dev, dims="[batch, tokens, heads, head_dim]")  # fmt: skip
    B, T, heads = q.shape[:3]
    if heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"{op}: `q` heads={heads} must be a positive multiple of the caches' "
            f"kv_heads={kv_heads} (grouped-query attention)"
        )
    _check_rows(op, slots, positions, B, T, dev)
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"{op}: `scale` must be a real number, got {type(scale).__name__}")
    if out is not None:
        check_tensor(op, "out", out, shape=(B, T, heads * head_dim), dtypes=FLOAT_DTYPES,
                     device=dev, dims="[batch, tokens, heads * head_dim]")  # fmt: skip
    check_rows(op, B)
    which = resolve(op, impl, dev)
    if _reads_values(slots):
        _check_values(op, slots, positions, kc.shape[0] - 1, max_len)
    errors = record_for(kc)
    if which == "reference":
        res = decode_attention_reference(
            q, k_cache, v_cache, slots, positions, float(scale), errors=errors
        )
        if out is None:
            return res
        out.copy_(res)
        return out
    if out is None:
        out = torch.empty(B, T, heads * head_dim, dtype=q.dtype, device=dev)
    run = torch.ops.hybridmeta.decode_attention if observed(q) else _decode_attention_impl
    run(q, k_cache, v_cache, slots, positions, float(scale), out, errors)
    return out


# --------------------------------------------------------------------------- references


def kv_cache_write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    *,
    errors: torch.Tensor | None = None,
) -> None:
    """The pure-torch KV write, in place: the runtime's ``index_put_`` for live rows.

    Fixed shapes, no device-to-host read (capturable). A pad row's tokens, and a token
    whose slot or position lies outside the caches (recorded in ``errors``, default: the
    device's record, as the kernel does), are pointed at cell ``[S, 0]`` of the scratch
    row with that cell's own value, so every cache cell keeps its bits unless a live token
    writes it.
    """
    scratch = k_cache.shape[0] - 1
    keys, live = attention_faults(slots, positions, scratch, k_cache.shape[1])
    token_slot = torch.where(live, slots.long()[:, None], scratch)
    token_pos = torch.where(live, positions.long(), 0)
    for cache, x in ((k_cache, k), (v_cache, v)):
        values = torch.where(live[:, :, None, None], x.to(cache.dtype), cache[scratch, 0])
        cache.index_put_((token_slot, token_pos), values)
    record_(
        errors if errors is not None else record_for(k_cache), "kv_cache_write", keys, -1,
        (scratch, k_cache.shape[1]),
    )  # fmt: skip


def attention_faults(
    slots: torch.Tensor, positions: torch.Tensor, num_slots: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, live)``: per-row fault keys (the slot, else the row's first position outside
    ``[0, max_len)``) and the ``[B, T]`` tokens that read / write the caches (no sync)."""
    s = slots.long()
    slot_ok = (s >= 0) & (s < num_slots)
    pos = positions.long()
    pos_ok = (pos >= 0) & (pos < max_len)  # [B, T]
    bad_pos = slot_ok[:, None] & ~pos_ok
    T = pos.shape[1]
    first = torch.where(bad_pos, torch.arange(T, device=pos.device)[None, :], T).amin(1)
    value = pos.gather(1, first.clamp(max=max(T - 1, 0))[:, None])[:, 0] if T else s
    keys = fault_keys(
        [((s != -1) & ~slot_ok, 0, s), (bad_pos.any(1) if T else slot_ok & ~slot_ok, 1, value)]
    )
    return keys, slot_ok[:, None] & pos_ok


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    errors: torch.Tensor | None = None,
) -> torch.Tensor:
    """The runtime's torch decode attention, exactly, for live rows; zeros for pad rows;
    NaN for a token whose slot or position lies outside the caches (recorded in ``errors``,
    default: the device's record, as the kernel does).

    Returns a new ``[B, T, Hq * head_dim]`` tensor in the caches' dtype. One step is added
    to the runtime's code: the values past a row's last position are zeroed before the
    ``p . v`` product, so that stale cells (NaN, inf) stay unread as in the kernel (their
    probabilities are exactly 0, so for finite caches this changes no value). Fixed shapes,
    no device-to-host read (capturable).
    """
    B, T, heads, head_dim = q.shape
    max_len, kv_heads = k_cache.shape[1:3]
    if T == 0:
        return torch.zeros(B, T, heads * head_dim, dtype=q.dtype, device=q.device)
    keys_f, live_t = attention_faults(slots, positions, k_cache.shape[0] - 1, max_len)
    record_(
        errors if errors is not None else record_for(k_cache), "decode_attention", keys_f, -1,
        (k_cache.shape[0] - 1, max_len),
    )  # fmt: skip
    safe = torch.where(live_t.any(1), slots.long(), 0)
    k = k_cache.index_select(0, safe)  # [B, M, KVH, hd]
    v = v_cache.index_select(0, safe)
    keys = torch.arange(max_len, device=q.device)
    mask = keys[None, None, :] <= positions[:, :, None]  # [B, T, M]
    seen = keys[None, :] <= positions.amax(dim=1)[:, None]  # [B, M] keys any token reads
    v = torch.where(seen[:, :, None, None], v, 0.0)
    qg = q.reshape(B, T, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("rlgqd,rmgd->rgqlm", qg, k).float() * scale
    scores = scores.masked_fill(~mask[:, None, None], -torch.inf)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.einsum("rgqlm,rmgd->rlgqd", probs, v).reshape(B, T, heads * head_dim)
    # Select, never multiply: a pad row's scores are all masked (NaN after the softmax).
    bad = (keys_f != NO_FAULT)[:, None] & ~live_t  # the tokens that read nothing, not pad
    poison = torch.where(bad, float("nan"), 0.0)[:, :, None].to(out.dtype)
    return torch.where(live_t[:, :, None], out, poison)
