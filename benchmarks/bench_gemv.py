"""The decode step's projections at Nemotron-Nano-9B-v2 shapes: cuBLAS against the Triton
GEMV (one row) and the skinny GEMM (2 to 16 rows).

At 1 to 16 rows every projection is a weight read (``N x K`` bf16), so its floor is the
weight bytes over the copy ceiling. For each projection and row count (1, 2, 4, 8, 16)
this measures, per call inside a CUDA graph of calls over rotating weight copies (more
bytes than L2 holds):

* ``F.linear`` (cuBLAS; both ``preferred_blas_library`` settings) and how many kernels
  each call launches (split-K reduce kernels and memsets included); for the MLP's down
  projection, which the runtime runs with ``input_activation="relu2"``, also
  ``relu_square`` + cuBLAS (what :func:`hybridmeta.kernels.linear` runs at more rows
  when the skinny GEMM does not take them);
* ``hybridmeta.linear``: the library's :func:`~hybridmeta.kernels.linear` as wired (the
  GEMV at one row, the skinny GEMM where ``skinny_blocks`` says so, else cuBLAS), with
  its path and kernel count;
* at 2 or more rows, each skinny GEMM tiling of :data:`SKINNY_GRID`
  (``kernels.linear.launch_skinny``), relu2 prologue included for the down projection.

It prints the winner per (projection, rows), then a table and candidate ``SkinnyRule``
lines for ``kernels.linear.SKINNY_RULES`` wherever a tiling beats the cuBLAS path. Writes
``gemv_<tag>.json`` (after every projection, so a run cut short keeps what it measured).

    python benchmarks/bench_gemv.py --out DIR            # H200: about a minute
    python benchmarks/bench_gemv.py --smoke --out DIR    # CPU interpreter, tiny shapes:
                                                         # runs every path once, no timing
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on a CPU-only machine (--smoke); decided
    # before any kernel is decorated (the imports below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F
import triton
from graph_timing import copy_tbps, graph_per_call_us  # type: ignore[import-not-found, unused-ignore]

from hybridmeta.kernels import implementation, linear, relu_square
from hybridmeta.kernels.linear import SkinnyConfig, _gemv_kernel, launch_skinny, skinny_blocks

# (name, N, K, relu2) of Nemotron-Nano-9B-v2 (hidden 4480, 128 x 80 Mamba heads, state
# 128, 8 groups, MLP 15680, 40/8 attention heads of 128); relu2: the runtime feeds the
# projection relu(x)**2 (input_activation="relu2")
SHAPES = [
    ("mamba in_proj", 10240 + 12288 + 128, 4480, False),
    ("mamba out_proj", 4480, 10240, False),
    ("mlp up_proj", 15680, 4480, False),
    ("mlp down_proj", 4480, 15680, True),
    ("attn q_proj", 5120, 4480, False),
    ("attn k_proj", 1024, 4480, False),
    ("attn o_proj", 4480, 5120, False),
]
SMOKE_SHAPES = [("tiny wide", 72, 40, False), ("tiny down relu2", 24, 72, True)]
ROWS = (1, 2, 4, 8, 16)

# Skinny GEMM tilings (block_n x block_k, warps, stages; swap_ab: W x^T): the prototype's
# winner (the default rule) and its neighbours; narrow blocks give the short-N shapes
# more programs, swap_ab puts the weight tile on tl.dot's 64+-row side.
SKINNY_GRID = [
    SkinnyConfig(32, 128, 4, 3),
    SkinnyConfig(16, 128, 4, 3),
    SkinnyConfig(16, 256, 4, 3),
    SkinnyConfig(32, 256, 4, 3),
    SkinnyConfig(32, 128, 4, 4),
    SkinnyConfig(64, 128, 4, 3),
    SkinnyConfig(64, 128, 4, 3, swap_ab=True),
    SkinnyConfig(128, 64, 4, 3, swap_ab=True),
    SkinnyConfig(64, 256, 8, 3, swap_ab=True),
]


def triton_gemv(block_n: int, block_k: int, warps: int, stages: int) -> Callable[..., None]:
    """The library's one-row GEMV kernel at another tiling than its rule's (``--gemv-grid``)."""

    def run(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        N, K = w.shape
        _gemv_kernel[(triton.cdiv(N, block_n),)](
            x, w, None, y, N, K, w.stride(0), HAS_BIAS=False, RELU2=False, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return run


GEMV_GRID = {
    "m1 n2 k1024 w4": triton_gemv(2, 1024, 4, 3),
    "m1 n4 k1024 w8": triton_gemv(4, 1024, 8, 3),
    "m1 n4 k512 w8": triton_gemv(4, 512, 8, 3),
    "m1 n8 k512 w8": triton_gemv(8, 512, 8, 3),
    "m1 n4 k256 w2": triton_gemv(4, 256, 2, 4),
}


def kernels_per_call(fn: Callable[[], object]) -> tuple[float, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
    ks = [e.name for e in prof.events()
          if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]  # fmt: skip
    return len(ks) / 4, sorted({k[:60] for k in ks})


def _path(m: int, n: int, k: int) -> str:
    """Which path ``linear`` takes for ``m`` rows of an ``n x k`` projection."""
    if m == 1:
        return "gemv"
    cfg = skinny_blocks(m, n, k)
    return "cublas" if cfg is None else f"skinny {cfg.name}"


class Bench:
    """Measures calls of one (projection, rows) over ``copies`` rotating weights."""

    def __init__(self, smoke: bool, ceiling: float, budget_s: float, t0: float) -> None:
        self.smoke = smoke
        self.ceiling = ceiling
        self.budget_s = budget_s
        self.t0 = t0

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s

    def entry(
        self,
        row: dict[str, Any],
        call: Callable[[int], object],
        copies: int,
        check: Callable[[], float] | None = None,
        count_kernels: bool = False,
    ) -> dict[str, Any]:
        """Time ``call(i)`` (weights ``i``) per call in a graph; ``check()``: max error."""
        try:
            out: dict[str, Any] = {}
            if check is not None:
                out["max_rel_err"] = check()
            if self.smoke:
                call(0)
                out["us"] = None
                return out
            us = graph_per_call_us(call, copies)
            out.update(us=us, frac_copy=row["floor_us"] / us)
            if count_kernels:
                out["kernels"], out["names"] = kernels_per_call(lambda: call(0))
            return out
        except Exception as e:  # a tiling that does not compile: record it
            return {"error": repr(e)[:300]}


def measure(
    b: Bench, name: str, N: int, K: int, relu2: bool, rows: tuple[int, ...], gemv_grid: bool
) -> list[dict[str, Any]]:
    """One projection at each row count: cuBLAS, ``linear`` as wired, the Triton tilings."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16
    wbytes = N * K * 2
    copies = 1 if b.smoke else max(2, -(-160 * 2**20 // wbytes))  # > L2 in flight
    ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    act: Literal["relu2"] | None = "relu2" if relu2 else None
    out_rows = []
    for M in rows:
        x = torch.randn(M, K, device=dev, dtype=dt)
        xa = relu_square(x) if relu2 else x  # the projection's input
        y = torch.empty(M, N, device=dev, dtype=dt)
        want = F.linear(xa, ws[0]).float()
        row: dict[str, Any] = {
            "proj": name, "N": N, "K": K, "M": M, "relu2": relu2, "weight_bytes": wbytes,
            "floor_us": wbytes / b.ceiling / 1e6, "linear_path": _path(M, N, K),
        }  # fmt: skip

        def err(fn: Callable[[], object], y: torch.Tensor = y, want: torch.Tensor = want) -> float:
            """Largest |error| against cuBLAS's bf16 result, over the largest |output|."""
            got = fn()
            res = got if isinstance(got, torch.Tensor) else y
            return float((res.float() - want).abs().max() / want.abs().max())

        def mm(i: int, x: torch.Tensor = xa, y: torch.Tensor = y) -> None:
            torch.matmul(x, ws[i].t(), out=y)

        libs = ("cublas",) if b.smoke else ("cublas", "cublaslt")
        for lib in libs:
            if not b.smoke:
                torch.backends.cuda.preferred_blas_library(lib)
            row[lib] = b.entry(row, mm, copies, count_kernels=True)
        if not b.smoke:
            torch.backends.cuda.preferred_blas_library("cublas")
        if relu2:

            def rmm(i: int, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                torch.matmul(relu_square(x), ws[i].t(), out=y)

            row["relu_square+cublas"] = b.entry(row, rmm, copies, count_kernels=True)

        def lin(i: int, x: torch.Tensor = x) -> torch.Tensor:
            return linear(x, ws[i], input_activation=act)

        row["hybridmeta.linear"] = b.entry(
            row, lin, copies, check=lambda: err(lambda: lin(0)), count_kernels=True
        )
        if M == 1 and gemv_grid and not relu2:
            for cname, fn in GEMV_GRID.items():

                def g(i: int, fn: Callable[..., None] = fn, x: torch.Tensor = x,
                      y: torch.Tensor = y) -> None:  # fmt: skip
                    fn(x, ws[i], y)

                row[cname] = b.entry(row, g, copies, check=lambda g=g: err(lambda: g(0)))
        if M > 1:
            for cfg in SKINNY_GRID:
                if b.over_budget():
                    row[f"skinny {cfg.name}"] = {"error": "skipped: over --budget-s"}
                    continue

                def sk(i: int, cfg: SkinnyConfig = cfg, x: torch.Tensor = x,
                       y: torch.Tensor = y) -> None:  # fmt: skip
                    launch_skinny(x, ws[i], None, y, cfg, relu2)

                row[f"skinny {cfg.name}"] = b.entry(row, sk, copies,
                                                    check=lambda sk=sk: err(lambda: sk(0)))  # fmt: skip
        out_rows.append(row)
        report(row)
    return out_rows


def _timed(row: dict[str, Any], prefix: str = "") -> list[tuple[float, str]]:
    return sorted(
        (v["us"], k) for k, v in row.items()
        if isinstance(v, dict) and v.get("us") is not None and k.startswith(prefix)
    )  # fmt: skip


def baseline(row: dict[str, Any]) -> str:
    """The path ``linear`` takes when the skinny GEMM does not (cuBLAS, after relu_square
    for a relu2 projection)."""
    return "relu_square+cublas" if row["relu2"] else "cublas"


def _us(row: dict[str, Any], key: str) -> str:
    v = row.get(key, {})
    if v.get("us") is None:
        return "   error" if "error" in v else "       -"
    return f"{v['us']:7.1f} ({100 * v['frac_copy']:3.0f}%)"


def report(row: dict[str, Any]) -> None:
    base = baseline(row)
    sk = _timed(row, "skinny ")
    best = _timed(row)
    nk = row[base].get("kernels")
    print(
        f"{row['proj']:15s} M={row['M']:2d} floor {row['floor_us']:6.1f} us | {base} "
        f"{_us(row, base)} {'' if nk is None else f'{nk:.0f} k'} | cublaslt "
        f"{_us(row, 'cublaslt')} | linear [{row['linear_path']}] {_us(row, 'hybridmeta.linear')}"
        + (f" | best skinny {sk[0][1][7:]} {sk[0][0]:.1f}" if sk else "")
        + (f" | winner {best[0][1]}" if best else ""),
        flush=True,
    )


def summary(rows: list[dict[str, Any]]) -> None:
    """Per (projection, rows): the cuBLAS path, linear as wired, the best skinny tiling;
    then ``SkinnyRule`` lines for each (projection, rows) the skinny GEMM wins."""
    print("\nsummary (us per call, % of the weight-read floor at the copy ceiling)")
    print(f"{'projection':15s} {'M':>2s}  {'cuBLAS path':>14s}  {'linear as wired':>14s}  "
          f"{'best skinny':>14s}  tiling")  # fmt: skip
    wins = []
    for r in rows:
        base = baseline(r)
        sk = _timed(r, "skinny ")
        tiling = sk[0][1][7:] if sk else "-"
        best = _us(r, sk[0][1]) if sk else "-"
        print(f"{r['proj']:15s} {r['M']:2d}  {_us(r, base):>14s}  "
              f"{_us(r, 'hybridmeta.linear'):>14s}  {best:>14s}  {tiling}")  # fmt: skip
        b_us = r[base].get("us")
        if sk and b_us is not None and sk[0][0] < b_us:
            wins.append((r, sk[0][1][7:], sk[0][0], b_us))
    print("\nskinny GEMM wins (candidate kernels.linear.SKINNY_RULES entries; widen by hand):")
    for r, tiling, us, b_us in wins:
        cfg = next(c for c in SKINNY_GRID if c.name == tiling)
        args = f"{cfg.block_n}, {cfg.block_k}, {cfg.num_warps}, {cfg.num_stages}"
        args += ", swap_ab=True" if cfg.swap_ab else ""
        print(f"    SkinnyRule(SkinnyConfig({args}), rows=({r['M']}, {r['M']}), "
              f"n=({r['N']}, {r['N']}), k=({r['K']}, {r['K']})),  # {r['proj']}: "
              f"{us:.1f} vs {b_us:.1f} us ({100 * (1 - us / b_us):.1f}% faster)")  # fmt: skip
    if not wins:
        print("    (none)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default=None, help="file name tag (default: h200, smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU interpreter: every path runs once, no timing")  # fmt: skip
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts")
    ap.add_argument("--only", default="", help="comma-separated projection name substrings")
    ap.add_argument("--gemv-grid", action="store_true",
                    help="also time other one-row GEMV tilings (the sweep behind gemv_blocks)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="skip the remaining skinny tilings once the run is this old")  # fmt: skip
    args = ap.parse_args()
    t0 = time.perf_counter()
    smoke = args.smoke or not torch.cuda.is_available()
    tag = args.tag or ("smoke" if smoke else "h200")
    rows = tuple(int(r) for r in args.rows.split(",") if r)
    only = [s for s in args.only.split(",") if s]
    shapes = [s for s in (SMOKE_SHAPES if smoke else SHAPES)
              if not only or any(o in s[0] for o in only)]  # fmt: skip
    ceiling = 1.0 if smoke else copy_tbps()
    res: dict[str, Any] = {
        "benchmark": "decode_projections",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu (smoke run)" if smoke else torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "cuda": torch.version.cuda, "python": sys.version.split()[0]},
        "copy_ceiling_tbps": ceiling,
        "method": "per call in a CUDA graph of 20 calls over rotating weight copies (> L2), "
                  "median of 15 replays; frac_copy = weight bytes / copy ceiling / time",
        "skinny_grid": [c.name for c in SKINNY_GRID],
        "rows": [],
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gemv_{tag}.json"
    b = Bench(smoke, ceiling, args.budget_s, t0)
    # --smoke: the Triton paths of linear too (the CPU default is the reference)
    with implementation("triton" if smoke else "auto"):
        for name, N, K, relu2 in shapes:
            res["rows"] += measure(b, name, N, K, relu2, rows, args.gemv_grid)
            res["elapsed_s"] = time.perf_counter() - t0
            path.write_text(json.dumps(res, indent=1))
    summary(res["rows"])
    errors = [(r["proj"], r["M"], k) for r in res["rows"] for k, v in r.items()
              if isinstance(v, dict) and "error" in v and "skipped" not in v["error"]]  # fmt: skip
    skipped = [(r["proj"], r["M"], k) for r in res["rows"] for k, v in r.items()
               if isinstance(v, dict) and "skipped" in v.get("error", "")]  # fmt: skip
    if skipped:
        print(f"\n{len(skipped)} tilings skipped past --budget-s {args.budget_s:.0f} "
              f"(first: {skipped[0]}); rerun with --only / --budget-s for them")  # fmt: skip
    bad = [(r["proj"], r["M"], k, v["max_rel_err"]) for r in res["rows"] for k, v in r.items()
           if isinstance(v, dict) and v.get("max_rel_err", 0.0) > 1e-2]  # fmt: skip
    print(f"\n{len(errors)} errors {errors[:6]}; {len(bad)} results off by > 1% {bad[:6]}; "
          f"{time.perf_counter() - b.t0:.0f} s; wrote {path}")  # fmt: skip


if __name__ == "__main__":
    main()
