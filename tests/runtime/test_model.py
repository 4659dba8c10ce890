"""The runtime model's decode step: derived per-layer constants and the ops one step runs."""

from __future__ import annotations

import collections
import copy
from pathlib import Path

import pytest
import torch

from hybridmeta.kernels import implementation
from hybridmeta.model import ForwardMetadata, prepare_decode
from hybridmeta.runtime.loader import load_nemotron_h
from hybridmeta.runtime.model import Mamba2Mixer, NemotronH
from hybridmeta.runtime.state import StatePool
from hybridmeta.runtime.tiny import tiny_config, write_tiny_checkpoint
from tests.op_log import OpLog


def _mixers(model: NemotronH) -> list[Mamba2Mixer]:
    return [m for m in model.modules() if isinstance(m, Mamba2Mixer)]


def _decode(model: NemotronH, bs: int = 2) -> torch.Tensor:
    pool = StatePool.allocate(
        model.config, num_working=4, num_track=0, max_len=16, device=torch.device("cpu"),
        dtype=torch.float32,
    )  # fmt: skip
    slots = torch.arange(bs)
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(bs + 1),
        mamba_cache_indices=slots,
        mamba_track_indices=torch.full_like(slots, -1),
        mamba_track_mask=torch.zeros_like(slots, dtype=torch.bool),
        has_mamba_track_mask=False,
    )
    ids = torch.tensor([5, 7][:bs])
    with torch.no_grad():
        return model.forward_decode(ids, torch.full((bs,), 3), prepare_decode(fwd), pool)


def _reference_decode(model: NemotronH) -> torch.Tensor:
    """The same step with the constants computed from the weights inside the forward."""
    twin = copy.deepcopy(model)
    for m in _mixers(twin):
        m.A = -torch.exp(m.A_log.float())
        m.dt_bias_f32 = m.dt_bias.float()
        m._derived_from = m._weights_key()
    return _decode(twin)


def test_derived_constants_equal_the_formula_after_loading(tiny_model: NemotronH) -> None:
    mixers = _mixers(tiny_model)
    assert mixers
    for m in mixers:
        assert torch.equal(m.A, -torch.exp(m.A_log.float()))
        assert torch.equal(m.dt_bias_f32, m.dt_bias.float())
        assert m.A.dtype == m.dt_bias_f32.dtype == torch.float32
    # derived, not weights: the state dict (what a checkpoint holds) is unchanged
    assert not any(k.endswith((".A", ".dt_bias_f32")) for k in tiny_model.state_dict())


def test_an_in_place_weight_update_reaches_the_next_eager_step(tiny_dir: Path) -> None:
    model = load_nemotron_h(tiny_dir)
    before = _decode(model)
    m = _mixers(model)[0]
    with torch.no_grad():
        m.A_log.add_(0.7)
        m.dt_bias.mul_(1.5)
    after = _decode(model)
    assert not torch.equal(before, after)
    assert torch.equal(m.A, -torch.exp(m.A_log.float()))
    assert torch.equal(m.dt_bias_f32, m.dt_bias.float())
    torch.testing.assert_close(after, _reference_decode(model), rtol=0, atol=0)


def test_load_state_dict_refreshes_the_derived_constants(tiny_dir: Path) -> None:
    model = load_nemotron_h(tiny_dir)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(k for k in sd if k.endswith("mixer.A_log"))
    sd[name] += 0.3
    stale = [m.A.clone() for m in _mixers(model)]
    model.load_state_dict(sd)
    changed = [not torch.equal(a, m.A) for a, m in zip(stale, _mixers(model), strict=True)]
    assert changed.count(True) == 1
    for m in _mixers(model):
        assert torch.equal(m.A, -torch.exp(m.A_log.float()))


def test_the_constants_stay_fp32_when_the_model_is_cast(tiny_dir: Path) -> None:
    model = load_nemotron_h(tiny_dir).to(torch.bfloat16)
    m = _mixers(model)[0]
    assert m.A.dtype == torch.bfloat16  # Module.to cast the buffer ...
    m._constants()
    # ... and the next forward derives it again, in fp32, from the cast weights
    assert m.A.dtype == m.dt_bias_f32.dtype == torch.float32
    assert torch.equal(m.A, -torch.exp(m.A_log.float()))
    assert torch.equal(m.dt_bias_f32, m.dt_bias.float())


# Ops that allocate, alias or describe without running a kernel.
_NO_KERNEL = (
    "empty", "empty_like", "promote_types", "view", "reshape", "_unsafe_view", "split",
    "split_with_sizes", "slice", "select", "squeeze", "unsqueeze", "expand", "t",
    "transpose", "permute", "alias", "detach", "as_strided", "unbind",
)  # fmt: skip


def _kernel_ops(pattern: str, tmp: Path, bs: int = 2) -> collections.Counter[str]:
    model = load_nemotron_h(write_tiny_checkpoint(tmp, config=tiny_config(pattern=pattern)))
    with implementation("triton"):
        _decode(model, bs)  # first step: nothing derived or compiled is counted
        with OpLog() as log:
            _decode(model, bs)
    return collections.Counter(op for op in log.ops if op.split(".")[1] not in _NO_KERNEL)


@pytest.mark.interpreter
@pytest.mark.parametrize("bs", [1, 2])
def test_a_mamba_layer_decodes_in_six_kernels(tmp_path: Path, bs: int) -> None:
    # One more Mamba layer (and its MLP-free block) adds exactly these ops to a decode step:
    # the fused add + RMSNorm, in_proj, conv update, SSM update (which adds the dt bias and
    # applies the softplus and the dt clamp itself), gated RMSNorm (reading z in place) and
    # out_proj. A constant recomputed per step (-exp(A_log), a cast of dt_bias or dt), a dt
    # discretised in torch, or a copy of z would show up here. One row: both projections
    # are the GEMV kernel; more rows: cuBLAS.
    one = _kernel_ops("M-", tmp_path / "one", bs)
    two = _kernel_ops("MM-", tmp_path / "two", bs)
    per_layer = two - one
    proj = "hybridmeta.gemv.default" if bs == 1 else "aten.mm.default"
    assert per_layer == collections.Counter({
        "hybridmeta.add_rms_norm.default": 1,
        proj: 2,
        "hybridmeta.causal_conv1d_update.default": 1,
        "hybridmeta.ssm_state_update.default": 1,
        "hybridmeta.gated_rms_norm.default": 1,
    }), per_layer  # fmt: skip
    assert one - two == collections.Counter()


@pytest.mark.interpreter
@pytest.mark.parametrize("bs", [1, 2])
def test_an_mlp_layer_decodes_in_three_or_four_kernels(tmp_path: Path, bs: int) -> None:
    # One more MLP block adds the fused add + RMSNorm, the two projections and the relu2
    # between them: inside the down projection's GEMV at one row, one relu_square kernel
    # at more rows. A relu and a square as two torch kernels, or a copy of the
    # activation, would show up here.
    one = _kernel_ops("M-", tmp_path / "one", bs)
    two = _kernel_ops("M--", tmp_path / "two", bs)
    want = (
        {"hybridmeta.gemv.default": 2}
        if bs == 1
        else {"aten.mm.default": 2, "hybridmeta.relu_square.default": 1}
    )
    assert two - one == collections.Counter({"hybridmeta.add_rms_norm.default": 1, **want}), (
        two - one
    )
    assert one - two == collections.Counter()
