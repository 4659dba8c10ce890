"""On a GPU: bf16 weights, real CUDA graphs. Cache hits ~ cold recompute, replay == eager.

Skipped where CUDA is absent (see tests/conftest.py); the lead runs them with
``PYTHONPATH=src python3 -m pytest tests/runtime -m gpu``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hybridmeta.kernels import Impl, implementation
from hybridmeta.runtime.engine import Finished, Runtime, RuntimeOptions
from hybridmeta.runtime.job import kl_per_position, main_job
from hybridmeta.runtime.loader import load_nemotron_h
from hybridmeta.runtime.model import NemotronH

pytestmark = pytest.mark.gpu

KL_BF16_MEAN = 5e-4


@pytest.fixture(scope="module")
def bf16_model(tiny_dir: Path) -> NemotronH:
    return load_nemotron_h(tiny_dir, device="cuda", dtype=torch.bfloat16)


def _opts(**kw: object) -> RuntimeOptions:
    base: dict[str, object] = {
        "num_working": 4,
        "num_track": 16,
        "max_len": 96,
        "track_interval": 16,
        "max_prefill_tokens": 64,
    }
    base.update(kw)
    return RuntimeOptions(**base)  # type: ignore[arg-type]


def _workload(rt: Runtime, forced: Sequence[tuple[int, ...]] | None = None) -> list[Finished]:
    gen = torch.Generator().manual_seed(0)
    firsts = [[int(t) for t in torch.randint(0, 96, (n,), generator=gen)] for n in (21, 27, 30)]
    out: list[Finished] = []
    rids = [
        rt.submit(p, 16, forced=None if forced is None else forced[i]) for i, p in enumerate(firsts)
    ]
    done = rt.run()
    out.extend(done[r] for r in rids)
    conts = []
    for f in list(out):
        conts.append([*list(f.tokens[:18]), 1, 2])  # prefill-made boundary 16
        conts.append([*list(f.tokens[:34]), 3])  # decode-made boundary 32
    rids = [
        rt.submit(p, 8, forced=None if forced is None else forced[len(firsts) + i])
        for i, p in enumerate(conts)
    ]
    done = rt.run()
    out.extend(done[r] for r in rids)
    return out


def test_real_cuda_graphs_are_used(bf16_model: NemotronH) -> None:
    rt = Runtime(bf16_model, _opts())
    assert rt.graphs is not None
    assert rt.graphs.backend_name == "cuda"


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_cache_hits_match_cold_recompute_bf16(bf16_model: NemotronH, kernels: Impl) -> None:
    with implementation(kernels):
        hit = _workload(Runtime(bf16_model, _opts()))
        forced = [f.output for f in hit]
        cold = _workload(Runtime(bf16_model, _opts(use_prefix_cache=False)), forced)
    hits = [i for i, f in enumerate(hit) if f.cached_tokens > 0]
    assert sorted({hit[i].cached_tokens for i in hits}) == [16, 32]
    kl = torch.cat([kl_per_position(hit[i].logprobs, cold[i].logprobs) for i in hits])
    assert float(kl.mean()) <= KL_BF16_MEAN, kl


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_graph_replay_equals_eager_bf16(bf16_model: NemotronH, kernels: Impl) -> None:
    with implementation(kernels):
        graph = _workload(Runtime(bf16_model, _opts()))
        forced = [f.output for f in graph]
        eager = _workload(Runtime(bf16_model, _opts(use_graphs=False)), forced)
    kl = torch.cat(
        [kl_per_position(g.logprobs, e.logprobs) for g, e in zip(graph, eager, strict=True)]
    )
    assert float(kl.mean()) <= KL_BF16_MEAN, kl


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_main_job_on_cuda(kernels: str) -> None:
    out = io.StringIO()
    rc = main_job(["--device", "cuda", "--quiet", "--kernels", kernels], out=out)
    text = out.getvalue()
    print(text)  # the table, for the GPU run's log
    assert rc == 0, text
    assert f"graph replay (cuda, {kernels} kernels) vs eager" in text


def test_overlapped_decode_equals_synchronous_on_cuda(bf16_model: NemotronH) -> None:
    """Tokens fed to the next step on the device (its host work overlapping the forward)
    give exactly the synchronous loop's outputs, bit for bit, with real CUDA graphs."""
    with implementation("triton"):
        over_rt = Runtime(bf16_model, _opts())
        over = _workload(over_rt)
        sync = _workload(Runtime(bf16_model, _opts(overlap_decode=False)))
    assert over_rt.overlapped_steps > 0
    for o, s in zip(over, sync, strict=True):
        assert o.output == s.output
        assert torch.equal(o.logprobs, s.logprobs)
