"""The MLP activation of Nemotron-H's dense layers: ``relu(x) ** 2`` in one pass.

``torch.square(F.relu(x))`` is two elementwise kernels (and one intermediate tensor) per
MLP layer per step; :func:`relu_square` is one, in place on the up-projection's output by
default. The result is bit-identical to the torch expression in every float dtype: the
relu is exact and the square of a value of dtype ``d`` is computed in fp32 (exact for
bf16 / fp16 inputs) and rounded to ``d`` once, as torch rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, resolve
from hybridmeta.kernels._launch import DirectLauncher
from hybridmeta.kernels._validate import FLOAT_DTYPES, check_tensor

__all__ = ["relu_square", "relu_square_reference"]

_BLOCK = 1024


@triton.jit
def _relu_square_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    n_cols: tl.tensor,
    stride_x: tl.tensor,
    stride_o: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    i_t = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_c = o_c < n_cols
    b_x = tl.load(x_ptr + i_t * stride_x + o_c, mask=m_c, other=0.0).to(tl.float32)
    # relu keeps NaN (torch's does); the product rounds once to the output dtype
    b_r = tl.where(b_x > 0.0, b_x, tl.where(b_x != b_x, b_x, 0.0))
    tl.store(out_ptr + i_t * stride_o + o_c, (b_r * b_r).to(out_ptr.dtype.element_ty), mask=m_c)


_LAUNCHER = DirectLauncher(_relu_square_kernel)


def launch_relu_square(x: torch.Tensor, out: torch.Tensor) -> None:
    """Launch on validated ``[T, F]`` tensors (last dim contiguous); ``out`` may be ``x``."""
    rows, n_cols = x.shape
    if rows == 0 or n_cols == 0:
        return
    strides = (x.stride(0), out.stride(0))
    ptrs = (x.data_ptr(), out.data_ptr())
    aligned = all(p & 15 == 0 for p in ptrs)
    dev = x.get_device()
    key = (dev, n_cols, strides, x.dtype, out.dtype)
    var = _LAUNCHER.lookup(key, aligned)
    grid = (rows, triton.cdiv(n_cols, _BLOCK), 1)
    _LAUNCHER.launch(
        var, grid, key, dev, aligned,
        lambda: (*ptrs, n_cols, *strides, _BLOCK),
        lambda g: launchable(_relu_square_kernel, x.device)[g](x, out, n_cols, *strides, BLOCK=_BLOCK, num_warps=4),
    )  # fmt: skip


def _relu_square_impl(x: torch.Tensor, out: torch.Tensor) -> None:
    launch_relu_square(x, out)


_relu_square_op = torch.library.custom_op(
    "hybridmeta::relu_square", _relu_square_impl, mutates_args=("out",)
)

_relu_square_op.register_fake(no_output_fake)


def relu_square(
    x: torch.Tensor, *, out: torch.Tensor | None = None, impl: Impl | None = None
) -> torch.Tensor:
    """``relu(x) ** 2`` (Nemotron-H's ``relu2``), one kernel, rounded as torch rounds it.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, F]``, a float dtype, last dim contiguous.
    out : torch.Tensor, optional
        ``[T, F]`` of ``x``'s dtype, last dim contiguous; may be ``x`` itself (in place).
        Default: a new tensor.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).
    """
    op = "relu_square"
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{op}: `x` must be a torch.Tensor [tokens, features], got {type(x).__name__}"
        )
    check_tensor(op, "x", x, shape=(None, None), dtypes=FLOAT_DTYPES, device=x.device,
                 dims="[tokens, features]")  # fmt: skip
    _check_inner(op, "x", x)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor(op, "out", out, shape=tuple(x.shape), dtypes=(x.dtype,), device=x.device,
                     dims="[tokens, features]")  # fmt: skip
        _check_inner(op, "out", out)
    if resolve(op, impl, x.device) == "reference":
        out.copy_(relu_square_reference(x))
        return out
    run = torch.ops.hybridmeta.relu_square if observed(x) else _relu_square_impl
    run(x, out)
    return out


def _check_inner(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{op}: `{name}` must be contiguous along its last dim, got strides {list(t.stride())}"
        )


def relu_square_reference(x: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's ``relu2`` as the Hugging Face model computes it."""
    return torch.square(torch.relu(x))
