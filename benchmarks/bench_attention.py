"""Decode attention at Nemotron-Nano-9B-v2 shapes: the split-keys launch against one pass.

Head dim 128, 40 query heads on 8 KV heads, bf16 caches. For each row count and context,
per call inside a CUDA graph of calls: ``decode_attention`` with its default launch
(split keys when ``rows x kv_heads`` programs would leave the GPU idle, then the combine
kernel) and forced to one pass, and the bytes read (K and V of the context) over the copy
ceiling measured in the same run. Writes ``attention_<tag>.json``.

    python benchmarks/bench_attention.py --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import triton
from graph_timing import copy_tbps, graph_per_call_us  # type: ignore[import-not-found, unused-ignore]

from hybridmeta.kernels.attention_decode import attention_splits, launch_decode_attention


def measure(ctx: int, B: int, ceiling: float) -> dict[str, Any]:
    """``B`` rows at position ``ctx - 1``: the default launch and one pass."""
    dev = torch.device("cuda")
    hd, kvh, heads = 128, 8, 40
    m = ctx + 16
    kc = torch.randn(B + 1, m, kvh, hd, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 1, heads, hd, device=dev, dtype=torch.bfloat16)
    slots = torch.arange(B, device=dev)
    pos = torch.full((B, 1), ctx - 1, device=dev)
    out = torch.empty(B, 1, heads * hd, device=dev, dtype=torch.bfloat16)
    nbytes = 2 * B * ctx * kvh * hd * 2
    split = attention_splits(B, kvh, m, 64)
    row: dict[str, Any] = {"rows": B, "context": ctx, "bytes": nbytes, "splits": split}
    variants: dict[str, tuple[int, int] | None] = {"default": None, "one_pass": (1, m)}
    for name, sp in variants.items():

        def call(_: int, sp: tuple[int, int] | None = sp) -> None:
            launch_decode_attention(q, kc, vc, slots, pos, hd**-0.5, out, splits=sp)

        us = graph_per_call_us(call)
        row[name] = {"us": us, "frac_copy": nbytes / (us * 1e-6) / 1e12 / ceiling}
    print(f"ctx {ctx:5d} B {B:3d} splits {split[0]:2d}x{split[1]:4d}: default "
          f"{row['default']['us']:7.1f} us ({row['default']['frac_copy']:.0%}) | one pass "
          f"{row['one_pass']['us']:7.1f} us ({row['one_pass']['frac_copy']:.0%})",
          flush=True)  # fmt: skip
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceiling = copy_tbps()
    res: dict[str, Any] = {
        "benchmark": "decode_attention",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "python": sys.version.split()[0]},
        "copy_ceiling_tbps": ceiling,
        "rows": [],
    }  # fmt: skip
    for ctx in (512, 2048, 8192):
        for B in (1, 4, 16, 64):
            res["rows"].append(measure(ctx, B, ceiling))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"attention_{args.tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
