"""The main job's "spec decode vs plain decode" rows, and that they fail loudly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import kernels
from hybridmeta.model import SpecCommitMetadata
from hybridmeta.runtime import job as job_module
from hybridmeta.runtime.engine import RuntimeOptions
from hybridmeta.runtime.model import NemotronH

_OPTS = RuntimeOptions(
    num_working=4, num_track=32, max_len=48, track_interval=16, max_prefill_tokens=64,
    use_graphs=True, sync_timing=True,
)  # fmt: skip


def _rows(model: NemotronH) -> dict[str, job_module.Check]:
    tol = job_module.Tolerances.for_dtype(torch.float32)
    return {c.name: c for c in job_module._spec_checks(model, _OPTS, tol, 0, None)}


def test_spec_rows_pass_on_the_fp32_cpu_run(tiny_model: NemotronH) -> None:
    rows = _rows(tiny_model)
    assert rows["spec decode vs plain decode: greedy tokens"].passed is True
    assert rows["spec decode vs plain decode: greedy tokens"].value == "3/3 identical"
    assert rows["spec decode vs plain decode: KL"].passed is True
    acc = rows["spec decode acceptance rate"]
    assert acc.passed is None and not acc.value.startswith("0%")
    assert rows["decode tokens/s spec vs plain"].passed is None


def test_spec_rows_pass_with_the_dt_floor_binding(floored_dt_model: NemotronH) -> None:
    """The verify kernel applies the model's dt floor as plain decode does: a verify that
    lost it would drift from plain decoding on this model, where the floor binds."""
    rows = _rows(floored_dt_model)
    assert rows["spec decode vs plain decode: greedy tokens"].passed is True
    assert rows["spec decode vs plain decode: KL"].passed is True


def test_spec_rows_fail_when_the_commit_keeps_rejected_drafts(
    tiny_model: NemotronH, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit that takes the state after the last draft column, accepted or not: the
    state then holds rejected tokens and the outputs drift from plain decoding."""

    def greedy_commit(cmd: SpecCommitMetadata, conv: Any, ssm: Any, ic: Any, iss: Any, **kw: Any) -> None:
        last = torch.full_like(cmd.accepted_index, cmd.draft_token_num - 1)
        kernels.spec_commit(conv, ssm, ic, iss, state_indices=cmd.mamba_cache_indices,
                            accepted_index=last)  # fmt: skip

    monkeypatch.setattr(kernels, "spec_commit_from_metadata", greedy_commit)
    rows = _rows(tiny_model)
    assert rows["spec decode vs plain decode: greedy tokens"].passed is False
    assert rows["spec decode vs plain decode: KL"].passed is False
