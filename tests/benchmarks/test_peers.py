"""benchmarks/peers.py without the GPU: clean degradation, and what each adapter hands
the peer (recorded by a stand-in for the peer's ``selective_state_update``)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import peers

H, P, N, G = 4, 3, 8, 2


@pytest.fixture(autouse=True)
def _fresh_loads() -> None:
    peers._load.cache_clear()


def _no_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    missing = tmp_path / "nothing-here"
    monkeypatch.setenv(peers.ENV_VAR, str(missing))
    return missing


def test_without_bundle_every_peer_is_unavailable_with_a_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = _no_bundle(tmp_path, monkeypatch)
    assert peers.bundle_path() == missing.resolve()
    for name in peers.PEERS:
        assert peers.single_token(name) is None
        assert peers.multi_token(name) is None
        reason = peers.why_unavailable(name)
        assert reason is not None
        assert str(missing / "py") in reason
        assert "fetch_peers.sh" in reason
        p = peers.peer(name)
        assert (p.name, p.version, p.reason) == (name, None, reason)
    assert peers.versions() == {}


def test_setup_without_bundle_raises_and_names_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = _no_bundle(tmp_path, monkeypatch)
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        peers.setup()
    assert str(missing / "py") not in __import__("sys").path


def test_unknown_peer_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown peer 'triton'.*flashinfer"):
        peers.single_token("triton")
    with pytest.raises(ValueError, match="unknown peer"):
        peers.why_unavailable("FlashInfer")


def test_broken_peer_reports_its_import_error_and_the_others_stay_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "bundle"
    pkg = bundle / "py" / "peer_vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('vllm shim broken on purpose')\n")
    (bundle / "VERSIONS.json").write_text(json.dumps({"vllm": {"version": "0.33.0"}}))
    monkeypatch.setenv(peers.ENV_VAR, str(bundle))
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    reason = peers.why_unavailable("vllm")
    assert reason is not None
    assert "peer_vllm" in reason
    assert "broken on purpose" in reason
    assert peers.peer("vllm").version == "0.33.0"
    assert peers.single_token("vllm") is None
    # mamba_ssm is simply absent from this bundle: its own import error, not vllm's
    other = peers.why_unavailable("mamba_ssm")
    assert other is not None
    assert "peer_mamba_ssm" in other


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_importable_peer_without_cuda_says_it_needs_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "bundle"
    pkg = bundle / "py" / "peer_sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def selective_state_update(*a, **k):\n    pass\n")
    monkeypatch.setenv(peers.ENV_VAR, str(bundle))
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    monkeypatch.delitem(__import__("sys").modules, "peer_sglang", raising=False)
    reason = peers.why_unavailable("sglang")
    assert reason is not None
    assert "CUDA" in reason
    assert peers.single_token("sglang") is None


# ---------------------------------------------------------------- adapters, recorded


class Recorder:
    def __init__(self, ret: torch.Tensor | None = None) -> None:
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.ret = ret

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        self.args, self.kwargs = args, kwargs
        return self.ret


def _single(bs: int = 3) -> dict[str, Any]:
    return {
        "state": torch.randn(5, H, P, N),
        "x": torch.randn(bs, H, P).bfloat16(),
        "dt": torch.randn(bs, H).bfloat16(),
        "A": -torch.rand(H),
        "B": torch.randn(bs, G, N).bfloat16(),
        "C": torch.randn(bs, G, N).bfloat16(),
        "state_indices": torch.tensor([2, -1, 0][:bs]),
        "D": torch.randn(H),
        "z": torch.randn(bs, H, P).bfloat16(),
        "dt_bias": torch.randn(H),
        "dt_softplus": True,
    }


def _call_single(adapter: Any, rec: Recorder, **kw: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    single, _ = adapter(rec)
    given = _single() | kw
    a = dict(given)
    out = single(a.pop("state"), a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"),
                 **a)  # fmt: skip
    return out, given


def _is_tied(A: torch.Tensor, dt: torch.Tensor, per_head: list[torch.Tensor]) -> None:
    assert A.shape == (H, P, N)
    assert A.stride() == (1, 0, 0)
    assert dt.stride()[-1] == 0
    for v in per_head:
        assert v.shape == (H, P)
        assert v.stride() == (1, 0)


def test_flashinfer_single_casts_dt_to_D_dtype_and_passes_pad_minus_one() -> None:
    rec = Recorder()
    out, given = _call_single(peers._flashinfer, rec)
    _state, x, dt, A, _B, _C, D = rec.args
    assert dt.dtype == torch.float32  # D is fp32, FlashInfer wants dt in D's dtype
    assert dt.shape == (3, H, P)
    assert torch.equal(dt[:, :, 0], given["dt"].float())
    assert torch.equal(D[:, 0], given["D"])
    _is_tied(A, dt, [D, rec.kwargs["dt_bias"]])
    assert rec.kwargs["pad_slot_id"] == -1
    assert rec.kwargs["out"] is out
    assert out.shape == x.shape
    assert out.dtype == x.dtype
    assert rec.kwargs["state_batch_indices"].tolist() == [2, -1, 0]


def test_vllm_single_overrides_its_null_block_zero_with_minus_one() -> None:
    rec = Recorder()
    _call_single(peers._vllm, rec, D=None, dt_bias=None)
    _state, _x, dt, A, _B, _C, D, dt_bias = rec.args
    assert rec.kwargs["null_block_id"] == -1
    _is_tied(A, dt, [D, dt_bias])
    assert not D.any()  # a missing D / dt_bias becomes zeros: vLLM needs both
    assert not dt_bias.any()


def test_sglang_and_mamba_ssm_always_get_D_and_dt_bias() -> None:
    rec = Recorder()
    _call_single(peers._sglang, rec, D=None, dt_bias=None)
    assert rec.kwargs["D"] is not None
    assert rec.kwargs["dt_bias"] is not None
    assert rec.kwargs["pad_slot_id"] == -1
    given = torch.randn(3, H, P).bfloat16()
    rec = Recorder(ret=given)
    out = torch.zeros(3, H, P).bfloat16()
    res, _ = _call_single(peers._mamba_ssm, rec, D=None, out=out)
    assert res is out
    assert torch.equal(out, given)  # mamba_ssm allocates; `out` gets a copy
    assert rec.args[6] is not None  # D
    assert rec.args[8] is not None  # dt_bias
    assert peers._mamba_ssm(rec)[1] is None  # no multi-token entry point


def test_single_token_refuses_multi_token_shapes() -> None:
    with pytest.raises(ValueError, match=r"`x` must be \[bs, H, P\]"):
        _call_single(peers._sglang, Recorder(), x=torch.randn(3, 2, H, P))


def _pool(bs: int, t: int, slots: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    pool = torch.zeros(slots + bs * t, H, P, N)
    return pool[:slots], pool[slots:].view(bs, t, H, P, N)


def _multi(bs: int, t: int) -> dict[str, Any]:
    return {
        "x": torch.randn(bs, t, H, P).bfloat16(),
        "dt": torch.randn(bs, t, H).bfloat16(),
        "A": -torch.rand(H),
        "B": torch.randn(bs, t, G, N).bfloat16(),
        "C": torch.randn(bs, t, G, N).bfloat16(),
        "state_indices": torch.tensor([3, -1, 1][:bs]),
        "D": torch.randn(H),
        "dt_bias": torch.randn(H),
    }


def test_vllm_multi_writes_token_states_into_the_pool_slots_of_the_buffer() -> None:
    bs, t = 3, 4
    state, inter = _pool(bs, t)
    rec = Recorder()
    _, multi = peers._vllm(rec)
    assert multi is not None
    a = _multi(bs, t)
    out = multi(state, a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"),
                intermediate_states=inter, **a)  # fmt: skip
    assert out.shape == (bs, t, H, P)
    x = rec.args[1]
    assert x.shape == (bs * t, H, P)
    kw = rec.kwargs
    dst = kw["dst_state_batch_indices"]
    assert dst[0].tolist() == [5, 6, 7, 8]  # buffer starts at pool slot 5
    assert dst[1].tolist() == [-1] * t  # pad row: no state written
    assert dst[2].tolist() == [13, 14, 15, 16]
    assert kw["state_batch_indices"].tolist() == [[3], [-1], [1]]
    assert kw["num_accepted_tokens"].tolist() == [1, 1, 1]
    assert kw["cu_seqlens"].tolist() == [0, 4, 8, 12]
    assert kw["null_block_id"] == -1
    assert kw["out"].data_ptr() == out.data_ptr()


def test_vllm_multi_refuses_a_buffer_outside_the_pool() -> None:
    bs, t = 2, 2
    state = torch.zeros(4, H, P, N)
    _, multi = peers._vllm(Recorder())
    assert multi is not None
    a = _multi(bs, t)
    with pytest.raises(ValueError, match="same allocation"):
        multi(state, a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"),
              intermediate_states=torch.zeros(bs, t, H, P, N), **a)  # fmt: skip


def test_pool_slot_needs_a_slot_boundary() -> None:
    pool = torch.zeros(10, H, P, N)
    assert peers._pool_slot(pool[:5], pool[5:9].view(2, 2, H, P, N)) == 5
    flat = pool.view(-1)
    shifted = flat[5 * H * P * N + 1 :][: 2 * 2 * H * P * N].view(2, 2, H, P, N)
    with pytest.raises(ValueError, match="slot boundary"):
        peers._pool_slot(pool[:5], shifted)


@pytest.mark.parametrize("adapter", [peers._flashinfer, peers._sglang])
def test_buffer_peers_get_disable_state_update_and_row_entries(adapter: Any) -> None:
    bs, t = 3, 4
    state, inter = _pool(bs, t)
    rec = Recorder()
    _, multi = adapter(rec)
    assert multi is not None
    a = _multi(bs, t)
    multi(state, a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"),
          intermediate_states=inter, **a)  # fmt: skip
    kw = rec.kwargs
    assert kw["disable_state_update"] is True
    assert kw["intermediate_states_buffer"] is inter
    assert kw["cache_steps"] == t
    assert kw["intermediate_state_indices"].tolist() == [0, 1, 2]
    assert kw["intermediate_state_indices"].dtype == kw["state_batch_indices"].dtype
    dt = rec.args[2]
    assert dt.shape == (bs, t, H, P)
    assert dt.stride()[-1] == 0


def test_multi_token_checks_the_buffer_shape_and_trees() -> None:
    bs, t = 3, 4
    state, inter = _pool(bs, t)
    _, multi = peers._flashinfer(Recorder())
    assert multi is not None
    a = _multi(bs, t)
    args = (state, a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"))
    with pytest.raises(ValueError, match="intermediate_states"):
        multi(*args, intermediate_states=inter[:, :2], **a)
    with pytest.raises(ValueError, match="flashinfer: `parent_token`"):
        multi(*args, intermediate_states=inter, parent_token=torch.zeros(bs, t), **a)


# ---------------------------------------------------------------- FlashInfer prebuilt modules


def _aot_archive(path: Path, member: str, payload: bytes = b"\x7fELF fake") -> None:
    with tarfile.open(path, "w:xz") as tar:
        info = tarfile.TarInfo(member)
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))


def test_setup_unpacks_prebuilt_flashinfer_modules_into_the_package(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "py").mkdir(parents=True)
    (bundle / "flashinfer_aot").mkdir()
    uri = "selective_state_update_s_f32_nt_1_sm90"
    _aot_archive(bundle / "flashinfer_aot" / f"{uri}.tar.xz", f"aot/{uri}/{uri}.so")
    assert peers._install_flashinfer_aot(bundle) == [uri]
    so = bundle / "py" / "flashinfer" / "data" / "aot" / uri / f"{uri}.so"
    assert so.read_bytes() == b"\x7fELF fake"
    so.write_bytes(b"kept")  # already there: not unpacked again
    assert peers._install_flashinfer_aot(bundle) == [uri]
    assert so.read_bytes() == b"kept"


def test_a_foreign_archive_is_refused_and_makes_the_peers_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "bundle"
    (bundle / "py").mkdir(parents=True)
    (bundle / "flashinfer_aot").mkdir()
    _aot_archive(bundle / "flashinfer_aot" / "evil.tar.xz", "../outside.so")
    with pytest.raises(ValueError, match=r"evil\.tar\.xz.*not a file under aot/"):
        peers._install_flashinfer_aot(bundle)
    assert not (bundle / "py" / "outside.so").exists()
    assert not (tmp_path / "outside.so").exists()
    monkeypatch.setenv(peers.ENV_VAR, str(bundle))
    reason = peers.why_unavailable("flashinfer")
    assert reason is not None
    assert "evil.tar.xz" in reason
