"""The decode step's projections at one row: a weight-streaming GEMV instead of cuBLAS.

At one row a projection reads its ``N x K`` weight once and does almost no arithmetic.
cuBLAS picks split-K tilings for most of Nemotron-Nano-9B-v2's projections at one row
(a GEMM kernel, a reduce kernel and often a memset: three launches where one would do)
and reaches 24-92% of the copy ceiling (``benchmarks/bench_gemv.py``). The kernel here
gives each program ``BLOCK_N`` whole weight rows, streams them in ``BLOCK_K`` columns with
every load issued before the products (fp32 accumulation, one rounding at the end), and
launches ``N / BLOCK_N`` programs: many small programs, so the last wave is short.

:func:`linear` is ``F.linear``; its Triton implementation runs this kernel for a one-row
input and ``F.linear`` (cuBLAS) for more rows, where cuBLAS's tensor-core tilings win.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, resolve
from hybridmeta.kernels._launch import DirectLauncher
from hybridmeta.kernels._validate import FLOAT_DTYPES, check_tensor
from hybridmeta.kernels.activations import relu_square, relu_square_reference

__all__ = ["linear", "linear_reference"]

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
        lambda g: _gemv_kernel[g](
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


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    input_activation: Literal["relu2"] | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """``F.linear(act(x), weight, bias)``; one row runs the GEMV kernel (Triton
    implementation).

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
        ``down(relu(up(x))**2)``). The GEMV computes it as it loads ``x`` (no kernel of
        its own, no intermediate tensor); otherwise it is one ``relu_square`` call.
        Either way the activation is rounded to ``x``'s dtype before the product.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`): the reference
        is ``F.linear``; the Triton one runs the GEMV kernel when ``x`` holds exactly one
        row with its last dim contiguous and ``weight``'s rows are contiguous, and
        ``F.linear`` (cuBLAS) otherwise.

    Returns
    -------
    torch.Tensor
        ``[..., N]`` in ``x``'s dtype (fp32 accumulation, one rounding).
    """
    op = "linear"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"{op}: `x` must be a torch.Tensor [..., in_features], got {type(x).__name__}")
    if input_activation not in (None, "relu2"):
        raise ValueError(f"{op}: `input_activation` must be None or 'relu2', got {input_activation!r}")
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
    if (
        which == "reference"
        or x.numel() != k
        or (k > 1 and (x.stride(-1) != 1 or weight.stride(1) != 1))
    ):
        if relu2:
            if which == "reference":
                return linear_reference(x, weight, bias, input_activation="relu2")
            x = relu_square(x.reshape(-1, k).contiguous(), impl=which).view(x.shape)
        return linear_reference(x, weight, bias)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=dev)
    run = torch.ops.hybridmeta.gemv if observed(x) else _gemv_impl
    run(x, weight, bias, out, relu2)
    return out


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
