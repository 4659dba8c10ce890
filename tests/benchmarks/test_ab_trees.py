"""benchmarks/ab_trees.py: each tree's best run over the reference tree's, per case."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("ab_trees", ROOT / "benchmarks" / "ab_trees.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(tree: str, rnd: int, **times: float) -> dict[str, Any]:
    rows = [
        {"state_dtype": k.split("_")[0], "bs": int(k.split("_")[1]), "graph_us": v}
        for k, v in times.items()
    ]
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
