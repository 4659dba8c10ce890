"""The decode step's projections at 1 to 16 rows: weight-streaming Triton kernels.

At a handful of rows a projection reads its ``N x K`` weight once and does almost no
arithmetic. cuBLAS picks split-K tilings for most of Nemotron-Nano-9B-v2's projections at
one row (a GEMM kernel, a reduce kernel and often a memset: three launches where one
would do) and reaches 24-92% of the copy ceiling (``benchmarks/bench_gemv.py``).

* One row: the GEMV kernel gives each program ``BLOCK_N`` whole weight rows, streams them
  in ``BLOCK_K`` columns with every load issued before the products (fp32 accumulation,
  one rounding at the end), and launches ``N / BLOCK_N`` programs: many small programs,
  so the last wave is short.
* 2 to 16 rows (:data:`SKINNY_MAX_ROWS`): the skinny GEMM kernel, for the projections that
  :func:`skinny_blocks` (a rule, :data:`SKINNY_RULES`) picks: each program streams
  ``BLOCK_N`` weight rows against one 16-row tile of the input with ``tl.dot`` (fp32
  accumulation); the rows past the live ones are masked, and the row count is a runtime
  argument (a new one compiles nothing). Every other projection of more than one row
  runs ``F.linear`` (cuBLAS), whose tensor-core tilings win there.

:func:`linear` is ``F.linear``; its Triton implementation picks among the three.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridmeta._interpret import launchable, runs_interpreted
from hybridmeta.kernels._config import cdiv
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, resolve
from hybridmeta.kernels._launch import DirectLauncher
from hybridmeta.kernels._validate import FLOAT_DTYPES, check_tensor
from hybridmeta.kernels.activations import relu_square, relu_square_reference

__all__ = [
    "SKINNY_MAX_ROWS",
    "SKINNY_RULES",
    "SkinnyConfig",
    "SkinnyRule",
    "linear",
    "linear_reference",
    "skinny_blocks",
]

#: rows of the weight per program and columns per step (H200 sweep, bench_gemv.py)
BLOCK_N = 4
BLOCK_K = 512


@triton.jit
def _gemv_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    b_ptr: tl.tensor,
    y_ptr: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_w: tl.tensor,
    HAS_BIAS: tl.constexpr,
    RELU2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    o_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(
            w_ptr + o_n[:, None] * stride_w + o_k[None, :],
            mask=m_n[:, None] & m_k[None, :],
            other=0.0,
        )
        b_x = tl.load(x_ptr + o_k, mask=m_k, other=0.0)
        if RELU2:
            # the activation of the previous projection, rounded to x's dtype as the
            # separate relu_square kernel stores it (relu keeps NaN, as torch's does)
            b_xf = b_x.to(tl.float32)
            b_xf = tl.where(b_xf > 0.0, b_xf, tl.where(b_xf != b_xf, b_xf, 0.0))
            b_x = (b_xf * b_xf).to(x_ptr.dtype.element_ty)
        acc += b_w.to(tl.float32) * b_x.to(tl.float32)[None, :]
    b_y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        b_y += tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + o_n, b_y.to(y_ptr.dtype.element_ty), mask=m_n)


_LAUNCHER = DirectLauncher(_gemv_kernel)


def gemv_blocks(n: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)``: 4 x 512 (H200 sweep, bench_gemv.py), 2 x 1024 below 2,048
    outputs, where 4-row blocks leave the GPU too few programs (the 1,024-output K/V
    projections: 5.9 against 7.8 us)."""
    return (2, 1024) if n < 2048 else (BLOCK_N, BLOCK_K)


def launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    relu2: bool = False,
) -> None:
    """``out[0] = weight @ f(x[0]) (+ bias)`` on validated tensors: ``x`` ``[1, K]``,
    ``weight`` ``[N, K]`` (inner dim contiguous), ``out`` ``[1, N]`` contiguous; ``f`` is
    ``relu(.)**2`` (rounded to x's dtype) with ``relu2``, else the identity."""
    n, k = weight.shape
    if n == 0:
        return
    block_n, block_k = gemv_blocks(n)
    stride_w = weight.stride(0)
    ptrs = (x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr())  # fmt: skip
    aligned = all(p is None or p & 15 == 0 for p in ptrs)
    dev = x.get_device()
    has_bias = bias is not None
    key = (dev, n, k, stride_w, relu2, x.dtype, weight.dtype, out.dtype,
           None if bias is None else bias.dtype)  # fmt: skip
    var = _LAUNCHER.lookup(key, aligned)
    _LAUNCHER.launch(
        var, (triton.cdiv(n, block_n), 1, 1), key, dev, aligned,
        lambda: (*ptrs, n, k, stride_w, has_bias, relu2, block_n, block_k),
        lambda g: launchable(_gemv_kernel, x.device)[g](
            x, weight, bias, out, n, k, stride_w, HAS_BIAS=has_bias, RELU2=relu2,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
        ),
    )  # fmt: skip


def _gemv_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    relu2: bool,
) -> None:
    launch_gemv(x, weight, bias, out, relu2)


_gemv_op = torch.library.custom_op("hybridmeta::gemv", _gemv_impl, mutates_args=("out",))

_gemv_op.register_fake(no_output_fake)


#: Most rows of the skinny GEMM: its one input tile (``tl.dot`` takes 16 rows at least).
SKINNY_MAX_ROWS = 16


@attrs.frozen
class SkinnyConfig:
    """Tiling of the skinny GEMM: ``block_n`` weight rows a program, ``block_k`` columns a
    step, launch options; ``swap_ab`` computes ``W x^T`` (the weight tile as ``tl.dot``'s
    left operand, ``[block_n, 16]`` accumulators) instead of ``x W^T``."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False

    @property
    def name(self) -> str:
        """Short label (benchmarks): ``n32 k128 w4 s3``, ``swap`` appended."""
        tail = " swap" if self.swap_ab else ""
        return f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}{tail}"


@attrs.frozen
class SkinnyRule:
    """``config`` for calls of ``rows``, ``n`` outputs and ``k`` inputs in these inclusive
    ranges."""

    config: SkinnyConfig
    rows: tuple[int, int] = (2, SKINNY_MAX_ROWS)
    n: tuple[int, int] = (1, 2**62)
    k: tuple[int, int] = (1, 2**62)

    def matches(self, m: int, n: int, k: int) -> bool:
        return (
            self.rows[0] <= m <= self.rows[1]
            and self.n[0] <= n <= self.n[1]
            and self.k[0] <= k <= self.k[1]
        )


#: Which projections of 2..16 rows take the skinny GEMM (first match wins; none: cuBLAS).
#: From the H200 sweep (``bench_gemv.py``, ``gemv_h200_skinny.json``: every tiling against
#: cuBLAS and cuBLASLt in one run, at 2 / 4 / 8 / 16 rows): the wide projections fed by the
#: 4,480-wide hidden state win with ``W x^T`` tiles of 64 weight rows by 128 columns
#: (Nano's Mamba in_proj 22656 x 4480: 49.3-49.9 us against cuBLAS's 52.1-55.3 us, 96-97%
#: of the weight-read floor; MLP up_proj 15680 x 4480: 35.5-36.0 against 36.6-37.5 us).
#: Rows 9-15 lie between measured winners and take the same tiling. The K-heavy
#: projections (out_proj, down_proj) and the narrow attention ones stay with cuBLAS, which
#: was faster there (split-K; this kernel has none).
SKINNY_RULES: tuple[SkinnyRule, ...] = (
    SkinnyRule(
        SkinnyConfig(64, 128, 4, 3, swap_ab=True), rows=(2, 16), n=(12288, 2**62), k=(1, 5120)
    ),
)


def skinny_blocks(m: int, n: int, k: int) -> SkinnyConfig | None:
    """The skinny GEMM's tiling for ``m`` rows of an ``n x k`` projection, or ``None``
    where ``F.linear`` (cuBLAS) runs: the first of :data:`SKINNY_RULES` that matches;
    ``None`` outside 2..:data:`SKINNY_MAX_ROWS` rows."""
    if not 2 <= m <= SKINNY_MAX_ROWS:
        return None
    for rule in SKINNY_RULES:
        if rule.matches(m, n, k):
            return rule.config
    return None


@triton.jit(do_not_specialize=["M"])  # the row count varies per call: one variant
def _skinny_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    b_ptr: tl.tensor,
    y_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_x: tl.tensor,
    stride_w: tl.tensor,
    stride_y: tl.tensor,
    HAS_BIAS: tl.constexpr,
    RELU2: tl.constexpr,
    DOT_F32: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    o_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M).to(tl.int64)
    m_n = o_n < N
    m_m = o_m < M  # rows past M: never read, never written
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(
            w_ptr + o_n[:, None] * stride_w + o_k[None, :],
            mask=m_n[:, None] & m_k[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K]
        b_x = tl.load(
            x_ptr + o_m[:, None] * stride_x + o_k[None, :],
            mask=m_m[:, None] & m_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if RELU2:
            # as the GEMV: relu(x)**2 rounded to x's dtype (relu keeps NaN, as torch's does)
            b_xf = b_x.to(tl.float32)
            b_xf = tl.where(b_xf > 0.0, b_xf, tl.where(b_xf != b_xf, b_xf, 0.0))
            b_x = (b_xf * b_xf).to(x_ptr.dtype.element_ty)
        if DOT_F32:
            # exact fp32 products (tl.dot would round fp32 inputs to TF32 by default)
            if SWAP_AB:
                acc = tl.dot(b_w.to(tl.float32), tl.trans(b_x.to(tl.float32)), acc,
                             input_precision="ieee")  # fmt: skip
            else:
                acc = tl.dot(b_x.to(tl.float32), tl.trans(b_w.to(tl.float32)), acc,
                             input_precision="ieee")  # fmt: skip
        elif SWAP_AB:
            acc = tl.dot(b_w, tl.trans(b_x), acc)
        else:
            acc = tl.dot(b_x, tl.trans(b_w), acc)
    b_y = tl.trans(acc) if SWAP_AB else acc  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        b_y += tl.load(b_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + o_m[:, None] * stride_y + o_n[None, :],
        b_y.to(y_ptr.dtype.element_ty),
        mask=m_m[:, None] & m_n[None, :],
    )


_SKINNY_LAUNCHER = DirectLauncher(_skinny_kernel)


def launch_skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: SkinnyConfig,
    relu2: bool = False,
) -> None:
    """``out[i] = weight @ f(x[i]) (+ bias)`` for the ``M = x.numel() / K`` rows of ``x``,
    on validated tensors: ``x`` ``[..., K]`` with ``M <= 16``, 2-D (rows at any stride) or
    contiguous; ``weight`` ``[N, K]`` (inner dim contiguous); ``out`` ``[..., N]`` of ``M``
    rows, 2-D or contiguous, last dim contiguous; ``f`` as in :func:`launch_gemv`. Writes
    nothing but ``out``'s ``M x N`` elements; ``M`` is not part of the variant."""
    n, k = weight.shape
    m = x.numel() // k if k else 0
    if n == 0 or m == 0:
        return
    stride_x = x.stride(0) if x.dim() == 2 else k
    stride_y = out.stride(0) if out.dim() == 2 else n
    stride_w = weight.stride(0)
    # bf16 / fp16 on a GPU: tensor-core products, fp32 accumulate. fp32: exact products;
    # so under the interpreter too (its bf16 tl.dot is wrong), the operands widened exactly.
    dot_f32 = x.dtype == torch.float32 or runs_interpreted(_skinny_kernel, x.device)
    ptrs = (x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr())  # fmt: skip
    aligned = all(p is None or p & 15 == 0 for p in ptrs)
    dev = x.get_device()
    has_bias = bias is not None
    c = config
    key = (dev, n, k, stride_x, stride_w, stride_y, relu2, dot_f32, x.dtype, weight.dtype,
           out.dtype, None if bias is None else bias.dtype, c)  # fmt: skip
    var = _SKINNY_LAUNCHER.lookup(key, aligned)
    _SKINNY_LAUNCHER.launch(
        var, (cdiv(n, c.block_n), 1, 1), key, dev, aligned,
        lambda: (*ptrs, m, n, k, stride_x, stride_w, stride_y, has_bias, relu2, dot_f32,
                 c.swap_ab, SKINNY_MAX_ROWS, c.block_n, c.block_k),
        lambda g: launchable(_skinny_kernel, x.device)[g](
            x, weight, bias, out, m, n, k, stride_x, stride_w, stride_y, HAS_BIAS=has_bias,
            RELU2=relu2, DOT_F32=dot_f32, SWAP_AB=c.swap_ab, BLOCK_M=SKINNY_MAX_ROWS,
            BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
            num_stages=c.num_stages,
        ),
    )  # fmt: skip


def _skinny_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    relu2: bool,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
    swap_ab: bool,
) -> None:
    config = SkinnyConfig(block_n, block_k, num_warps, num_stages, swap_ab)
    launch_skinny(x, weight, bias, out, config, relu2)


_skinny_op = torch.library.custom_op("hybridmeta::skinny_gemm", _skinny_impl, mutates_args=("out",))

_skinny_op.register_fake(no_output_fake)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_activation: Literal["relu2"] | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """``F.linear(act(x), weight, bias)``; one row runs the GEMV kernel, 2 to 16 rows the
    skinny GEMM where :func:`skinny_blocks` says so (Triton implementation).

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]``, a float dtype.
    weight : torch.Tensor
        ``[N, K]`` of ``x``'s dtype.
    bias : torch.Tensor, optional
        ``[N]``.
    input_activation : {"relu2"}, optional
        Apply :func:`~hybridmeta.kernels.relu_square` to ``x`` first (Nemotron-H's MLP:
        ``down(relu(up(x))**2)``). The GEMV and the skinny GEMM compute it as they load
        ``x`` (no kernel of its own, no intermediate tensor); otherwise it is one
        ``relu_square`` call.
        Either way the activation is rounded to ``x``'s dtype before the product.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`): the reference
        is ``F.linear``; the Triton one runs the GEMV kernel when ``x`` holds exactly one
        row with its last dim contiguous and ``weight``'s rows are contiguous, the skinny
        GEMM for 2 to 16 such rows (``x`` 2-D or contiguous) when
        ``skinny_blocks(rows, N, K)`` gives a tiling, and ``F.linear`` (cuBLAS) otherwise.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` in ``x``'s dtype (fp32 accumulation, one rounding).
    """
    op = "linear"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(
            f"{op}: `x` must be a torch.Tensor [..., in_features], got {type(x).__name__}"
        )
    if input_activation not in (None, "relu2"):
        raise ValueError(
            f"{op}: `input_activation` must be None or 'relu2', got {input_activation!r}"
        )
    relu2 = input_activation == "relu2"
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: `x` must have dtype bfloat16/float16/float32, got {x.dtype}")
    dev = x.device
    k = x.shape[-1]
    check_tensor(op, "weight", weight, shape=(None, k), dtypes=(x.dtype,), device=dev,
                 dims="[out_features, in_features]")  # fmt: skip
    n = weight.shape[0]
    if bias is not None:
        check_tensor(op, "bias", bias, shape=(n,), dtypes=(x.dtype,), device=dev,
                     dims="[out_features]")  # fmt: skip
    which = resolve(op, impl, dev)
    if which == "triton" and (k <= 1 or (x.stride(-1) == 1 and weight.stride(1) == 1)):
        if x.numel() == k:
            out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=dev)
            run = torch.ops.hybridmeta.gemv if observed(x) else _gemv_impl
            run(x, weight, bias, out, relu2)
            return out
        rows = x.numel() // k if k else 0
        cfg = skinny_blocks(rows, n, k) if x.dim() == 2 or x.is_contiguous() else None
        if cfg is not None:
            out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=dev)
            run_mm = torch.ops.hybridmeta.skinny_gemm if observed(x) else _skinny_impl
            run_mm(x, weight, bias, out, relu2, cfg.block_n, cfg.block_k, cfg.num_warps,
                   cfg.num_stages, cfg.swap_ab)  # fmt: skip
            return out
    if relu2:
        if which == "reference":
            return linear_reference(x, weight, bias, input_activation="relu2")
        x = relu_square(x.reshape(-1, k).contiguous(), impl=which).view(x.shape)
    return linear_reference(x, weight, bias)


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_activation: Literal["relu2"] | None = None,
) -> torch.Tensor:
    """``F.linear`` (of ``relu(x)**2`` with ``input_activation="relu2"``): what every
    implementation of :func:`linear` computes."""
    if input_activation == "relu2":
        x = relu_square_reference(x)
    return F.linear(x, weight, bias)
