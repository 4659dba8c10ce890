"""Prefill throughput of the chunked SSD scan path (planner, conv, scan, track-save).

Runs on the GPU when there is one (Nemotron-Nano-9B-v2 layer shapes, docs/background.md
section 4); ``--small`` (or no CUDA) runs tiny shapes on the CPU as a smoke test. Compares:

* ``torch``: the scan's vectorised reference (``ssd_chunked_scan(impl="reference")``) over
  the whole flattened batch (the baseline),
* ``triton``: the Triton scan (``ssd_chunked_scan(impl="triton")``) on the same plan,
* ``per_request``: the reference called once per request (what an engine without the
  global-grid plan does),
* ``oracle``: the token-by-token recurrence of ``tests/oracle.py``, on a short slice
  (tokens/s only).

Every implementation is checked against the oracle on a slice before it is timed; the
JSON says by how much.

Usage::

    PYTHONPATH=src python3 benchmarks/bench_prefill.py --out DIR [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on a CPU-only machine; decided before any
    # kernel is decorated (the import below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridmeta import Mamba2Metadata, plan_mixed_batch
from hybridmeta.kernels import (
    Impl,
    SSMParams,
    causal_conv1d_prefill,
    extend_track_save,
    split_xbc,
    ssd_chunked_scan,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' oracle
from tests.oracle import oracle_layer

NANO_9B = {"nheads": 128, "headdim": 80, "dstate": 128, "ngroups": 8, "conv_kernel": 4}
SMALL = {"nheads": 4, "headdim": 8, "dstate": 8, "ngroups": 2, "conv_kernel": 4}


def _time(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in microseconds (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(float(start.elapsed_time(end)) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return float(statistics.median(samples))


class Layer:
    """Random weights, inputs and pools for one Mamba2 layer."""

    def __init__(
        self,
        shape: dict[str, int],
        tokens: int,
        pool: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)
        H, P, N, G, K = (
            shape[k] for k in ("nheads", "headdim", "dstate", "ngroups", "conv_kernel")
        )
        self.shape = shape
        conv_dim = H * P + 2 * G * N

        def rnd(*s: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
            return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dt)

        self.xbc = rnd(tokens, conv_dim)
        self.dt = rnd(tokens, H, scale=0.5, dt=torch.float32)
        self.w = rnd(conv_dim, K, scale=0.5, dt=torch.float32)
        self.b = rnd(conv_dim, scale=0.1, dt=torch.float32)
        self.params = SSMParams(
            A=-(torch.rand(H, generator=g) + 0.2).to(device),
            D=rnd(H, dt=torch.float32),
            dt_bias=rnd(H, scale=0.2, dt=torch.float32),
        )
        self.conv_pool = rnd(pool, conv_dim, K - 1)
        self.ssm_pool = rnd(pool, H, P, N, dt=torch.float32)

    def split(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        return split_xbc(u, s["nheads"], s["headdim"], s["ngroups"], s["dstate"])


def _plan(
    lens: list[int], prefix: list[int], chunk: int, interval: int, K: int, device: torch.device
) -> Mamba2Metadata:
    n = len(lens)
    return plan_mixed_batch(
        extend_lens=lens,
        prefix_lens=prefix,
        slots=list(range(n)),
        num_decodes=0,
        chunk_size=chunk,
        conv_kernel=K,
        track_interval=interval,
        track_mask=[True] * n,
        track_slots=list(range(n, 2 * n)),
        device=device,
    )


def _forward(
    layer: Layer,
    md: Mamba2Metadata,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    impl: Impl = "reference",
    track: bool = True,
) -> Any:
    conv = causal_conv1d_prefill(xbc, layer.w, layer.b, md=md, conv_state=layer.conv_pool)
    x, B, C = layer.split(conv.out)
    scan = ssd_chunked_scan(
        x, dt, B, C, params=layer.params, md=md, ssm_state=layer.ssm_pool, impl=impl
    )
    if track:
        extend_track_save(
            md,
            xbc=xbc,
            conv=conv,
            scan=scan,
            conv_state=layer.conv_pool,
            ssm_state=layer.ssm_pool,
        )
    return scan


def _oracle_error(
    layer: Layer, chunk: int, device: torch.device, impl: Impl, n_tok: int
) -> float:
    """Max |y - oracle| on a two-row slice (second row resumes from a state)."""
    lens = [n_tok // 2 + 3, n_tok - n_tok // 2 - 3]
    plan = _plan(lens, [0, 5], chunk, chunk, layer.shape["conv_kernel"], device)
    s = layer.shape
    pool_c, pool_s = layer.conv_pool.clone(), layer.ssm_pool.clone()
    rows = oracle_layer(
        layer.xbc[:n_tok].float().cpu(),
        layer.dt[:n_tok].cpu(),
        lens,
        [None, pool_c[1].float().cpu()],
        [None, pool_s[1].float().cpu()],
        conv_weight=layer.w.cpu(),
        conv_bias=layer.b.cpu(),
        params=SSMParams(
            A=layer.params.A.cpu(), D=layer.params.D.cpu(), dt_bias=layer.params.dt_bias.cpu()
        ),
        nheads=s["nheads"],
        headdim=s["headdim"],
        ngroups=s["ngroups"],
        dstate=s["dstate"],
    )
    scan = _forward(layer, plan, layer.xbc[:n_tok], layer.dt[:n_tok], impl, track=False)
    layer.conv_pool.copy_(pool_c)
    layer.ssm_pool.copy_(pool_s)
    ref = torch.cat([r.y for r in rows])
    return float((scan.y.float().cpu() - ref).abs().max())


def _scan_variants() -> dict[str, Impl]:
    return {"torch": "reference", "triton": "triton"}


def _bench_case(
    layer: Layer,
    variants: dict[str, Impl],
    name: str,
    lens: list[int],
    prefix: list[int],
    chunk: int,
    interval: int,
    device: torch.device,
    reps: int,
) -> dict[str, Any]:
    K = layer.shape["conv_kernel"]
    T = sum(lens)
    xbc, dt = layer.xbc[:T], layer.dt[:T]
    t0 = time.perf_counter()
    for _ in range(20):
        plan = _plan(lens, prefix, chunk, interval, K, device)
    plan_us = (time.perf_counter() - t0) / 20 * 1e6
    entry: dict[str, Any] = {
        "case": name,
        "tokens": T,
        "rows": len(lens),
        "planner_host_us": plan_us,
        "logical_chunks": plan.mixed.chunks.num_logical if plan.mixed is not None else 0,
        "track_entries": {
            "final": int(plan.mamba_track_mask.sum()) if plan.mamba_track_mask is not None else 0,
            "h": plan.mixed.track.num_h if plan.mixed is not None else 0,
            "recompute": plan.mixed.track.num_recompute if plan.mixed is not None else 0,
        },
    }
    conv = causal_conv1d_prefill(xbc, layer.w, layer.b, md=plan, conv_state=layer.conv_pool)
    x, B, C = layer.split(conv.out)
    for vname, impl in variants.items():

        def layer_fwd(impl: Impl = impl) -> None:
            _forward(layer, plan, xbc, dt, impl)

        def scan_only(impl: Impl = impl) -> None:
            ssd_chunked_scan(
                x, dt, B, C, params=layer.params, md=plan, ssm_state=layer.ssm_pool, impl=impl
            )

        us = _time(layer_fwd, device, reps)
        entry[f"{vname}_layer_us"] = us
        entry[f"{vname}_tokens_per_s"] = T / us * 1e6
        entry[f"{vname}_scan_only_us"] = _time(scan_only, device, reps)

    def conv_only() -> None:
        causal_conv1d_prefill(xbc, layer.w, layer.b, md=plan, conv_state=layer.conv_pool)

    entry["conv_only_us"] = _time(conv_only, device, reps)
    if "triton" in variants:
        entry["triton_scan_speedup_vs_torch"] = (
            entry["torch_scan_only_us"] / entry["triton_scan_only_us"]
        )
    # per-request: one plan + one scan call per row (no shared global grid)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    singles = [
        (_plan([n], [p], chunk, interval, K, device), s, n)
        for n, p, s in zip(lens, prefix, starts, strict=True)
    ]

    def per_request() -> None:
        for pl, s, n in singles:
            _forward(layer, pl, xbc[s : s + n], dt[s : s + n])

    pr_us = _time(per_request, device, max(1, reps // 2))
    entry["per_request_layer_us"] = pr_us
    entry["per_request_tokens_per_s"] = T / pr_us * 1e6
    entry["batched_speedup_vs_per_request"] = pr_us / entry["torch_layer_us"]
    return entry


def run(args: argparse.Namespace) -> dict[str, Any]:
    use_gpu = torch.cuda.is_available() and not args.small
    device = torch.device("cuda" if use_gpu else "cpu")
    shape = NANO_9B if use_gpu else SMALL
    chunk = 128 if use_gpu else 16
    interval = 256 if use_gpu else 32
    dtype = torch.bfloat16 if use_gpu else torch.float32
    reps = args.reps if use_gpu else 3
    cases = (
        [
            ("1x4096", [4096], [0]),
            ("8x512_resume", [512] * 8, [300] * 8),
            (
                "32x128_mixed",
                [97, 128, 1, 250, 33] * 6 + [128, 3],
                [0, 256, 17, 5, 512] * 6 + [0, 1],
            ),
        ]
        if use_gpu
        else [("1x96", [96], [0]), ("4x24_resume", [24] * 4, [10] * 4)]
    )
    max_tokens = max(sum(c[1]) for c in cases)
    layer = Layer(shape, max_tokens, 2 * 40, device, dtype)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if use_gpu else "cpu",
        "torch": torch.__version__,
        "shape": shape,
        "chunk_size": chunk,
        "track_interval": interval,
        "activation_dtype": str(dtype),
        "ssm_state_dtype": "torch.float32",
        "cases": [],
    }
    n_check = 96 if use_gpu else 40
    variants: dict[str, Impl] = {}
    result["max_abs_err_vs_oracle"] = {}
    for vname, fn in _scan_variants().items():
        try:
            err = _oracle_error(layer, chunk, device, fn, n_check)
        except Exception as exc:  # a variant that cannot run here is reported, not fatal
            result.setdefault("failed_variants", {})[vname] = repr(exc)[:2000]
            continue
        result["max_abs_err_vs_oracle"][vname] = err
        variants[vname] = fn

    oracle_tokens = 16 if use_gpu else 24
    t0 = time.perf_counter()
    _oracle_error(layer, chunk, device, "reference", oracle_tokens)
    oracle_s = time.perf_counter() - t0
    result["oracle_tokens_per_s"] = oracle_tokens / oracle_s

    for name, lens, prefix in cases:
        entry = _bench_case(layer, variants, name, lens, prefix, chunk, interval, device, reps)
        result["cases"].append(entry)
        print(json.dumps(entry))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="directory for bench_prefill.json")
    ap.add_argument("--small", action="store_true", help="tiny CPU-sized shapes")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_prefill.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
