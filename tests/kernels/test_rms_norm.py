"""Fused RMSNorms: residual add + RMSNorm and the mixer's gated norm, against references."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from tests.kernels._support import DEVICE, assert_close, bits, nan_empty
from tests.op_log import OpLog

pytestmark = pytest.mark.interpreter if DEVICE.type == "cpu" else pytest.mark.gpu


def _rnd(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def test_reference_path_of_the_op_is_the_reference() -> None:
    """``impl="reference"`` (the CPU path of the runtime) computes exactly the references."""
    for dtype in (torch.float32, torch.bfloat16):
        x = _rnd(3, 40, dtype=dtype, seed=0)
        r = _rnd(3, 40, dtype=dtype, seed=3)
        w = 1.0 + _rnd(40, dtype=dtype, seed=1, scale=0.1)
        out, h = add_rms_norm(x, r, w, 1e-5, impl="reference")
        ref_out, ref_h = add_rms_norm_reference(x, r, w, 1e-5)
        assert torch.equal(out, ref_out) and torch.equal(h, ref_h)
        z = _rnd(3, 40, dtype=dtype, seed=2)
        assert torch.equal(
            gated_rms_norm(x, z, w, 8, 1e-5, impl="reference"),
            gated_rms_norm_reference(x, z, w, 8, 1e-5),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 64, 1])
def test_add_rms_norm_matches_reference(dtype: torch.dtype, width: int) -> None:
    rows = 3
    x = _rnd(rows, width, dtype=dtype, seed=3, scale=2.0)
    res = _rnd(rows, width, dtype=dtype, seed=4)
    w = 1.0 + _rnd(width, dtype=dtype, seed=5, scale=0.1)
    out = nan_empty(rows, width, dtype=dtype)
    res_out = nan_empty(rows, width, dtype=dtype)
    got, h = add_rms_norm(x, res, w, 1e-5, out=out, residual_out=res_out)
    ref, ref_h = add_rms_norm_reference(x, res, w, 1e-5)
    assert got.data_ptr() == out.data_ptr() and h.data_ptr() == res_out.data_ptr()
    assert_close(h, ref_h, "new residual")
    assert_close(got, ref, "normalised output")
    if DEVICE.type == "cuda":
        # The GPU rounds fp32 -> bf16 to nearest like torch: the residual add is exact.
        assert torch.equal(bits(h), bits(ref_h))


def test_rms_norm_without_residual_and_in_place() -> None:
    x = _rnd(4, 48, dtype=torch.bfloat16, seed=6)
    w = 1.0 + _rnd(48, dtype=torch.float32, seed=7, scale=0.1)
    ref = rms_norm_reference(x, w, 1e-6)
    assert_close(rms_norm(x, w, 1e-6), ref, "rms_norm")
    # Residual updated in place and the output written over x: each row is read first.
    res = _rnd(4, 48, dtype=torch.bfloat16, seed=8)
    ref_o, ref_h = add_rms_norm_reference(x, res, w, 1e-6)
    xc = x.clone()
    out, h = add_rms_norm(xc, res, w, 1e-6, out=xc, residual_out=res)
    assert out.data_ptr() == xc.data_ptr() and h.data_ptr() == res.data_ptr()
    assert_close(h, ref_h, "in-place residual")
    assert_close(out, ref_o, "output over x")


def test_strided_rows_are_read_at_their_stride() -> None:
    base = _rnd(3, 100, dtype=torch.float32, seed=9)
    x = base[:, 10:50]  # row stride 100, inner stride 1
    res = _rnd(3, 40, dtype=torch.float32, seed=10)
    w = _rnd(40, dtype=torch.float32, seed=11)
    got, h = add_rms_norm(x, res, w, 1e-5)
    ref, ref_h = add_rms_norm_reference(x.contiguous(), res, w, 1e-5)
    assert_close(got, ref, "strided x")
    assert_close(h, ref_h, "strided x residual")


@pytest.mark.parametrize(
    ("y_dtype", "w_dtype"),
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
)
def test_gated_rms_norm_matches_reference(y_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    rows, groups, gs = 3, 4, 12
    width = groups * gs
    y = _rnd(rows, width, dtype=y_dtype, seed=12)
    proj = _rnd(rows, 2 * width + 5, dtype=torch.bfloat16, seed=13)
    z = proj[:, 5 : 5 + width]  # a column slice of the input projection, as in the mixer
    w = 1.0 + _rnd(width, dtype=w_dtype, seed=14, scale=0.1)
    ref = gated_rms_norm_reference(y, z, w, gs, 1e-5)
    got = gated_rms_norm(y, z, w, gs, 1e-5)
    assert got.dtype == ref.dtype
    assert_close(got, ref, "gated norm")
    # Straight into the next matmul's dtype: the reference, then one cast.
    out = nan_empty(rows, width, dtype=torch.bfloat16)
    gated_rms_norm(y, z, w, gs, 1e-5, out=out)
    assert_close(out, ref.to(torch.bfloat16), "gated norm into bf16 out")


def test_groups_are_normalised_independently() -> None:
    """Scaling one group's input leaves every other group's output bit-identical."""
    y = _rnd(2, 32, dtype=torch.float32, seed=15)
    z = _rnd(2, 32, dtype=torch.float32, seed=16)
    w = _rnd(32, dtype=torch.float32, seed=17)
    a = gated_rms_norm(y, z, w, 8, 1e-5)
    y2 = y.clone()
    y2[:, 8:16] *= 7.0
    b = gated_rms_norm(y2, z, w, 8, 1e-5)
    keep = [c for c in range(32) if not 8 <= c < 16]
    assert torch.equal(bits(a[:, keep]), bits(b[:, keep]))
    # RMSNorm is scale-invariant within the group (up to eps).
    assert_close(a[:, 8:16], b[:, 8:16], "scaled group")


def test_bad_arguments_are_refused_and_nothing_is_written() -> None:
    x = _rnd(2, 16, dtype=torch.float32, seed=18)
    w = _rnd(16, dtype=torch.float32, seed=19)
    out = nan_empty(2, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"`weight` must have shape \[hidden\]"):
        add_rms_norm(x, None, w[:8], 1e-5, out=out)
    with pytest.raises(ValueError, match=r"`residual` must have shape"):
        add_rms_norm(x, x[:1], w, 1e-5, out=out)
    with pytest.raises(ValueError, match=r"`x` must be contiguous along its last dim"):
        add_rms_norm(x.t().contiguous().t(), None, w, 1e-5, out=out)
    with pytest.raises(ValueError, match=r"`residual_out` needs a `residual`"):
        add_rms_norm(x, None, w, 1e-5, out=out, residual_out=out)
    with pytest.raises(ValueError, match=r"`group_size` 5 must be >= 1 and divide 16"):
        gated_rms_norm(x, x, w, 5, 1e-5, out=out)
    with pytest.raises(TypeError, match=r"`z` must have dtype"):
        gated_rms_norm(x, x.int(), w, 8, 1e-5, out=out)
    assert bool(torch.isnan(out).all())


def test_each_launch_is_one_dispatched_op() -> None:
    x = _rnd(2, 16, dtype=torch.float32, seed=20)
    w = _rnd(16, dtype=torch.float32, seed=21)
    out = torch.empty_like(x)
    with OpLog() as rec:
        add_rms_norm(x, x, w, 1e-5, out=out, residual_out=torch.empty_like(x))
        gated_rms_norm(x, x, w, 8, 1e-5, out=out)
    mine = [s for s in rec.ops if s.startswith("hybridmeta.")]
    assert mine == ["hybridmeta.add_rms_norm.default", "hybridmeta.gated_rms_norm.default"]


@pytest.mark.gpu
def test_nano_shapes_match_reference() -> None:
    """Nemotron-Nano-9B-v2 widths: hidden 4480, mixer 10240 in 8 groups of 1280."""
    rows = 16
    x = _rnd(rows, 4480, dtype=torch.bfloat16, seed=22)
    res = _rnd(rows, 4480, dtype=torch.bfloat16, seed=23, scale=4.0)
    w = 1.0 + _rnd(4480, dtype=torch.bfloat16, seed=24, scale=0.1)
    got, h = add_rms_norm(x, res, w, 1e-5)
    ref, ref_h = add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(bits(h), bits(ref_h))
    assert_close(got, ref, "nano add_rms_norm")
    y = _rnd(rows, 10240, dtype=torch.float32, seed=25)
    proj = _rnd(rows, 22656, dtype=torch.bfloat16, seed=26)  # in_proj output: z first
    z = proj[:, :10240]
    wg = 1.0 + _rnd(10240, dtype=torch.bfloat16, seed=27, scale=0.1)
    out = nan_empty(rows, 10240, dtype=torch.bfloat16)
    gated_rms_norm(y, z, wg, 1280, 1e-5, out=out)
    assert_close(out, gated_rms_norm_reference(y, z, wg, 1280, 1e-5).to(torch.bfloat16), "nano")
