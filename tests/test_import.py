"""``import hybridmeta`` changes nothing in the process, whatever was imported before it.

Each case runs in a fresh interpreter: what a test process already imported (triton, by
this suite's own modules) must not hide an import-order effect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Imports what an engine imported first, then the package and every submodule an engine
# would, records what that changed in os.environ and every warning it raised, then (optionally) runs one Triton op on CPU tensors
# against its reference.
_PROBE = """
import json, os, sys, warnings
for name in sys.argv[1].split(","):
    if name:
        __import__(name)
before = dict(os.environ)  # after the engine's own imports (torch._dynamo sets some)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import hybridmeta, hybridmeta.kernels, hybridmeta.graphs, hybridmeta.runtime
    import hybridmeta.testing
after = dict(os.environ)
report = {
    "added": sorted(set(after) - set(before)),
    "removed": sorted(set(before) - set(after)),
    "changed": sorted(k for k in before if k in after and before[k] != after[k]),
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    "interpret": os.environ.get("TRITON_INTERPRET"),
}
if sys.argv[2] == "run":
    import torch
    from hybridmeta.kernels import ssm_state_update
    g = torch.Generator().manual_seed(0)
    H, P, N, G = 2, 4, 8, 1
    state = torch.randn(6, H, P, N, generator=g)
    args = (torch.randn(3, H, P, generator=g), torch.rand(3, H, generator=g),
            -torch.rand(H, generator=g), torch.randn(3, G, N, generator=g),
            torch.randn(3, G, N, generator=g))
    idx = torch.tensor([4, -1, 1])
    ref_state = state.clone()
    y_ref = ssm_state_update(ref_state, *args, state_indices=idx, impl="reference")
    y = ssm_state_update(state, *args, state_indices=idx, impl="triton")
    torch.testing.assert_close(y, y_ref, rtol=3e-4, atol=1e-3)
    torch.testing.assert_close(state, ref_state, rtol=3e-4, atol=1e-3)
    report["ran"] = True
print(json.dumps(report))
"""


def _probe(first: str, run: bool, **env_over: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_over)
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, first, "run" if run else "import"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize(
    "first",
    [
        pytest.param("", id="hybridmeta-first"),
        pytest.param("triton,triton.language", id="triton-first"),
        pytest.param("torch._dynamo", id="dynamo-first"),
    ],
)
def test_import_leaves_the_environment_alone_and_warns_nothing(first: str) -> None:
    report = _probe(first, run=False)
    assert report["added"] == [] and report["removed"] == [] and report["changed"] == []
    assert report["interpret"] is None
    assert report["warnings"] == []


@pytest.mark.parametrize(
    "first",
    [
        pytest.param("triton,triton.language", id="triton-first"),
        pytest.param("torch._dynamo", id="dynamo-first"),
    ],
)
def test_a_triton_op_on_cpu_tensors_runs_after_triton_was_imported_first(first: str) -> None:
    report = _probe(first, run=True)
    assert report["ran"] is True
    assert report["added"] == [] and report["warnings"] == []


def test_a_user_set_triton_interpret_keeps_working() -> None:
    """``TRITON_INTERPRET=1`` before the import: every kernel is Triton's own interpreted
    function; hybridmeta leaves the variable as the user set it and the op runs."""
    report = _probe("triton", run=True, TRITON_INTERPRET="1")
    assert report["interpret"] == "1" and report["ran"] is True
    assert report["changed"] == [] and report["warnings"] == []
