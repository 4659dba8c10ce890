"""Run one vLLM engine configuration in a process of its own and write what it served.

``python -m tests.integrations.vllm.serve SPEC.json OUT.json``: SPEC names the checkpoint
directory, the ``vllm.LLM`` keyword arguments, the environment (``HYBRIDMETA_VLLM=1``
enables the plugin) and rounds of token-id prompts; OUT holds, per round and prompt, the
generated tokens, the chosen tokens' log-probs, the top log-probs at each step and the
number of prompt tokens vLLM served from its prefix cache. Rounds run one after the other
on the same engine, so a later round can hit the prefix cache an earlier one filled.

vLLM starts its engine in a spawned process: this module is the ``__main__`` guard it
needs, and running each configuration in a process of its own leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _round(llm: Any, rnd: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=rnd["max_tokens"],
        logprobs=rnd.get("logprobs", 5),
        ignore_eos=True,
        seed=0,
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


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    t0 = time.monotonic()
    from vllm import LLM

    llm = LLM(model=spec["model"], **spec["engine"])
    t_start = time.monotonic() - t0
    rounds = []
    for rnd in spec["rounds"]:
        t1 = time.monotonic()
        rounds.append({"outputs": _round(llm, rnd), "seconds": time.monotonic() - t1})
    result = {
        "engine_start_s": t_start,
        "rounds": rounds,
        "plugin": os.environ.get("HYBRIDMETA_VLLM", ""),
    }
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
