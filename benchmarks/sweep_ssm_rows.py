"""Sweep of the SSM tile kernel's rows a program (``SsmLaunchConfig.tile_rows``) on one GPU.

Nemotron-Nano-9B-v2 layer shapes (128 heads, headdim 80, dstate 128, 8 groups; x, z, B, C
bf16, dt fp32 with dt_bias and softplus, D, z), state bf16 and fp32, the one-tile-a-program
kernel (``row_walk=False``) at its default tile. For each state dtype, rows a program and
warps (and, unless ``--no-cap``, each multi-row variant at the fewest warps again with its
registers capped at the one-row variant's count, ``SsmLaunchConfig.max_regs``):

* per-call time inside one CUDA graph of calls on rotating pools
  (``graph_timing.graph_per_call_us``) at every batch size, and the fraction of the
  device-to-device copy ceiling measured first in the same run (bytes: each row's state read
  and written, x, z, out, B, C, dt; ``bench_kernels.SsmProblem.bytes``);
* padding: a bucket-256 graph replayed with one live row (255 pad rows, slot -1) against a
  bucket-1 graph of the same configuration and of the one-row configuration (the target:
  at most 2x); pad rows' output checked zero;
* registers per thread and spilled bytes of each compiled variant (``n_regs``, ``n_spills``);
* a check of each configuration against the reference (37 rows, pads among them).

Writes ``sweep_ssm_rows_<tag>.json`` (device, versions, date, every figure) into ``--out``
(default ``$OUT``) and prints compact tables. Run on the GPU machine::

    PYTHONPATH=src:benchmarks python benchmarks/sweep_ssm_rows.py --out "$OUT"

``--smoke`` runs tiny shapes on the CPU under the Triton interpreter (checks the script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import bench_kernels as bk  # type: ignore[import-not-found, unused-ignore]
import torch
from graph_timing import (  # type: ignore[import-not-found, unused-ignore]
    copy_tbps,
    graph_per_call_us,
)

from hybridmeta.kernels import ssm_state_update_reference
from hybridmeta.kernels import ssm_update as su
from hybridmeta.kernels._config import SsmLaunchConfig, ssm_launch_config

ROWS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
WARPS: dict[str, tuple[int, ...]] = {"bfloat16": (2, 4), "float32": (1, 2)}
BS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PAD_BUCKET = 256
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Bytes streamed per graph replay (rotating pools beyond L2) and the time one replay aims at.
ROTATE_BYTES = 256e6
REPLAY_US = 4000.0
# The check: 37 rows with pads among them (9 in the smoke run: the interpreter is slow).
CHECK_BS, CHECK_PAD_ROWS = 37, (1, 5, 6, 20, 36)
SMOKE_CHECK_BS, SMOKE_CHECK_PAD_ROWS = 9, (1, 5, 6, 8)


def _cuda() -> bool:
    return bool(bk.DEV.type == "cuda")


def per_call_us(calls: Sequence[Callable[[], None]], est_us: float) -> float:
    """Per-call time of ``calls`` (rotating pools) inside one CUDA graph; on the CPU
    (``--smoke``) the wall time of one call."""
    if not _cuda():
        t0 = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t0) * 1e6
    reps = max(3, min(20, math.ceil(REPLAY_US / max(est_us, 1.0))))
    reps = max(reps, len(calls))
    return float(graph_per_call_us(lambda i: calls[i](), copies=len(calls), reps=reps))


def _variant_regs(before: set[Any]) -> dict[str, int]:
    """Registers and spills of the tile-kernel variant compiled since ``before``."""
    new = [v for k, v in su._TILE_LAUNCHER._variants.items() if k not in before]
    return {"n_regs": new[0].n_regs, "n_spills": new[0].n_spills} if new else {}


class Config:
    """One launch configuration of the sweep and what was measured for it."""

    def __init__(self, dtype: str, rows: int, warps: int, block_p: int, cap: int | None) -> None:
        self.dtype, self.rows, self.warps, self.cap = dtype, rows, warps, cap
        self.cfg = SsmLaunchConfig(
            block_p=block_p, num_warps=warps, row_walk=False, tile_rows=rows, max_regs=cap
        )
        self.result: dict[str, Any] = {
            "state_dtype": dtype, "tile_rows": rows, "num_warps": warps, "block_p": block_p,
            "max_regs": cap, "bs": {},
        }  # fmt: skip

    @property
    def name(self) -> str:
        cap = f" cap {self.cap}" if self.cap is not None else ""
        return f"R{self.rows:<2d} w{self.warps}{cap}"


def _problems(bs: int, dtype: torch.dtype, live: int | None = None, most: int = 16) -> list[Any]:
    probe = bk.SsmProblem(bs, dtype, live=live)
    n = max(1, min(most, math.ceil(ROTATE_BYTES / probe.bytes()))) if _cuda() else 1
    return [probe] + [bk.SsmProblem(bs, dtype, seed=i + 1, live=live) for i in range(n - 1)]


def _measure(conf: Config, probs: list[Any], ceiling: float) -> dict[str, Any]:
    nbytes = probs[0].bytes()
    before = set(su._TILE_LAUNCHER._variants)
    entry: dict[str, Any] = {"bytes": nbytes}
    try:
        us = per_call_us([p.launcher(conf.cfg) for p in probs], nbytes / ceiling / 1e6)
    except Exception as e:  # one failing variant must not lose the run
        entry["error"] = repr(e)[:300]
        return entry
    entry["us"] = us
    entry["frac_copy"] = nbytes / us / 1e6 / ceiling
    regs = _variant_regs(before)
    if regs:
        conf.result.update(regs)
    return entry


# (rtol, atol) by the compared tensor's dtype: tests/kernels/_support.py's table.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (3e-4, 1e-3),
    torch.float16: (1e-3, 5e-3),
    torch.bfloat16: (1e-2, 5e-2),
}


def _check(conf: Config, prob: Any, pad: list[int]) -> dict[str, Any]:
    """One launch against the reference on rows with pads among them (a short last block at
    every rows value > 1): largest errors of the output and of the state, whether both are
    within the tests' tolerances, and whether the pad rows' output is exactly zero."""
    state0 = prob.state.clone()
    prob.out.fill_(float("nan"))
    try:
        prob.launcher(conf.cfg)()
    except Exception as e:
        return {"error": repr(e)[:300]}
    ref_state, ref_out = state0.clone(), torch.empty_like(prob.out)
    ssm_state_update_reference(
        ref_state, prob.x, prob.dt, prob.A, prob.B, prob.C, ref_out, prob.src, D=prob.D,
        z=prob.z, dt_bias=prob.dt_bias, dt_softplus=True,
    )  # fmt: skip
    out_tol, state_tol = TOLERANCES[prob.out.dtype], TOLERANCES[prob.state.dtype]
    res = {
        "out_max_abs_err": float((prob.out.float() - ref_out.float()).abs().max()),
        "state_max_abs_err": float((prob.state.float() - ref_state.float()).abs().max()),
        "pad_rows_zero": bool((prob.out[pad] == 0).all()),
        "matches_reference": bool(
            torch.allclose(prob.out.float(), ref_out.float(), *out_tol)
            and torch.allclose(prob.state.float(), ref_state.float(), *state_tol)
        ),
    }
    prob.state.copy_(state0)
    return res


def sweep_dtype(
    name: str, ceiling: float, args: argparse.Namespace, save: Callable[[list[Config]], None]
) -> list[Config]:
    dtype = DTYPES[name]
    block_p = ssm_launch_config(dtype, bk.P, bk.N).block_p
    confs = [Config(name, r, w, block_p, None) for w in args.warps[name] for r in args.rows]
    check_bs, check_pad = (
        (CHECK_BS, CHECK_PAD_ROWS) if _cuda() else (SMOKE_CHECK_BS, SMOKE_CHECK_PAD_ROWS)
    )
    check = bk.SsmProblem(check_bs, dtype, seed=99)
    check.src[list(check_pad)] = -1
    # Every batch size: all configurations on the same pools (the one-row ones first: the
    # capped variants take their register count).
    for bs in args.bs:
        probs = _problems(bs, dtype)
        if args.cap and bs == args.bs[0]:
            # The fewest warps (the most registers a thread): each multi-row variant again,
            # capped at the one-row variant's register count.
            w = min(args.warps[name])
            base = next(c for c in confs if c.warps == w and c.rows == 1)
            base.result["bs"][bs] = _measure(base, probs, ceiling)
            cap = base.result.get("n_regs") or (64 if not _cuda() else None)
            if cap:
                confs += [Config(name, r, w, block_p, cap) for r in args.rows if r > 1]
        for conf in confs:
            if bs not in conf.result["bs"]:
                conf.result["bs"][bs] = _measure(conf, probs, ceiling)
            if "check" not in conf.result:
                conf.result["check"] = _check(conf, check, list(check_pad))
        del probs
        if _cuda():
            torch.cuda.empty_cache()
        save(confs)
        print(f"{name} bs {bs}: {len(confs)} configurations done", flush=True)
    # Padding: a bucket graph with one live row against bucket-1 graphs: of the same
    # configuration, of one row a program at the same warps, and of the default launch.
    probs = _problems(args.pad_bucket, dtype, live=1, most=8)
    default = ssm_launch_config(dtype, bk.P, bk.N)

    def bucket1_us(rows: int, warps: int) -> float | None:
        for c in confs:
            if (c.rows, c.warps, c.cap) == (rows, warps, None):
                us = c.result["bs"].get(1, {}).get("us")
                return float(us) if us else None
        return None

    for conf in confs:
        probs[0].out.fill_(float("nan"))
        pad = _measure(conf, probs, ceiling)
        pad["pad_rows_zero"] = bool((probs[0].out[1:] == 0).all())
        one = conf.result["bs"].get(1, {}).get("us")
        baselines = {
            "over_bucket1_same_config": one,
            "over_bucket1_one_row": bucket1_us(1, conf.warps),
            "over_bucket1_default": bucket1_us(1, default.num_warps),
        }
        for key, base in baselines.items():
            if "us" in pad and base:
                pad[key] = pad["us"] / base
        conf.result["padding"] = {"bucket": args.pad_bucket, "live": 1, **pad}
    del probs
    return confs


def _table(confs: list[Config], bs_list: Sequence[int]) -> str:
    head = f"{'config':19s} {'regs':>8s} | " + " ".join(f"{b:>7d}" for b in bs_list)
    lines = [head + f" | {'pad us':>8s} {'x b1':>5s} {'x R1':>5s}"]
    for c in confs:
        r = c.result
        regs = f"{r.get('n_regs', '-')}/{r.get('n_spills', '-')}"
        us = " ".join(f"{r['bs'].get(b, {}).get('us', float('nan')):7.2f}" for b in bs_list)
        pct = " ".join(
            f"{100 * r['bs'].get(b, {}).get('frac_copy', float('nan')):6.1f}%" for b in bs_list
        )
        p = r.get("padding", {})
        pad = (
            f"{p.get('us', float('nan')):8.2f} {p.get('over_bucket1_same_config', float('nan')):5.2f}"
            f" {p.get('over_bucket1_one_row', float('nan')):5.2f}"
        )
        lines.append(f"{c.dtype[:4]} {c.name:14s} {regs:>8s} | {us} | {pad}")
        ck = r.get("check", {})
        ok = (
            f"check: {'ok' if ck['matches_reference'] else 'MISMATCH'} (out err "
            f"{ck['out_max_abs_err']:.1e}, state err {ck['state_max_abs_err']:.1e}), pad rows "
            f"{'zero' if ck['pad_rows_zero'] else 'NOT ZERO'}"
            if "out_max_abs_err" in ck
            else f"check: {ck.get('error', 'not run')}"
        )
        lines.append(f"{'':19s} {'':>8s} | {pct} | {ok}")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    ap.add_argument("--tag", default="h200", help="file name tag")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rows", type=_ints, default=ROWS, help="rows a program, e.g. 1,4,16")
    ap.add_argument("--bs", type=_ints, default=BS, help="batch sizes, e.g. 1,64,512")
    ap.add_argument("--warps-bf16", type=_ints, default=WARPS["bfloat16"])
    ap.add_argument("--warps-fp32", type=_ints, default=WARPS["float32"])
    ap.add_argument("--pad-bucket", type=int, default=PAD_BUCKET)
    ap.add_argument(
        "--cap", action=argparse.BooleanOptionalAction, default=True,
        help="also sweep each multi-row variant capped (max_regs) at its one-row variant's "
        "register count",
    )  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    args = ap.parse_args(argv)
    if args.smoke:
        bk._make_dry()
        args.bs = tuple(b for b in args.bs if b <= 5) or (1, 3)
        args.pad_bucket = 5
    args.warps = {"bfloat16": args.warps_bf16, "float32": args.warps_fp32}
    if 1 not in args.rows or 1 not in args.bs:
        ap.error("--rows and --bs must include 1 (the baselines)")
    args.bs = tuple(sorted(set(args.bs)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    import triton  # after hybridmeta chose the interpreter or the GPU

    ceiling = copy_tbps() if _cuda() else 1.0
    result: dict[str, Any] = {
        "benchmark": "ssm_tile_rows_sweep",
        "device": torch.cuda.get_device_name(0) if _cuda() else "cpu (smoke, interpreter)",
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if _cuda() else 0,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shapes": {"nheads": bk.H, "headdim": bk.P, "dstate": bk.N, "ngroups": bk.G,
                   "activations": "bfloat16", "dt": "float32 + dt_bias, softplus", "D": True,
                   "z": True},
        "method": "per call inside one CUDA graph of calls on rotating pools (>= 256 MB a "
        "replay, median of 15 replays, graph_timing.graph_per_call_us); fraction of the "
        "device-to-device copy ceiling measured first (bytes: state read + written of live "
        "rows, x, z, out, B, C, dt)",
        "copy_ceiling_tbps": ceiling,
        "configs": [],
    }  # fmt: skip
    path = out / f"sweep_ssm_rows_{args.tag}.json"
    tables = []
    done: list[dict[str, Any]] = []

    def save(confs: list[Config]) -> None:
        # after every batch size: a run stopped early keeps what it measured
        result["configs"] = done + [c.result for c in confs]
        result["seconds"] = time.perf_counter() - t0
        path.write_text(json.dumps(result, indent=1))

    print(f"{result['device']}: copy ceiling {ceiling:.3f} TB/s", flush=True)
    for name in [d for d in args.dtypes.split(",") if d]:
        confs = sweep_dtype(name, ceiling, args, save)
        save(confs)
        done += [c.result for c in confs]
        tables.append(_table(confs, args.bs))
    print(f"copy ceiling {ceiling:.3f} TB/s; per call us (second line: % of copy); padding: "
          f"bucket {args.pad_bucket} with 1 live row, us and over bucket 1 (same config / "
          f"one row a program)")  # fmt: skip
    for t in tables:
        print(t)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
