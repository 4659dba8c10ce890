"""End to end: vLLM serving tiny checkpoints with and without the plugin (CPU, fp32).

Every configuration is served once per session (:mod:`tests.integrations.vllm.runs`):

* ``stock``: vLLM 0.32 as installed, prefix caching off (its CPU scan crashes on the first
  align-mode checkpoint, see ``runs.PREFIX_CACHING``);
* ``plugin``: ``HYBRIDMETA_VLLM=1``, prefix caching on (align mode, vLLM's default for
  these models): every Mamba2 layer runs hybridmeta's metadata and ops.

Rounds per checkpoint: 12 prompts of 1 to 700 tokens (past the scheduler's budget of 200:
chunked prefill; 8 running requests: mixed prefill/decode steps), the same 12 again
(prefix-cache hits), then 32 requests in one call. Greedy tokens must equal stock's; a
divergence counts as agreement only at a near-tie (the two tokens within 2e-3 in the
plugin's own log-probs), after which the rest of that sequence is not compared.
Chosen-token log-probs must agree within vLLM's own CPU noise, measured here: stock
vLLM against transformers in fp32 on the same tokens, the largest difference over the
served checkpoints (:func:`vllm_noise`; per checkpoint it ranges from a few 1e-6 to a
few 1e-3, :func:`noise`).
"""

from __future__ import annotations

import json
import math
from functools import cache
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM environment (make test-vllm)")

import torch

from tests.integrations.vllm import runs

NEAR_TIE = 2e-3
#: fp32 rounding floor of a log-prob compare (|lp| < 10, fp32 epsilon 1.2e-7, a few
#: hundred accumulated terms): below it two fp32 runs are the same number.
FLOOR = 1e-5
NAMES = runs.SERVED


def _engine(mode: str, name: str, tp: int = 1) -> dict[str, Any]:
    eng: dict[str, Any] = runs.served(mode, tp)["engines"][name]
    assert "error" not in eng, f"{mode} tp={tp} {name}: {eng.get('error')}\n{eng.get('traceback')}"
    return eng


@cache
def vllm_noise() -> float:
    """vLLM's own CPU noise: the largest :func:`noise` over the served checkpoints."""
    return max(noise(n) for n in NAMES)


@cache
def noise(name: str) -> float:
    """max |stock log-prob - transformers fp32 log-prob| of stock's chosen tokens (round 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(runs.checkpoint_dir(name)), dtype=torch.float32)
    model.train(False)
    fixed, _ = runs.prompts(name)
    worst = 0.0
    for prompt, out in zip(fixed, _engine("stock", name)["rounds"][0]["outputs"], strict=True):
        ids = torch.tensor([prompt + out["tokens"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        n = len(prompt)
        for j, (tok, got) in enumerate(zip(out["tokens"], out["logprobs"], strict=True)):
            worst = max(worst, abs(float(lp[n - 1 + j, tok]) - got))
    return worst


def _compare(a: dict[str, Any], b: dict[str, Any], tol: float) -> dict[str, float]:
    """``a`` (the plugin's) against ``b`` (the reference) for one prompt."""
    worst, ties = 0.0, 0
    for j, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
        if ta != tb:
            top = a["top"][j]
            assert str(tb) in top, f"step {j}: token {tb} not in the plugin's top log-probs {top}"
            gap = abs(top[str(ta)] - top[str(tb)])
            assert gap <= NEAR_TIE, f"step {j}: {ta} vs {tb}, log-prob gap {gap:.3g} > {NEAR_TIE}"
            ties += 1
            break
        worst = max(worst, abs(a["logprobs"][j] - b["logprobs"][j]))
    assert worst <= tol, f"chosen log-probs differ by {worst:.3g} > {tol:.3g}"
    return {"max_lp_diff": worst, "near_ties": ties}


def _report(key: str, value: object) -> None:
    path = runs.CACHE / "report.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


@pytest.mark.parametrize("name", NAMES)
def test_plugin_serves_every_mamba2_layer(name: str) -> None:
    eng = _engine("plugin", name)
    calls = eng["plugin_calls"]
    # every round has prefills and decodes: both paths ran through hybridmeta's layer
    assert calls.get("prefill", 0) > 0 and calls.get("decode", 0) > 0, calls
    assert _engine("stock", name)["plugin_calls"] == {}


@pytest.mark.parametrize("name", NAMES)
def test_same_tokens_as_stock_vllm(name: str) -> None:
    plugin, stock = _engine("plugin", name), _engine("stock", name)
    tol = max(vllm_noise(), FLOOR)
    stats = []
    for r in (0, 1, 2):  # cold, again (plugin: cache hits), the 32 requests
        pr, sr = plugin["rounds"][r]["outputs"], stock["rounds"][r]["outputs"]
        assert len(pr) == len(sr) >= 10
        stats += [_compare(a, b, tol) for a, b in zip(pr, sr, strict=True)]
    _report(f"tp1/{name}", {
        "noise_vs_transformers": noise(name),
        "vllm_noise_all_checkpoints": vllm_noise(),
        "max_lp_diff_vs_stock": max(s["max_lp_diff"] for s in stats),
        "near_ties": sum(s["near_ties"] for s in stats),
        "prompts": len(stats),
        "plugin_engine_start_s": plugin["engine_start_s"],
        "plugin_round_s": [x["seconds"] for x in plugin["rounds"]],
        "stock_round_s": [x["seconds"] for x in stock["rounds"]],
    })  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_prefix_cache_hits_equal_the_cold_run(name: str) -> None:
    cold, warm = (_engine("plugin", name)["rounds"][r]["outputs"] for r in (0, 1))
    hits = 0
    for n, a, b in zip(runs.LENGTHS, warm, cold, strict=True):
        if n > 128:  # longer than the mamba block: align mode has a checkpoint to resume
            assert a["num_cached_tokens"] > 0, (n, a["num_cached_tokens"])
            hits += 1
        assert a["tokens"] == b["tokens"], n
        # resumed from a saved state vs recomputed: fp32 rounding of a different chunking
        worst = max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))
        assert worst <= max(vllm_noise(), FLOOR), (n, worst)
    assert hits >= 4
    assert all(c["num_cached_tokens"] == 0 for c in cold)


def test_the_workload_has_chunked_prefill_mixed_batches_and_many_requests() -> None:
    assert max(runs.LENGTHS) > runs.BUDGET and min(runs.LENGTHS) == 1
    assert len(runs.LENGTHS) > runs.MAX_SEQS  # more requests than slots: mixed steps
    assert runs.MANY >= 32
    name = NAMES[0]
    assert len(_engine("plugin", name)["rounds"][2]["outputs"]) == runs.MANY


@pytest.mark.parametrize("name", runs.TP_CHECKPOINTS)
def test_tensor_parallel_2_equals_tp1_and_stock_tp2(name: str) -> None:
    p2 = _engine("plugin", name, tp=2)
    s2 = _engine("stock", name, tp=2)
    p1 = _engine("plugin", name)
    tol = max(vllm_noise(), FLOOR)
    worst = 0.0
    for r in (0, 1, 2):
        for a, b, c in zip(p2["rounds"][r]["outputs"], s2["rounds"][r]["outputs"],
                           p1["rounds"][r]["outputs"], strict=True):  # fmt: skip
            worst = max(worst, _compare(a, b, tol)["max_lp_diff"], _compare(a, c, tol)["max_lp_diff"])
    _report(f"tp2/{name}", {"max_lp_diff_vs_stock_tp2_and_plugin_tp1": worst})
    assert not math.isnan(worst)
    # both ranks' layers ran hybridmeta's path (each worker process logs its first forward)
    log = (runs.CACHE / "runs" / "plugin_tp2.log").read_text()
    for rank in (0, 1):
        assert f"hybridmeta MambaMixer2 serving (tp rank {rank} of 2" in log, rank
    assert "hybridmeta MambaMixer2 serving" not in (runs.CACHE / "runs" / "stock_tp2.log").read_text()


def _tokens_agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Greedy tokens equal, or equal up to a near-tie of ``a``'s own log-probs."""
    for j, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
        if ta != tb:
            top = a["top"][j]
            return str(tb) in top and abs(top[str(ta)] - top[str(tb)]) <= NEAR_TIE
    return True


@pytest.mark.parametrize("name", runs.SPEC_CHECKPOINTS)
def test_ngram_speculative_decoding_is_lossless(name: str) -> None:
    """vLLM's ngram speculation through the plugin: greedy tokens equal the plugin's own
    without speculation (greedy speculative decoding is lossless), prompt by prompt, with
    drafts proposed and accepted; stock vLLM's CPU build is compared where it is right."""
    spec = _engine("plugin_spec", name)
    plain = _engine("plugin", name)["rounds"][runs.SPEC_ROUND]["outputs"]
    got = spec["rounds"][0]["outputs"]
    assert len(got) == len(plain) >= 8
    tol = max(vllm_noise(), FLOOR)
    stats = [_compare(a, b, tol) for a, b in zip(got, plain, strict=True)]
    calls, m = spec["plugin_calls"], spec["spec_metrics"]
    assert calls.get("spec_decode", 0) > 0, calls  # speculative decode steps ran through us
    accepted = m.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    drafts = m.get("vllm:spec_decode_num_draft_tokens", 0.0)
    assert drafts > 0 and accepted > 0, m  # drafts verified, some accepted (columns > 0)
    stock_spec = _engine("stock_spec", name)["rounds"][0]["outputs"]
    stock_plain = _engine("stock", name)["rounds"][runs.SPEC_ROUND]["outputs"]
    stock_right = 0
    for a, s, p in zip(got, stock_spec, stock_plain, strict=True):
        if _tokens_agree(s, p):  # stock's speculation is right on this prompt
            stock_right += 1
            _compare(a, s, tol)
    _report(f"spec/{name}", {
        "prompts": len(got), "max_lp_diff_vs_plugin_nonspec": max(x["max_lp_diff"] for x in stats),
        "near_ties": sum(x["near_ties"] for x in stats), "spec_metrics": m,
        "stock_spec_right_prompts": stock_right, "plugin_spec_decode_calls": calls["spec_decode"],
        "round_s": spec["rounds"][0]["seconds"],
    })  # fmt: skip
