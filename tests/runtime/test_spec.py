"""Speculative decoding in the reference runtime: drafts, verify plan, acceptance, the step loop.

Greedy speculative decoding must give exactly the tokens of plain decoding (fp32 CPU), with
graph replay of verify + commit equal to eager; prefix-cache entries made by a commit --
including boundaries crossed in the middle of an accepted draft -- must resume exactly like
a cold recompute; the KV rows of rejected drafts must never leak into later tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hybridmeta import kernels
from hybridmeta.kernels import implementation
from hybridmeta.model import SpecCommitMetadata
from hybridmeta.runtime.engine import Finished, Runtime, RuntimeOptions, cold_logits
from hybridmeta.runtime.job import kl_per_position
from hybridmeta.runtime.loader import load_nemotron_h
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.spec import greedy_accept, ngram_draft, plan_spec_step

KL_FP32 = 1e-6


def _opts(**kw: object) -> RuntimeOptions:
    base: dict[str, object] = {
        "num_working": 3,
        "num_track": 8,
        "max_len": 96,
        "track_interval": 16,
        "max_prefill_tokens": 64,
        "use_graphs": False,
    }
    base.update(kw)
    return RuntimeOptions(**base)  # type: ignore[arg-type]


def _tokens(n: int, seed: int, vocab: int = 96) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=gen)]


def _looping(n: int, seed: int) -> list[int]:
    """A prompt that repeats a short pattern: the drafter finds matches at once."""
    pattern = _tokens(5, seed)
    return (pattern * (n // 5 + 1))[:n]


def _run(rt: Runtime, prompts: Sequence[tuple[list[int], int]]) -> list[Finished]:
    rids = [rt.submit(p, n) for p, n in prompts]
    done = rt.run()
    return [done[r] for r in rids]


def _cold_kl(model: NemotronH, f: Finished) -> torch.Tensor:
    cold = cold_logits(model, f.tokens[:-1])[len(f.prompt) - 1 :].log_softmax(-1)
    return kl_per_position(f.logprobs, cold)


# ----------------------------------------------------------------------- drafting


def test_ngram_draft_continues_the_latest_match_of_the_longest_suffix() -> None:
    toks = [5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    # suffix (1, 2, 3) last occurred before 7: continue with 7, 1, 2
    assert ngram_draft(toks, 3) == [7, 1, 2]
    assert ngram_draft(toks, 1) == [7]
    assert ngram_draft(toks, 0) == []
    # a 2-token suffix with no earlier occurrence falls back to 1 token: 4 followed 8
    assert ngram_draft([8, 4, 6, 8], 2, max_ngram=2) == [4, 6]
    assert ngram_draft([1, 2, 3], 2) == []  # nothing repeats


def test_ngram_draft_extends_a_loop_by_its_period() -> None:
    # the latest match of (7, 7, 7) is one token back: period 1
    assert ngram_draft([3, 7, 7, 7, 7], 4) == [7, 7, 7, 7]
    # period 2: a b a b a -> b a b
    assert ngram_draft([1, 2, 1, 2, 1], 3, max_ngram=2) == [2, 1, 2]


# ----------------------------------------------------------------------- the verify plan


def test_plan_spec_step_lays_out_rows_of_T_tokens() -> None:
    sp = plan_spec_step(
        slots=[2, 0], seq_lens=[10, 4], tokens=[[5, 6, 7], [8, 8, 8]],
        targets=[[-1, -1, -1], [1, 2, 3]], num_draft=[2, 0], track_mask=[True, False],
        track_slots=[5, -1],
    )  # fmt: skip
    staged = {k: torch.as_tensor(v) for k, v in sp.staged_arrays.items()}
    v = sp.views(staged)
    assert v["positions"].tolist() == [10, 11, 12, 4, 5, 6]
    assert v["input_ids"].tolist() == [5, 6, 7, 8, 8, 8]
    assert v["targets"].tolist() == [-1, -1, -1, 1, 2, 3]
    md = sp.verify.metadata(staged)
    assert md.is_target_verify and md.draft_token_num == 3 and md.num_decodes == 2
    assert md.query_start_loc.tolist() == [0, 3, 6]
    assert md.mamba_track_indices is not None and md.mamba_track_indices.tolist() == [5, -1]
    assert md.has_mamba_track_mask
    assert md.retrieve_parent_token is None  # chains


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_draft": [3, 0]}, r"num_draft must lie in \[0, T - 1 = 2\]"),
        ({"slots": [1, 1]}, "slots must be distinct"),
        ({"track_mask": [True, False], "track_slots": [0, -1]}, "is also a working slot"),
        ({"track_mask": [True, False]}, "track_mask and track_slots are given together"),
        ({"tokens": [[1, 2, 3], [1, 2]]}, "tokens must be"),
        ({"seq_lens": [3]}, r"seq_lens must have shape \(2,\)"),
    ],
)
def test_plan_spec_step_refuses_inconsistent_rows(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "slots": [0, 1], "seq_lens": [3, 3], "tokens": [[1, 2, 3], [4, 5, 6]],
        "targets": [[-1] * 3, [-1] * 3], "num_draft": [2, 2],
    }  # fmt: skip
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        plan_spec_step(**args)


def test_greedy_accept_keeps_the_leading_run_of_matches() -> None:
    V, T = 6, 4
    # choices per row: row 0 argmax 1, 2, 9->? use tokens < V
    argmax = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4], [1, 2, 3, 4]])
    logits = torch.full((3, T, V), -5.0)
    logits.scatter_(2, argmax[..., None], 5.0)
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
    # row 0: all three drafts match; row 1: draft 2 (token 2) != choice 5 -> 1 accepted;
    # row 2: only one real draft (num_draft 1), so at most 1 even though all match.
    acc = greedy_accept(
        logits.view(-1, V), ids.view(-1), torch.full((3 * T,), -1), torch.tensor([3, 3, 1])
    )
    assert acc.num_accepted.tolist() == [3, 1, 1]
    assert acc.choice.tolist() == argmax.tolist()
    # a forced target overrides the argmax: row 0 forced to 0 at column 1 stops at 1
    tgt = torch.full((3, T), -1)
    tgt[0, 1] = 0
    forced = greedy_accept(logits.view(-1, V), ids.view(-1), tgt.view(-1), torch.tensor([3, 3, 1]))
    assert forced.num_accepted.tolist() == [1, 1, 1]
    assert forced.choice[0].tolist() == [1, 0, 3, 4]
    np.testing.assert_allclose(forced.logprobs.exp().sum(-1).numpy(), 1.0, rtol=1e-6)


# ----------------------------------------------------------------------- the step loop


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_spec_decode_gives_the_plain_greedy_tokens(tiny_model: NemotronH, graphs: bool) -> None:
    prompts = [(_looping(27, 1), 24), (_tokens(19, 2), 18), (_looping(9, 3), 20)]
    plain = _run(Runtime(tiny_model, _opts(use_prefix_cache=False)), prompts)
    rt = Runtime(tiny_model, _opts(spec_tokens=3, use_graphs=graphs, use_prefix_cache=False))
    spec = _run(rt, prompts)
    for p, s in zip(plain, spec, strict=True):
        assert s.output == p.output
        assert float(kl_per_position(s.logprobs, p.logprobs).max()) <= KL_FP32
    # drafts were both accepted and rejected (rejected drafts' KV rows did not leak)
    assert 0 < rt.accepted_tokens < rt.drafted_tokens
    assert rt.decode_tokens == sum(n - 1 for _, n in prompts)
    assert rt.verify_steps < max(n for _, n in prompts) - 1  # fewer steps than tokens
    if graphs:
        assert rt.verify_graphs is not None and rt.verify_graphs.buckets == (
            (1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (3, 2), (1, 3), (2, 3), (3, 3),
            (1, 4), (2, 4), (3, 4),
        )  # fmt: skip


def test_graph_replay_of_verify_and_commit_equals_eager(tiny_model: NemotronH) -> None:
    prompts = [(_looping(21, 4), 14), (_tokens(12, 5), 14)]
    graph = _run(Runtime(tiny_model, _opts(spec_tokens=2, use_graphs=True)), prompts)
    rt_e = Runtime(tiny_model, _opts(spec_tokens=2))
    rids = [rt_e.submit(p, n, forced=g.output) for (p, n), g in zip(prompts, graph, strict=True)]
    eager = [rt_e.run()[r] for r in rids]
    for g, e in zip(graph, eager, strict=True):
        # The eager run was forced along the graph run's tokens: its own greedy choice at
        # every position must be those tokens (top-1/top-2 gaps here are >= 0.1).
        assert e.logprobs.argmax(-1).tolist() == list(g.output)
        torch.testing.assert_close(g.logprobs, e.logprobs, atol=5e-5, rtol=0)
    assert rt_e.accepted_tokens > 0


def _commit_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int], bool]]:
    seen: list[tuple[list[int], list[int], bool]] = []
    orig = kernels.spec_commit_from_metadata

    def spy(cmd: SpecCommitMetadata, *a: Any, **kw: Any) -> None:
        seen.append((cmd.accepted_index.tolist(), cmd.track_token.tolist(),
                     cmd.has_mamba_track_mask))  # fmt: skip
        orig(cmd, *a, **kw)

    monkeypatch.setattr(kernels, "spec_commit_from_metadata", spy)
    return seen


def test_boundary_crossed_inside_accepted_drafts_resumes_like_cold(
    tiny_model: NemotronH, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _commit_spy(monkeypatch)
    rt = Runtime(tiny_model, _opts(spec_tokens=4))
    # 26 prompt tokens, then decode past boundary 32 while the model loops: the verify
    # that crosses 32 accepts 2 drafts and 32 is the state after the first of them
    (first,) = _run(rt, [(_looping(26, 6), 20)])
    assert first.cached_tokens == 0
    # some commit saved a boundary that was not its row's last accepted token
    mid = [
        (a, k) for acc, tok, on in seen if on
        for a, k in zip(acc, tok, strict=True) if 0 <= k < a
    ]  # fmt: skip
    assert mid, f"no boundary fell inside an accepted draft: {seen}"
    assert tuple(first.tokens[:32]) in rt.cache
    follow = _run(rt, [([*first.tokens[:35], 7], 6), ([*first.tokens[:40], 2], 6)])
    assert [f.cached_tokens for f in follow] == [32, 32]
    for f in [first, *follow]:
        assert float(_cold_kl(tiny_model, f).max()) <= KL_FP32


def test_spec_hits_at_prefill_and_verify_made_boundaries_equal_cold(tiny_model: NemotronH) -> None:
    rt = Runtime(tiny_model, _opts(spec_tokens=3, use_graphs=True))
    base = _looping(37, 6)
    (first,) = _run(rt, [(base, 24)])
    follow = _run(
        rt,
        [
            ([*base[:35], 1, 2], 5),  # hits 32 (prefill-made)
            ([*first.tokens[:50], 3], 6),  # hits 48 (made by a verify)
        ],
    )
    assert [f.cached_tokens for f in follow] == [32, 48]
    for f in [first, *follow]:
        assert float(_cold_kl(tiny_model, f).max()) <= KL_FP32
    assert len(rt.cache.slots.used) == len(rt.cache)  # no reserved slot leaked


def test_unreached_boundary_reservations_are_released(
    tiny_model: NemotronH, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a row 2 tokens short of a boundary with 4 drafts reserves a slot; when the drafts are
    # rejected the boundary is not crossed: nothing saved, the slot goes back
    seen = _commit_spy(monkeypatch)
    rt = Runtime(tiny_model, _opts(spec_tokens=4, num_working=1))
    prompt = _tokens(29, 14)
    prompt[-4:] = prompt[-8:-4]  # a match for the drafter that the model will not follow
    (first,) = _run(rt, [(prompt, 12)])
    tracked = [tok[0] for _, tok, on in seen if on]
    assert tracked[0] == -1 and tracked[-1] >= 0, seen  # unreached first, crossed later
    assert len(rt.cache.slots.used) == len(rt.cache)
    assert rt.cache.keys() == (tuple(first.tokens[:16]), tuple(first.tokens[:32]))
    (hit,) = _run(rt, [([*first.tokens[:33], 5], 4)])
    assert hit.cached_tokens == 32
    assert float(_cold_kl(tiny_model, hit).max()) <= KL_FP32


def test_spec_options_are_validated(tiny_model: NemotronH) -> None:
    with pytest.raises(ValueError, match=r"spec_tokens must lie in \[0, track_interval - 1 = 15\]"):
        Runtime(tiny_model, _opts(spec_tokens=16))
    with pytest.raises(ValueError, match="spec_tokens must lie in"):
        Runtime(tiny_model, _opts(spec_tokens=-1))
    with pytest.raises(ValueError, match="spec_ngram must be >= 1"):
        Runtime(tiny_model, _opts(spec_tokens=2, spec_ngram=0))


@pytest.mark.interpreter
def test_triton_verify_and_commit_in_graphs_equal_cold(tiny_model: NemotronH) -> None:
    """The Triton verify and commit kernels under the graph emulation (interpreter)."""
    with implementation("triton"):
        rt = Runtime(tiny_model, _opts(num_working=1, spec_tokens=2, use_graphs=True))
        (first,) = _run(rt, [(_looping(29, 9), 6)])  # crosses 32 in a verify
    assert rt.accepted_tokens > 0
    assert tuple(first.tokens[:32]) in rt.cache
    assert float(_cold_kl(tiny_model, first).max()) <= KL_FP32


# ----------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def cuda_models(tiny_dir: Path) -> dict[torch.dtype, NemotronH]:
    return {
        dt: load_nemotron_h(tiny_dir, device="cuda", dtype=dt)
        for dt in (torch.float32, torch.bfloat16)
    }


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_spec_decode_on_cuda_graphs(cuda_models: dict[torch.dtype, NemotronH], dtype: torch.dtype) -> None:
    model = cuda_models[dtype]
    prompts = [(_looping(27, 1), 30), (_tokens(19, 2), 24), (_looping(33, 3), 20)]
    opts = _opts(use_graphs=True, num_track=16)
    plain = _run(Runtime(model, opts), prompts)
    rt = Runtime(model, _opts(use_graphs=True, num_track=16, spec_tokens=4))
    assert rt.backend_name == "cuda"
    forced = Runtime(model, _opts(use_graphs=True, num_track=16, spec_tokens=4))
    rids = [forced.submit(p, n, forced=f.output) for (p, n), f in zip(prompts, plain, strict=True)]
    teacher = [forced.run()[r] for r in rids]
    spec = _run(rt, prompts)
    kl = torch.cat([kl_per_position(t.logprobs, p.logprobs) for t, p in zip(teacher, plain, strict=True)])
    if dtype == torch.float32:
        assert [s.output for s in spec] == [p.output for p in plain]
        assert float(kl.max()) <= 1e-5
    else:
        assert float(kl.mean()) <= 5e-4
    assert rt.accepted_tokens > 0
    # cache hits made by verify commits resume like cold recompute
    follow = _run(rt, [([*spec[0].tokens[:50], 3], 6)])
    assert follow[0].cached_tokens == 48
    cold = cold_logits(model, follow[0].tokens[:-1])[len(follow[0].prompt) - 1 :].log_softmax(-1)
    kl_hit = kl_per_position(follow[0].logprobs, cold)
    assert float(kl_hit.max() if dtype == torch.float32 else kl_hit.mean()) <= (
        1e-5 if dtype == torch.float32 else 5e-4
    )


@pytest.mark.gpu
def test_verify_accept_and_commit_do_not_sync_the_device(
    cuda_models: dict[torch.dtype, NemotronH],
) -> None:
    """The device half of a speculative step (verify graph, acceptance, track column,
    commit metadata and graph) reads no device value on the host."""
    from hybridmeta.model import prepare_commit, prepare_target_verify
    from hybridmeta.runtime.spec import plan_spec_step
    from hybridmeta.staging import to_device_packed

    model = cuda_models[torch.float32]
    rt = Runtime(model, _opts(use_graphs=True, num_track=16, spec_tokens=3))
    assert rt.verify_graphs is not None
    sp = plan_spec_step(
        slots=[0, 2], seq_lens=[14, 5], tokens=[[1, 2, 3, 4], [5, 6, 7, 7]],
        targets=[[-1] * 4, [-1] * 4], num_draft=[3, 2], track_mask=[True, False],
        track_slots=[4, -1],
    )  # fmt: skip
    staged = to_device_packed(sp.staged_arrays, rt.device)
    v = sp.views(staged)
    fwd = sp.verify.forward(staged)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = rt.verify_graphs.verify(fwd, v["input_ids"], v["positions"])
        acc = greedy_accept(logits, v["input_ids"], v["targets"], v["num_draft"])
        cmd = prepare_commit(
            prepare_target_verify(fwd),
            accepted_index=acc.num_accepted,
            track_token=kernels.spec_track_token(v["seq_lens"], acc.num_accepted + 1, 16),
        )
        rt.verify_graphs.commit(cmd)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert acc.choice.shape == (2, 4)
    # row 0 crossed boundary 16 iff it accepted 2+ drafts: the track slot then holds the
    # state after column 16 - 14 - 1 = 1
    k0 = int(acc.num_accepted[0])
    inter_conv, inter_ssm = rt.pool.verify_states(2, 4)
    if k0 >= 1:
        assert torch.equal(rt.pool.ssm[:, 4], inter_ssm[:, 0, 1])
        assert torch.equal(rt.pool.conv[:, 4], inter_conv[:, 0, 1])
    assert torch.equal(rt.pool.ssm[:, 0], inter_ssm[:, 0, k0])
