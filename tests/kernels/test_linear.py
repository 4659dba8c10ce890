"""kernels.linear: the one-row GEMV kernel against F.linear, and when it is (not) used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmeta.kernels import Impl
from hybridmeta.kernels.linear import gemv_blocks, linear, linear_reference
from tests.kernels._support import DEVICE
from tests.op_log import OpLog

pytestmark = pytest.mark.interpreter if DEVICE.type == "cpu" else pytest.mark.gpu


def _w(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(DEVICE, dtype)


def _ops(fn: object) -> list[str]:
    with OpLog() as log:
        fn()  # type: ignore[operator]
    return [op for op in log.ops if op.startswith(("hybridmeta.", "aten.mm", "aten.addmm"))]


def _check_gemv(n: int, k: int, dtype: torch.dtype, bias: bool, shapes: tuple[int, ...]) -> None:
    w = _w(n, k, dtype)
    b = _w(1, n, dtype, seed=1)[0] if bias else None
    x = _w(1, k, dtype, seed=2)
    for xs in shapes:  # [1, K] and [K]
        xv = x if xs == 2 else x[0]
        got = linear(xv, w, b, impl="triton")
        want = F.linear(xv.float(), w.float(), None if b is None else b.float())
        assert got.shape == want.shape and got.dtype == dtype
        # fp32 accumulation in another order than the fp32 reference; one bf16 rounding
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-3, 1e-3)
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)
    assert _ops(lambda: linear(x, w, b, impl="triton")) == ["hybridmeta.gemv.default"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_runs_the_gemv_and_matches_f_linear(dtype: torch.dtype, bias: bool) -> None:
    # 11 outputs in blocks of 2 and 1,100 inputs in steps of 1,024: every masked edge.
    assert gemv_blocks(11) == (2, 1024)
    _check_gemv(11, 1100, dtype, bias, (2, 1))


def test_wide_projections_take_four_row_blocks() -> None:
    # 2,050 outputs in blocks of 4 (a partial last one), 600 inputs in steps of 512.
    assert gemv_blocks(2050) == (4, 512)
    _check_gemv(2050, 600, torch.float32, True, (2,))


def test_more_rows_and_the_reference_are_f_linear_exactly() -> None:
    w = _w(12, 40, torch.float32)
    x = _w(3, 40, torch.float32, seed=3)
    impls: tuple[Impl, ...] = ("triton", "reference")
    for impl in impls:
        assert torch.equal(linear(x, w, impl=impl), F.linear(x, w))
    one = _w(1, 40, torch.float32, seed=4)
    assert torch.equal(linear(one, w, impl="reference"), linear_reference(one, w))
    assert "hybridmeta.gemv.default" not in _ops(lambda: linear(x, w, impl="triton"))
    # one row with strided features: F.linear too
    wide = _w(1, 80, torch.float32, seed=5)[:, ::2]
    assert _ops(lambda: linear(wide, w, impl="triton")) != ["hybridmeta.gemv.default"]
    torch.testing.assert_close(linear(wide, w, impl="triton"), F.linear(wide, w))


@pytest.mark.parametrize("rows", [1, 3])
def test_relu2_input_equals_relu_square_then_linear(rows: int) -> None:
    """The GEMV's relu2 prologue (one row) and the relu_square + F.linear path (more rows)
    compute F.linear(relu(x)**2): negative inputs must not contribute."""
    w = _w(10, 600, torch.float32)
    x = _w(rows, 600, torch.float32, seed=6) * 20.0
    want = F.linear(torch.relu(x) ** 2, w)
    got = linear(x, w, input_activation="relu2", impl="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    ref = linear(x, w, input_activation="relu2", impl="reference")
    assert torch.equal(ref, linear_reference(x, w, input_activation="relu2"))
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-4)
    ops = _ops(lambda: linear(x, w, input_activation="relu2", impl="triton"))
    assert ops == (["hybridmeta.gemv.default"] if rows == 1 else ["hybridmeta.relu_square.default", "aten.mm.default"])
    with pytest.raises(ValueError, match=r"linear: `input_activation` must be None or 'relu2'"):
        linear(x, w, input_activation="gelu", impl="triton")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("x", "w", "b", "exc", "match"),
    [
        ([1.0], torch.zeros(2, 3), None, TypeError, r"linear: `x` must be a torch.Tensor"),
        (torch.zeros(1, 3, dtype=torch.int64), torch.zeros(2, 3), None, TypeError, r"`x` must have dtype"),
        (torch.zeros(1, 3), torch.zeros(2, 4), None, ValueError, r"`weight` must have shape"),
        (torch.zeros(1, 3), torch.zeros(2, 3, dtype=torch.bfloat16), None, TypeError, r"`weight` must have dtype"),
        (torch.zeros(1, 3), torch.zeros(2, 3), torch.zeros(3), ValueError, r"`bias` must have shape"),
    ],
)
def test_bad_arguments_name_the_field(
    x: object, w: torch.Tensor, b: torch.Tensor | None, exc: type[Exception], match: str
) -> None:
    def dev(t: object) -> object:
        return t.to(DEVICE) if isinstance(t, torch.Tensor) else t

    with pytest.raises(exc, match=match):
        linear(dev(x), w.to(DEVICE), None if b is None else b.to(DEVICE), impl="triton")  # type: ignore[arg-type]
