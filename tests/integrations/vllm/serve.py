"""Run vLLM engine configurations in a process of their own and write what they served.

``python -m tests.integrations.vllm.serve SPEC.json OUT.json``. SPEC::

    {"env": {...},                       # set before vLLM is imported (HYBRIDMETA_VLLM=1)
     "engines": [{"name": str, "model": dir, "engine": {vllm.LLM kwargs},
                  "rounds": [{"prompts": [[token ids]], "max_tokens": int}]}]}

OUT holds, per engine, round and prompt: the generated tokens, the chosen tokens'
log-probs, the top log-probs of each step and the number of prompt tokens vLLM served
from its prefix cache; the engine's start time; the plugin's layer calls in this process
(in-process engines only); or the error an engine stopped with. Engines run one after
the other in this process, each until its rounds are done; rounds run one after the
other on their engine, so a later round can hit the prefix cache an earlier one filled.

vLLM starts its engine core in a spawned process unless
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: this module is the ``__main__`` guard it needs, and
a process per configuration set leaves nothing behind.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _round(llm: Any, rnd: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams  # type: ignore[import-not-found]

    params = SamplingParams(
        temperature=0.0,
        max_tokens=rnd["max_tokens"],
        logprobs=rnd.get("logprobs", 5),
        ignore_eos=True,
    )
    prompts = [{"prompt_token_ids": p} for p in rnd["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    served = []
    for o in outs:
        c = o.outputs[0]
        chosen, top = [], []
        for tok, lp in zip(c.token_ids, c.logprobs or [], strict=True):
            chosen.append(float(lp[tok].logprob))
            top.append({str(k): float(v.logprob) for k, v in lp.items()})
        served.append({
            "tokens": list(c.token_ids),
            "logprobs": chosen,
            "top": top,
            "num_cached_tokens": int(o.num_cached_tokens or 0),
        })
    return served


def _spec_metrics(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
            out[m.name] = float(m.value)
    return out


def _calls() -> dict[str, int]:
    mixer = sys.modules.get("hybridmeta.integrations.vllm.layer")
    return dict(mixer.CALLS) if mixer is not None else {}


def _engine(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    before = _calls()
    t0 = time.monotonic()
    llm = None
    try:
        llm = LLM(model=spec["model"], **spec["engine"])
        start = time.monotonic() - t0
        rounds = []
        prof = None
        if os.environ.get("HYBRIDMETA_SERVE_PROFILE"):  # by hand: where the time goes
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        for rnd in spec["rounds"]:
            t1 = time.monotonic()
            rounds.append({"outputs": _round(llm, rnd), "seconds": time.monotonic() - t1})
        spec_metrics = _spec_metrics(llm) if "speculative_config" in spec["engine"] else {}
        if prof is not None:
            prof.disable()
            prof.dump_stats(os.environ["HYBRIDMETA_SERVE_PROFILE"] + "." + spec["name"])
    except Exception as e:  # recorded: the test that reads it says what it means
        return {
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-4000:],
            "seconds": time.monotonic() - t0,
        }
    finally:
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
            gc.collect()
    after = _calls()
    return {
        "engine_start_s": start,
        "rounds": rounds,
        "plugin_calls": {k: after.get(k, 0) - before.get(k, 0) for k in after},
        "spec_metrics": spec_metrics,
    }


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    t0 = time.monotonic()
    results: dict[str, Any] = {}
    for eng in spec["engines"]:
        results[eng["name"]] = _engine(eng)
        # written after each engine, so a killed run keeps what finished
        Path(out_path).write_text(json.dumps({"engines": results}))
    results_all = {"engines": results, "seconds": time.monotonic() - t0}
    Path(out_path).write_text(json.dumps(results_all))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
