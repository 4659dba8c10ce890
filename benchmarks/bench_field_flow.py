"""``check_field_flow`` on a 32-field sglang-shaped ``ForwardMetadata`` with 15 dropped fields.

The classes are the suite's reproduction of sglang 0.5.23's ``ForwardMetadata`` /
``Mamba2Metadata`` shapes (``tests/testing/sglang_shapes.py``); the constructor is its
four-argument ``prepare_decode``. Times one ``check_field_flow`` under a hybridmeta profile
(default ``hybridmeta-ci``, the pytest default), wall clock and process CPU time, counts the
constructor calls, and checks the report names each of the 15 fields once with one
falsifying source. Writes ``field_flow.json`` into ``--out``.

    python benchmarks/bench_field_flow.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

import hybridmeta  # noqa: E402
from hybridmeta.testing import check_field_flow, resolve_settings  # noqa: E402
from tests.testing import sglang_shapes as sg  # noqa: E402


def run(profile: str) -> dict[str, Any]:
    resolve_settings()  # registers the profiles
    chosen = settings.get_profile(profile)
    seq_lens = torch.arange(3)
    calls = 0

    def prepare(fwd: sg.ForwardMetadata) -> sg.Mamba2Metadata:
        nonlocal calls
        calls += 1
        return sg.Mamba2Metadata.prepare_decode(
            fwd, seq_lens, is_target_verify=fwd.is_target_verify,
            draft_token_num=fwd.draft_token_num,
        )  # fmt: skip

    wall, cpu = time.perf_counter(), time.process_time()
    report = check_field_flow(sg.ForwardMetadata, prepare, derived=sg.Mamba2Metadata,
                              settings=chosen)  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    text = report.format()
    once = all(text.count(f"ForwardMetadata.{n} does not reach") == 1 for n in sg.DROPPED)
    return {
        "profile": profile,
        "max_examples": chosen.max_examples,
        "fields": len(report.checked),
        "dropped": list(report.dropped),
        "dropped_as_expected": report.dropped == sg.DROPPED,
        "each_field_once": once,
        "falsifying_sources": len(report.examples),
        "report_chars": len(text),
        "constructor_calls": calls,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--profile", default="hybridmeta-ci")
    args = p.parse_args(argv)
    result = run(args.profile)
    report = {
        "benchmark": "bench_field_flow",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "hybridmeta": hybridmeta.__version__,
        "torch": torch.__version__,
        **result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "field_flow.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"check_field_flow, {result['fields']} fields, {len(result['dropped'])} dropped "
        f"({args.profile}): {result['wall_s']} s wall, {result['cpu_s']} s CPU, "
        f"{result['constructor_calls']} constructor calls, {result['falsifying_sources']} "
        f"falsifying source(s), {result['report_chars']} report chars"
    )
    ok = result["dropped_as_expected"] and result["each_field_once"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
