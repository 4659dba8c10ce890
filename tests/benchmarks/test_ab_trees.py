"""benchmarks/ab_trees.py: each tree's best run over the reference tree's, per case."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("ab_trees", ROOT / "benchmarks" / "ab_trees.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tree: str, rnd: int, **times: float) -> dict[str, Any]:
    rows = [{"case": k.replace("_", "/"), "graph_us": v} for k, v in times.items()]
    return {"tree": tree, "round": rnd, "rows": rows}


def test_best_run_of_each_tree_over_the_reference_trees_best() -> None:
    ab = _script()
    runs = [
        _run("base", 0, bf16_8=10.0, bf16_128=100.0),
        _run("new", 0, bf16_8=12.0, bf16_128=95.0),
        _run("base", 1, bf16_8=11.0, bf16_128=90.0),  # base's best at 128 is its 2nd run
        _run("new", 1, bf16_8=10.5, bf16_128=99.0),
        {"tree": "new", "round": 2, "error": "timeout"},  # a failed run counts for nothing
        _run("other", 0, bf16_16=5.0),  # a case the reference never ran: no ratio
    ]
    got = ab._ratios(runs, "base")
    assert got["base"] == {"bf16/8": 1.0, "bf16/128": 1.0}
    assert got["new"] == {"bf16/8": 1.05, "bf16/128": 95.0 / 90.0}
    assert got["other"] == {}


def test_no_reference_run_gives_no_ratios() -> None:
    ab = _script()
    got = ab._ratios([_run("new", 0, bf16_8=1.0)], "base")
    assert got == {"new": {}}


def test_cases_of_every_op_are_keyed_apart() -> None:
    """Every case of every op has its own key (a ratio is never taken across two cases)."""
    ab = _script()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        keys = [k for k, _, _ in ab._cases(list(ab.OPS), ["float32", "bfloat16"], [1, 8], [2, 4])]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert len(keys) == len(set(keys))
    assert {k.split("/")[0] for k in keys} == set(ab.OPS)
    # the verify's cases differ by state dtype, draft length and bs
    assert {k for k in keys if k.startswith("verify/")} == {
        f"verify/{d}/T{t}/{b}" for d in ("float32", "bfloat16") for t in (2, 4) for b in (1, 8)
    }
    with pytest.raises(SystemExit, match="unknown op 'ssm_update'"):
        list(ab._cases(["ssm_update"], ["float32"], [1], [2]))


@pytest.mark.interpreter
def test_smoke_run_of_two_trees_times_every_case_of_each(tmp_path: Path) -> None:
    ops = "ssm,conv,conv_inner,track,verify,conv_verify,commit"
    src = str(ROOT / "src")
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ab_trees.py"), "--smoke", "--out",
         str(tmp_path), "--tree", f"ref={src}", "--tree", f"new={src}", "--rounds", "1",
         "--ops", ops, "--dtypes", "float32,bfloat16", "--bs", "1,3", "--T", "2"],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "ab_trees.json").read_text())
    assert [(x["tree"], "error" in x) for x in res["runs"]] == [("ref", False), ("new", False)]
    cases = {x["case"] for x in res["runs"][0]["rows"]}
    assert {c.split("/")[0] for c in cases} == set(ops.split(","))
    assert res["best_over_ref"]["ref"] == dict.fromkeys(cases, 1.0)
    assert set(res["best_over_ref"]["new"]) == cases
    assert all(v > 0 for v in res["best_over_ref"]["new"].values())
