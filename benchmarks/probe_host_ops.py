"""Probe: host time of the single torch ops a graph refresh is made of, on a GPU.

Each op is called alone with the device idle (a sync before each call, outside the timed
span), 3,000 times after 100 warm-up calls; the median in microseconds, two rounds. The
ops: the slot-table translation candidates (``index_select`` / ``gather`` / ``take`` with
``out=``, all on a 1-D int64 table of 1,024 entries and 256 ids), a plain ``copy_``, a
dtype view (``view(torch.uint8)``), a 4-tensor int64 ``_foreach_copy_`` (with and without a
bool ``copy_`` beside it) and the same five as one byte-view ``_foreach_copy_`` (with the
views built per call), and ``torch.empty_like`` as the host's yardstick. Checks that the
gather and the take give the index_select's values.

    PYTHONPATH=src python3 benchmarks/probe_host_ops.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_graphs import report_header  # type: ignore[import-not-found, unused-ignore]


def _isolated_us(fn: Callable[[], object], n: int = 3000) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def _two(first: Callable[[], object], second: Callable[[], object]) -> None:
    first()
    second()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_host_ops: needs a CUDA device")
        return 1
    dev = "cuda"
    table = torch.randperm(1024, device=dev)
    idx = torch.randint(0, 1024, (256,), device=dev)
    dst = torch.empty(512, dtype=torch.long, device=dev)[:256]
    i64 = [torch.zeros(256, dtype=torch.long, device=dev) for _ in range(4)]
    i64d = [torch.zeros(256, dtype=torch.long, device=dev) for _ in range(4)]
    b = torch.zeros(256, dtype=torch.bool, device=dev)
    bd = torch.zeros(256, dtype=torch.bool, device=dev)
    u8 = torch.uint8
    ops: dict[str, Callable[[], object]] = {
        "index_select_out": lambda: torch.index_select(table, 0, idx, out=dst),
        "aten_index_select_out": lambda: torch.ops.aten.index_select.out(table, 0, idx, out=dst),
        "gather_out": lambda: torch.gather(table, 0, idx, out=dst),
        "take_out": lambda: torch.take(table, idx, out=dst),
        "copy_": lambda: dst.copy_(idx),
        "view_uint8": lambda: idx.view(u8),
        "foreach_int64x4": lambda: torch._foreach_copy_(i64d, i64),
        "foreach_int64x4_plus_bool_copy": lambda: _two(
            lambda: torch._foreach_copy_(i64d, i64), lambda: bd.copy_(b)
        ),
        "foreach_bytes_x5": lambda: torch._foreach_copy_(
            [t.view(u8) for t in i64d] + [bd.view(u8)], [t.view(u8) for t in i64] + [b.view(u8)]
        ),
        "empty_like": lambda: torch.empty_like(idx),
    }
    rounds: dict[str, list[float]] = {}
    for _ in range(2):
        for name, fn in ops.items():
            rounds.setdefault(name, []).append(_isolated_us(fn))
    for name, us in rounds.items():
        print(f"{name:34s} {us}")
    torch.index_select(table, 0, idx, out=dst)
    ref = dst.clone()
    equal = {}
    for name in ("gather_out", "take_out"):
        dst.zero_()
        ops[name]()
        equal[name] = bool(torch.equal(dst, ref))
        print(name, "equal", equal[name])
    report = {
        **report_header("probe_host_ops", torch.device(dev)),
        "isolated_median_us_two_rounds": rounds,
        "equal_to_index_select": equal,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_host_ops.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
