"""kernels.linear: the one-row GEMV kernel and the 2..16-row skinny GEMM against F.linear,
and when each is (not) used."""

from __future__ import annotations

import importlib
from collections.abc import Hashable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hybridmeta.kernels import Impl
from hybridmeta.kernels.linear import (
    SKINNY_MAX_ROWS,
    SkinnyConfig,
    SkinnyRule,
    _skinny_kernel,
    gemv_blocks,
    launch_skinny,
    linear,
    linear_reference,
    skinny_blocks,
)
from tests.kernels._support import DEVICE, assert_close, bits, compiled_count, nan_empty
from tests.op_log import OpLog

# the module (``hybridmeta.kernels.linear`` as an attribute is the function)
_LINEAR = importlib.import_module("hybridmeta.kernels.linear")

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


# --- the skinny GEMM (2..16 rows) -------------------------------------------------------

#: small tiles so that small shapes have several programs and K steps, each with a
#: masked edge: 37 outputs in blocks of 16, 150 inputs in steps of 64
_SMALL = SkinnyConfig(16, 64)
_N, _K = 37, 150


@pytest.fixture(params=[False, True], ids=["xwT", "swap_ab"])
def skinny_everywhere(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SkinnyConfig:
    """Every 2..16-row projection takes the skinny GEMM with ``_SMALL`` (either operand
    order)."""
    cfg = SkinnyConfig(_SMALL.block_n, _SMALL.block_k, swap_ab=request.param)
    monkeypatch.setattr(_LINEAR, "SKINNY_RULES", (SkinnyRule(cfg),))
    return cfg


def _reference(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu2: bool
) -> torch.Tensor:
    """F.linear in fp32 of the activation rounded to x's dtype, rounded once to x's dtype."""
    xa = torch.square(torch.relu(x)) if relu2 else x  # in x's dtype, as relu_square stores it
    want = F.linear(xa.float(), w.float(), None if b is None else b.float())
    return want.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 3, 16])
@pytest.mark.parametrize("relu2", [False, True], ids=["plain", "relu2"])
def test_skinny_rows_match_f_linear(
    skinny_everywhere: SkinnyConfig, dtype: torch.dtype, rows: int, relu2: bool
) -> None:
    w = _w(_N, _K, dtype)
    b = _w(1, _N, dtype, seed=1)[0]
    # inputs of both signs (relu2 must drop the negative ones) and of size ~1
    x = _w(rows, _K, dtype, seed=2) * 20.0
    act: Any = "relu2" if relu2 else None
    got = linear(x, w, b, input_activation=act, impl="triton")
    assert got.shape == (rows, _N) and got.dtype == dtype
    assert_close(got, _reference(x, w, b, relu2), "skinny")
    ops = _ops(lambda: linear(x, w, b, input_activation=act, impl="triton"))
    assert ops == ["hybridmeta.skinny_gemm.default"]


def test_skinny_takes_fp16_no_bias_and_leading_dims(skinny_everywhere: SkinnyConfig) -> None:
    w = _w(_N, _K, torch.float16)
    x = _w(12, _K, torch.float16, seed=3) * 20.0
    # [3, 4, K] contiguous: 12 rows, output [3, 4, N]
    got = linear(x.view(3, 4, _K), w, impl="triton")
    assert got.shape == (3, 4, _N)
    assert_close(got.view(12, _N), _reference(x, w, None, False), "fp16 3-D")
    assert _ops(lambda: linear(x.view(3, 4, _K), w, impl="triton")) == [
        "hybridmeta.skinny_gemm.default"
    ]
    # rows at a stride (a 2-D view of a wider buffer) are read in place
    wide = torch.zeros(12, _K + 10, dtype=torch.float16, device=DEVICE)
    wide[:, :_K] = x
    assert_close(linear(wide[:, :_K], w, impl="triton"), _reference(x, w, None, False), "strided")
    # a 3-D input whose rows are not uniformly strided: F.linear, no copy for the kernel
    odd = wide[:, :_K].view(3, 4, _K).transpose(0, 1)
    assert not odd.is_contiguous()
    assert "hybridmeta.skinny_gemm.default" not in _ops(lambda: linear(odd, w, impl="triton"))
    torch.testing.assert_close(linear(odd, w, impl="triton"), F.linear(odd, w))


@pytest.mark.parametrize("rows", [2, 3, 16])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["xwT", "swap_ab"])
def test_skinny_writes_its_rows_and_nothing_else(rows: int, swap_ab: bool) -> None:
    """``out`` is a ``[rows, N]`` view of a NaN-filled buffer of 16 + 3 rows and 5 more
    columns (a store of the whole 16-row tile stays inside it); ``x`` a view of a buffer
    whose rows past ``rows`` are NaN. The kernel writes every element of the view and
    nothing around it."""
    dtype = torch.float32
    cfg = SkinnyConfig(_SMALL.block_n, _SMALL.block_k, swap_ab=swap_ab)
    w = _w(_N, _K, dtype)
    b = _w(1, _N, dtype, seed=1)[0]
    xbuf = nan_empty(SKINNY_MAX_ROWS + 2, _K + 6, dtype=dtype)
    x = xbuf[:rows, :_K]
    x.copy_(_w(rows, _K, dtype, seed=4))
    buf = nan_empty(SKINNY_MAX_ROWS + 3, _N + 5, dtype=dtype)
    before = buf.clone()
    out = buf[:rows, :_N]
    launch_skinny(x, w, b, out, cfg)
    assert_close(out.clone(), _reference(x, w, b, False), "written rows")
    assert torch.equal(bits(buf[rows:]), bits(before[rows:])), "a row past M was written"
    assert torch.equal(bits(buf[:, _N:]), bits(before[:, _N:])), "a column past N was written"


def _dns(kernel: Any) -> list[str]:
    """The kernel's ``do_not_specialize`` (compiled ``JITFunction`` or interpreted)."""
    got = getattr(kernel, "do_not_specialize", None)
    if got is None and hasattr(kernel, "kwargs"):
        got = kernel.kwargs.get("do_not_specialize")
    return list(got or ())


def test_a_new_row_count_compiles_nothing(
    skinny_everywhere: SkinnyConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row count is a runtime argument: Triton does not specialise on it and the
    direct launcher's variant key leaves it out, so every row count runs one variant (a key
    with the count would compile or cache a variant per count; a specialised count would
    let a variant cached at 16 rows run 3 rows with 16-row assumptions)."""
    assert "M" in _dns(_skinny_kernel)
    launcher = _LINEAR._SKINNY_LAUNCHER
    keys: list[Hashable] = []
    real = launcher.launch

    def spy(var: Any, grid: Any, key: Hashable, *rest: Any) -> None:
        keys.append(key)
        real(var, grid, key, *rest)

    monkeypatch.setattr(launcher, "launch", spy)
    w = _w(_N, _K, torch.float32)
    counts = []
    for i, rows in enumerate((16, 2, 3, 7, 16, 5)):
        x = _w(rows, _K, torch.float32, seed=10 + i)
        assert_close(linear(x, w, impl="triton"), _reference(x, w, None, False), f"{rows} rows")
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            counts.append(compiled_count(_skinny_kernel))
    assert len(keys) == 6 and len(set(keys)) == 1, keys
    assert all(c == counts[0] for c in counts), f"compiled variants per row count: {counts}"


def test_the_rule_is_the_sweeps_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default (H200 sweep): 2-16 rows of Nano's in_proj and up_proj take 64 x 128
    # W x^T tiles; one row, more than 16, the K-heavy and the narrow projections, and the
    # tiny test models, run the GEMV or cuBLAS.
    wide = SkinnyConfig(64, 128, 4, 3, swap_ab=True)
    for m in (2, 4, 9, 16):
        assert skinny_blocks(m, 22656, 4480) == wide
        assert skinny_blocks(m, 15680, 4480) == wide
    for m, n, k in [
        (1, 22656, 4480), (17, 22656, 4480),
        (16, 4480, 15680), (16, 4480, 10240), (16, 5120, 4480), (16, 1024, 4480),
        (2, 64, 32), (16, 64, 32),
    ]:  # fmt: skip
        assert skinny_blocks(m, n, k) is None, (m, n, k)
    # Whatever the rules say, one row and more than 16 rows are not the skinny GEMM's.
    monkeypatch.setattr(_LINEAR, "SKINNY_RULES", (SkinnyRule(_SMALL, rows=(1, 64)),))
    assert skinny_blocks(16, 10, 10) == _SMALL
    assert skinny_blocks(1, 10, 10) is None
    assert skinny_blocks(SKINNY_MAX_ROWS + 1, 10, 10) is None
    # first match wins; ranges are inclusive
    other = SkinnyConfig(64, 64)
    rules = (SkinnyRule(other, rows=(4, 8), n=(100, 200), k=(10, 20)), SkinnyRule(_SMALL))
    monkeypatch.setattr(_LINEAR, "SKINNY_RULES", rules)
    assert skinny_blocks(4, 100, 20) == other and skinny_blocks(8, 200, 10) == other
    assert skinny_blocks(3, 100, 20) == _SMALL and skinny_blocks(4, 201, 20) == _SMALL
    w = _w(_N, _K, torch.float32)
    x = _w(SKINNY_MAX_ROWS + 1, _K, torch.float32, seed=5)
    assert _ops(lambda: linear(x, w, impl="triton")) == ["aten.mm.default"]
