"""The main job on the shapes of model the loader accepts: each runs to its table, every
check applying (exit 0), or is refused up front (exit 2, one line, nothing loaded).

Each shape here crashed the job before: ``chunk_size`` 1 to 3 (the spec rows' sequences
outgrew ``max_len`` after the whole workload), no attention layer (transformers' cache
needs one), a chunk size whose workload cannot fit in memory (tens of GB allocated).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from hybridmeta.runtime import job as job_module
from hybridmeta.runtime.engine import Runtime
from hybridmeta.runtime.job import main_job
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.tiny import tiny_config, write_tiny_checkpoint


def _job(d: Path, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["--model", str(d), "--device", "cpu", "--quiet", "--prompts", "1", "--slots", "1"]
    rc = main_job([*argv, *extra], out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def _row(text: str, name: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(name))


@pytest.mark.parametrize(
    ("changes", "transformers_row"),
    [
        # track interval 2 (the smallest): spec rows with 1 draft token
        pytest.param({"chunk_size": 1}, False, id="chunk-1"),
        # a vocabulary of one token: every prompt is a prefix of every other, so only the
        # continuations' lengths keep the planned boundary the longest cached prefix
        pytest.param({"chunk_size": 1, "vocab_size": 1}, False, id="chunk-1-vocab-1"),
        # track interval 6, not a power of two
        pytest.param({"chunk_size": 3}, False, id="chunk-3"),
        # no attention layer: transformers' comparison runs without its cache
        pytest.param({"pattern": "M-M"}, True, id="no-attention"),
        # neither attention nor MLP, one layer
        pytest.param({"pattern": "M"}, True, id="one-mamba-layer"),
        # no Mamba2 layer, no attention layer: one MLP
        pytest.param({"pattern": "-"}, True, id="one-mlp-layer"),
    ],
)
def test_the_job_runs_every_check_on_the_model(
    tmp_path: Path, changes: dict[str, Any], transformers_row: bool
) -> None:
    if transformers_row:
        pytest.importorskip("transformers")
    d = write_tiny_checkpoint(tmp_path / "ckpt", config=attrs.evolve(tiny_config(), **changes))
    rc, text, err = _job(d, *([] if transformers_row else ["--no-transformers"]))
    assert (rc, err) == (0, ""), text + err
    assert text.splitlines()[-1] == "all checks passed"
    for row in ("hits at prefill-made boundaries", "hits at decode-made boundaries"):
        assert "PASS" in _row(text, row), text
    assert "PASS" in _row(text, "spec decode vs plain decode: KL"), text
    if transformers_row:
        assert "PASS" in _row(text, "agreement with transformers"), text


def test_the_memory_bound_counts_the_pools_the_runtimes_allocate(tiny_model: NemotronH) -> None:
    """What the job's bound counts for the state pools is exactly what the runtimes alive
    at its peak allocate (three plain ones and the spec rows' one), and its weights term
    the model's parameters."""
    args = job_module.build_parser().parse_args(["--prompts", "2", "--slots", "3"])
    options = job_module._options(args, 16)
    need = job_module._memory_needed(tiny_model.config, options, torch.float32, "triton")
    plain = Runtime(tiny_model, attrs.evolve(options, use_graphs=False))
    spec = Runtime(tiny_model, attrs.evolve(options, use_graphs=False, spec_tokens=4))

    def pool_bytes(rt: Runtime) -> int:
        p = rt.pool
        tensors = (p.conv, p.ssm, p.k, p.v, p.inter_conv, p.inter_ssm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    assert need["4 state pools"] == 3 * pool_bytes(plain) + pool_bytes(spec)
    assert need["weights"] == sum(p.numel() * 4 for p in tiny_model.parameters())
    assert "the scan's [chunk, chunk] blocks" not in need  # the Triton scan builds none
    ref = job_module._memory_needed(tiny_model.config, options, torch.float32, "reference")
    chunk = tiny_model.config.chunk_size  # 8 chunks of 8 in 64 prefill tokens, 4 heads
    assert ref["the scan's [chunk, chunk] blocks"] == 3 * 8 * 4 * chunk * chunk * 4
