"""Which operations does a real CUDA stream capture refuse? (GPU machine only.)

Runs every case of ``tests/graphs/capture_cases.py`` under ``torch.cuda.graph`` capture,
each in its own subprocess (a refused capture poisons the CUDA context), and writes
``{"refused": {case: bool}, ...}`` as JSON (default: next to the cases, where the CPU test
reads it).

    PYTHONPATH=src:. python3 scripts/cuda_capture_refusals.py [--out FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_CHILD = r"""
import sys, torch
from tests.graphs.capture_cases import CASES
fn = CASES[sys.argv[1]]
t = torch.arange(4.0, device="cuda") - 1.0
try:
    fn(t.clone())  # eager: the case itself must work, or its capture answers nothing
    torch.cuda.synchronize()
except Exception as e:
    print("CASE-BROKEN", type(e).__name__, str(e).splitlines()[0][:200])
    sys.exit(3)
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        fn(t)
    torch.cuda.synchronize()
except Exception as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0][:200])
    sys.exit(0)
print("CAPTURED")
"""


def _run(case: str) -> tuple[str, bool, str]:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, case],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = res.stdout.strip().splitlines()
    last = out[-1] if out else ""
    if last.startswith("CASE-BROKEN"):
        raise RuntimeError(f"case {case!r} fails eagerly, before any capture: {last}")
    if res.returncode != 0 or not last.startswith(("REFUSED", "CAPTURED")):
        # a hard failure during capture (the process died) is a refusal too
        return case, True, f"exit {res.returncode}: {res.stderr.strip().splitlines()[-1:]}"
    return case, last.startswith("REFUSED"), last


def main() -> None:
    from tests.graphs.capture_cases import CASES, RESULTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    import torch

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = sorted(pool.map(_run, CASES))
    data = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "refused": {c: r for c, r, _ in results},
        "detail": {c: d for c, _, d in results},
    }
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    for c, r, d in results:
        print(f"{c:28s} {'REFUSED ' if r else 'captured'} {d[:100]}")


if __name__ == "__main__":
    main()
