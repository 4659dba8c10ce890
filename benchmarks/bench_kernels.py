"""Decode-kernel benchmark on one GPU at Nemotron-Nano-9B-v2 layer shapes.

Measures in one run: the device-to-device copy ceiling; our SSM update (fp32 and bf16
state, bs 1..512; bs=1 also under CUDA-graph replay), the fused track write, the conv
update and track-save over 27 layers; and, as the baseline, mamba_ssm's Triton
``selective_state_update`` from the mamba-ssm sdist (extracted into
``third_party/mamba_ssm_ops/``, never committed). Every time is a ``do_bench`` median with
the L2 flushed before each repetition. Writes JSON and a PNG plot into ``--out``.

Run (GPU machine)::

    PYTHONPATH=src python3 benchmarks/bench_kernels.py --out "$OUT" [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridmeta.kernels import causal_conv1d_update, ssm_state_update, track_save
from hybridmeta.kernels._config import (
    ConvLaunchConfig,
    CopyLaunchConfig,
    SsmLaunchConfig,
    ssm_launch_config,
)
from hybridmeta.kernels.conv_update import launch_conv_update
from hybridmeta.kernels.ssm_update import launch_ssm_update
from hybridmeta.kernels.track_save import launch_track_save

H, P, N, G, CONV_DIM, K, LAYERS = 128, 80, 128, 8, 12288, 4, 27
BS_LIST: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACT = torch.bfloat16
DEV = torch.device("cuda")


def med_us(fn: Callable[[], Any], rep: int = 60) -> float:
    """Median time in microseconds, L2 flushed before every repetition (do_bench)."""
    if DEV.type != "cuda":  # --dry: one timed call, only to exercise the script
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench  # after hybridmeta.kernels chose interpreter or GPU

    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median")) * 1000.0


def copy_ceiling() -> dict[str, float]:
    n = 1 << 28 if DEV.type == "cuda" else 1 << 16  # 1 GiB of fp32 each way
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    t = med_us(lambda: dst.copy_(src))
    return {"bytes": 2.0 * n * 4, "us": t, "tbps": 2.0 * n * 4 / t / 1e6}


class SsmProblem:
    """One SSM-update problem at Nano shapes; slots scattered through the pool."""

    def __init__(
        self, bs: int, state_dtype: torch.dtype, *, tracked: int = 0, seed: int = 0
    ) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        slots = bs + tracked + 1
        self.bs, self.tracked, self.state_dtype = bs, tracked, state_dtype
        self.state = torch.empty(slots, H, P, N, device=DEV, dtype=state_dtype).normal_(generator=g)
        perm = torch.randperm(slots, device=DEV, generator=g)
        self.src = perm[:bs].clone()
        self.trk = torch.full((bs,), -1, dtype=torch.int64, device=DEV)
        self.trk[:tracked] = perm[bs : bs + tracked]
        self.mask = torch.zeros(bs, dtype=torch.bool, device=DEV)
        self.mask[:tracked] = True
        self.x = torch.randn(bs, H, P, device=DEV, generator=g).to(ACT)
        self.z = torch.randn(bs, H, P, device=DEV, generator=g).to(ACT)
        self.dt = (torch.randn(bs, H, device=DEV, generator=g) * 0.5).to(ACT)
        self.B = torch.randn(bs, G, N, device=DEV, generator=g).to(ACT)
        self.C = torch.randn(bs, G, N, device=DEV, generator=g).to(ACT)
        self.A = -torch.rand(H, device=DEV, generator=g)
        self.D = torch.randn(H, device=DEV, generator=g)
        self.dt_bias = torch.randn(H, device=DEV, generator=g) * 0.5
        self.out = torch.empty_like(self.x)

    def bytes(self) -> float:
        es = torch.empty((), dtype=self.state_dtype).element_size()
        state = (2 * self.bs + self.tracked) * H * P * N * es
        acts = 3 * self.bs * H * P * 2 + 2 * self.bs * G * N * 2 + self.bs * H * 2
        return float(state + acts)

    def ours(self) -> None:
        ssm_state_update(
            self.state, self.x, self.dt, self.A, self.B, self.C, state_indices=self.src, D=self.D,
            z=self.z, dt_bias=self.dt_bias, dt_softplus=True,
            track_indices=self.trk if self.tracked else None,
            track_mask=self.mask if self.tracked else None, out=self.out,
        )  # fmt: skip

    def launcher(self, cfg: SsmLaunchConfig) -> Callable[[], None]:
        def run() -> None:
            launch_ssm_update(
                self.state, self.x, self.dt, self.A, self.B, self.C, self.out, self.src,
                D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=True, dst_indices=None,
                track_indices=None, track_mask=None, config=cfg,
            )  # fmt: skip

        return run

    def baseline(self, fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        A = self.A[:, None, None].expand(H, P, N)
        dt = self.dt[:, :, None].expand(self.bs, H, P)
        dt_bias = self.dt_bias[:, None].expand(H, P)
        D = self.D[:, None].expand(H, P)
        src32 = self.src.to(torch.int32)
        return lambda: fn(
            self.state, self.x, dt, A, self.B, self.C, D, self.z, dt_bias, True, src32
        )


def graph_us(make_calls: list[Callable[[], Any]]) -> float:
    """Per-call time of ``len(make_calls)`` calls captured in one CUDA graph, each on its own
    pool (so consecutive calls do not hit each other's lines in L2)."""
    if DEV.type != "cuda":
        return med_us(make_calls[0])
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in make_calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in make_calls:
            c()
    return med_us(graph.replay, rep=100) / len(make_calls)


def bench_ssm(ceiling: float, baseline: Callable[..., torch.Tensor] | None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        for bs in BS_LIST:
            prob = SsmProblem(bs, dtype)
            t = med_us(prob.ours)
            row: dict[str, Any] = {
                "state_dtype": str(dtype).removeprefix("torch."),
                "bs": bs,
                "bytes": prob.bytes(),
                "ours_us": t,
                "ours_tbps": prob.bytes() / t / 1e6,
                "ours_frac_copy": prob.bytes() / t / 1e6 / ceiling,
            }
            if baseline is not None:
                tb = med_us(prob.baseline(baseline))
                row |= {
                    "baseline_us": tb,
                    "baseline_tbps": prob.bytes() / tb / 1e6,
                    "baseline_frac_copy": prob.bytes() / tb / 1e6 / ceiling,
                    "speedup_vs_baseline": tb / t,
                }
            rows.append(row)
            print(f"ssm {row['state_dtype']:8s} bs={bs:4d} ours {t:9.2f} us "
                  f"{row['ours_frac_copy']:.0%} of copy"
                  + (f" | baseline {row['baseline_us']:9.2f} us "
                     f"{row['baseline_frac_copy']:.0%}" if baseline is not None else ""),
                  flush=True)  # fmt: skip
            del prob
    torch.cuda.empty_cache()

    # bs = 1: eager (launch included), one-op graph replay, and per-kernel time inside a
    # graph of 32 calls on rotating pools.
    small: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        probs = [SsmProblem(1, dtype, seed=i) for i in range(32)]
        entry: dict[str, Any] = {"state_dtype": str(dtype).removeprefix("torch."), "bs": 1}
        entry["ours_eager_us"] = med_us(probs[0].ours)
        entry["ours_graph1_us"] = graph_us([probs[0].ours])
        entry["ours_graph_per_call_us"] = graph_us([p.ours for p in probs])
        if baseline is not None:
            entry["baseline_eager_us"] = med_us(probs[0].baseline(baseline))
            entry["baseline_graph1_us"] = graph_us([probs[0].baseline(baseline)])
            entry["baseline_graph_per_call_us"] = graph_us([p.baseline(baseline) for p in probs])
        entry["floor_us"] = probs[0].bytes() / ceiling / 1e6
        small.append(entry)
        print("ssm bs=1", entry, flush=True)
        del probs
    torch.cuda.empty_cache()

    fused: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        for bs in (64, 256):
            plain = SsmProblem(bs, dtype)
            t0 = med_us(plain.ours)
            del plain
            tracked = SsmProblem(bs, dtype, tracked=bs)
            t1 = med_us(tracked.ours)
            fused.append({
                "state_dtype": str(dtype).removeprefix("torch."), "bs": bs,
                "untracked_us": t0, "all_tracked_us": t1, "tracked_row_cost_ratio": t1 / t0,
                "tracked_frac_copy": tracked.bytes() / t1 / 1e6 / ceiling,
            })  # fmt: skip
            print("fused track", fused[-1], flush=True)
            del tracked
    torch.cuda.empty_cache()
    return {"rows": rows, "bs1": small, "fused_track": fused}


class ConvProblem:
    """Conv update at Nano shapes; ``inner``: state stored ``[slots, k-1, conv_dim]``."""

    def __init__(self, bs: int, *, inner: bool = False) -> None:
        slots = bs + 1
        if inner:
            self.cs = torch.randn(slots, K - 1, CONV_DIM, device=DEV).to(ACT).transpose(1, 2)
        else:
            self.cs = torch.randn(slots, CONV_DIM, K - 1, device=DEV).to(ACT)
        self.x = torch.randn(bs, CONV_DIM, device=DEV).to(ACT)
        self.w = torch.randn(CONV_DIM, K, device=DEV).to(ACT)
        self.b = torch.randn(CONV_DIM, device=DEV).to(ACT)
        self.idx = torch.randperm(slots, device=DEV)[:bs].clone()
        self.out = torch.empty_like(self.x)
        self.nbytes = float(
            2 * bs * CONV_DIM * (K - 1) * 2 + 2 * bs * CONV_DIM * 2 + CONV_DIM * (K + 1) * 2
        )

    def ours(self) -> None:
        causal_conv1d_update(self.x, self.cs, self.w, self.b, cache_indices=self.idx, out=self.out)

    def launcher(self, cfg: ConvLaunchConfig) -> Callable[[], None]:
        return functools.partial(
            launch_conv_update,
            self.x,
            self.cs,
            self.w,
            self.b,
            self.out,
            self.idx,
            silu=True,
            config=cfg,
        )


def _rotating(bs: int, inner: bool, nbytes: float) -> list[ConvProblem]:
    # Enough independent pools that one graph replay streams well past the L2 cache.
    n = max(2, min(32, math.ceil(256e6 / nbytes)))
    return [ConvProblem(bs, inner=inner) for _ in range(n)]


def bench_conv(ceiling: float) -> list[dict[str, Any]]:
    """Eager (public op, launch included) and per-call time inside a CUDA graph of calls on
    rotating pools (device time only: the eager figure is bound by host launch time at
    small bs)."""
    rows: list[dict[str, Any]] = []
    for inner in (False, True):
        layout = (
            "[slots, k-1, conv_dim] (conv_dim contiguous)"
            if inner
            else "[slots, conv_dim, k-1] contiguous"
        )
        for bs in BS_LIST:
            prob = ConvProblem(bs, inner=inner)
            t = med_us(prob.ours)
            probs = _rotating(bs, inner, prob.nbytes)
            tg = graph_us([p.ours for p in probs])
            rows.append({"layout": layout, "bs": bs, "bytes": prob.nbytes, "ours_us": t,
                         "ours_tbps": prob.nbytes / t / 1e6,
                         "ours_frac_copy": prob.nbytes / t / 1e6 / ceiling,
                         "ours_graph_per_call_us": tg,
                         "ours_graph_frac_copy": prob.nbytes / tg / 1e6 / ceiling})  # fmt: skip
            print(f"conv {'inner' if inner else 'packed'} bs={bs:4d} eager {t:8.2f} us "
                  f"{rows[-1]['ours_frac_copy']:.0%} | graph {tg:8.2f} us "
                  f"{rows[-1]['ours_graph_frac_copy']:.0%} of copy", flush=True)  # fmt: skip
            del prob, probs
    return rows


def host_overhead() -> dict[str, float]:
    """Host microseconds per call (200 back-to-back calls of tiny problems, one sync)."""
    import hybridmeta.kernels._dispatch as ops

    def per_call(fn: Callable[[], Any], n: int = 200) -> float:
        for _ in range(10):
            fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    ssm = SsmProblem(1, torch.float32)
    conv = ConvProblem(1)
    res = {
        "ssm_public_direct_us": per_call(ssm.ours),
        "ssm_launcher_us": per_call(ssm.launcher(ssm_launch_config(torch.float32, P, N))),
        "conv_public_direct_us": per_call(conv.ours),
    }
    ops.ALWAYS_DISPATCH = True
    try:
        res["ssm_public_dispatched_us"] = per_call(ssm.ours)
        res["conv_public_dispatched_us"] = per_call(conv.ours)
    finally:
        ops.ALWAYS_DISPATCH = False
    print("host overhead per call", res, flush=True)
    return res


class TrackProblem:
    def __init__(self, tracked: int, bs: int, ssm_dtype: torch.dtype) -> None:
        slots = bs + tracked + 1
        self.conv = torch.randn(LAYERS, slots, CONV_DIM, K - 1, device=DEV).to(ACT)
        self.ssm = torch.empty(LAYERS, slots, H, P, N, device=DEV, dtype=ssm_dtype).normal_()
        perm = torch.randperm(slots, device=DEV)
        self.src = perm[:bs].clone()
        self.trk = torch.full((bs,), -1, dtype=torch.int64, device=DEV)
        self.trk[:tracked] = perm[bs : bs + tracked]
        self.mask = torch.zeros(bs, dtype=torch.bool, device=DEV)
        self.mask[:tracked] = True
        self.rows_src = self.src[:tracked].clone()
        self.rows_dst = self.trk[:tracked].clone()
        per_row = LAYERS * (H * P * N * self.ssm.element_size() + CONV_DIM * (K - 1) * 2)
        self.nbytes = float(2 * tracked * per_row)

    def ours(self) -> None:
        track_save(
            self.conv, self.ssm, src_indices=self.src, track_indices=self.trk, track_mask=self.mask
        )

    def launcher(self, cfg: CopyLaunchConfig) -> Callable[[], None]:
        return lambda: launch_track_save(
            self.conv, self.ssm, self.src, self.trk, self.mask, config=cfg
        )

    def indexing(self) -> None:
        # What engines do today: advanced indexing over all layers (indices precomputed).
        self.ssm[:, self.rows_dst] = self.ssm[:, self.rows_src]
        self.conv[:, self.rows_dst] = self.conv[:, self.rows_src]


def bench_track(ceiling: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for tracked, bs in ((1, 16), (4, 16), (16, 16), (4, 64)):
        prob = TrackProblem(tracked, bs, torch.float32)
        t = med_us(prob.ours, rep=100)
        ti = med_us(prob.indexing, rep=100)
        rows.append({
            "tracked": tracked, "bs": bs, "ssm_dtype": "float32", "bytes": prob.nbytes,
            "ours_us": t, "ours_frac_copy": prob.nbytes / t / 1e6 / ceiling,
            "indexing_us": ti, "indexing_frac_copy": prob.nbytes / ti / 1e6 / ceiling,
        })  # fmt: skip
        print(f"track tracked={tracked:3d} bs={bs:4d} ours {t:9.1f} us "
              f"{rows[-1]['ours_frac_copy']:.0%} | indexing {ti:9.1f} us "
              f"{rows[-1]['indexing_frac_copy']:.0%}", flush=True)  # fmt: skip
        del prob
        torch.cuda.empty_cache()
    return rows


def _sweep_ssm(ceiling: float) -> list[dict[str, Any]]:
    """bs = 1 per-call time inside a graph (32 calls on rotating pools) per tile shape."""
    res: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        probs = [SsmProblem(1, dtype, seed=i) for i in range(32)]
        for bp in (4, 8, 16, 32):
            for nw in (1, 2, 4):
                cfg = SsmLaunchConfig(block_p=bp, num_warps=nw)
                t = graph_us([p.launcher(cfg) for p in probs])
                res.append(
                    {
                        "state_dtype": name,
                        "bs": 1,
                        "block_p": bp,
                        "num_warps": nw,
                        "graph_per_call_us": t,
                    }
                )
        print("sweep ssm bs1 best", min((r for r in res if r["state_dtype"] == name),
                                        key=lambda r: r["graph_per_call_us"]), flush=True)  # fmt: skip
        del probs
    torch.cuda.empty_cache()
    return res


def _sweep_conv(ceiling: float) -> list[dict[str, Any]]:
    res: list[dict[str, Any]] = []
    for inner in (False, True):
        prob = ConvProblem(256, inner=inner)
        for rows in (1, 2, 4, 8):
            for bc in (64, 128, 256):
                for nw in (2, 4, 8):
                    cfg = ConvLaunchConfig(block_c=bc, num_warps=nw, rows=rows)
                    t = med_us(prob.launcher(cfg), rep=30)
                    res.append({"inner": inner, "bs": 256, "rows": rows, "block_c": bc, "num_warps": nw,
                                "us": t, "frac_copy": prob.nbytes / t / 1e6 / ceiling})  # fmt: skip
        print("sweep conv best", max((r for r in res if r["inner"] == inner), key=lambda r: r["frac_copy"]),
              flush=True)  # fmt: skip
        del prob
    return res


def _sweep_ssm_large(ceiling: float) -> list[dict[str, Any]]:
    """Tile shapes that won at bs = 1, checked at bs 64 and 512."""
    res: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for bs in (64, 512):
            prob = SsmProblem(bs, dtype)
            for bp, nw in ((4, 1), (8, 1), (16, 1), (8, 2), (16, 2)):
                t = med_us(prob.launcher(SsmLaunchConfig(block_p=bp, num_warps=nw)), rep=40)
                res.append({"state_dtype": name, "bs": bs, "block_p": bp, "num_warps": nw, "us": t,
                            "frac_copy": prob.bytes() / t / 1e6 / ceiling})  # fmt: skip
                print("sweep ssm", res[-1], flush=True)
            del prob
    torch.cuda.empty_cache()
    return res


def _sweep_track(ceiling: float) -> list[dict[str, Any]]:
    res: list[dict[str, Any]] = []
    sms = _sm_count()
    for tracked in (1, 4):
        prob = TrackProblem(tracked, 16, torch.float32)
        for block_bytes in (16384, 32768):
            for per_sm in (8, 16, 32):
                cfg = CopyLaunchConfig(
                    block=block_bytes // 4, num_warps=8, max_programs=per_sm * sms
                )
                t = med_us(prob.launcher(cfg), rep=60)
                res.append({"tracked": tracked, "block_bytes": block_bytes, "programs_per_sm": per_sm,
                            "num_warps": 8, "us": t, "frac_copy": prob.nbytes / t / 1e6 / ceiling})  # fmt: skip
        print("sweep track best", max((r for r in res if r["tracked"] == tracked), key=lambda r: r["frac_copy"]),
              flush=True)  # fmt: skip
        del prob
        torch.cuda.empty_cache()
    return res


def sweep(ceiling: float) -> dict[str, Any]:
    """Launch-configuration sweep behind the defaults in hybridmeta.kernels._config."""
    return {
        "ssm": _sweep_ssm(ceiling),
        "conv": _sweep_conv(ceiling),
        "track": _sweep_track(ceiling),
    }


def load_baseline() -> tuple[Callable[..., torch.Tensor] | None, str]:
    path = Path(__file__).resolve().parent.parent / "third_party" / "mamba_ssm_ops"
    if not path.is_dir():
        return None, f"not found: {path}"
    sys.path.insert(0, str(path))
    try:
        from selective_state_update import selective_state_update  # type: ignore[import-not-found]
    except Exception as e:  # the baseline is optional: report why it is missing
        return None, f"import failed: {e!r}"
    return (
        selective_state_update,
        "mamba-ssm 2.3.2.post1 sdist: mamba_ssm/ops/triton/selective_state_update.py",
    )


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    ceiling = result["copy_ceiling"]["tbps"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    ax = axes[0]
    for dtype, color in (("float32", "C0"), ("bfloat16", "C1")):
        rows = [r for r in result["ssm"]["rows"] if r["state_dtype"] == dtype]
        bs = [r["bs"] for r in rows]
        ax.plot(
            bs,
            [r["ours_tbps"] for r in rows],
            "o-",
            color=color,
            label=f"hybridmeta, {dtype} state",
        )
        if rows and "baseline_tbps" in rows[0]:
            ax.plot(bs, [r["baseline_tbps"] for r in rows], "x--", color=color,
                    label=f"mamba_ssm Triton, {dtype} state")  # fmt: skip
    ax.axhline(ceiling, color="k", ls=":", label=f"D2D copy ceiling {ceiling:.2f} TB/s")
    ax.set(xscale="log", xlabel="batch size", ylabel="TB/s (bytes moved / time)",
           title="SSM state update, Nano-9B-v2 layer")  # fmt: skip
    ax.legend(fontsize=8)
    ax = axes[1]
    for layout in sorted({r.get("layout", "[slots, conv_dim, k-1]") for r in result["conv"]}):
        rows = [r for r in result["conv"] if r.get("layout", "[slots, conv_dim, k-1]") == layout]
        ax.plot(
            [r["bs"] for r in rows],
            [r["ours_tbps"] for r in rows],
            "o-",
            label=f"hybridmeta, {layout}",
        )
    ax.axhline(ceiling, color="k", ls=":", label="copy ceiling")
    ax.set(
        xscale="log",
        xlabel="batch size",
        ylabel="TB/s",
        title="causal-conv1d update (conv_dim 12288, k 4)",
    )
    ax.legend(fontsize=8)
    ax = axes[2]
    rows = result["track"]
    labels = [f"{r['tracked']}/{r['bs']}" for r in rows]
    xs = range(len(rows))
    ax.bar(
        [i - 0.2 for i in xs],
        [r["ours_frac_copy"] * ceiling for r in rows],
        0.4,
        label="hybridmeta, 1 launch",
    )
    ax.bar(
        [i + 0.2 for i in xs],
        [r["indexing_frac_copy"] * ceiling for r in rows],
        0.4,
        label="torch indexing",
    )
    ax.axhline(ceiling, color="k", ls=":", label="copy ceiling")
    ax.set_xticks(list(xs), labels)
    ax.set(
        xlabel="tracked rows / bs",
        ylabel="TB/s",
        title="track-save, 27 layers, fp32 SSM + bf16 conv",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _make_dry() -> None:
    global H, P, N, G, CONV_DIM, LAYERS, BS_LIST, DEV
    H, P, N, G, CONV_DIM, LAYERS = 2, 4, 8, 1, 16, 2
    BS_LIST = (1, 3)
    DEV = torch.device("cpu")


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if DEV.type == "cuda" else "cpu (dry run)"


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEV.type == "cuda" else 1


def _triton_version() -> str:
    import triton

    return triton.__version__


def replot(json_path: Path) -> None:
    """Redraw the PNG beside a saved JSON result."""
    plot(json.loads(json_path.read_text()), json_path.with_suffix(".png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    ap.add_argument("--tag", default="h200", help="file name tag")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    ap.add_argument("--explore", action="store_true", help="only the conv and SSM tile sweeps")
    ap.add_argument(
        "--conv-only", action="store_true", help="only the conv update (eager and graph)"
    )
    ap.add_argument("--replot", type=Path, help="redraw the PNG of a saved JSON and exit")
    ap.add_argument(
        "--dry", action="store_true", help="tiny shapes on the CPU interpreter (script check)"
    )
    args = ap.parse_args()
    if args.replot is not None:
        replot(args.replot)
        return
    if args.dry:
        _make_dry()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    baseline, baseline_note = load_baseline()
    result: dict[str, Any] = {
        "device": _device_name(),
        "sms": _sm_count(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shapes": {
            "nheads": H,
            "headdim": P,
            "dstate": N,
            "ngroups": G,
            "conv_dim": CONV_DIM,
            "k": K,
            "layers": LAYERS,
            "activations": "bfloat16",
        },
        "method": "triton.testing.do_bench median, L2 flushed before each repetition; "
        "bandwidth = bytes read + written / time",
        "baseline": baseline_note,
    }
    result["copy_ceiling"] = copy_ceiling()
    ceiling = result["copy_ceiling"]["tbps"]
    print(f"copy ceiling {ceiling:.3f} TB/s", flush=True)
    if args.conv_only:
        result["conv"] = bench_conv(ceiling)
        (out / f"kernels_conv_{args.tag}.json").write_text(json.dumps(result, indent=1))
        return
    if args.explore:
        result["explore"] = {"conv": _sweep_conv(ceiling), "ssm": _sweep_ssm_large(ceiling)}
        (out / f"kernels_{args.tag}.json").write_text(json.dumps(result, indent=1))
        return
    if args.sweep:
        result["sweep"] = sweep(ceiling)
    result["host_overhead"] = host_overhead()
    result["ssm"] = bench_ssm(ceiling, baseline)
    result["conv"] = bench_conv(ceiling)
    result["track"] = bench_track(ceiling)
    (out / f"kernels_{args.tag}.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, out / f"kernels_{args.tag}.png")
    except Exception as e:  # a missing matplotlib must not lose the numbers
        print(f"plot failed: {e!r}")
    print(f"wrote {out / f'kernels_{args.tag}.json'}")


if __name__ == "__main__":
    main()
