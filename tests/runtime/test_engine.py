"""The step loop: cache hits equal cold recompute, graph replay equals eager, slots are safe."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch

from hybridmeta import ForwardMetadata
from hybridmeta.kernels import Impl, implementation
from hybridmeta.runtime.engine import Finished, Request, Runtime, RuntimeOptions, cold_logits
from hybridmeta.runtime.job import kl_per_position
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.spec import ngram_draft

# fp32, every position. A cache hit and a cold recompute reach a token through different
# fp32 paths (chunked scan from a saved state vs one pass), |dlogp| ~1e-6 (KL ~1e-12); a
# stale or misplaced state gives KL ~1 (the stale-tail defect of sglang PR #32555: 1.55).
# 1e-6 sits between, far from both, so neither the CPU's vector width nor its threads can
# move a result across it.
KL_FP32 = 1e-6


def _opts(**kw: object) -> RuntimeOptions:
    base: dict[str, object] = {
        "num_working": 3,
        "num_track": 8,
        "max_len": 96,
        "track_interval": 16,
        "max_prefill_tokens": 64,
        "use_graphs": True,
    }
    base.update(kw)
    return RuntimeOptions(**base)  # type: ignore[arg-type]


def _tokens(n: int, seed: int, vocab: int = 96) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=gen)]


def _cold_kl(model: NemotronH, f: Finished) -> torch.Tensor:
    """KL(runtime || cold recompute) at every output position of ``f``."""
    cold = cold_logits(model, f.tokens[:-1])[len(f.prompt) - 1 :].log_softmax(-1)
    return kl_per_position(f.logprobs, cold)


def _run(rt: Runtime, prompts: Sequence[tuple[list[int], int]]) -> list[Finished]:
    rids = [rt.submit(p, n) for p, n in prompts]
    done = rt.run()
    return [done[r] for r in rids]


def test_hits_at_prefill_and_decode_made_boundaries_equal_cold(tiny_model: NemotronH) -> None:
    rt = Runtime(tiny_model, _opts())
    base = _tokens(37, seed=1)
    # boundaries 16 and 32 in prefill (the planner saves a row's last one: 32); 48 in decode
    (first,) = _run(rt, [(base, 20)])
    assert first.cached_tokens == 0
    follow = _run(
        rt,
        [
            ([*base[:35], 1, 2], 5),  # hits 32 (prefill-made)
            ([*base[:20], 1, 2], 5),  # misses: 16 was crossed, not saved
            ([*list(first.tokens[:50]), 3], 6),  # hits 48 (decode-made)
        ],
    )
    assert [f.cached_tokens for f in follow] == [32, 0, 48]
    for f in [first, *follow]:
        assert float(_cold_kl(tiny_model, f).max()) <= KL_FP32
    assert rt.cache.hits == 2


@pytest.mark.interpreter
def test_triton_decode_kernels_in_graphs_equal_cold(tiny_model: NemotronH) -> None:
    """hybridmeta.kernels under the graph emulation (Triton interpreter on the CPU)."""
    with implementation("triton"):
        rt = Runtime(tiny_model, _opts(num_working=2))
        base = _tokens(30, seed=5)
        (first,) = _run(rt, [(base, 4)])  # boundary 32 reached by decode
        (hit,) = _run(rt, [([*list(first.tokens[:33]), 9], 2)])
    assert hit.cached_tokens == 32
    for f in (first, hit):
        assert float(_cold_kl(tiny_model, f).max()) <= KL_FP32


@pytest.mark.parametrize(
    "kernels", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)]
)
def test_decode_applies_the_models_dt_floor_as_prefill_does(
    floored_dt_model: NemotronH, kernels: Impl
) -> None:
    """Decode discretises dt inside the SSM kernel (bias, softplus, ``time_step_min``
    clamp), prefill in torch before the scan: with the floor binding for every head,
    decoded tokens still equal a cold prefill recompute. A decode that lost the clamp (or
    the bias, or the softplus) fails this."""
    with implementation(kernels):
        rt = Runtime(floored_dt_model, _opts(num_working=2))
        (f,) = _run(rt, [(_tokens(12, seed=3), 5)])
    assert float(_cold_kl(floored_dt_model, f).max()) <= KL_FP32


def test_steady_decode_reuses_its_host_plan(
    tiny_model: NemotronH, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step whose rows (slots) are the previous one's and that saves no track
    reuses that step's host plan; a change of rows or a track save plans again. The
    tokens still equal a cold recompute (a stale plan would put a row on another slot)."""
    import hybridmeta.runtime.engine as engine
    from hybridmeta.planner import plan_host as real

    decode_plans: list[int] = []

    def counting(**kw: Any) -> Any:
        if kw["num_decodes"]:
            decode_plans.append(kw["num_decodes"])
        return real(**kw)

    monkeypatch.setattr(engine, "plan_host", counting)
    rt = Runtime(tiny_model, _opts(num_working=2))
    rids = [rt.submit(_tokens(5, seed=11), 20), rt.submit(_tokens(9, seed=12), 6)]
    steps: list[int] = []
    done = rt.run(on_step=lambda st: steps.append(st.decode_rows))
    decode_steps = sum(1 for n in steps if n)
    # planned: the first decode step, the step after the second request finished (one row
    # left), each step saving a track (boundary 16) and the step after it
    assert decode_plans[:1] == [2] and 1 in decode_plans
    assert len(decode_plans) <= 6 < decode_steps, (decode_plans, steps)
    for r in rids:
        assert float(_cold_kl(tiny_model, done[r]).max()) <= KL_FP32


GRAPH_ATOL = 5e-5


def test_graph_replay_equals_eager(tiny_model: NemotronH) -> None:
    prompts = [(_tokens(n, seed=n), 9) for n in (5, 17, 23)]
    graph = _run(Runtime(tiny_model, _opts(num_working=4)), prompts)
    rt_e = Runtime(tiny_model, _opts(num_working=4, use_graphs=False))
    rids = [rt_e.submit(p, n, forced=g.output) for (p, n), g in zip(prompts, graph, strict=True)]
    eager = [rt_e.run()[r] for r in rids]
    for g, e in zip(graph, eager, strict=True):
        # The eager run was forced along the graph run's tokens: its own greedy choice at
        # every position must be those tokens (top-1/top-2 gaps here are >= 0.1).
        assert e.logprobs.argmax(-1).tolist() == list(g.output)
        # the graph runs the padded bucket (4 rows for 3), eager the exact batch: GEMMs of
        # different row counts may sum in another order (BLAS blocking depends on the CPU's
        # vector width and threads), which moves a result by a few ulps. |logp| <= ~14 here,
        # where one fp32 ulp is ~1e-6: 5e-5 allows ~50 ulps accumulated over 8 layers and the
        # recurrent state of up to 32 steps. (Measured on the 2-core CI machine: 0.)
        torch.testing.assert_close(g.logprobs, e.logprobs, atol=GRAPH_ATOL, rtol=0)
        # |dlogp| <= a gives KL ~ Var_p(dlogp) / 2 <= a**2 / 2 (Popoviciu); a**2 covers the
        # higher-order terms
        assert float(kl_per_position(g.logprobs, e.logprobs).max()) <= GRAPH_ATOL**2


def test_queueing_when_out_of_slots_keeps_live_state(tiny_model: NemotronH) -> None:
    prompts = [(_tokens(n, seed=100 + n), 6) for n in (9, 18, 4, 12)]
    rt1 = Runtime(tiny_model, _opts(num_working=1, max_decode_bs=1))
    rid0 = rt1.submit(*prompts[0])
    rt1.step()
    assert rt1.num_running == 1
    for p, n in prompts[1:]:
        rt1.submit(p, n)
    assert rt1.num_waiting == 3
    rt1.step()
    assert rt1.num_running == 1  # the others wait for the slot
    done = rt1.run()
    assert len(done) == 4
    assert rt1.working.num_free == 1
    for f in done.values():
        assert float(_cold_kl(tiny_model, f).max()) <= KL_FP32
    assert done[rid0].cached_tokens == 0


def test_chunked_prefill_and_track_eviction(tiny_model: NemotronH) -> None:
    # budget of one interval per step: a 45-token prompt takes three steps
    rt = Runtime(tiny_model, _opts(num_track=1, max_prefill_tokens=16))
    prompt = _tokens(45, seed=3)
    rid = rt.submit(prompt, 4)
    sizes = []
    while rt.has_work:
        sizes.append(rt.step().prefill_tokens)
    assert sizes[:3] == [16, 16, 13]
    assert rt.cache.evictions >= 1  # one track slot for boundaries 16 and 32
    assert len(rt.cache) == 1
    assert float(_cold_kl(tiny_model, rt.finished[rid]).max()) <= KL_FP32
    # the surviving entry is the latest boundary: 48, made by decode (45 + 3 steps)
    (hit,) = _run(rt, [(list(rt.finished[rid].tokens[:49]), 3)])
    assert hit.cached_tokens == 48
    assert float(_cold_kl(tiny_model, hit).max()) <= KL_FP32


def test_decode_graph_pad_rows_leave_other_slots_untouched(tiny_model: NemotronH) -> None:
    rt = Runtime(tiny_model, _opts(num_working=4))
    _run(rt, [(_tokens(n, seed=n), 3) for n in (7, 11, 19)])
    assert rt.graphs is not None
    assert rt.graphs.buckets == (1, 2, 4)
    pool = rt.pool
    before = [t.clone() for t in (pool.conv, pool.ssm, pool.k, pool.v)]
    # 3 live rows in bucket 4 (row 3 is padding); row 0 also saves its state to track slot 9
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(4),
        mamba_cache_indices=torch.tensor([1, 2, 3]),
        mamba_track_indices=torch.tensor([9, -1, -1]),
        mamba_track_mask=torch.tensor([True, False, False]),
        has_mamba_track_mask=True,
    )
    rt.graphs.run(fwd, torch.tensor([5, 6, 7]), torch.tensor([20, 21, 22]))
    others = [s for s in range(pool.num_slots) if s not in (1, 2, 3, 9)]
    after = (pool.conv, pool.ssm, pool.k, pool.v)
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b[:, others], a[:, others])
        assert not torch.equal(b[:, 1], a[:, 1])  # the live rows did write their slots
    # the track slot got row 0's new Mamba state (the KV row is the engine's copy)
    assert torch.equal(pool.conv[:, 9], pool.conv[:, 1])
    assert torch.equal(pool.ssm[:, 9], pool.ssm[:, 1])


def test_submit_refuses_bad_requests(tiny_model: NemotronH) -> None:
    rt = Runtime(tiny_model, _opts(use_graphs=False))
    with pytest.raises(ValueError, match="prompt must not be empty"):
        rt.submit([], 3)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\)"):
        rt.submit([1, 96], 3)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        rt.submit([1], 0)
    with pytest.raises(ValueError, match="must be <= max_len 96"):
        rt.submit([1] * 90, 7)
    with pytest.raises(ValueError, match="forced must hold max_new_tokens=3"):
        rt.submit([1], 3, forced=[1, 2])
    assert not rt.has_work


def test_runtime_options_are_validated(tiny_model: NemotronH) -> None:
    with pytest.raises(ValueError, match="multiple of the model's chunk_size 8"):
        Runtime(tiny_model, _opts(track_interval=12))
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= track_interval"):
        Runtime(tiny_model, _opts(max_prefill_tokens=8))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        # Issue 21: accepted, then run() died after the prefill had written state.
        ({"num_working": 4, "max_decode_bs": 2},
         r"RuntimeOptions\.max_decode_bs=2 is below num_working=4: a decode step runs up to "
         r"num_working rows and the largest captured bucket must hold them all"),
        ({"num_working": 3, "max_decode_bs": 2, "spec_tokens": 2},
         r"max_decode_bs=2 is below num_working=3"),
        ({"num_working": 0}, r"num_working must be >= 1, got 0 \(no request could ever be admitted\)"),
        ({"num_track": 0}, r"num_track must be >= 1, got 0"),
        ({"max_len": 1}, r"max_len must be >= 2, got 1 \(a request holds at least one prompt"),
        ({"track_interval": 0}, r"track_interval must be >= 1, got 0"),
        ({"track_interval": -16}, r"track_interval must be >= 1, got -16"),
        ({"max_prefill_tokens": 8}, r"max_prefill_tokens must be >= track_interval 16, got 8"),
        ({"max_decode_bs": 0}, r"max_decode_bs must be >= 1, got 0"),
        ({"spec_tokens": 16}, r"spec_tokens must lie in \[0, track_interval - 1 = 15\]"),
        ({"spec_tokens": -1}, r"spec_tokens must lie in"),
        ({"spec_ngram": 0}, r"spec_ngram must be >= 1, got 0"),
        ({"num_working": 2.0}, r"num_working must be an int, got float 2.0"),
        ({"max_decode_bs": True}, r"max_decode_bs must be an int, got bool True"),
        ({"use_graphs": 1}, r"use_graphs must be a bool, got int 1"),
        ({"overlap_decode": "no"}, r"overlap_decode must be a bool, got str 'no'"),
    ],
)  # fmt: skip
def test_runtime_options_that_cannot_run_are_refused_at_construction(
    kw: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _opts(**kw)


def test_runtime_options_that_can_run_are_accepted(tiny_model: NemotronH) -> None:
    # Eager decode has no bucket to outgrow; a bucket larger than num_working is unused.
    eager = _opts(num_working=4, max_decode_bs=2, use_graphs=False)
    wide = _opts(num_working=2, max_decode_bs=4)
    for opts in (eager, wide):
        rt = Runtime(tiny_model, opts)
        for p in ([1, 2, 3], [4, 5], [6]):
            rt.submit(p, 2)
        assert len(rt.run()) == 3
    # An evolved copy is validated too.
    with pytest.raises(ValueError, match="max_decode_bs=2 is below num_working=4"):
        attrs.evolve(eager, use_graphs=True)


def test_identical_prompts_in_one_step_share_one_track_slot(tiny_model: NemotronH) -> None:
    rt = Runtime(tiny_model, _opts())
    prompt = _tokens(20, seed=11)
    a, b = _run(rt, [(prompt, 4), (prompt, 4)])
    assert a.output == b.output
    assert len(rt.cache.slots.used) == len(rt.cache)  # no leaked track slot
    assert rt.working.num_free == rt.options.num_working
    assert float(_cold_kl(tiny_model, a).max()) <= KL_FP32


def _overlap_workload(rt: Runtime) -> list[Finished]:
    """Rows that start, finish and cross decode-made track boundaries at different steps,
    one teacher-forced row beside greedy ones, a request arriving mid-decode, then hits on
    the boundaries decode made."""
    a, b, c = _tokens(13, seed=31), _tokens(5, seed=32), _tokens(9, seed=33)
    rids = [rt.submit(a, 30), rt.submit(b, 7, forced=_tokens(7, seed=34))]
    for _ in range(6):
        rt.step()
    rids.append(rt.submit(c, 12))
    done = rt.run()
    first = [done[r] for r in rids]
    # decode made boundaries 32 and 16 of the first request (13 + 30 tokens)
    return first + _run(rt, [([*first[0].tokens[:33], 4], 3), ([*first[0].tokens[:17], 5], 3)])


def test_overlapped_decode_equals_the_synchronous_loop(tiny_model: NemotronH) -> None:
    """Feeding a step's tokens to the next step on the device gives the synchronous loop's
    tokens, log-probabilities and cache hits, exactly."""
    sync_rt = Runtime(tiny_model, _opts(overlap_decode=False))
    over_rt = Runtime(tiny_model, _opts())
    sync, over = _overlap_workload(sync_rt), _overlap_workload(over_rt)
    assert sync_rt.overlapped_steps == 0
    # most of its 30 decode-only steps overlap (23 on this workload): all but those that
    # save a track, follow a prefill or a step that finished a row
    assert over_rt.overlapped_steps >= 20, over_rt.overlapped_steps
    assert [f.cached_tokens for f in over[3:]] == [32, 16]
    for s, o in zip(sync, over, strict=True):
        assert o.output == s.output
        assert torch.equal(o.logprobs, s.logprobs)
    assert over[1].output == tuple(_tokens(7, seed=34))  # the forced row kept its tokens
    for f in over:
        assert float(_cold_kl(tiny_model, f).max()) <= KL_FP32


def test_overlapped_decode_tokens_land_before_the_host_needs_them(tiny_model: NemotronH) -> None:
    """Between overlapped steps a request lags one token; a step that saves a track, a
    finished request and a new prefill row see every token."""
    rt = Runtime(tiny_model, _opts(num_working=1, max_decode_bs=1))
    rid = rt.submit(_tokens(14, seed=35), 6)
    rt.step()  # prefill and the first token (a mixed step samples on the host)
    (req,) = rt._running
    assert len(req.tokens) == 15
    rt.step()  # decodes token 15: the second output stays on the device
    assert len(req.tokens) == 15 and rt._pending is not None
    rt.step()  # decodes token 16, a track boundary: its key needs the second output first
    assert rt.overlapped_steps == 0 and len(req.tokens) == 16
    assert tuple(req.tokens[:16]) in rt.cache
    rt.step()  # decodes token 17 from the device, then lands the third output
    assert rt.overlapped_steps == 1 and len(req.tokens) == 17
    done = rt.run()
    left: object = rt._pending  # (mypy narrowed the attribute above)
    assert left is None
    assert len(done[rid].output) == 6
    assert float(_cold_kl(tiny_model, done[rid]).max()) <= KL_FP32


def test_prefill_rows_take_the_budget_and_split_on_track_boundaries(tiny_model: NemotronH) -> None:
    """The plan phase of a step alone: rows within the token budget, a prompt longer than
    what is left split on a track boundary (or skipped), one track slot reserved for each
    row's last boundary reached, and nothing run or advanced yet."""
    rt = Runtime(tiny_model, _opts(max_prefill_tokens=40, use_graphs=False))
    prompts = [_tokens(50, seed=1), _tokens(30, seed=2), _tokens(7, seed=3)]
    for p in prompts:
        rt.submit(p, 2)
    rt._admit()
    before = rt.pool.ssm.clone()
    rows, chunk_ids, tracks, commits = rt._prefill_rows()
    # 50 > 40: 32 tokens (two intervals); 30 > 8 left: no interval fits, skipped; 7 <= 8
    assert [(req.prompt, start, take) for req, start, take in rows] == [
        (tuple(prompts[0]), 0, 32),
        (tuple(prompts[2]), 0, 7),
    ]
    assert chunk_ids == prompts[0][:32] + prompts[2]
    # row 0 reaches boundaries 16 and 32: the planner saves the last, so 32 is reserved
    assert len(tracks) == 1 and tracks[0][0] == 0
    assert commits == [(tuple(prompts[0][:32]), tracks[0][1])]
    assert all(r.num_computed == 0 for r in rt._running)
    assert torch.equal(rt.pool.ssm, before)


def test_decode_tracks_reserve_the_rows_reaching_a_boundary(tiny_model: NemotronH) -> None:
    """The decode plan phase: a track slot for each row whose length reaches a multiple of
    the interval with this token, its cache key the tokens up to that boundary."""
    rt = Runtime(tiny_model, _opts(use_graphs=False))
    reqs = [
        Request(rid=i, prompt=(1,), max_new_tokens=40, forced=None, tokens=_tokens(n + 1, seed=i),
                num_computed=n, slot=i)
        for i, n in enumerate((14, 15, 31))
    ]  # fmt: skip
    commits: list[tuple[tuple[int, ...], int]] = []
    slots, tracks = rt._decode_tracks(reqs, commits)
    assert slots == [0, 1, 2]
    # rows 1 and 2 reach 16 and 32 with this token; row 0 reaches 15
    assert [row for row, _ in tracks] == [1, 2]
    assert commits == [
        (tuple(reqs[1].tokens[:16]), tracks[0][1]),
        (tuple(reqs[2].tokens[:32]), tracks[1][1]),
    ]
    # the plan without a track save is reused while the rows stay; a track save replans
    hp = rt._decode_host_plan([r.num_computed for r in reqs], slots, [])
    assert rt._decode_host_plan([15, 16, 32], slots, []) is hp
    assert rt._decode_host_plan([15, 16, 32], slots, tracks) is not hp
    assert rt._decode_host_plan([15, 16, 32], [2, 1, 0], []) is not hp


def test_draft_lays_out_the_verify_rows(tiny_model: NemotronH) -> None:
    """A verify step's host phase: each row's pending token and prompt-lookup draft,
    padded to the step's width with its last token; the forced targets (or -1); a track
    slot for a row whose draft may cross a boundary, keyed as if the draft were accepted."""
    rt = Runtime(tiny_model, _opts(use_graphs=False, spec_tokens=3))
    loop = [5, 6, 7] * 4 + [5]  # 13 tokens: the drafter continues the loop
    reqs = [
        Request(rid=0, prompt=(5,), max_new_tokens=30, forced=None, tokens=list(loop),
                num_computed=12, slot=0),
        # one generated (forced) token, 9, still pending; no suffix repeats: no draft
        Request(rid=1, prompt=(1, 2, 3, 4), max_new_tokens=30, forced=(9, 8, 7, 6, 5),
                tokens=[1, 2, 3, 4, 9], num_computed=4, slot=1),
        # its last token to come: no room for a draft, though its suffix repeats
        Request(rid=2, prompt=(1, 2, 1), max_new_tokens=2, forced=None, tokens=[1, 2, 1, 2],
                num_computed=3, slot=2),
    ]  # fmt: skip
    d = rt._draft(reqs)
    draft0 = ngram_draft(loop, 3, max_ngram=3)
    assert draft0 == [6, 7, 5]
    assert d.num_tokens == 4 and d.draft_lens == [3, 0, 0]
    assert d.slots == [0, 1, 2] and d.seq_lens == [12, 4, 3]
    assert d.rows == [[loop[12], *draft0], [9, 9, 9, 9], [2, 2, 2, 2]]
    assert d.targets == [[-1] * 4, [8, 7, 6, 5], [-1] * 4]
    # row 0: its pending token and draft (positions 12..15) end on boundary 16; the key is
    # the sequence as if the draft were accepted
    assert list(d.tracked) == [0]
    key, _, boundary = d.tracked[0]
    assert boundary == 16 and key == tuple([*loop, *draft0][:16])
