"""The served runs the vLLM integration tests read: one engine per configuration, shared.

Every configuration is served once per test session (engine starts cost 40-160 s on a
loaded 2-core machine): :func:`served` runs a :mod:`tests.integrations.vllm.serve`
process per (mode, tensor-parallel size) — ``stock`` (vLLM as installed) and ``plugin``
(``HYBRIDMETA_VLLM=1``) — and every test reads the results. The checkpoints are written
by :mod:`tests.integrations.vllm.checkpoints` into a cache folder
(``HYBRIDMETA_VLLM_CACHE``, default ``third_party/vllm-cache`` of the checkout).
``HYBRIDMETA_VLLM_REUSE=1`` (by hand, never in CI) re-reads a finished run of the same
spec instead of serving it again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

from tests.integrations.vllm.checkpoints import CHECKPOINTS, VOCAB, write_checkpoint

ROOT = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("HYBRIDMETA_VLLM_CACHE", ROOT / "third_party" / "vllm-cache"))

#: Prompt lengths of the first two rounds: 1 token to several SSD chunks and several mamba
#: blocks (128 tokens), beyond max_num_batched_tokens (chunked prefill).
LENGTHS = (1, 2, 5, 17, 33, 64, 100, 150, 201, 300, 450, 700)
MAX_TOKENS = 8
#: The third round: this many requests in one generate call (mixed prefill/decode steps).
MANY = 32
#: Scheduler budget: below two mamba blocks (2 x 128), so prompts past it are chunked and
#: every align-mode checkpoint lies inside its chunk (docs/vllm_api_needs.md, item 3).
BUDGET = 200
MAX_SEQS = 8
TP_CHECKPOINTS = ("nemotron_h_g1_c32", "nemotron_h_g4_c32")
#: Checkpoints vLLM 0.32's CPU build does not serve stock (measured), with its error:
#: not compared (the tests need stock's tokens).
STOCK_CPU_REFUSES = {
    "nemotron_3_moe": "NotImplementedError: is_act_and_mul=False is supported only for CUDA, "
    "XPU and ROCm for now (the non-gated relu2 MoE experts)",
    "bamba": "ValueError: Layer 0 (linear_attention) does not dispatch through the "
    "Transformers attention interface (vLLM 0.32 has no Bamba model of its own)",
}
SERVED = tuple(n for n in CHECKPOINTS if n not in STOCK_CPU_REFUSES)

ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "skip_tokenizer_init": True,
    "max_model_len": 1024,
    "max_num_seqs": MAX_SEQS,
    "max_num_batched_tokens": BUDGET,
    "seed": 0,
    # 1 GiB of CPU KV cache is 16,384 blocks of this tiny model; the reference ops (the
    # CPU path) update a pool with fixed shapes, in time proportional to its slots
    # (docs/vllm_api_needs.md, item 7): 256 blocks hold every request of a round and the
    # prefix cache of the previous one. Stock runs the same.
    "num_gpu_blocks_override": 256,
}
#: vLLM's CPU SSD scan ignores ``return_intermediate_states`` (it returns each row's final
#: state only), so stock vLLM crashes on the first align-mode prefill checkpoint
#: (``IndexError`` at ``varlen_states[last_chunk_indices_p]``): stock runs without prefix
#: caching, the plugin with it (align mode, vLLM's default for these models).
PREFIX_CACHING = {"stock": False, "plugin": True, "stock_spec": False, "plugin_spec": False}
#: Speculative decoding (issue 20 item 4): vLLM's ngram method, which needs no draft model.
#: Served without prefix caching (the plugin refuses align mode with speculation).
SPEC: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SPEC_CHECKPOINTS = ("nemotron_h_g1_c32", "nemotron_h_g2_c64")
#: The round index of the ngram prompts (served by every mode: the non-spec modes give
#: the reference tokens).
SPEC_ROUND = 3
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def prompts(name: str) -> tuple[list[list[int]], list[list[int]]]:
    """The checkpoint's prompts: the round-1/2 set (one per length) and the many-set."""
    seed = sorted(CHECKPOINTS).index(name) + 1
    g = torch.Generator().manual_seed(seed)
    fixed = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    lens = torch.randint(1, 60, (MANY,), generator=g).tolist()
    many = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in lens]
    return fixed, many


def spec_prompts(name: str) -> list[list[int]]:
    """Prompts ngram drafts from: a random segment repeated (periods 1 to 7), 1 to 150
    tokens, so the proposer finds matches and the model's continuation often follows."""
    g = torch.Generator().manual_seed(100 + sorted(CHECKPOINTS).index(name))
    out = [[int(torch.randint(3, VOCAB, (1,), generator=g))]]
    for period, length in ((1, 12), (2, 30), (3, 45), (4, 64), (5, 90), (7, 150), (3, 20)):
        seg = torch.randint(3, VOCAB, (period,), generator=g).tolist()
        out.append((seg * (length // period + 1))[:length])
    return out


def rounds(name: str) -> list[dict[str, Any]]:
    fixed, many = prompts(name)
    return [
        {"prompts": fixed, "max_tokens": MAX_TOKENS},  # cold
        {"prompts": fixed, "max_tokens": MAX_TOKENS},  # again: align-mode prefix-cache hits
        {"prompts": many, "max_tokens": 4},
        {"prompts": spec_prompts(name), "max_tokens": 40},  # SPEC_ROUND
    ]


def checkpoint_dir(name: str) -> Path:
    return write_checkpoint(name, CACHE / "checkpoints" / name)


def _spec(mode: str, tp: int, names: tuple[str, ...]) -> dict[str, Any]:
    env = dict(ENV)
    if mode.startswith("plugin"):
        env["HYBRIDMETA_VLLM"] = "1"
    engine = dict(ENGINE, enable_prefix_caching=PREFIX_CACHING[mode])
    if mode.endswith("_spec"):  # the ngram prompts only, with speculation and its counters
        engine.update(speculative_config=SPEC, disable_log_stats=False)
    if tp == 1:
        # engine core and worker in this process: one vLLM import instead of three
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine["distributed_executor_backend"] = "uni"
    else:
        engine["tensor_parallel_size"] = tp
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    return {
        "env": env,
        "engines": [
            {"name": n, "model": str(checkpoint_dir(n)), "engine": engine,
             "rounds": rounds(n)[SPEC_ROUND:] if mode.endswith("_spec") else rounds(n)}
            for n in names
        ],
    }


@cache
def served(mode: str, tp: int = 1, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Serve every checkpoint (``tp == 1``; the ``*_spec`` modes: :data:`SPEC_CHECKPOINTS`)
    or :data:`TP_CHECKPOINTS` in one process."""
    spec_mode = mode.endswith("_spec")
    if spec_mode and names is None:
        # vLLM 0.32's CPU build starts a second speculative engine in one process only to
        # fail (its Triton-override rebinding: "'_lib_fn_wrapper' object has no attribute
        # 'get'"): one process per checkpoint
        merged: dict[str, Any] = {"engines": {}, "wall_s": 0.0}
        for n in SPEC_CHECKPOINTS:
            one = served(mode, tp, (n,))
            merged["engines"].update(one["engines"])
            merged["wall_s"] += one["wall_s"]
        return merged
    if names is None:
        names = SERVED if tp == 1 else TP_CHECKPOINTS
    out_dir = CACHE / "runs"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{mode}_tp{tp}" + (f"_{'_'.join(names)}" if spec_mode else "")
    spec_path = out_dir / f"{stem}.spec.json"
    out_path = out_dir / f"{stem}.out.json"
    log_path = out_dir / f"{stem}.log"
    spec_text = json.dumps(_spec(mode, tp, names))
    if (
        os.environ.get("HYBRIDMETA_VLLM_REUSE") == "1"  # by hand only: re-read a finished run
        and out_path.exists()
        and spec_path.exists()
        and spec_path.read_text() == spec_text
    ):
        reused: dict[str, Any] = json.loads(out_path.read_text())
        if "seconds" in reused:  # the run finished
            reused["wall_s"] = reused["seconds"]
            return reused
    spec_path.write_text(spec_text)
    out_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.integrations.vllm.serve", str(spec_path), str(out_path)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=False,
        )  # fmt: skip
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"serve {mode} tp={tp} exited {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["wall_s"] = time.monotonic() - t0
    return result
