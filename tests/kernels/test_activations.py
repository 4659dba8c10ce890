"""relu_square: one kernel, bit-identical to ``torch.square(F.relu(x))``."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.kernels.activations import relu_square, relu_square_reference
from tests.kernels._support import DEVICE, bits, nan_empty
from tests.op_log import OpLog

pytestmark = pytest.mark.interpreter if DEVICE.type == "cpu" else pytest.mark.gpu


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, NaN where NaN (payloads may differ)."""
    if DEVICE.type == "cpu" and got.dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 where torch (and the GPU) round: one ulp.
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _x(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=g) * 3.0
    x[0, :3] = torch.tensor([0.0, -0.0, float("nan")])  # zeros of both signs, a NaN
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [5, 1024, 1500])
def test_bitwise_equal_to_torch(dtype: torch.dtype, cols: int) -> None:
    """Across block boundaries (1,500 columns: a partial second block) and for a strided row
    layout; NaN stays NaN, negatives give 0. Exact on the GPU (one rounding, as torch)."""
    x = _x(3, cols, dtype)
    want = torch.square(torch.relu(x))
    out = nan_empty(3, cols, dtype=dtype)
    got = relu_square(x, out=out)
    assert got.data_ptr() == out.data_ptr()
    _same(got, want)
    assert torch.equal(bits(relu_square_reference(x)), bits(want))
    # rows of a wider buffer (the up-projection of a fused GEMM is such a slice)
    wide = torch.zeros(3, cols + 7, dtype=dtype, device=DEVICE)
    wide[:, :cols] = x
    _same(relu_square(wide[:, :cols]), want)


def test_in_place() -> None:
    x = _x(2, 40, torch.bfloat16)
    want = torch.square(torch.relu(x))
    got = relu_square(x, out=x)
    assert got.data_ptr() == x.data_ptr()
    _same(x, want)


def test_one_dispatched_op_and_the_reference_path() -> None:
    x = _x(2, 8, torch.float32)
    with OpLog() as log:
        relu_square(x)
    assert [op for op in log.ops if op.startswith("hybridmeta.")] == ["hybridmeta.relu_square.default"]
    out = relu_square(x, impl="reference")
    assert torch.equal(bits(out), bits(relu_square_reference(x)))


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"x": [1.0]}, TypeError, r"relu_square: `x` must be a torch.Tensor"),
        ({"x": torch.zeros(4)}, ValueError, r"`x` must have shape \[tokens, features\]"),
        ({"x": torch.zeros(2, 3, dtype=torch.int32)}, TypeError, r"`x` must have dtype"),
        ({"out": torch.zeros(2, 4)}, ValueError, r"`out` must have shape"),
        ({"out": torch.zeros(2, 3, dtype=torch.float64)}, TypeError, r"`out` must have dtype"),
        ({"out": torch.zeros(3, 2).t()}, ValueError, r"`out` must be contiguous along its last"),
        ({"x": torch.zeros(3, 2).t()}, ValueError, r"`x` must be contiguous along its last"),
    ],
)
def test_bad_arguments_are_refused_and_nothing_is_written(
    kw: dict[str, object], exc: type[Exception], match: str
) -> None:
    args: dict[str, object] = {"x": torch.ones(2, 3, device=DEVICE)}
    for k, v in kw.items():
        args[k] = v.to(DEVICE) if isinstance(v, torch.Tensor) else v
    out = args.get("out")
    before = bits(out).clone() if isinstance(out, torch.Tensor) else None
    with pytest.raises(exc, match=match):
        relu_square(args["x"], out=out)  # type: ignore[arg-type]
    if isinstance(out, torch.Tensor) and before is not None:
        assert torch.equal(bits(out), before)
