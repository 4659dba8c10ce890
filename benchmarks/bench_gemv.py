"""The decode step's projections at Nemotron-Nano-9B-v2 shapes: cuBLAS against a Triton GEMV.

At 1 to 16 rows every projection is a weight read (``N x K`` bf16), so its floor is the
weight bytes over the copy ceiling. For each projection and row count this measures, per
call inside a CUDA graph of calls over rotating weight copies (more bytes than L2 holds):
``F.linear`` (cuBLAS; both ``preferred_blas_library`` settings), how many kernels each
call launches (split-K reduce kernels and memsets included), and candidate Triton GEMV
tilings. Writes ``gemv_<tag>.json``.

    python benchmarks/bench_gemv.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from graph_timing import copy_tbps, graph_per_call_us  # type: ignore[import-not-found, unused-ignore]

from hybridmeta.kernels.linear import launch_gemv

# (name, N, K) of Nemotron-Nano-9B-v2 (hidden 4480, 128 x 80 Mamba heads, state 128,
# 8 groups, MLP 15680, 40/8 attention heads of 128)
SHAPES = [
    ("mamba in_proj", 10240 + 12288 + 128, 4480),
    ("mamba out_proj", 4480, 10240),
    ("mlp up_proj", 15680, 4480),
    ("mlp down_proj", 4480, 15680),
    ("attn q_proj", 5120, 4480),
    ("attn k_proj", 1024, 4480),
    ("attn o_proj", 4480, 5120),
]


@triton.jit
def _gemv_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    y_ptr: tl.tensor,
    M: tl.tensor,
    N: tl.tensor,
    K: tl.tensor,
    stride_x: tl.tensor,
    stride_w: tl.tensor,
    stride_y: tl.tensor,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
) -> None:
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.arange(0, BLOCK_M)
    m_n = o_n < N
    m_m = o_m < M
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(w_ptr + o_n[:, None] * stride_w + o_k[None, :],
                      mask=m_n[:, None] & m_k[None, :], other=0.0)  # fmt: skip
        if USE_DOT:
            b_x = tl.load(x_ptr + o_m[:, None] * stride_x + o_k[None, :],
                          mask=m_m[:, None] & m_k[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(b_x, tl.trans(b_w), acc)
        else:
            b_x1 = tl.load(x_ptr + o_k, mask=m_k, other=0.0).to(tl.float32)
            acc2 += b_w.to(tl.float32) * b_x1[None, :]
    if USE_DOT:
        tl.store(y_ptr + o_m[:, None] * stride_y + o_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_m[:, None] & m_n[None, :])  # fmt: skip
    else:
        tl.store(y_ptr + o_n, tl.sum(acc2, axis=1).to(y_ptr.dtype.element_ty), mask=m_n)


def triton_gemv(block_n: int, block_k: int, warps: int, stages: int) -> Callable[..., None]:
    def run(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        M, K = x.shape
        N = w.shape[0]
        use_dot = M > 1
        _gemv_kernel[(triton.cdiv(N, block_n),)](
            x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
            BLOCK_M=16 if use_dot else 1, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return run


def kernels_per_call(fn: Callable[[], None]) -> tuple[float, list[str]]:
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


def measure(
    name: str, N: int, K: int, ceiling: float, cands: dict[str, Callable[..., None]]
) -> list[dict[str, Any]]:
    """One projection at 1 and 16 rows: cuBLAS (both BLAS settings) and each Triton tiling."""
    dev = torch.device("cuda")
    wbytes = N * K * 2
    copies = max(2, -(-160 * 2**20 // wbytes))  # > L2 in flight
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    rows = []
    for M in (1, 16):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        want = F.linear(x, ws[0]).float()
        row: dict[str, Any] = {"proj": name, "N": N, "K": K, "M": M, "weight_bytes": wbytes,
                               "floor_us": wbytes / ceiling / 1e6}  # fmt: skip

        def mm(i: int, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            torch.matmul(x, ws[i].t(), out=y)

        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            us = graph_per_call_us(mm, copies)
            nk, names = kernels_per_call(lambda mm=mm: mm(0))
            row[lib] = {"us": us, "frac_copy": row["floor_us"] / us, "kernels": nk,
                        "names": names}  # fmt: skip
        torch.backends.cuda.preferred_blas_library("cublas")
        for cname, fn in cands.items():
            if cname.startswith("m1 ") and M > 1:
                continue
            try:
                fn(x, ws[0], y)
                err = float((y.float() - want).abs().max())

                def call(i: int, fn: Callable[..., None] = fn, x: torch.Tensor = x,
                         y: torch.Tensor = y) -> None:  # fmt: skip
                    fn(x, ws[i], y)

                us = graph_per_call_us(call, copies)
                row[cname] = {"us": us, "frac_copy": row["floor_us"] / us, "max_err": err}
            except Exception as e:  # a tiling that does not compile: record it
                row[cname] = {"error": repr(e)[:300]}
        rows.append(row)
        best = min((v["us"], k) for k, v in row.items() if isinstance(v, dict) and "us" in v)
        print(f"{name:15s} M={M:2d} floor {row['floor_us']:7.1f} us | cublas "
              f"{row['cublas']['us']:7.1f} ({row['cublas']['kernels']:.0f} k) cublaslt "
              f"{row['cublaslt']['us']:7.1f} ({row['cublaslt']['kernels']:.0f} k) | best "
              f"{best[1]} {best[0]:.1f}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceiling = copy_tbps()
    res: dict[str, Any] = {
        "benchmark": "decode_projections",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "cuda": torch.version.cuda, "python": sys.version.split()[0]},
        "copy_ceiling_tbps": ceiling,
        "rows": [],
    }  # fmt: skip
    cands: dict[str, Callable[..., None]] = {
        # the library's one-row path (kernels.linear: BLOCK_N 4, BLOCK_K 512, 4 warps)
        "m1 hybridmeta.linear": lambda x, w, y: launch_gemv(x, w, None, y),
        "m1 n2 k1024 w4": triton_gemv(2, 1024, 4, 3),
        "m1 n4 k1024 w8": triton_gemv(4, 1024, 8, 3),
        "m1 n4 k512 w8": triton_gemv(4, 512, 8, 3),
        "m1 n8 k512 w8": triton_gemv(8, 512, 8, 3),
        "m1 n4 k256 w2": triton_gemv(4, 256, 2, 4),
        "triton n32 k128 w4": triton_gemv(32, 128, 4, 3),
    }
    for name, N, K in SHAPES:
        res["rows"] += measure(name, N, K, ceiling, cands)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gemv_{args.tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
