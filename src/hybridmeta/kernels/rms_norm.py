"""Fused RMSNorms of the decode step: residual add + RMSNorm, and the mixer's gated norm.

* :func:`add_rms_norm` - ``h = x + residual`` (rounded to the activation dtype, as the
  model's bf16 add does), ``out = rmsnorm(h) * weight``; returns ``out`` and ``h`` (the new
  residual) from one pass over the row. :func:`rms_norm` is the same without the add.
* :func:`gated_rms_norm` - the Mamba2 mixer's ``norm(y * silu(z))`` per group of channels.

Both follow Nemotron-H's arithmetic (the references below): normalise in fp32,
multiply the weight in fp32, round where the reference rounds. Each launch is one
``torch.library`` op when something observes the dispatcher, a direct launch otherwise;
the references (``*_reference``) are the executable specification the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.kernels._config import TL_DTYPE, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, resolve
from hybridmeta.kernels._launch import DirectLauncher
from hybridmeta.kernels._validate import FLOAT_DTYPES, check_tensor

__all__ = [
    "add_rms_norm",
    "add_rms_norm_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]


# --------------------------------------------------------------------------- kernels


@triton.jit
def _add_rms_norm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    n_cols: tl.tensor,
    stride_x: tl.tensor,
    stride_r: tl.tensor,
    stride_o: tl.tensor,
    stride_ro: tl.tensor,
    eps: tl.tensor,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    i_t = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BLOCK)
    m_c = o_c < n_cols
    b_x = tl.load(x_ptr + i_t * stride_x + o_c, mask=m_c, other=0.0)  # [BLOCK]
    if HAS_RES:
        b_r = tl.load(res_ptr + i_t * stride_r + o_c, mask=m_c, other=0.0)
        # The residual stream is kept in the activation dtype: round the fp32 sum once,
        # as `x + residual` in that dtype does.
        b_h = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + i_t * stride_ro + o_c, b_h, mask=m_c)
        b_hf = b_h.to(tl.float32)
    else:
        b_hf = b_x.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_hf * b_hf, axis=0) / n_cols + eps)
    b_w = tl.load(w_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + i_t * stride_o + o_c,
        (b_w * (b_hf * b_rstd)).to(out_ptr.dtype.element_ty),
        mask=m_c,
    )


@triton.jit
def _gated_rms_norm_kernel(
    y_ptr: tl.tensor,
    z_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    group_size: tl.tensor,
    stride_y: tl.tensor,
    stride_z: tl.tensor,
    stride_o: tl.tensor,
    eps: tl.tensor,
    NORM_DTYPE: tl.constexpr,
    PRODUCT_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    i_t = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1)
    o_c = i_g * group_size + tl.arange(0, BLOCK)  # channels of this group
    m_c = tl.arange(0, BLOCK) < group_size
    b_y = tl.load(y_ptr + i_t * stride_y + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_z = tl.load(z_ptr + i_t * stride_z + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_h = b_y * (b_z * tl.sigmoid(b_z))  # [BLOCK] y * silu(z)
    b_rstd = tl.rsqrt(tl.sum(b_h * b_h, axis=0) / group_size + eps)
    # The reference casts the normalised value to y's dtype, multiplies by the weight in
    # their promoted dtype, and the caller's `out` dtype is one more cast.
    b_n = (b_h * b_rstd).to(NORM_DTYPE).to(tl.float32)  # type: ignore[arg-type]
    b_w = tl.load(w_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_o = (b_w * b_n).to(PRODUCT_DTYPE)  # type: ignore[arg-type]
    tl.store(out_ptr + i_t * stride_o + o_c, b_o.to(out_ptr.dtype.element_ty), mask=m_c)


_NORM_LAUNCHER = DirectLauncher(_add_rms_norm_kernel)
_GATED_LAUNCHER = DirectLauncher(_gated_rms_norm_kernel)


def _norm_warps(block: int) -> int:
    # 16 bytes per thread per pass of fp32 work at most; 4480 columns -> 8 warps.
    return max(1, min(16, block // 256))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def launch_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    """Launch the fused norm on validated ``[T, H]`` tensors (inner dim contiguous)."""
    rows, n_cols = x.shape
    if rows == 0:
        return
    block = pow2_ceil(n_cols)
    warps = _norm_warps(block)
    has_res = residual is not None
    strides = (
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
    )  # fmt: skip
    ptrs = (x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), _ptr(residual_out))
    aligned = all(p is None or p & 15 == 0 for p in ptrs)
    dev = x.get_device()
    key = (
        dev, n_cols, strides, has_res, x.dtype, weight.dtype, out.dtype,
        None if residual is None else residual.dtype,
        None if residual_out is None else residual_out.dtype,
    )  # fmt: skip
    var = _NORM_LAUNCHER.lookup(key, aligned)
    _NORM_LAUNCHER.launch(
        var, (rows, 1, 1), key, dev, aligned,
        lambda: (*ptrs, n_cols, *strides, eps, has_res, block),
        lambda g: launchable(_add_rms_norm_kernel, x.device)[g](
            x, residual, weight, out, residual_out, n_cols, *strides, eps,
            HAS_RES=has_res, BLOCK=block, num_warps=warps,
        ),
    )  # fmt: skip


def launch_gated_rms_norm(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out: torch.Tensor,
) -> None:
    """Launch the gated norm on validated ``[T, I]`` tensors (inner dim contiguous)."""
    rows, width = y.shape
    if rows == 0:
        return
    groups = width // group_size
    block = pow2_ceil(group_size)
    warps = _norm_warps(block)
    norm_dtype = TL_DTYPE[y.dtype]
    product_dtype = TL_DTYPE[torch.promote_types(weight.dtype, y.dtype)]
    strides = (y.stride(0), z.stride(0), out.stride(0))
    ptrs = (y.data_ptr(), z.data_ptr(), weight.data_ptr(), out.data_ptr())
    aligned = all(p & 15 == 0 for p in ptrs)
    dev = y.get_device()
    key = (dev, group_size, strides, y.dtype, z.dtype, weight.dtype, out.dtype)
    var = _GATED_LAUNCHER.lookup(key, aligned)
    _GATED_LAUNCHER.launch(
        var, (rows, groups, 1), key, dev, aligned,
        lambda: (*ptrs, group_size, *strides, eps, norm_dtype, product_dtype, block),
        lambda g: launchable(_gated_rms_norm_kernel, y.device)[g](
            y, z, weight, out, group_size, *strides, eps,
            NORM_DTYPE=norm_dtype, PRODUCT_DTYPE=product_dtype, BLOCK=block, num_warps=warps,
        ),
    )  # fmt: skip


# --------------------------------------------------------------------------- custom ops


def _add_rms_norm_impl(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
) -> None:
    launch_add_rms_norm(x, residual, weight, eps, out, residual_out)


_add_rms_norm_op = torch.library.custom_op(
    "hybridmeta::add_rms_norm", _add_rms_norm_impl, mutates_args=("out", "residual_out")
)

_add_rms_norm_op.register_fake(no_output_fake)


def _gated_rms_norm_impl(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    out: torch.Tensor,
) -> None:
    launch_gated_rms_norm(y, z, weight, group_size, eps, out)


_gated_rms_norm_op = torch.library.custom_op(
    "hybridmeta::gated_rms_norm", _gated_rms_norm_impl, mutates_args=("out",)
)

_gated_rms_norm_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- public ops


def _check_rows(
    op: str, name: str, t: object, rows: int, width: int, dev: torch.device
) -> torch.Tensor:
    t = check_tensor(op, name, t, shape=(rows, width), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[tokens, hidden]")  # fmt: skip
    if width > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{op}: `{name}` must be contiguous along its last dim, got strides {list(t.stride())}"
        )
    return t


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + RMSNorm in one pass: ``h = x + residual``; ``rmsnorm(h) * weight``.

    ``h`` is rounded to ``residual_out``'s dtype (by default ``x``'s), as ``x + residual``
    is in the model; the norm reads that rounded ``h``, in fp32.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, hidden]`` (a layer's output, or the embeddings), last dim contiguous.
    residual : torch.Tensor or None
        ``[T, hidden]`` residual stream; ``None``: plain RMSNorm of ``x`` (then ``h`` is
        ``x`` itself and is returned as the new residual).
    weight : torch.Tensor
        ``[hidden]``.
    eps : float
    out : torch.Tensor, optional
        ``[T, hidden]`` normalised output (default: ``x``'s dtype); may alias ``x``.
    residual_out : torch.Tensor, optional
        ``[T, hidden]`` new residual (default: a new tensor of ``x``'s dtype); may alias
        ``residual`` for an in-place update.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).

    Returns
    -------
    out, residual_out : torch.Tensor
    """
    op = "add_rms_norm"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: `x` must be a torch.Tensor [tokens, hidden], got {_desc(x)}")
    rows, width = x.shape
    dev = x.device
    _check_rows(op, "x", x, rows, width, dev)
    check_tensor(op, "weight", weight, shape=(width,), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[hidden]")  # fmt: skip
    if residual is not None:
        _check_rows(op, "residual", residual, rows, width, dev)
    if out is not None:
        _check_rows(op, "out", out, rows, width, dev)
    if residual_out is not None:
        if residual is None:
            raise ValueError(f"{op}: `residual_out` needs a `residual` to add")
        _check_rows(op, "residual_out", residual_out, rows, width, dev)
    if out is None:
        out = torch.empty_like(x)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    if resolve(op, impl, dev) == "reference":
        if residual is None:
            out.copy_(rms_norm_reference(x, weight, eps))
            return out, x
        normed, h = add_rms_norm_reference(x, residual, weight, eps)
        assert residual_out is not None
        residual_out.copy_(h)
        out.copy_(normed)
        return out, residual_out
    run = torch.ops.hybridmeta.add_rms_norm if observed(x) else _add_rms_norm_impl
    run(x, residual, weight, float(eps), out, residual_out)
    return out, residual_out if residual_out is not None else x


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """RMSNorm as Nemotron-H computes it (fp32 statistics, fp32 weight product, one cast).

    ``x``: ``[T, hidden]``; ``weight``: ``[hidden]``; ``out`` defaults to ``x``'s dtype.
    """
    return add_rms_norm(x, None, weight, eps, out=out, impl=impl)[0]


def gated_rms_norm(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """The Mamba2 mixer's gated grouped RMSNorm: ``weight * norm_g(y * silu(z))``.

    Per row and group of ``group_size`` channels, in fp32; the normalised value is rounded
    to ``y``'s dtype and multiplied by the weight in the dtype the two promote to (as
    ``gated_rms_norm_reference`` computes); ``out`` may hold any float dtype (one more
    cast, e.g. straight to the activation dtype of the next matmul).

    Parameters
    ----------
    y, z : torch.Tensor
        ``[T, I]`` SSM output and gate, last dim contiguous (``z`` may be a column slice of
        the input projection).
    weight : torch.Tensor
        ``[I]``.
    group_size : int
        Channels per group; divides ``I``.
    out : torch.Tensor, optional
        ``[T, I]``; default dtype ``promote_types(weight.dtype, y.dtype)``.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).
    """
    op = "gated_rms_norm"
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"{op}: `y` must be a torch.Tensor [tokens, channels], got {_desc(y)}")
    rows, width = y.shape
    dev = y.device
    _check_rows(op, "y", y, rows, width, dev)
    _check_rows(op, "z", z, rows, width, dev)
    check_tensor(op, "weight", weight, shape=(width,), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[channels]")  # fmt: skip
    if group_size < 1 or width % group_size != 0:
        raise ValueError(f"{op}: `group_size` {group_size} must be >= 1 and divide {width}")
    if out is None:
        out = torch.empty(rows, width, dtype=torch.promote_types(weight.dtype, y.dtype), device=dev)
    else:
        _check_rows(op, "out", out, rows, width, dev)
    if resolve(op, impl, dev) == "reference":
        out.copy_(gated_rms_norm_reference(y, z, weight, int(group_size), float(eps)))
        return out
    run = torch.ops.hybridmeta.gated_rms_norm if observed(y) else _gated_rms_norm_impl
    run(y, z, weight, int(group_size), float(eps), out)
    return out


def _desc(t: object) -> str:
    return f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


# --------------------------------------------------------------------------- references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Nemotron-H's RMSNorm: normalise in fp32, multiply the weight in fp32, cast back."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (in ``x``'s dtype), then :func:`rms_norm_reference` of ``h``."""
    h = x + residual.to(x.dtype)
    return rms_norm_reference(h, weight, eps), h


def gated_rms_norm_reference(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """The mixer's gated grouped RMSNorm, as Nemotron-H computes it."""
    dtype = y.dtype
    h = y.float() * torch.nn.functional.silu(z.float())
    shape = h.shape
    g = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(shape).to(dtype)
