"""Benchmark: the host time targets of issue 11, item 5, in one quick run (no kernels).

1. The prefill planner, per call: ``plan_host`` (host numpy planning) and
   ``plan_mixed_batch`` (planning, the one staged copy, the metadata built through
   ``evolve_from``) for 1 x 4096 tokens, 8 x 512 resumed rows and 32 mixed rows (random
   lengths 1..300, prefixes in {0, 128, 256}; tracking on, interval 256, chunk 128, conv
   width 4). Target: ``plan_mixed_batch`` under 300 us for the 32 rows, with no device
   sync.
2. ``StaticBuffers.refresh`` + metadata at bs 256 (bucket 256), with the virtual ->
   physical slot table and without. Target: under 25 us with the table. Beside it, in the
   same run, the references: the same refresh with one copy call per dtype (int64, bool)
   instead of the one byte-view copy (``per_dtype``), and that with the translation
   through ``index_select`` instead of ``gather`` (``previous``: the refresh before both
   changes); every mode measured twice, alternating.

Host time per call is measured two ways (as ``bench_graphs.py`` does): each call alone,
the device idle when it starts (``isolated_*``: the host cost of one call), and calls back
to back (``median_us`` / ``min_us``; on a GPU bounded below by the device time they
enqueue). ``mean_of_20_us`` is what ``bench_prefill.py`` reports as ``planner_host_us``.

    PYTHONPATH=src python3 benchmarks/bench_host.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from bench_graphs import (  # type: ignore[import-not-found, unused-ignore]
    MAX_BS,
    _host_us,
    _no_sync,
    _sync,
    bench_refresh,
    report_header,
)

from hybridmeta.graphs import StaticBuffers
from hybridmeta.planner import plan_host, plan_mixed_batch

PLANNER_TARGET_US = 300.0
REFRESH_TARGET_US = 25.0


def planner_cases() -> dict[str, tuple[list[int], list[int]]]:
    """The three batches of ``bench_prefill.py`` (the 32 mixed rows drawn with seed 0)."""
    rng = random.Random(0)
    lens = [rng.randint(1, 300) for _ in range(32)]
    prefix = [rng.choice([0, 128, 256]) for _ in range(32)]
    return {
        "1x4096": ([4096], [0]),
        "8x512_resume": ([512] * 8, [256] * 8),
        "32_mixed": (lens, prefix),
    }


def planner_kwargs(lens: list[int], prefix: list[int]) -> dict[str, Any]:
    n = len(lens)
    return {
        "extend_lens": lens,
        "prefix_lens": prefix,
        "slots": list(range(n)),
        "num_decodes": 0,
        "chunk_size": 128,
        "conv_kernel": 4,
        "track_interval": 256,
        "track_mask": [True] * n,
        "track_slots": list(range(n, 2 * n)),
    }


def bench_planner(device: torch.device, number: int, repeat: int) -> list[dict[str, Any]]:
    results = []
    for name, (lens, prefix) in planner_cases().items():
        kw = planner_kwargs(lens, prefix)

        def host(kw: dict[str, Any] = kw) -> object:
            return plan_host(**kw)

        def full(kw: dict[str, Any] = kw) -> object:
            return plan_mixed_batch(**kw, device=device)

        full()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            full()
        mean20 = (time.perf_counter() - t0) / 20 * 1e6
        results.append(
            {
                "case": name,
                "rows": len(lens),
                "tokens": sum(lens),
                "plan_host": _host_us(host, device, number, repeat),
                "plan_mixed_batch": _host_us(full, device, number, repeat),
                "plan_mixed_batch_mean_of_20_us": mean20,
                "no_device_sync": _no_sync(full, device),
            }
        )
    return results


def _translate_index_select(self: StaticBuffers, step: Any, plan: Any) -> None:
    """The translation as it was before the gather (reference of ``previous``)."""
    table = self._slot_table
    for name, dst in plan.translate:
        assert table is not None  # a plan translates only when a table was given
        torch.index_select(table, 0, getattr(step, name), out=dst)


def _refresh(device: torch.device, number: int, repeat: int) -> list[dict[str, Any]]:
    return bench_refresh(device, number * 4, repeat, sizes=(MAX_BS,), rebuild=False)


def _best(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per configuration, the round with the lowest isolated median (the quieter host)."""
    return [
        min(same, key=lambda r: r["refresh_and_build"]["isolated_median_us"])
        for same in zip(*runs, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--number", type=int, default=500)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    planner = bench_planner(device, args.number, args.repeat)
    rounds: dict[str, list[list[dict[str, Any]]]] = {"merged": [], "per_dtype": [], "previous": []}
    for _ in range(2):  # alternating, so that a drift of the host's speed hits every mode
        rounds["merged"].append(_refresh(device, args.number, args.repeat))
        # The references: no byte-view plan (one copy call per dtype); and that with the
        # translation through index_select (the refresh before either change).
        with mock.patch("hybridmeta.graphs.buffers._merge", return_value=None):
            rounds["per_dtype"].append(_refresh(device, args.number, args.repeat))
            with mock.patch.object(StaticBuffers, "_translate", _translate_index_select):
                rounds["previous"].append(_refresh(device, args.number, args.repeat))
    refresh = _best(rounds["merged"])
    mixed = next(r for r in planner if r["case"] == "32_mixed")
    table = next(r for r in refresh if r["slot_table"])
    plan_us = mixed["plan_mixed_batch"]["isolated_median_us"]
    refresh_us = table["refresh_and_build"]["isolated_median_us"]
    per_dtype_us, previous_us = (
        next(r for r in _best(rounds[mode]) if r["slot_table"])["refresh_and_build"][
            "isolated_median_us"
        ]
        for mode in ("per_dtype", "previous")
    )
    report = {
        **report_header("host", device),
        "planner": planner,
        "refresh": refresh,
        "refresh_rounds": rounds,
        "targets": {
            "plan_mixed_batch_32_mixed_us": PLANNER_TARGET_US,
            "plan_mixed_batch_32_mixed_isolated_median_us": plan_us,
            "plan_mixed_batch_met": plan_us < PLANNER_TARGET_US and mixed["no_device_sync"],
            "refresh_bs256_slot_table_us": REFRESH_TARGET_US,
            "refresh_bs256_slot_table_isolated_median_us": refresh_us,
            "refresh_met": refresh_us < REFRESH_TARGET_US and table["no_device_sync"],
            "refresh_bs256_slot_table_per_dtype_isolated_median_us": per_dtype_us,
            "refresh_merged_over_per_dtype": refresh_us / per_dtype_us,
            "refresh_bs256_slot_table_previous_isolated_median_us": previous_us,
            "refresh_over_previous": refresh_us / previous_us,
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_host.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
