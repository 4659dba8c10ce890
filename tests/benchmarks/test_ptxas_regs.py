"""benchmarks/ptxas_regs.py compiles the SSM kernels for sm_90a without a GPU and reports
ptxas's figures, honouring a register cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_case_is_compiled_and_capped(tmp_path: Path) -> None:
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    if not (Path(str(triton.__file__)).parent / "backends/nvidia/bin/cuobjdump").exists():
        pytest.skip("this Triton has no bundled cuobjdump")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)  # the script compiles; it sets the mode itself
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ptxas_regs.py"), "--out", str(tmp_path),
         "--tag", "t", "--maxnreg", "48"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "ptxas_regs_t.json").read_text())
    assert {"target", "triton", "date_utc", "shapes", "cases"} <= set(res)
    kinds = {(c["kernel"], c["state_dtype"], c["rows"]) for c in res["cases"]}
    assert kinds == {("tile", "bf16", 1), ("tile", "bf16", 16), ("tile", "bf16", 32),
                     ("tile", "fp32", 1), ("walk", "fp32", 1), ("verify", "bf16", 1),
                     ("verify", "fp32", 1)}  # fmt: skip
    for c in res["cases"]:
        assert c["maxnreg"] == 48
        assert 16 <= c["registers"] <= 48, c  # the cap reached ptxas
        # at most 48 registers a thread: at least 21 one-warp programs (65,536 registers an
        # SM, 256 a warp's allocation unit), and the hardware's 32 at most
        assert 21 // c["num_warps"] <= c["programs_per_sm"] <= 32, c
        assert c["local_bytes"] >= 0 and c["stack_bytes"] >= 0
    # each case on one line of the printed table
    assert proc.stdout.count("registers") == len(res["cases"])
