"""Stateful workload test of the reference runtime.

Random arrivals, prompt and decode lengths, track intervals, slot pressure and prefix hits
(prompts that extend or cut earlier sequences). Invariants: slot bookkeeping is exact,
and every finished request's log-probabilities equal a cold recompute of its tokens
(fp32: KL <= 1e-6 at every position).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridmeta.runtime.engine import Runtime, RuntimeOptions, cold_logits
from hybridmeta.runtime.job import kl_per_position
from hybridmeta.runtime.loader import load_nemotron_h
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.tiny import write_tiny_checkpoint
from tests.properties.strategies.runtime import runtime_options, token_lists

# Rounding between two fp32 paths gives KL ~1e-12, a wrong state KL ~1: 1e-6 separates
# them with orders of magnitude to spare on any CPU (see tests/runtime/test_engine.py).
KL_FP32 = 1e-6
_MODEL: list[NemotronH] = []


def _model(tmp: Path) -> NemotronH:
    if not _MODEL:
        _MODEL.append(load_nemotron_h(write_tiny_checkpoint(tmp / "tiny", seed=0)))
    return _MODEL[0]


class RuntimeWorkload(RuleBasedStateMachine):
    model: NemotronH
    tmp: Path

    def __init__(self) -> None:
        super().__init__()
        self.rt: Runtime | None = None
        self.known: list[tuple[int, ...]] = []  # sequences seen so far (for prefix hits)
        self.checked: set[int] = set()

    @initialize(
        options=runtime_options(),
        prompts=st.lists(token_lists(96, min_size=1, max_size=40), min_size=1, max_size=4),
        n=st.integers(1, 12),
    )
    def start(self, options: RuntimeOptions, prompts: list[list[int]], n: int) -> None:
        self.rt = Runtime(self.model, options)
        for p in prompts:
            self.rt.submit(p, n)
            self.known.append(tuple(p))

    def _room(self) -> int:
        assert self.rt is not None
        return self.rt.options.max_len

    @rule(prompt=token_lists(96), n=st.integers(1, 10))
    def arrive(self, prompt: list[int], n: int) -> None:
        assert self.rt is not None
        n = min(n, self._room() - len(prompt))
        self.rt.submit(prompt, n)
        self.known.append(tuple(prompt))

    @rule(data=st.data(), n=st.integers(1, 8))
    def arrive_sharing_a_prefix(self, data: st.DataObject, n: int) -> None:
        """A prompt that cuts an earlier prompt or finished sequence, often just past a
        track boundary, plus a few new tokens."""
        assert self.rt is not None
        if not self.known:
            return
        base = data.draw(st.sampled_from(self.known))
        interval = self.rt.options.track_interval
        boundaries = list(range(interval, len(base) + 1, interval))
        near_boundary: bool = data.draw(st.integers(0, 3)) > 0
        if boundaries and near_boundary:
            cut = min(
                len(base), data.draw(st.sampled_from(boundaries)) + data.draw(st.integers(0, 3))
            )
        else:
            cut = data.draw(st.integers(1, len(base)))
        tail = data.draw(token_lists(96, min_size=0, max_size=4))
        prompt = list(base[:cut]) + tail
        n = min(n, self._room() - len(prompt))
        if n < 1:
            return
        self.rt.submit(prompt, n)
        self.known.append(tuple(prompt))

    @rule(data=st.data(), n=st.integers(1, 8))
    def arrive_on_a_cached_prefix(self, data: st.DataObject, n: int) -> None:
        """A prompt that extends a prefix the cache holds right now: a guaranteed hit."""
        assert self.rt is not None
        keys = self.rt.cache.keys()
        while not keys and self.rt.has_work:  # the request arrives once something is cached
            self.rt.step()
            keys = self.rt.cache.keys()
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        prompt = list(key) + data.draw(token_lists(96, min_size=1, max_size=6))
        n = min(n, self._room() - len(prompt))
        if n < 1:
            return
        self.rt.submit(prompt, n)
        self.known.append(tuple(prompt))

    @rule(k=st.integers(1, 8))
    def step(self, k: int) -> None:
        assert self.rt is not None
        for _ in range(k):
            if not self.rt.has_work:
                break
            self.rt.step()

    @rule()
    def finish_all(self) -> None:
        assert self.rt is not None
        self.rt.run()

    @invariant()
    def slots_are_accounted(self) -> None:
        if self.rt is None:
            return
        rt = self.rt
        live = [r.slot for r in rt._running]
        assert len(set(live)) == len(live)
        assert set(live) == set(rt.working.used)
        assert rt.working.num_free + len(live) == rt.options.num_working
        assert len(rt.cache) <= rt.options.num_track
        assert len(rt.cache.slots.used) == len(rt.cache)

    @invariant()
    def finished_requests_equal_cold_recompute(self) -> None:
        if self.rt is None:
            return
        for rid, f in self.rt.finished.items():
            if rid in self.checked:
                continue
            self.checked.add(rid)
            self.known.append(f.tokens)
            event("request resumed from the prefix cache" if f.cached_tokens else "cold request")
            cold = cold_logits(self.model, f.tokens[:-1])[len(f.prompt) - 1 :].log_softmax(-1)
            kl = kl_per_position(f.logprobs, cold)
            assert float(kl.max()) <= KL_FP32, (rid, f.cached_tokens, kl.tolist())

    def teardown(self) -> None:
        if self.rt is not None:
            self.rt.run()
            self.finished_requests_equal_cold_recompute()


RuntimeWorkload.TestCase.settings = settings(stateful_step_count=16)


@pytest.fixture(autouse=True)
def _tiny_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    RuntimeWorkload.model = _model(tmp_path_factory.mktemp("runtime-workload"))


TestRuntimeWorkload = RuntimeWorkload.TestCase


def test_the_workload_reaches_prefix_hits() -> None:
    """Guard against a vacuous property: a fixed run of the machine's rules does hit."""
    rt = Runtime(
        RuntimeWorkload.model,
        RuntimeOptions(
            num_working=1,
            num_track=2,
            max_len=80,
            track_interval=8,
            max_prefill_tokens=8,
            use_graphs=False,
        ),
    )
    a = rt.submit(list(range(20)), 6)
    rt.run()
    b = rt.submit([*list(rt.finished[a].tokens[:25]), 1], 3)
    rt.run()
    assert rt.finished[b].cached_tokens == 24
