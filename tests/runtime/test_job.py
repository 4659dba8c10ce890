"""The main job end to end on the embedded tiny model, and that it fails loudly."""

from __future__ import annotations

import io
import json
import math
import re
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


def test_main_job_passes_on_the_embedded_default(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    rc, text = _run(["--device", "cpu", "--quiet", "--prompts", "4"])
    assert rc == 0, text
    # --quiet: no progress at all, transformers' weight-loading bar and warnings included
    # (captured at the file-descriptor level, where tqdm and logging write)
    assert capfd.readouterr().err == ""
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


def test_progress_goes_to_stderr_and_the_table_to_stdout(tiny_dir: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    argv = ["--model", str(tiny_dir), "--prompts", "1", "--no-transformers", "--device", "cpu"]
    assert main_job(argv, out=out, err=err) == 0
    assert err.getvalue().startswith(f"[1/5] loading {tiny_dir} on cpu")
    assert "[4/5] cold recompute run" in err.getvalue()
    progress = re.compile(r"\bstep +\d+:")  # the per-step progress line
    assert progress.search(err.getvalue()) and not progress.search(out.getvalue())
    assert out.getvalue().splitlines()[-1] == "all checks passed"
    assert "[1/5]" not in out.getvalue()


def test_main_job_refuses_an_unsupported_model(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path / "moe")
    raw = json.loads((d / "config.json").read_text())
    raw["hybrid_override_pattern"] = "ME"
    (d / "config.json").write_text(json.dumps(raw))
    out, err = io.StringIO(), io.StringIO()
    rc = main_job(["--device", "cpu", "--quiet", "--model", str(d)], out=out, err=err)
    assert rc == 2
    assert out.getvalue() == ""
    assert "MoE 'E' layers are not supported" in err.getvalue()


def test_tolerances_are_stricter_for_fp32() -> None:
    f32 = job_module.Tolerances.for_dtype(torch.float32)
    bf16 = job_module.Tolerances.for_dtype(torch.bfloat16)
    assert f32.hit_vs_cold == 1e-6 and f32.reduce == "max"
    assert bf16.hit_vs_cold == 5e-4 and bf16.reduce == "mean"
    # what the name claims: every fp32 limit is tighter than its bf16 counterpart
    for name in ("graph_vs_eager", "hit_vs_cold", "transformers"):
        assert getattr(f32, name) < getattr(bf16, name), name


def _kl_reference(p: torch.Tensor, q: torch.Tensor) -> list[float]:
    """KL(p || q) per row in float64, scalar by scalar with exact sums (``math.fsum``).

    ``kl_per_position`` renormalises both inputs in float64 before it sums; so does this,
    so neither result depends on how the CPU vectorises an fp32 ``log_softmax``.
    """

    def log_normalise(row: list[float]) -> list[float]:
        m = max(row)
        lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
        return [x - lse for x in row]

    out = []
    for p_row, q_row in zip(p.double().tolist(), q.double().tolist(), strict=True):
        lp, lq = log_normalise(p_row), log_normalise(q_row)
        out.append(math.fsum(math.exp(a) * (a - b) for a, b in zip(lp, lq, strict=True)))
    return out


def test_kl_per_position_is_zero_on_itself_and_positive_otherwise() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(5, 11, generator=gen).log_softmax(-1)
    q = torch.randn(5, 11, generator=gen).log_softmax(-1)
    # p - p is exactly 0 in any order of operations
    assert torch.equal(job_module.kl_per_position(p, p), torch.zeros(5, dtype=torch.float64))
    kl = job_module.kl_per_position(p, q)
    assert kl.dtype == torch.float64
    ref = torch.tensor(_kl_reference(p, q), dtype=torch.float64)
    # Both sides work in float64 on the same float64 inputs: they differ by the rounding of
    # 11-term sums (~1e-16 relative), far inside assert_close's float64 default (1e-7).
    torch.testing.assert_close(kl, ref)
    assert bool((kl > 1e-3).all())  # random distributions are far apart
    # renormalised: a log-probability vector off by a constant is the same distribution
    shifted = job_module.kl_per_position(p.double() + 0.25, q.double() - 1.0)
    torch.testing.assert_close(shifted, ref)  # shifts exact in float64 up to ~1e-16
