"""Decode-kernel benchmark on one GPU at Nemotron-Nano-9B-v2 layer shapes.

Measures in one run, against the device-to-device copy ceiling measured first:

* ``host``: host microseconds per call of each public op path (and its pieces), and of the
  peers' Python entry points;
* ``ssm``: our SSM update and the peers' (FlashInfer 0.7.4, vLLM, sglang, mamba_ssm through
  ``benchmarks/peers.py`` and its bundle, ``$HYBRIDMETA_PEERS``; never committed), fp32 and
  bf16 state, bs 1..512, eager (``do_bench``) and per call inside a CUDA graph; bs 1 eager
  back-to-back; a bucket-256 graph replayed with one live row against a bucket-1 graph;
  the fused track write;
* ``conv``, ``norms``, ``track``: conv update, fused RMSNorms, track-save;
* ``sweep`` (opt-in): the SSM launch configurations behind ``kernels/_config.py``.

Every time is a ``do_bench`` median with the L2 flushed before each repetition. Writes
JSON (after every section) and a PNG plot into ``--out``.

Run (GPU machine)::

    PYTHONPATH=src python3 benchmarks/bench_kernels.py --out "$OUT" --only sweep,host,ssm,...
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
from hybridmeta.kernels.rms_norm import add_rms_norm, gated_rms_norm
from hybridmeta.kernels.ssm_update import launch_ssm_update
from hybridmeta.kernels.track_save import launch_track_save

H, P, N, G, CONV_DIM, K, LAYERS, HIDDEN = 128, 80, 128, 8, 12288, 4, 27, 4480
BS_LIST: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SWEEP_BS: tuple[int, ...] = (1, 128, 512)
MIXER_BS: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 512)
NORM_BS: tuple[int, ...] = (1, 16, 64, 256)
FUSED_TRACK_BS: tuple[int, ...] = (64, 256)
PAD_BUCKET = 256
TRACK_CASES: tuple[tuple[int, int], ...] = ((1, 16), (4, 16), (16, 16), (4, 64))
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
    """One SSM-update problem at Nano shapes; slots scattered through the pool.

    ``live``: rows with a slot (the rest are pad rows, slot ``-1``: the bucket-padding case).
    ``dt`` is fp32, as the runtime hands it over after its softplus (and as FlashInfer wants
    it, in ``D``'s dtype, with no cast).
    """

    def __init__(
        self,
        bs: int,
        state_dtype: torch.dtype,
        *,
        tracked: int = 0,
        seed: int = 0,
        live: int | None = None,
    ) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        n_live = bs if live is None else live
        # FlashInfer wants at least bs slots even when most rows are padding.
        slots = max(n_live + tracked + 1, bs)
        self.bs, self.tracked, self.state_dtype, self.live = bs, tracked, state_dtype, n_live
        self.state = torch.empty(slots, H, P, N, device=DEV, dtype=state_dtype).normal_(generator=g)
        perm = torch.randperm(slots, device=DEV, generator=g)
        self.src = torch.full((bs,), -1, dtype=torch.int64, device=DEV)
        self.src[:n_live] = perm[:n_live]
        self.trk = torch.full((bs,), -1, dtype=torch.int64, device=DEV)
        self.trk[:tracked] = perm[n_live : n_live + tracked]
        self.mask = torch.zeros(bs, dtype=torch.bool, device=DEV)
        self.mask[:tracked] = True
        self.x = torch.randn(bs, H, P, device=DEV, generator=g).to(ACT)
        self.z = torch.randn(bs, H, P, device=DEV, generator=g).to(ACT)
        self.dt = torch.randn(bs, H, device=DEV, generator=g) * 0.5
        self.B = torch.randn(bs, G, N, device=DEV, generator=g).to(ACT)
        self.C = torch.randn(bs, G, N, device=DEV, generator=g).to(ACT)
        self.A = -torch.rand(H, device=DEV, generator=g)
        self.D = torch.randn(H, device=DEV, generator=g)
        self.dt_bias = torch.randn(H, device=DEV, generator=g) * 0.5
        self.out = torch.empty_like(self.x)

    def bytes(self) -> float:
        """Fewest bytes: each live row's state read + written (+ track writes), x, z, out,
        B, C, dt of every row."""
        es = torch.empty((), dtype=self.state_dtype).element_size()
        state = (2 * self.live + self.tracked) * H * P * N * es
        acts = 3 * self.bs * H * P * 2 + 2 * self.bs * G * N * 2 + self.bs * H * 4
        return float(state + acts)

    def ours(self) -> None:
        ssm_state_update(
            self.state, self.x, self.dt, self.A, self.B, self.C, state_indices=self.src, D=self.D,
            z=self.z, dt_bias=self.dt_bias, dt_softplus=True,
            track_indices=self.trk if self.tracked else None,
            track_mask=self.mask if self.tracked else None, out=self.out,
        )  # fmt: skip

    def ours_alloc(self) -> None:
        """The public op with no ``out`` (it allocates one), as a model's forward calls it."""
        ssm_state_update(
            self.state, self.x, self.dt, self.A, self.B, self.C, state_indices=self.src, D=self.D,
            z=self.z, dt_bias=self.dt_bias, dt_softplus=True,
        )  # fmt: skip

    def launcher(self, cfg: SsmLaunchConfig) -> Callable[[], None]:
        def run() -> None:
            launch_ssm_update(
                self.state, self.x, self.dt, self.A, self.B, self.C, self.out, self.src,
                D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=True, dst_indices=None,
                track_indices=None, track_mask=None, config=cfg,
            )  # fmt: skip

        return run

    def peer(self, fn: Callable[..., torch.Tensor]) -> Callable[[], Any]:
        """A peer at hybridmeta's calling convention (``benchmarks/peers.py``)."""
        return lambda: fn(
            self.state, self.x, self.dt, self.A, self.B, self.C, state_indices=self.src,
            D=self.D, z=self.z, dt_bias=self.dt_bias, dt_softplus=True, out=self.out,
        )  # fmt: skip


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
    t = med_us(graph.replay, rep=100) / len(make_calls)
    del graph
    return t


def _n_rotating(nbytes: float) -> int:
    # Enough independent problems that one graph replay streams well past the 60 MB L2.
    return max(1, min(16, math.ceil(256e6 / nbytes)))


def burst_us(fn: Callable[[], Any], n: int = 200) -> dict[str, float]:
    """Back-to-back eager calls: host microseconds per call (no sync inside the window), and
    end-to-end per call (the same calls, then a sync): max(host, GPU)."""
    if DEV.type != "cuda":  # --dry
        n = 2
    for _ in range(20 if DEV.type == "cuda" else 1):
        fn()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"host_us": (t1 - t0) / n * 1e6, "end_to_end_us": (t2 - t0) / n * 1e6}


def bench_ssm(ceiling: float, peers: dict[str, Callable[..., torch.Tensor]]) -> dict[str, Any]:
    """Ours and every available peer, eager (do_bench) and per call inside a CUDA graph of
    calls on rotating pools, bs 1..512, both state dtypes; the figures of merit are the
    fraction of the copy ceiling and the ratio to FlashInfer measured here."""
    rows: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for bs in BS_LIST:
            probe = SsmProblem(bs, dtype)
            nb = probe.bytes()
            probs = [probe] + [SsmProblem(bs, dtype, seed=i + 1) for i in range(_n_rotating(nb) - 1)]
            row: dict[str, Any] = {"state_dtype": name, "bs": bs, "bytes": nb,
                                   "floor_us": nb / ceiling / 1e6}  # fmt: skip
            impls: dict[str, Callable[[SsmProblem], Callable[[], Any]]] = {
                "ours": lambda p: p.ours
            }
            for pname, fn in peers.items():
                impls[pname] = lambda p, fn=fn: p.peer(fn)  # type: ignore[misc]
            for iname, make in impls.items():
                try:
                    te = med_us(make(probe))
                    tg = graph_us([make(p) for p in probs])
                except Exception as e:  # a peer failing must not lose the run
                    row[f"{iname}_error"] = repr(e)[:300]
                    continue
                row[f"{iname}_eager_us"] = te
                row[f"{iname}_graph_us"] = tg
                row[f"{iname}_eager_frac_copy"] = nb / te / 1e6 / ceiling
                row[f"{iname}_graph_frac_copy"] = nb / tg / 1e6 / ceiling
            for mode in ("eager", "graph"):
                fi = row.get(f"flashinfer_{mode}_us")
                if fi is not None and f"ours_{mode}_us" in row:
                    row[f"flashinfer_over_ours_{mode}"] = fi / row[f"ours_{mode}_us"]
            rows.append(row)
            print(
                f"ssm {name:8s} bs={bs:4d} ours eager {row['ours_eager_us']:8.2f} us "
                f"{row['ours_eager_frac_copy']:.1%} graph {row['ours_graph_us']:8.2f} us "
                f"{row['ours_graph_frac_copy']:.1%}"
                + "".join(
                    f" | {p} {row[p + '_eager_us']:8.2f} / {row[p + '_graph_us']:8.2f}"
                    for p in peers if p + "_eager_us" in row
                ),
                flush=True,
            )  # fmt: skip
            del probe, probs
            if DEV.type == "cuda":
                torch.cuda.empty_cache()

    # bs 1 eager, back-to-back (host launch time included): ours (out given / allocated),
    # FlashInfer.
    small: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        p1 = SsmProblem(1, dtype)
        entry: dict[str, Any] = {"state_dtype": str(dtype).removeprefix("torch."), "bs": 1,
                                 "ours_do_bench_us": med_us(p1.ours),
                                 "ours": burst_us(p1.ours), "ours_alloc_out": burst_us(p1.ours_alloc)}  # fmt: skip
        for pname, fn in peers.items():
            try:
                entry[pname] = burst_us(p1.peer(fn))
                entry[pname + "_do_bench_us"] = med_us(p1.peer(fn))
            except Exception as e:
                entry[pname] = repr(e)[:300]
        small.append(entry)
        print("ssm bs=1 eager", entry, flush=True)

    # Padding: a bucket-256 graph replayed with 1 live row against a bucket-1 graph.
    pad: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        b1 = [SsmProblem(1, dtype, seed=i) for i in range(8)]
        b256 = [SsmProblem(PAD_BUCKET, dtype, seed=i, live=1) for i in range(8)]
        entry = {"state_dtype": str(dtype).removeprefix("torch."), "bucket": PAD_BUCKET, "live": 1}
        for iname, make in [("ours", lambda p: p.ours)] + [
            (n, lambda p, fn=fn: p.peer(fn)) for n, fn in peers.items()  # type: ignore[misc]
        ]:
            try:
                t1 = graph_us([make(p) for p in b1])
                t256 = graph_us([make(p) for p in b256])
                # Every pad row's output must be zero (the declared pad semantics).
                entry[f"{iname}_pad_rows_zero"] = bool((b256[0].out[1:] == 0).all())
            except Exception as e:
                entry[f"{iname}_error"] = repr(e)[:300]
                continue
            entry[f"{iname}_bucket1_us"] = t1
            entry[f"{iname}_bucket256_live1_us"] = t256
            entry[f"{iname}_ratio"] = t256 / t1
        pad.append(entry)
        print("ssm padding", entry, flush=True)
        del b1, b256

    fused: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        for bs in FUSED_TRACK_BS:
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
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "bs1_eager": small, "padding": pad, "fused_track": fused}


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


def _n_rotating_conv(nbytes: float) -> int:
    # Enough independent pools that one graph replay streams well past the L2 cache.
    return max(2, min(32, math.ceil(256e6 / nbytes)))


def _rotating(bs: int, inner: bool, nbytes: float) -> list[ConvProblem]:
    return [ConvProblem(bs, inner=inner) for _ in range(_n_rotating_conv(nbytes))]


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


def host_overhead(peers: dict[str, Callable[..., torch.Tensor]]) -> dict[str, Any]:
    """Host microseconds per call of tiny problems (bs 1): 200 back-to-back calls timed
    without a sync inside the window (host_us), and end to end with the sync (the eager
    throughput, max(host, GPU)). Each path of the public SSM op, its pieces, the conv op,
    the fused norms and the peers' Python entry points."""
    import hybridmeta.kernels._dispatch as ops
    from hybridmeta.kernels.ssm_update import ssm_args_ok

    ssm = SsmProblem(1, torch.float32)
    conv = ConvProblem(1)
    cfg = ssm_launch_config(torch.float32, P, N)
    norm_x = torch.randn(1, HIDDEN, device=DEV).to(ACT)
    norm_w = torch.randn(HIDDEN, device=DEV).to(ACT)
    norm_o, norm_r = torch.empty_like(norm_x), torch.empty_like(norm_x)
    res: dict[str, Any] = {
        "ssm_args_ok": burst_us(lambda: ssm_args_ok(
            ssm.state, ssm.x, ssm.dt, ssm.A, ssm.B, ssm.C, ssm.src, ssm.D, ssm.z, ssm.dt_bias,
            None, None, None, ssm.out)),
        "ssm_launcher_direct": burst_us(ssm.launcher(cfg)),
        "ssm_public_direct": burst_us(ssm.ours),
        "ssm_public_alloc_out": burst_us(ssm.ours_alloc),
        "conv_public_direct": burst_us(conv.ours),
        "add_rms_norm_public": burst_us(lambda: add_rms_norm(
            norm_x, norm_x, norm_w, 1e-5, out=norm_o, residual_out=norm_r)),
        "torch_empty_like_x": burst_us(lambda: torch.empty_like(ssm.x)),
    }  # fmt: skip
    launcher_mod = sys.modules["hybridmeta.kernels.ssm_update"]
    saved = launcher_mod._LAUNCHER._variants.copy()  # type: ignore[attr-defined]
    # Triton's own launch path every time (what main did): a cache that never fills.
    launcher_mod._LAUNCHER._compiled = False  # type: ignore[attr-defined]
    launcher_mod._LAUNCHER.clear()  # type: ignore[attr-defined]
    try:
        res["ssm_public_triton_launch"] = burst_us(ssm.ours)
    finally:
        launcher_mod._LAUNCHER._compiled = True  # type: ignore[attr-defined]
        launcher_mod._LAUNCHER._variants.update(saved)  # type: ignore[attr-defined]
    ops.ALWAYS_DISPATCH = True
    try:
        res["ssm_public_dispatched"] = burst_us(ssm.ours)
        res["conv_public_dispatched"] = burst_us(conv.ours)
    finally:
        ops.ALWAYS_DISPATCH = False
    for pname, fn in peers.items():
        try:
            res[f"{pname}_public"] = burst_us(ssm.peer(fn))
        except Exception as e:
            res[f"{pname}_public"] = repr(e)[:300]
    print("host overhead per call (us)", json.dumps(res), flush=True)
    return res


def _torch_add_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from hybridmeta.kernels import add_rms_norm_reference

    return add_rms_norm_reference(x, r, w, 1e-5)[0]


def _torch_gated(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, gs: int) -> torch.Tensor:
    from hybridmeta.kernels import gated_rms_norm_reference

    return gated_rms_norm_reference(y, z, w, gs, 1e-5).to(ACT)


def bench_norms(ceiling: float) -> list[dict[str, Any]]:
    """Fused residual-add + RMSNorm ([bs, 4480]) and the gated norm ([bs, 10240], 8 groups)
    per call inside a CUDA graph, against the ops' pure-torch references (eager, their
    several kernels) and the bytes floor."""
    rows: list[dict[str, Any]] = []
    for bs in NORM_BS:
        n = 8
        xs = [torch.randn(bs, HIDDEN, device=DEV).to(ACT) for _ in range(n)]
        rs = [torch.randn(bs, HIDDEN, device=DEV).to(ACT) for _ in range(n)]
        w = torch.randn(HIDDEN, device=DEV).to(ACT)
        outs = [torch.empty_like(x) for x in xs]
        news = [torch.empty_like(x) for x in xs]
        nb = float(5 * bs * HIDDEN * 2 + HIDDEN * 2)  # x, residual in; out, residual out; w

        inner = H * P
        ys = [torch.randn(bs, inner, device=DEV) for _ in range(n)]
        zs = [torch.randn(bs, inner, device=DEV).to(ACT) for _ in range(n)]
        wg = torch.randn(inner, device=DEV).to(ACT)
        gouts = [torch.empty(bs, inner, device=DEV, dtype=ACT) for _ in range(n)]
        gnb = float(bs * inner * (4 + 2 + 2) + inner * 2)  # y fp32, z, out bf16, w
        gs = inner // G
        fused = [functools.partial(add_rms_norm, xs[i], rs[i], w, 1e-5, out=outs[i],
                                   residual_out=news[i]) for i in range(n)]  # fmt: skip
        ref = [functools.partial(_torch_add_norm, xs[i], rs[i], w) for i in range(n)]
        gated = [functools.partial(gated_rms_norm, ys[i], zs[i], wg, gs, 1e-5, out=gouts[i])
                 for i in range(n)]  # fmt: skip
        gated_ref = [functools.partial(_torch_gated, ys[i], zs[i], wg, gs) for i in range(n)]

        r = {"bs": bs, "add_rms_norm_bytes": nb, "gated_bytes": gnb,
             "add_rms_norm_graph_us": graph_us(fused),
             "add_rms_norm_torch_graph_us": graph_us(ref),
             "gated_graph_us": graph_us(gated),
             "gated_torch_graph_us": graph_us(gated_ref)}  # fmt: skip
        r["add_rms_norm_floor_us"] = nb / ceiling / 1e6
        r["gated_floor_us"] = gnb / ceiling / 1e6
        rows.append(r)
        print("norms", r, flush=True)
    return rows


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
    for tracked, bs in TRACK_CASES:
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


# Tile shapes (block_p, num_warps, row_block) and row splits swept beside the defaults.
SSM_SWEEP: dict[torch.dtype, tuple[tuple[int, int, int], ...]] = {
    torch.float32: ((8, 1, 64), (8, 1, 16)),
    torch.bfloat16: ((16, 2, 64), (16, 2, 16), (16, 1, 64), (16, 1, 16), (8, 1, 64)),
}
SWEEP_SPLITS: tuple[int, ...] = (16, 32)


def _new_variant(before: set[Any]) -> dict[str, int]:
    """Registers and spills of the SSM variant compiled since ``before`` (a key set)."""
    import hybridmeta.kernels.ssm_update as su

    variants = su._LAUNCHER._variants  # type: ignore[attr-defined]
    new = [v for k, v in variants.items() if k not in before]
    return {"n_regs": new[0].n_regs, "n_spills": new[0].n_spills} if new else {}


def _sweep_ssm(ceiling: float) -> list[dict[str, Any]]:
    """Tile shapes, warps, row blocks and row splits at bs 1 (per call in a graph of calls on
    rotating pools), 128 and 512 (do_bench); ``row_splits = bs`` is one row per program
    (main's grid), ``None`` the default rule. Registers per thread from the compiled kernel."""
    import hybridmeta.kernels.ssm_update as su

    res: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for bs in SWEEP_BS:
            probe = SsmProblem(bs, dtype)
            nb = probe.bytes()
            probs = [probe] + [SsmProblem(bs, dtype, seed=i + 1) for i in range(_n_rotating(nb) - 1)]
            cfgs = [SsmLaunchConfig(block_p=bp, num_warps=nw, row_block=rb)
                    for bp, nw, rb in SSM_SWEEP[dtype]]  # fmt: skip
            default = ssm_launch_config(dtype, P, N)
            cfgs.append(SsmLaunchConfig(default.block_p, default.num_warps, row_splits=bs))
            if bs > 1:
                cfgs += [SsmLaunchConfig(default.block_p, default.num_warps, row_splits=s)
                         for s in SWEEP_SPLITS]  # fmt: skip
            for cfg in cfgs:
                before = set(su._LAUNCHER._variants)  # type: ignore[attr-defined]
                t = graph_us([p.launcher(cfg) for p in probs]) if bs == 1 else med_us(
                    probe.launcher(cfg), rep=40
                )
                res.append({"state_dtype": name, "bs": bs, "block_p": cfg.block_p,
                            "num_warps": cfg.num_warps, "row_block": cfg.row_block,
                            "row_splits": cfg.row_splits, "us": t,
                            "frac_copy": nb / t / 1e6 / ceiling, **_new_variant(before)})  # fmt: skip
                print("sweep ssm", res[-1], flush=True)
            del probe, probs
            if DEV.type == "cuda":
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


TILE_SWEEP: tuple[tuple[int, int], ...] = ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (32, 4))
TILE_SWEEP_BS: tuple[int, ...] = (1, 4, 8, 16, 64, 128, 256, 512)


def _sweep_tile(ceiling: float) -> list[dict[str, Any]]:
    """The one-tile-a-program kernel (``row_walk=False``) at several tile shapes and warps
    against the default, both state dtypes: per call in a graph of calls on rotating pools
    (what a replayed decode step sees), and the padding price (bucket ``bs`` launched with
    one live row, over a bucket-1 launch)."""
    res: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        default = ssm_launch_config(dtype, P, N)
        for bs in TILE_SWEEP_BS:
            probe = SsmProblem(bs, dtype)
            nb = probe.bytes()
            probs = [probe] + [SsmProblem(bs, dtype, seed=i + 1) for i in range(_n_rotating(nb) - 1)]
            cfgs = [default] + [SsmLaunchConfig(block_p=bp, num_warps=nw, row_walk=False)
                                for bp, nw in TILE_SWEEP if bp <= P]  # fmt: skip
            for cfg in cfgs:
                t = graph_us([p.launcher(cfg) for p in probs])
                row = {"state_dtype": name, "bs": bs, "block_p": cfg.block_p,
                       "num_warps": cfg.num_warps, "row_walk": cfg.row_walk,
                       "default": cfg == default, "graph_us": t,
                       "frac_copy": nb / t / 1e6 / ceiling}  # fmt: skip
                if bs == 256:
                    live = probe.src.clone()
                    probe.src[1:] = -1  # one live row in a bucket of 256
                    try:
                        row["pad_bucket256_live1_us"] = med_us(probe.launcher(cfg))
                    finally:
                        probe.src.copy_(live)
                res.append(row)
                print("sweep tile", row, flush=True)
            del probe, probs
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
    return res


def sweep(ceiling: float) -> dict[str, Any]:
    """SSM launch-configuration sweep behind the defaults in hybridmeta.kernels._config."""
    return {"ssm": _sweep_ssm(ceiling)}


def sweep_copy_kernels(ceiling: float) -> dict[str, Any]:
    """Conv update and track-save configuration sweeps (``--only sweep_conv``)."""
    return {"conv": _sweep_conv(ceiling), "track": _sweep_track(ceiling)}


def load_peers(names: list[str]) -> tuple[dict[str, Callable[..., torch.Tensor]], dict[str, Any]]:
    """The peers' SSM updates at our calling convention, from ``benchmarks/peers.py`` and its
    bundle (``$HYBRIDMETA_PEERS``; never committed). FlashInfer's modules are JIT-built
    first (in parallel, timed) unless the bundle carries them prebuilt."""
    notes: dict[str, Any] = {}
    if DEV.type != "cuda" or not names:
        return {}, {"skipped": "no CUDA device" if DEV.type != "cuda" else "none asked for"}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import peers as peer_mod  # type: ignore[import-not-found, unused-ignore]
    except Exception as e:  # the peers are optional: report why they are missing
        return {}, {"import": repr(e)[:300]}
    out: dict[str, Callable[..., torch.Tensor]] = {}
    notes["versions"] = peer_mod.versions()
    for name in names:
        if name == "flashinfer" and peer_mod.why_unavailable(name) is None:
            t0 = time.perf_counter()
            try:
                notes["flashinfer_build"] = peer_mod.prebuild_flashinfer(
                    (torch.float32, torch.bfloat16), (1,), dim=P, dstate=N,
                    input_dtype=ACT, weight_dtype=torch.float32, index_dtype=torch.int64,
                )  # fmt: skip
            except Exception as e:
                notes["flashinfer_build_error"] = repr(e)[:300]
            notes["flashinfer_build_s"] = time.perf_counter() - t0
        fn = peer_mod.single_token(name)
        notes[name] = peer_mod.why_unavailable(name)
        if fn is not None:
            out[name] = fn
    print("peers", notes, flush=True)
    return out, notes


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    ceiling = result["copy_ceiling"]["tbps"]
    fig, axes = plt.subplots(1, 4, figsize=(24, 5))
    for ax, dtype in zip(axes[:2], ("float32", "bfloat16"), strict=True):
        rows = [r for r in result.get("ssm", {}).get("rows", []) if r["state_dtype"] == dtype]
        bs = [r["bs"] for r in rows]
        impls = ["ours"] + [k[: -len("_graph_us")] for k in (rows[0] if rows else {})
                            if k.endswith("_graph_us") and not k.startswith("ours")]  # fmt: skip
        for i, impl in enumerate(impls):
            label = "hybridmeta" if impl == "ours" else impl
            ax.plot(bs, [r.get(f"{impl}_graph_frac_copy", float("nan")) for r in rows], "o-",
                    color=f"C{i}", label=f"{label}, graph replay")  # fmt: skip
            ax.plot(bs, [r.get(f"{impl}_eager_frac_copy", float("nan")) for r in rows], "x:",
                    color=f"C{i}", label=f"{label}, eager")  # fmt: skip
        ax.axhline(1.0, color="k", ls=":", label=f"copy ceiling {ceiling:.2f} TB/s")
        ax.axhline(0.93, color="grey", ls="--", lw=0.8, label="93% target")
        ax.set(xscale="log", ylim=(0, 1.05), xlabel="batch size", ylabel="fraction of copy",
               title=f"SSM update, Nano-9B-v2 layer, {dtype} state")  # fmt: skip
        ax.legend(fontsize=7)
    ax = axes[2]
    conv = result.get("conv", [])
    for layout in sorted({r["layout"] for r in conv}):
        rows = [r for r in conv if r["layout"] == layout]
        ax.plot([r["bs"] for r in rows], [r["ours_graph_frac_copy"] for r in rows], "o-",
                label=f"conv, {layout}")  # fmt: skip
    ax.axhline(0.8, color="grey", ls="--", lw=0.8, label="80% target")
    ax.set(xscale="log", ylim=(0, 1.05), xlabel="batch size", ylabel="fraction of copy",
           title="conv update, graph replay")  # fmt: skip
    ax.legend(fontsize=7)
    ax = axes[3]
    pad = result.get("ssm", {}).get("padding", [])
    labels, vals1, vals256 = [], [], []
    for e in pad:
        for impl in ("ours", "flashinfer", "vllm", "sglang", "mamba_ssm"):
            if f"{impl}_bucket1_us" in e:
                labels.append(f"{impl}\n{e['state_dtype']}")
                vals1.append(e[f"{impl}_bucket1_us"])
                vals256.append(e[f"{impl}_bucket256_live1_us"])
    xs = range(len(labels))
    ax.bar([i - 0.2 for i in xs], vals1, 0.4, label="bucket-1 graph, 1 row")
    ax.bar([i + 0.2 for i in xs], vals256, 0.4, label="bucket-256 graph, 1 live row")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(yscale="log", ylabel="us per call in a graph", title="SSM update: cost of pad rows")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _make_dry() -> None:
    global H, P, N, G, CONV_DIM, LAYERS, BS_LIST, DEV, HIDDEN
    global SWEEP_BS, MIXER_BS, NORM_BS, FUSED_TRACK_BS, PAD_BUCKET, TRACK_CASES
    H, P, N, G, LAYERS, HIDDEN = 2, 4, 8, 1, 2, 24
    CONV_DIM = H * P + 2 * G * N
    BS_LIST = SWEEP_BS = MIXER_BS = NORM_BS = FUSED_TRACK_BS = (1, 3)
    PAD_BUCKET = 5
    TRACK_CASES = ((1, 3),)
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


SECTIONS = ("host", "ssm", "conv", "norms", "track", "sweep", "sweep_conv", "sweep_tile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder")
    ap.add_argument("--tag", default="h200", help="file name tag")
    ap.add_argument("--only", default=",".join(s for s in SECTIONS if not s.startswith("sweep")),
                    help=f"comma-separated sections of {SECTIONS}")  # fmt: skip
    ap.add_argument("--peers", default="flashinfer,vllm,sglang,mamba_ssm",
                    help="peers to measure beside ours (benchmarks/peers.py)")  # fmt: skip
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
    only = {s for s in args.only.split(",") if s}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    t_start = time.perf_counter()
    peers, peer_notes = load_peers([p for p in args.peers.split(",") if p])
    result: dict[str, Any] = {
        "device": _device_name(),
        "sms": _sm_count(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shapes": {"nheads": H, "headdim": P, "dstate": N, "ngroups": G, "conv_dim": CONV_DIM,
                   "k": K, "layers": LAYERS, "hidden": HIDDEN, "activations": "bfloat16"},
        "method": "triton.testing.do_bench median, L2 flushed before each repetition; graph: "
        "per call inside one CUDA graph of calls on rotating pools (>= 256 MB streamed per "
        "replay); bandwidth = fewest bytes read + written / time",
        "peers": peer_notes,
    }  # fmt: skip
    result["copy_ceiling"] = copy_ceiling()
    ceiling = result["copy_ceiling"]["tbps"]
    print(f"copy ceiling {ceiling:.3f} TB/s", flush=True)

    def save() -> None:
        result["seconds"] = time.perf_counter() - t_start
        (out / f"kernels_{args.tag}.json").write_text(json.dumps(result, indent=1))

    steps: list[tuple[str, Callable[[], Any]]] = [
        ("sweep", lambda: sweep(ceiling)),
        ("sweep_conv", lambda: sweep_copy_kernels(ceiling)),
        ("sweep_tile", lambda: {"ssm_tile": _sweep_tile(ceiling)}),
        ("host", lambda: host_overhead(peers)),
        ("ssm", lambda: bench_ssm(ceiling, peers)),
        ("conv", lambda: bench_conv(ceiling)),
        ("norms", lambda: bench_norms(ceiling)),
        ("track", lambda: bench_track(ceiling)),
    ]
    for name, fn in steps:
        if name not in only:
            continue
        try:
            result[name] = fn()
        except Exception as e:  # one failing section must not lose the others
            result[f"{name}_error"] = repr(e)[:1000]
            print(f"section {name} failed: {e!r}", flush=True)
        save()
    try:
        plot(result, out / f"kernels_{args.tag}.png")
    except Exception as e:  # a missing matplotlib must not lose the numbers
        print(f"plot failed: {e!r}")
    print(f"wrote {out / f'kernels_{args.tag}.json'} in {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
