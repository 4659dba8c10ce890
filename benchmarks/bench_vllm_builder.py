"""Host cost of the plugin's Mamba2 metadata build against vLLM's own builder.

Both builders are built from one vLLM config of a tiny Nemotron-H checkpoint and handed
the same ``CommonAttentionMetadata`` of each batch, side by side in one process:

* ``vllm``: ``Mamba2AttentionMetadataBuilder.build`` (vLLM 0.32's own);
* ``hybridmeta``: ``HybridMamba2Builder.build`` (reads vLLM's fields into the declared
  step, then the one translation: the planner, one staged copy, ``Mamba2Metadata``).

Batches: decode-only (bs 1 / 16 / 64 / 256), prefill-only (1 / 8 rows of 512 tokens) and
mixed (32 decodes + 4 prefill chunks of 100 tokens, some resuming). Each build is timed
``--repeat`` times, the two interleaved (median, best-of microseconds); the JSON gives device, versions, date
and the ratio hybridmeta / vLLM per batch (goal: <= 1).

Run in the vLLM environment::

    .venv-vllm/bin/python benchmarks/bench_vllm_builder.py --out benchmarks/results/vllm_builder_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCHES: dict[str, list[tuple[int, int]]] = {  # rows of (query len, computed len), decodes first
    "decode_bs1": [(1, 100)],
    "decode_bs16": [(1, 100 + i) for i in range(16)],
    "decode_bs64": [(1, 50 + i) for i in range(64)],
    "decode_bs256": [(1, 20 + i) for i in range(256)],
    "prefill_1x512": [(512, 0)],
    "prefill_8x512": [(512, 0)] * 8,
    "mixed_32d_4p": [(1, 30 + i) for i in range(32)] + [(100, 0), (100, 200), (100, 0), (100, 300)],
}
BLOCK = 128  # tokens per KV block of the tiny model (vLLM's choice for it)


def _config(model: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
        max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=8192,
        enable_prefix_caching=False,
    )  # fmt: skip
    return args.create_engine_config()


def _common(rows: list[tuple[int, int]]) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    seq = torch.tensor([r[0] + r[1] for r in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = q.cumsum(0)
    n = len(rows)
    blocks = torch.arange(1, n + 1, dtype=torch.int32).view(n, 1)  # block 0 is the null block
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=blocks, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        is_prefilling=torch.tensor([r[1] == 0 or r[0] > 1 for r in rows]),
        seq_lens_cpu_upper_bound=seq.clone(),
    )  # fmt: skip


def _time_pair(a: Any, b: Any, repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """Time ``a`` and ``b`` interleaved (a, b, a, b, ...): a shared machine's drift hits
    both alike."""
    for _ in range(3):
        a()
        b()
    ta, tb = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append((t1 - t0) * 1e6)
        tb.append((t2 - t1) * 1e6)
    return tuple(  # type: ignore[return-value]
        {"median_us": statistics.median(t), "best_us": min(t)} for t in (ta, tb)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from hybridmeta.integrations.vllm.backend import HybridMamba2Builder
    from tests.integrations.vllm.checkpoints import CHECKPOINTS, write_checkpoint

    name = "nemotron_h_g2_c64"
    spec_ck = CHECKPOINTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_checkpoint(name, Path(tmp) / name))
        cfg = _config(model)
    conv_dim = spec_ck.num_heads * spec_ck.head_dim + 2 * spec_ck.n_groups * 16
    kv_spec = MambaSpec(
        block_size=BLOCK,
        shapes=((3, conv_dim), (spec_ck.num_heads, spec_ck.head_dim, 16)),
        dtypes=(torch.float32, torch.float32),
    )
    dev = torch.device("cpu")
    results: dict[str, Any] = {}
    with set_current_vllm_config(cfg):
        ref = Mamba2AttentionMetadataBuilder(kv_spec, ["l0"], cfg, dev)
        ours = HybridMamba2Builder(kv_spec, ["l0"], cfg, dev)
        for batch, rows in BATCHES.items():
            common = _common(rows)
            t_ref, t_ours = _time_pair(
                lambda c=common: ref.build(0, c), lambda c=common: ours.build(0, c), args.repeat
            )
            results[batch] = {
                "vllm": t_ref,
                "hybridmeta": t_ours,
                "ratio_median": t_ours["median_us"] / t_ref["median_us"],
            }
            print(f"{batch:>14}: vLLM {t_ref['median_us']:8.1f} us   hybridmeta "
                  f"{t_ours['median_us']:8.1f} us   ratio {results[batch]['ratio_median']:.2f}")  # fmt: skip
    report = {
        "name": "bench_vllm_builder",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "checkpoint": name,
        "repeat": args.repeat,
        "threads": torch.get_num_threads(),
        "results": results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
