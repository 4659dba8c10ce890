"""The main job end to end on the embedded tiny model, and that it fails loudly."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from hybridmeta import kernels
from hybridmeta.model import Mamba2Metadata
from hybridmeta.runtime import job as job_module
from hybridmeta.runtime.job import main_job
from hybridmeta.runtime.tiny import write_tiny_checkpoint


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    rc = main_job(argv, out=out)
    return rc, out.getvalue()


def test_main_job_passes_on_the_embedded_default() -> None:
    pytest.importorskip("transformers")
    rc, text = _run(["--device", "cpu", "--quiet", "--prompts", "4"])
    assert rc == 0, text
    assert "all checks passed" in text
    for row in (
        "graph replay (emulated, reference kernels) vs eager",
        "cache hit vs cold recompute",
        "hits at prefill-made boundaries",
        "hits at decode-made boundaries",
        "agreement with transformers",
        "decode tokens/s graph vs eager",
        "prefix cache hit rate",
    ):
        line = next(ln for ln in text.splitlines() if ln.startswith(row))
        assert "FAIL" not in line
    hf_line = next(ln for ln in text.splitlines() if ln.startswith("agreement with transformers"))
    assert "PASS" in hf_line
    assert "8 requests" in hf_line  # 4 prompts + 2 continuations of each of the first 2


def test_main_job_fails_when_tracked_state_is_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stale-tail defect's symptom: the decode track-save copies slot 0 (a never-refreshed
    row) instead of the live row's slot; the job must notice and exit non-zero."""

    def stale(
        md: Mamba2Metadata, conv_pool: torch.Tensor, ssm_pool: torch.Tensor, **kw: object
    ) -> None:
        if not md.has_mamba_track_mask:
            return
        assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
        src = torch.zeros_like(md.mamba_cache_indices)  # a row nobody refreshed: slot 0
        kernels.track_save_reference(
            conv_pool, ssm_pool, src, md.mamba_track_indices, md.mamba_track_mask
        )

    monkeypatch.setattr(kernels, "track_save_from_metadata", stale)
    rc, text = _run(["--device", "cpu", "--quiet", "--prompts", "3", "--no-transformers"])
    assert rc == 1
    fail = next(ln for ln in text.splitlines() if ln.startswith("cache hit vs cold recompute"))
    assert "FAIL" in fail
    assert "cache hit vs cold recompute" in text.splitlines()[-1]


def test_main_job_on_a_model_dir_with_the_reference_ops(tiny_dir: Path) -> None:
    rc, text = _run(
        [
            "--quiet",
            "--model",
            str(tiny_dir),
            "--device",
            "cpu",
            "--prompts",
            "2",
            "--kernels",
            "reference",
            "--no-transformers",
            "--slots",
            "1",
        ]
    )
    assert rc == 0, text
    assert "Mamba2 ops: reference" in text
    assert "1 working / 16 track slots" in text


def test_main_job_refuses_an_unsupported_model(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path / "moe")
    raw = json.loads((d / "config.json").read_text())
    raw["hybrid_override_pattern"] = "ME"
    (d / "config.json").write_text(json.dumps(raw))
    rc, text = _run(["--device", "cpu", "--quiet", "--model", str(d)])
    assert rc == 2
    assert "MoE 'E' layers are not supported" in text


def test_main_job_refuses_cuda_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    rc, text = _run(["--device", "cuda"])
    assert rc == 2
    assert "CUDA is not available" in text


def test_tolerances_are_stricter_for_fp32() -> None:
    f32 = job_module.Tolerances.for_dtype(torch.float32)
    bf16 = job_module.Tolerances.for_dtype(torch.bfloat16)
    assert f32.hit_vs_cold == 1e-6 and f32.reduce == "max"
    assert bf16.hit_vs_cold == 5e-4 and bf16.reduce == "mean"
    # what the name claims: every fp32 limit is tighter than its bf16 counterpart
    for name in ("graph_vs_eager", "hit_vs_cold", "transformers"):
        assert getattr(f32, name) < getattr(bf16, name), name


def test_kl_per_position_is_zero_on_itself_and_positive_otherwise() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(5, 11, generator=gen).log_softmax(-1)
    q = torch.randn(5, 11, generator=gen).log_softmax(-1)
    assert torch.equal(job_module.kl_per_position(p, p), torch.zeros(5, dtype=torch.float64))
    kl = job_module.kl_per_position(p, q)
    ref = (p.double().exp() * (p.double() - q.double())).sum(-1)
    torch.testing.assert_close(kl, ref)
    assert bool((kl > 0).all())
