"""benchmarks/bench_gemv.py --smoke: the script runs on the CPU interpreter (every path of
one tiny relu2 projection once, no timing) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.interpreter
def test_smoke_run_writes_every_path(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gemv.py"), "--smoke", "--rows", "1,3",
         "--only", "tiny down", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0 errors" in done.stdout and "0 results off" in done.stdout, done.stdout[-2000:]
    res = json.loads((tmp_path / "gemv_smoke.json").read_text())
    rows = {r["M"]: r for r in res["rows"]}
    assert set(rows) == {1, 3} and all(r["relu2"] for r in rows.values())
    assert rows[1]["linear_path"] == "gemv"
    skinny = [k for k in rows[3] if k.startswith("skinny ")]
    assert len(skinny) == len(res["skinny_grid"]) > 0
    for k in ["hybridmeta.linear", *skinny]:
        assert rows[3][k]["max_rel_err"] < 1e-2, (k, rows[3][k])
