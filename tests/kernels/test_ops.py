"""Public kernel ops: argument validation, debug checks, dispatch, metadata entries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hybridmeta import ForwardMetadata, debug_mode, prepare_decode
from hybridmeta.kernels import (
    causal_conv1d_update,
    causal_conv1d_update_from_metadata,
    ssm_state_update,
    ssm_state_update_from_metadata,
    track_save,
    track_save_from_metadata,
)
from hybridmeta.kernels._config import ssm_launch_config
from tests.kernels._support import (
    DEVICE,
    assert_close,
    bits,
    causal_conv1d_update_ref,
    ssm_state_update_ref,
    strided,
    track_save_ref,
)
from tests.op_log import OpLog

H, P, N, G, SLOTS, BS = 4, 8, 16, 2, 8, 3


def _ssm_args() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "state": torch.randn(SLOTS, H, P, N, generator=g).to(DEVICE),
        "x": torch.randn(BS, H, P, generator=g).to(DEVICE),
        "dt": torch.rand(BS, H, generator=g).to(DEVICE),
        "A": -torch.rand(H, generator=g).to(DEVICE),
        "B": torch.randn(BS, G, N, generator=g).to(DEVICE),
        "C": torch.randn(BS, G, N, generator=g).to(DEVICE),
        "state_indices": torch.tensor([2, -1, 5], device=DEVICE),
        "D": torch.randn(H, generator=g).to(DEVICE),
        "z": torch.randn(BS, H, P, generator=g).to(DEVICE),
        "dt_bias": torch.randn(H, generator=g).to(DEVICE),
        "dt_softplus": True,
    }


def _call_ssm(a: dict[str, Any]) -> torch.Tensor:
    a = dict(a)
    return ssm_state_update(
        a.pop("state"), a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"), **a
    )


SSM_BAD: list[tuple[str, str, Any, type[Exception], str]] = [
    (
        "x wrong headdim",
        "x",
        torch.zeros(BS, H, P + 1, device=DEVICE),
        ValueError,
        r"`x` must have shape",
    ),
    (
        "x int",
        "x",
        torch.zeros(BS, H, P, dtype=torch.int32, device=DEVICE),
        TypeError,
        r"`x` must have dtype",
    ),
    (
        "dt rows",
        "dt",
        torch.zeros(BS + 1, H, device=DEVICE),
        ValueError,
        r"`dt` must have shape \[bs, nheads\]",
    ),
    (
        "A per-dim",
        "A",
        torch.zeros(H, P, device=DEVICE),
        ValueError,
        r"`A` must have shape \[nheads\]",
    ),
    (
        "B ngroups",
        "B",
        torch.zeros(BS, 3, N, device=DEVICE),
        ValueError,
        r"ngroups=3 must divide nheads=4",
    ),
    ("C mismatch", "C", torch.zeros(BS, 1, N, device=DEVICE), ValueError, r"`C` must have shape"),
    ("D shape", "D", torch.zeros(H + 1, device=DEVICE), ValueError, r"`D` must have shape"),
    ("z shape", "z", torch.zeros(BS, H, 1, device=DEVICE), ValueError, r"`z` must have shape"),
    (
        "idx float",
        "state_indices",
        torch.zeros(BS, device=DEVICE),
        TypeError,
        r"`state_indices` must have dtype",
    ),
    (
        "idx rows",
        "state_indices",
        torch.zeros(BS + 2, dtype=torch.long, device=DEVICE),
        ValueError,
        r"`state_indices` must have shape \[bs\]",
    ),
    (
        "track alone",
        "track_indices",
        torch.zeros(BS, dtype=torch.long, device=DEVICE),
        ValueError,
        r"`track_indices` and `track_mask` must be given together",
    ),
    (
        "out dtype",
        "out",
        torch.zeros(BS, H, P, dtype=torch.bfloat16, device=DEVICE),
        TypeError,
        r"`out` must have dtype",
    ),
    (
        "state 3d",
        "state",
        torch.zeros(SLOTS, H, P, device=DEVICE),
        ValueError,
        r"`state` must have shape",
    ),
    ("x not tensor", "x", [1.0], TypeError, r"`x` must be a torch.Tensor"),
]
if DEVICE.type == "cuda":
    SSM_BAD.append(("x on cpu", "x", torch.zeros(BS, H, P), ValueError, r"`x` must be on"))


@pytest.mark.parametrize(
    ("case", "name", "value", "exc", "match"), SSM_BAD, ids=[c[0] for c in SSM_BAD]
)
def test_ssm_rejects_bad_argument_and_writes_nothing(
    case: str, name: str, value: Any, exc: type[Exception], match: str
) -> None:
    a = _ssm_args()
    a[name] = value
    if name != "out":
        a["out"] = torch.full((BS, H, P), float("nan"), device=DEVICE)
    # Every tensor passed (the state, the NaN output, the bad value itself) stays unwritten.
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=match):
        _call_ssm(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


def test_ssm_debug_mode_checks_indices() -> None:
    a = _ssm_args()
    before = a["state"].clone()
    a["state_indices"] = torch.tensor([2, SLOTS, 1], device=DEVICE)
    with (
        debug_mode(),
        pytest.raises(
            ValueError, match=r"`state_indices` values must be -1 \(pad\) or in \[0, 8\); row 1"
        ),
    ):
        _call_ssm(a)
    a["state_indices"] = torch.tensor([2, -1, 2], device=DEVICE)
    with debug_mode(), pytest.raises(ValueError, match=r"slot 2 is written twice"):
        _call_ssm(a)
    a["state_indices"] = torch.tensor([2, -1, 3], device=DEVICE)
    a["track_indices"] = torch.tensor([3, 0, 7], device=DEVICE)
    a["track_mask"] = torch.tensor([True, False, False], device=DEVICE)
    # Row 0 would store its track copy into the slot row 2 reads and writes.
    with debug_mode(), pytest.raises(ValueError, match=r"slot 3 is written twice"):
        _call_ssm(a)
    a["dst_indices"] = torch.tensor([6, -1, 4], device=DEVICE)
    with (
        debug_mode(),
        pytest.raises(ValueError, match=r"slot 3 is read by `state_indices` of row 2"),
    ):
        _call_ssm(a)
    assert torch.equal(a["state"], before)


def test_ssm_pad_and_dst_semantics() -> None:
    a = _ssm_args()
    a["dst_indices"] = torch.tensor([7, 0, -1], device=DEVICE)
    state0 = a["state"].clone()
    ref_state, ref_out = ssm_state_update_ref(
        state0, a["x"], a["dt"], a["A"], a["B"], a["C"], a["state_indices"], D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, dst_indices=a["dst_indices"],
    )  # fmt: skip
    out = torch.full((BS, H, P), float("nan"), device=DEVICE)
    _call_ssm({**a, "out": out})
    assert bool((out[1] == 0).all())  # pad row
    assert_close(out, ref_out, "out")
    # Row 0 read slot 2 and wrote slot 7; row 2 wrote nothing; slot 0 (a pad row's dst) kept.
    assert torch.equal(a["state"][[0, 1, 2, 3, 4, 5, 6]], state0[[0, 1, 2, 3, 4, 5, 6]])
    assert_close(a["state"][7], ref_state[7], "dst slot")
    assert not torch.equal(a["state"][7], state0[7])


def test_ssm_bs_zero_is_a_no_op() -> None:
    a = _ssm_args()
    for k in ("x", "dt", "B", "C", "z", "state_indices"):
        a[k] = a[k][:0]
    before = a["state"].clone()
    out = _call_ssm(a)
    assert out.shape == (0, H, P)
    assert torch.equal(a["state"], before)


def _conv_args() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(BS, 24, generator=g).to(DEVICE),
        "conv_state": torch.randn(SLOTS, 24, 3, generator=g).to(DEVICE),
        "weight": torch.randn(24, 4, generator=g).to(DEVICE),
        "bias": torch.randn(24, generator=g).to(DEVICE),
        "cache_indices": torch.tensor([1, -1, 4], device=DEVICE),
    }


def _call_conv(a: dict[str, Any]) -> torch.Tensor:
    rest = {k: v for k, v in a.items() if k not in ("x", "conv_state", "weight")}
    return causal_conv1d_update(a["x"], a["conv_state"], a["weight"], **rest)


CONV_BAD: list[tuple[str, str, Any, type[Exception], str]] = [
    (
        "weight k",
        "weight",
        torch.zeros(24, 3, device=DEVICE),
        ValueError,
        r"`weight` must have shape \[conv_dim, k\]",
    ),
    (
        "x dim",
        "x",
        torch.zeros(BS, 23, device=DEVICE),
        ValueError,
        r"`x` must have shape \[bs, conv_dim\]",
    ),
    ("bias", "bias", torch.zeros(25, device=DEVICE), ValueError, r"`bias` must have shape"),
    (
        "idx",
        "cache_indices",
        torch.zeros(BS, dtype=torch.bool, device=DEVICE),
        TypeError,
        r"`cache_indices` must have dtype",
    ),
    (
        "activation",
        "activation",
        "gelu",
        ValueError,
        r"`activation` must be None, 'silu' or 'swish'",
    ),
    (
        "state dtype",
        "conv_state",
        torch.zeros(SLOTS, 24, 3, dtype=torch.int8, device=DEVICE),
        TypeError,
        r"`conv_state` must have dtype",
    ),
]


@pytest.mark.parametrize(
    ("case", "name", "value", "exc", "match"), CONV_BAD, ids=[c[0] for c in CONV_BAD]
)
def test_conv_rejects_bad_argument_and_writes_nothing(
    case: str, name: str, value: Any, exc: type[Exception], match: str
) -> None:
    a = _conv_args()
    a[name] = value
    a["out"] = torch.full((BS, 24), float("nan"), device=DEVICE)
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=match):
        _call_conv(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


def test_conv_debug_mode_checks_indices() -> None:
    a = _conv_args()
    before = a["conv_state"].clone()
    a["cache_indices"] = torch.tensor([1, -2, 4], device=DEVICE)
    with debug_mode(), pytest.raises(ValueError, match=r"`cache_indices` values must be -1"):
        _call_conv(a)
    a["cache_indices"] = torch.tensor([4, -1, 4], device=DEVICE)
    with debug_mode(), pytest.raises(ValueError, match=r"slot 4 is written twice"):
        _call_conv(a)
    assert torch.equal(a["conv_state"], before)


def _pools() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(2, SLOTS, 6, 3, generator=g).to(DEVICE, torch.bfloat16),
        torch.randn(2, SLOTS, 2, 3, 4, generator=g).to(DEVICE),
    )


def test_track_save_rejects_bad_arguments() -> None:
    conv, ssm = _pools()
    idx = torch.tensor([0, 1], device=DEVICE)
    m = torch.tensor([True, True], device=DEVICE)
    with pytest.raises(ValueError, match=r"`conv_pool` must have shape \[layers, slots"):
        track_save(conv[:1], ssm, src_indices=idx, track_indices=idx + 2, track_mask=m)
    with pytest.raises(ValueError, match=r"`ssm_pool` must be contiguous within each slot"):
        track_save(conv, ssm.transpose(3, 4), src_indices=idx, track_indices=idx + 2, track_mask=m)
    with pytest.raises(TypeError, match=r"`ssm_pool` must have dtype bfloat16/float16/float32"):
        track_save(conv, ssm.int(), src_indices=idx, track_indices=idx + 2, track_mask=m)
    with pytest.raises(ValueError, match=r"`ssm_pool` must have shape \[layers, slots, nheads"):
        track_save(conv, ssm[0], src_indices=idx, track_indices=idx + 2, track_mask=m)
    with pytest.raises(TypeError, match=r"`track_mask` must have dtype bool"):
        track_save(conv, ssm, src_indices=idx, track_indices=idx + 2, track_mask=idx)
    with pytest.raises(ValueError, match=r"`track_indices` must have shape \[bs\]"):
        track_save(conv, ssm, src_indices=idx, track_indices=idx[:1], track_mask=m)
    with debug_mode(), pytest.raises(ValueError, match=r"slot 1 is read by `src_indices` of row 1"):
        track_save(conv, ssm, src_indices=idx, track_indices=idx + 1, track_mask=m)
    fresh_conv, fresh_ssm = _pools()
    assert torch.equal(conv, fresh_conv)
    assert torch.equal(ssm, fresh_ssm)


def _hybridmeta_ops(fn: Callable[[], object]) -> list[str]:
    with OpLog() as rec:
        fn()
    return [o for o in rec.ops if o.startswith("hybridmeta.")]


def test_each_launch_is_one_dispatched_op() -> None:
    a = _ssm_args()
    out = torch.empty(BS, H, P, device=DEVICE)
    assert _hybridmeta_ops(lambda: _call_ssm({**a, "out": out})) == [
        "hybridmeta.ssm_state_update.default"
    ]
    c = _conv_args()
    assert _hybridmeta_ops(
        lambda: causal_conv1d_update(
            c["x"], c["conv_state"], c["weight"], c["bias"], cache_indices=c["cache_indices"]
        )
    ) == ["hybridmeta.causal_conv1d_update.default"]
    conv, ssm = _pools()
    idx = torch.tensor([0], device=DEVICE)
    assert _hybridmeta_ops(
        lambda: track_save(conv, ssm, src_indices=idx, track_indices=idx + 3, track_mask=idx >= 0)
    ) == ["hybridmeta.track_save.default"]
    schema = torch.ops.hybridmeta.ssm_state_update.default._schema
    mutated = {
        arg.name
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    }
    assert mutated == {"state", "out", "errors"}


def test_metadata_entries_use_slots_and_track_fields() -> None:
    a = _ssm_args()
    src = torch.tensor([2, -1, 5], device=DEVICE)
    trk = torch.tensor([6, -1, 0], device=DEVICE)
    mask = torch.tensor([True, False, False], device=DEVICE)
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(BS + 1, device=DEVICE),
        mamba_cache_indices=src,
        mamba_track_indices=trk,
        mamba_track_mask=mask,
        has_mamba_track_mask=True,
    )
    md = prepare_decode(fwd)
    state0 = a["state"].clone()
    ref_state, ref_out = ssm_state_update_ref(
        state0, a["x"], a["dt"], a["A"], a["B"], a["C"], src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, track_indices=trk, track_mask=mask,
    )  # fmt: skip
    out = ssm_state_update_from_metadata(
        md, a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, fuse_track=True,
    )  # fmt: skip
    assert_close(out, ref_out, "out")
    assert_close(a["state"], ref_state, "state")
    assert torch.equal(a["state"][6], a["state"][2])  # fused track copy

    c = _conv_args()
    ref_cs, ref_co = causal_conv1d_update_ref(
        c["x"], c["conv_state"], c["weight"], c["bias"], src, silu=True
    )
    co = causal_conv1d_update_from_metadata(md, c["x"], c["conv_state"], c["weight"], c["bias"])
    assert_close(co, ref_co, "conv out")
    assert torch.equal(c["conv_state"], ref_cs)

    conv, ssm = _pools()
    ref_conv, ref_ssm = track_save_ref(conv, ssm, src, trk, mask)
    track_save_from_metadata(md, conv, ssm)
    assert torch.equal(conv, ref_conv)
    assert torch.equal(ssm, ref_ssm)

    with pytest.raises(
        ValueError, match=r"the metadata has 3 decode rows but the inputs have bs=2"
    ):
        ssm_state_update_from_metadata(
            md, a["state"], a["x"][:2], a["dt"][:2], a["A"], a["B"][:2], a["C"][:2]
        )


def test_ssm_tile_carries_4_kib_of_state() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        cfg = ssm_launch_config(dtype, 80, 128)
        tile = cfg.block_p * 128 * torch.empty((), dtype=dtype).element_size()
        assert tile == 4096
    assert ssm_launch_config(torch.float32, 3, 128).block_p == 4  # never above headdim's pow2


def test_direct_and_dispatched_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an observer the kernel is launched directly; through the op it is the same."""
    import hybridmeta.kernels._dispatch as ops

    results = []
    for forced in (False, True):
        monkeypatch.setattr(ops, "ALWAYS_DISPATCH", forced)
        a = _ssm_args()
        out = _call_ssm(a)
        c = _conv_args()
        co = causal_conv1d_update(
            c["x"], c["conv_state"], c["weight"], c["bias"], cache_indices=c["cache_indices"]
        )
        results.append((out, a["state"], co, c["conv_state"]))
    for direct, dispatched in zip(results[0], results[1], strict=True):
        assert torch.equal(bits(direct), bits(dispatched))


def test_every_op_runs_under_fake_tensors() -> None:
    """Each launch is a torch.library op with a fake: shape propagation (torch.compile,
    meta analysis) runs every op without touching data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = OpLog()
    with FakeTensorMode(), seen:
        a = _ssm_args()
        _call_ssm(a)
        c = _conv_args()
        causal_conv1d_update(
            c["x"], c["conv_state"], c["weight"], c["bias"], cache_indices=c["cache_indices"]
        )
        conv, ssm = _pools()
        track_save(
            conv, ssm, src_indices=torch.tensor([0, 1], device=DEVICE),
            track_indices=torch.tensor([2, 3], device=DEVICE),
            track_mask=torch.tensor([True, False], device=DEVICE),
        )  # fmt: skip
    assert [op for op in seen.ops if op.startswith("hybridmeta.")] == [
        "hybridmeta.ssm_state_update.default",
        "hybridmeta.causal_conv1d_update.default",
        "hybridmeta.track_save.default",
    ]


@pytest.mark.parametrize("name", ['state_indices', 'A', 'D', 'dt_bias'])
def test_strided_1d_argument_is_refused_and_writes_nothing(name: str) -> None:
    """The kernels read entry ``i`` of a 1-D argument at offset ``i``: a strided view would
    hand them other rows' values (and other slots to write)."""
    a = _ssm_args()
    a[name] = strided(a[name])
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=rf"`{name}` must be contiguous"):
        _call_ssm(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


@pytest.mark.parametrize("name", ["cache_indices", "bias"])
def test_conv_strided_1d_argument_is_refused_and_writes_nothing(name: str) -> None:
    a = _conv_args()
    a[name] = strided(a[name])
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=rf"`{name}` must be contiguous"):
        _call_conv(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


@pytest.mark.parametrize("name", ["src_indices", "track_indices", "track_mask"])
def test_track_save_strided_1d_argument_is_refused_and_writes_nothing(name: str) -> None:
    conv, ssm = _pools()
    a: dict[str, torch.Tensor] = {
        "src_indices": torch.tensor([0, 1], device=DEVICE),
        "track_indices": torch.tensor([2, 3], device=DEVICE),
        "track_mask": torch.tensor([True, True], device=DEVICE),
    }
    a[name] = strided(a[name])
    with pytest.raises(ValueError, match=rf"`{name}` must be contiguous"):
        track_save(
            conv,
            ssm,
            src_indices=a["src_indices"],
            track_indices=a["track_indices"],
            track_mask=a["track_mask"],
        )
    fresh_conv, fresh_ssm = _pools()
    assert torch.equal(conv, fresh_conv)
    assert torch.equal(ssm, fresh_ssm)
