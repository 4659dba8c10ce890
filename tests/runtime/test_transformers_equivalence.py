"""Logits equal transformers' NemotronHForCausalLM on the same checkpoint (fp32, CPU).

Tolerance: ``|logits - reference| <= 1e-4 + 1e-4 * |reference|`` at every position of the
prefill and at every decode step (measured: about 1e-5 on logits of magnitude ~7). Both
sides compute in fp32 but in different orders (our chunked scan and fused decode step vs
transformers' own scan): a few ulps (6e-8 relative each) per op over 8 layers and up to 40
recurrent steps; 1e-4 is ten times what was measured and holds whatever order the CPU's
BLAS (vector width, threads) sums in.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridmeta.model import Mamba2Metadata
from hybridmeta.planner import plan_host
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.plan import AttentionPlan, attention_host_plan
from hybridmeta.runtime.state import StatePool
from hybridmeta.staging import to_device_packed

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
RTOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> Any:
    transformers.utils.logging.set_verbosity_error()
    model = transformers.NemotronHForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    return model.eval()


def _ours(model: NemotronH, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill ``prompt_len`` tokens (all logits), then decode the rest one by one."""
    pool = StatePool.allocate(
        model.config,
        num_working=2,
        num_track=1,
        max_len=64,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    cpu = torch.device("cpu")
    cfg = model.config

    def plan(start: int, length: int, decode: bool) -> tuple[Mamba2Metadata, AttentionPlan]:
        hp = plan_host(
            extend_lens=[length], prefix_lens=[start], slots=[1], num_decodes=int(decode),
            chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel,
        )  # fmt: skip
        ah = attention_host_plan([length], [start])
        views = to_device_packed({**hp.arrays, **ah.arrays}, cpu)
        return hp.metadata(views), ah.plan(views)

    with torch.no_grad():
        md, attn = plan(0, prompt_len, decode=False)
        out = [model.forward_prefill(tokens[:prompt_len], md, attn, pool, all_logits=True)]
        for i in range(prompt_len, tokens.shape[0]):
            md, _ = plan(i, 1, decode=True)
            out.append(model.forward_decode(tokens[i : i + 1], torch.tensor([i]), md, pool))
    return torch.cat(out)


def _cache_kwarg(hf: Any) -> str:
    """The keyword that hands the cache back to the model: ``cache`` from transformers 5.24
    on (``past_key_values`` still accepted there, deprecated), ``past_key_values`` before
    (5.19, sglang 0.5.23's pin, ignores an unknown ``cache=`` and decodes without state)."""
    params = inspect.signature(hf.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _theirs(hf: Any, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    key = _cache_kwarg(hf)
    with torch.no_grad():
        out = hf(input_ids=tokens[None, :prompt_len], use_cache=True)
        cache = getattr(out, key)
        steps = [out.logits[0]]
        for i in range(prompt_len, tokens.shape[0]):
            o = hf(input_ids=tokens[None, i : i + 1], use_cache=True, **{key: cache})
            cache = getattr(o, key)
            steps.append(o.logits[0])
    return torch.cat(steps).float()


@pytest.mark.parametrize(("prompt_len", "total"), [(1, 6), (13, 25), (24, 30)])
def test_prefill_and_every_decode_step_match(
    tiny_model: NemotronH, hf_model: Any, prompt_len: int, total: int
) -> None:
    gen = torch.Generator().manual_seed(prompt_len)
    tokens = torch.randint(0, tiny_model.config.vocab_size, (total,), generator=gen)
    ours = _ours(tiny_model, tokens, prompt_len)
    theirs = _theirs(hf_model, tokens, prompt_len)
    assert ours.shape == theirs.shape == (total, tiny_model.config.vocab_size)
    # the model is far from uniform, so agreement is not trivially small logits
    assert float(theirs.std(-1).min()) > 0.5
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)


def test_full_sequence_forward_matches(tiny_model: NemotronH, hf_model: Any) -> None:
    from hybridmeta.runtime.engine import cold_logits

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, tiny_model.config.vocab_size, (40,), generator=gen)
    with torch.no_grad():
        theirs = hf_model(input_ids=tokens[None]).logits[0].float()
    torch.testing.assert_close(
        cold_logits(tiny_model, tokens.tolist()), theirs, atol=ATOL, rtol=RTOL
    )
