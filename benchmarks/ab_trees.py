"""A/B of source trees' SSM update kernels in one device session, trees run alternately.

Each tree is a ``src`` folder (``git archive <commit> src``): a worker process imports
hybridmeta from it and times ``ssm_state_update`` per call inside a CUDA graph
(``bench_kernels.SsmProblem`` and ``graph_us``: calls on rotating pools, L2 streamed past),
with this checkout's benchmark code in every tree, and the copy ceiling each worker measures
first (every row also carries its fraction of it). The parent runs the trees round-robin,
``--rounds`` times, rotating the order each round, and writes every run and each tree's best
run over the reference tree's (the first) to ``--out``/``ab_trees.json`` after every worker,
so a call that runs out of time keeps what it measured.

``--ncu`` instead runs one worker per tree under Nsight Compute (one profiled launch of the
tile kernel per batch size, ``--clock-control none``) and keeps its CSV.

Run (GPU machine)::

    python3 benchmarks/ab_trees.py --out "$OUT" --tree base=.gpu_snap/base/src \\
        --tree main=src --rounds 2 --dtypes bfloat16 --bs 8,16,128,256
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NCU_SECTIONS = (
    "SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "SchedulerStats",
    "InstructionStats", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis",
)  # fmt: skip


def worker(dtypes: list[str], bs_list: list[int], profile: bool) -> None:
    import bench_kernels as bk
    import torch

    from hybridmeta.kernels import ssm_update

    rows: list[dict[str, Any]] = []
    # The device-to-device copy ceiling, measured in this worker (the fractions below are
    # of it): 1 GiB each way, as bench_kernels.py measures it.
    ceiling = None if profile else bk.copy_ceiling()["tbps"]
    for name in dtypes:
        dtype = getattr(torch, name)
        for bs in bs_list:
            probe = bk.SsmProblem(bs, dtype)
            if profile:  # one eager call a case: ncu profiles each (it replays the kernel)
                probe.ours()
                torch.cuda.synchronize()
                continue
            nb = probe.bytes()
            probs = [probe] + [
                bk.SsmProblem(bs, dtype, seed=i + 1) for i in range(bk._n_rotating(nb) - 1)
            ]
            t = bk.graph_us([p.ours for p in probs])
            assert ceiling is not None
            rows.append({"state_dtype": name, "bs": bs, "graph_us": t, "bytes": nb,
                         "frac_copy": nb / t / 1e6 / ceiling})  # fmt: skip
            del probe, probs
            torch.cuda.empty_cache()
    regs = sorted(
        {(v.n_regs, v.n_spills) for v in ssm_update._TILE_LAUNCHER._variants.values()}
    )
    print(json.dumps({"rows": rows, "copy_tbps": ceiling, "tile_regs_spills": regs}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tree", action="append", default=[], help="name=path/to/src (first: reference)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--bs", default="8,16,128,256")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    bs_list = [int(b) for b in args.bs.split(",")]
    if args.worker:
        worker(dtypes, bs_list, args.profile)
        return
    trees = [t.split("=", 1) for t in args.tree]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--dtypes", args.dtypes, "--bs", args.bs, "--worker"]
    if args.ncu:
        for name, src in trees:
            env = dict(os.environ, PYTHONPATH=f"{src}:{HERE}")
            cmd = [
                "ncu", "--clock-control", "none", "-k", "regex:_ssm_update_tile_kernel",
                "--launch-count", str(len(bs_list) * len(dtypes)),
                *[a for s in NCU_SECTIONS for a in ("--section", s)],
                "--csv", "--page", "details", "--print-units", "base",
                sys.executable, str(Path(__file__).resolve()), *common, "--profile",
            ]  # fmt: skip
            t0 = time.perf_counter()
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            (out / f"ncu_{name}.csv").write_text(r.stdout)
            (out / f"ncu_{name}.err").write_text(r.stderr[-20000:])
            print(f"ncu {name}: rc {r.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
        return
    import torch

    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "ab_trees",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "trees": dict(trees),
        "runs": runs,
    }
    for rnd in range(args.rounds):
        k = rnd % len(trees)
        for name, src in trees[k:] + trees[:k]:
            env = dict(os.environ, PYTHONPATH=f"{src}:{HERE}")
            t0 = time.perf_counter()
            try:
                r = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), *common],
                    env=env, capture_output=True, text=True, timeout=args.timeout,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                runs.append({"tree": name, "round": rnd, "error": "timeout"})
                continue
            wall = time.perf_counter() - t0
            if r.returncode != 0:
                runs.append({"tree": name, "round": rnd, "error": r.stderr[-3000:]})
                print(f"{name} round {rnd}: FAILED\n{r.stderr[-1500:]}", flush=True)
            else:
                got = json.loads(r.stdout.strip().splitlines()[-1])
                runs.append({"tree": name, "round": rnd, "wall_s": wall, **got})
                print(
                    f"{name} round {rnd} ({wall:.0f} s, copy {got['copy_tbps']:.3f} TB/s, "
                    f"regs {got['tile_regs_spills']}): "
                    + " ".join(f"{x['state_dtype'][:4]}/{x['bs']}={x['graph_us']:.2f}"
                               f" ({x['frac_copy']:.1%})" for x in got["rows"]),
                    flush=True,
                )  # fmt: skip
            result["best_over_ref"] = _ratios(runs, trees[0][0])
            (out / "ab_trees.json").write_text(json.dumps(result, indent=1))
    for tree, per in result.get("best_over_ref", {}).items():
        print(tree, " ".join(f"{k}={v:.3f}" for k, v in per.items()))


def _triton_version() -> str:
    try:
        import triton
    except ImportError:  # pragma: no cover - the benchmark needs it; the record says so
        return "none"
    return str(triton.__version__)


def _ratios(runs: list[dict[str, Any]], ref: str) -> dict[str, dict[str, float]]:
    best: dict[str, dict[str, float]] = {}
    for r in runs:
        for x in r.get("rows", []):
            key = f"{x['state_dtype']}/{x['bs']}"
            cur = best.setdefault(r["tree"], {})
            cur[key] = min(cur.get(key, float("inf")), x["graph_us"])
    base = best.get(ref, {})
    return {
        t: {k: v / base[k] for k, v in per.items() if k in base} for t, per in best.items()
    }


if __name__ == "__main__":
    main()
