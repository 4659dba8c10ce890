"""A/B of source trees' decode and verify kernels in one device session, trees run alternately.

Each tree is a ``src`` folder (``git archive <commit> src``): a worker process imports
hybridmeta from it and times each case of ``--ops`` per call inside a CUDA graph (the
problems of ``bench_kernels`` and ``bench_spec`` at Nano shapes, calls on rotating pools so
L2 is streamed past; ``graph_us``), with this checkout's benchmark code in every tree, and
the copy ceiling each worker measures first (every row also carries its fraction of it).
The parent runs the trees round-robin, ``--rounds`` times, rotating the order each round,
and writes every run and each tree's best run over the reference tree's (the first), per
case, to ``--out``/``ab_trees.json`` after every worker, so a call that runs out of time
keeps what it measured.

Ops (``--ops``): ``ssm`` (``ssm_state_update``), ``conv`` / ``conv_inner``
(``causal_conv1d_update`` on a ``[slots, conv_dim, k-1]`` / ``[slots, k-1, conv_dim]``
pool), ``track`` (``track_save``, its fixed cases), ``verify`` (``ssm_verify_update``,
``--T`` tokens), ``conv_verify``, ``commit`` (``spec_commit``, T = 4, its fixed cases).

``--ncu`` instead runs one worker per tree under Nsight Compute (one profiled launch of the
SSM tile kernel per batch size, ``--clock-control none``; ``--ops ssm`` only) and keeps its
CSV.

Run (GPU machine)::

    python3 benchmarks/ab_trees.py --out "$OUT" --tree base=.gpu_snap/base/src \\
        --tree main=src --rounds 2 --ops ssm,conv --dtypes bfloat16 --bs 8,16,128,256
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NCU_SECTIONS = (
    "SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "SchedulerStats",
    "InstructionStats", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis",
)  # fmt: skip


OPS = ("ssm", "conv", "conv_inner", "track", "verify", "conv_verify", "commit")
Calls = list[Callable[[], Any]]


def _cases(
    ops: list[str], dtypes: list[str], bs_list: list[int], t_list: list[int]
) -> Iterator[tuple[str, dict[str, Any], Callable[[], tuple[Calls, float]]]]:
    """Each case's key, its row fields, and a builder of (its calls, each on its own
    problem, and one call's bytes). Builders run one at a time: one case's pools live."""
    import bench_kernels as bk
    import bench_spec as bsp
    import torch

    def rotating(make: Callable[[int], Any], count: Callable[[float], int]) -> tuple[Calls, float]:
        first = make(0)
        nb = _nbytes(first)
        return [first.ours] + [make(i).ours for i in range(1, count(nb))], nb

    for op in ops:
        if op not in OPS:
            raise SystemExit(f"--ops: unknown op {op!r} (one of {', '.join(OPS)})")
        if op == "ssm":
            for name in dtypes:
                for bs in bs_list:
                    make = functools.partial(_seeded, bk.SsmProblem, bs, getattr(torch, name))
                    yield f"ssm/{name}/{bs}", {"state_dtype": name, "bs": bs}, (
                        functools.partial(rotating, make, bk._n_rotating)
                    )  # fmt: skip
        elif op in ("conv", "conv_inner"):
            for bs in bs_list:
                make = functools.partial(_unseeded, bk.ConvProblem, bs, inner=op == "conv_inner")
                yield f"{op}/{bs}", {"bs": bs}, functools.partial(rotating, make, bk._n_rotating_conv)
        elif op == "track":
            for tracked, bs in bk.TRACK_CASES:
                make = functools.partial(_unseeded, bk.TrackProblem, tracked, bs, torch.float32)
                yield f"track/{tracked}/{bs}", {"tracked": tracked, "bs": bs}, (
                    functools.partial(rotating, make, lambda nb: 1)
                )  # fmt: skip
        elif op == "verify":
            for name in dtypes:
                for T in t_list:
                    for bs in bs_list:
                        make = functools.partial(_seeded, bsp.Verify, bs, T, getattr(torch, name))
                        yield f"verify/{name}/T{T}/{bs}", {"state_dtype": name, "T": T, "bs": bs}, (
                            functools.partial(rotating, make, bk._n_rotating)
                        )  # fmt: skip
        elif op == "conv_verify":
            for T in t_list:
                for bs in bs_list:
                    make = functools.partial(_seeded, bsp.ConvVerify, bs, T)
                    yield f"conv_verify/T{T}/{bs}", {"T": T, "bs": bs}, (
                        functools.partial(rotating, make, bk._n_rotating)
                    )  # fmt: skip
        else:  # commit: 27 layers, big enough without rotating
            for bs, tracked in bsp.COMMIT_CASES:
                make = functools.partial(_unseeded, bsp.Commit, bs, tracked, 4)
                yield f"commit/T4/{bs}/{tracked}", {"T": 4, "bs": bs, "tracked": tracked}, (
                    functools.partial(rotating, make, lambda nb: 1)
                )  # fmt: skip


def _seeded(cls: Any, *args: Any) -> Any:
    """``cls(*args[:-1], seed=args[-1])``: with the leading arguments bound, problem ``i``."""
    *head, seed = args
    return cls(*head, seed=seed)


def _unseeded(cls: Any, *args: Any, **kw: Any) -> Any:
    """``cls(*args[:-1], **kw)``: problem ``i`` of a class without a seed (global RNG)."""
    return cls(*args[:-1], **kw)


def _nbytes(prob: Any) -> float:
    """Bytes one call moves, as each problem class spells it (``bytes()``, ``nbytes()``, or
    an ``nbytes`` attribute)."""
    for name in ("bytes", "nbytes"):
        v = getattr(prob, name, None)
        if v is not None:
            return float(v() if callable(v) else v)
    raise TypeError(f"{type(prob).__name__} has neither bytes() nor nbytes")


def worker(
    ops: list[str],
    dtypes: list[str],
    bs_list: list[int],
    t_list: list[int],
    profile: bool,
    smoke: bool = False,
) -> None:
    import bench_kernels as bk
    import bench_spec as bsp
    import torch

    if smoke:  # tiny shapes on the CPU (the interpreter): only to exercise the script
        bk._make_dry()
        bsp._make_dry()

    rows: list[dict[str, Any]] = []
    # The device-to-device copy ceiling, measured in this worker (the fractions below are
    # of it): 1 GiB each way, as bench_kernels.py measures it.
    ceiling = None if profile else bk.copy_ceiling()["tbps"]
    for key, fields, build in _cases(ops, dtypes, bs_list, t_list):
        calls, nb = build()
        if profile:  # one eager call a case: ncu profiles each (it replays the kernel)
            calls[0]()
            torch.cuda.synchronize()
        else:
            t = bk.graph_us(calls)
            assert ceiling is not None
            rows.append({"case": key, "op": key.split("/")[0], **fields, "graph_us": t,
                         "bytes": nb, "frac_copy": nb / t / 1e6 / ceiling})  # fmt: skip
        del calls
        torch.cuda.empty_cache()
    print(json.dumps({"rows": rows, "copy_tbps": ceiling, "regs_spills": _regs()}))


def _regs() -> dict[str, list[tuple[int, int]]]:
    """Registers and spills of every variant each kernel launcher compiled in this worker."""
    out: dict[str, list[tuple[int, int]]] = {}
    for mname, mod in sorted(sys.modules.items()):
        if not mname.startswith("hybridmeta.kernels.") or mod is None:
            continue
        for attr, obj in vars(mod).items():
            variants = getattr(obj, "_variants", None)
            if isinstance(variants, dict) and variants:
                out[f"{mname.rsplit('.', 1)[1]}.{attr}"] = sorted(
                    {(getattr(v, "n_regs", -1), getattr(v, "n_spills", -1)) for v in variants.values()}
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tree", action="append", default=[], help="name=path/to/src (first: reference)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ops", default="ssm", help=f"comma-separated, of {','.join(OPS)}")
    ap.add_argument("--dtypes", default="bfloat16", help="state dtypes (ssm, verify)")
    ap.add_argument("--bs", default="8,16,128,256", help="batch sizes (not track, commit)")
    ap.add_argument("--T", default="4", help="draft lengths (verify, conv_verify)")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a test)")
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    ops = args.ops.split(",")
    dtypes = args.dtypes.split(",")
    bs_list = [int(b) for b in args.bs.split(",")]
    t_list = [int(t) for t in args.T.split(",")]
    if args.worker:
        worker(ops, dtypes, bs_list, t_list, args.profile, args.smoke)
        return
    if args.ncu and ops != ["ssm"]:
        raise SystemExit("--ncu profiles the SSM tile kernel: --ops ssm only")
    trees = [t.split("=", 1) for t in args.tree]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--ops", args.ops, "--dtypes", args.dtypes, "--bs", args.bs, "--T", args.T]
    common += ["--worker", *(["--smoke"] if args.smoke else [])]
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
                    f"regs {got['regs_spills']}): "
                    + " ".join(f"{x['case']}={x['graph_us']:.2f} ({x['frac_copy']:.1%})"
                               for x in got["rows"]),
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
            key = x["case"]
            cur = best.setdefault(r["tree"], {})
            cur[key] = min(cur.get(key, float("inf")), x["graph_us"])
    base = best.get(ref, {})
    return {
        t: {k: v / base[k] for k, v in per.items() if k in base} for t, per in best.items()
    }


if __name__ == "__main__":
    main()
