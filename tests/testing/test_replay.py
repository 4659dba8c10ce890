"""The replay harness on a minimal backend with planted defects, one at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import pytest
import torch
from hypothesis import settings

from hybridmeta.graphs import EmulatedGraphBackend
from hybridmeta.testing import (
    Batch,
    GraphedDecodeBackend,
    Reference,
    ReplayFailure,
    TailFill,
    check_replay,
    resolve_settings,
)
from hybridmeta.testing.replay import rows_rule

_QUICK = settings(resolve_settings(), max_examples=25, stateful_step_count=5, database=None)


class Tiny(GraphedDecodeBackend):
    """``pool[slot] += x`` per live row, ``y = pool[slot]``; pad rows write a trash row.

    ``defect`` plants one bug: ``"no_pad"`` (refresh leaves rows [bs:B) stale),
    ``"past_bucket"`` (the step reads slot ids from the last B rows of the whole buffer),
    ``"wrong_output"`` (row 0's output is off by one), ``"touch_neighbour"`` (also writes
    slot + 1), ``"crash"`` (indexes the pool with a value read from the buffer's last row).
    """

    def __init__(self, defect: str | None = None, max_bs: int = 4) -> None:
        self.max_bs, self.num_slots, self.device = max_bs, 2 * max_bs + 2, torch.device("cpu")
        self.defect = defect
        self.pool = torch.arange(self.num_slots + 1, dtype=torch.float32)[:, None] * 1.0
        self.slots = torch.zeros(max_bs, dtype=torch.int64)
        self.x = torch.zeros(max_bs, 1)

    def graph_backend(self) -> EmulatedGraphBackend:
        return EmulatedGraphBackend("cpu")

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return {"slots": self.slots, "x": self.x}

    def state_pools(self) -> Mapping[str, torch.Tensor]:
        return {"pool": self.pool}

    def make_inputs(self, batch: Batch, gen: torch.Generator) -> Mapping[str, torch.Tensor]:
        return {"x": torch.randn(batch.bs, 1, generator=gen)}

    def prepare_capture(self, bucket: int) -> None:
        self.slots[:bucket] = -1
        self.x[:bucket] = 0

    def _step(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        live = slots >= 0
        dst = torch.where(live, slots, self.num_slots)
        new = self.pool.index_select(0, dst) + x
        self.pool.index_copy_(0, dst, new)
        if self.defect == "touch_neighbour":
            nb = torch.where(live, (slots + 1) % self.num_slots, self.num_slots)
            self.pool.index_add_(0, nb, torch.ones_like(new) * 0.5)
        return new

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        slots = self.slots[:bucket]
        if self.defect == "past_bucket":
            slots = self.slots[-bucket:]
        if self.defect == "crash":
            # Indexes the pool with the buffer's last row, unchecked: -1 (a pad) is the only
            # value that stays in range.
            self.pool.index_select(0, (self.slots[-1:] + 1) * 1000)
        y = self._step(slots, self.x[:bucket])
        if self.defect == "wrong_output":
            bump = torch.zeros_like(y)
            bump[0] = 1.0
            y = y + bump
        return {"y": y}

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        bs = batch.bs
        self.slots[:bs] = torch.tensor(batch.slots)
        self.x[:bs] = inputs["x"]
        if self.defect != "no_pad":
            self.slots[bs:bucket] = -1
            self.x[bs:bucket] = 0

    def reference(
        self, pools: Mapping[str, torch.Tensor], batch: Batch, inputs: Mapping[str, torch.Tensor]
    ) -> Reference:
        pool = pools["pool"].clone()
        ys = []
        for i, s in enumerate(batch.slots):
            pool[s] = pool[s] + inputs["x"][i]
            ys.append(pool[s].clone())
        return Reference(pools={"pool": pool}, outputs={"y": torch.stack(ys)})


def test_a_correct_backend_passes() -> None:
    check_replay(Tiny, settings=_QUICK, track=False)


def test_stale_pad_rows_are_found_and_named() -> None:
    with pytest.raises(ReplayFailure) as info:
        check_replay(lambda: Tiny("no_pad"), settings=_QUICK, track=False)
    text = str(info.value)
    assert "disagrees with the backend's eager reference" in text
    assert "of static buffer 'slots' (the pad rows of bucket" in text
    assert "steps to reproduce, after capture():\n  step(batch=Batch(bs=" in text
    assert info.value.steps and info.value.steps[-1][0].bs >= 1


def test_reading_past_the_bucket_is_found_and_named() -> None:
    with pytest.raises(ReplayFailure) as info:
        check_replay(lambda: Tiny("past_bucket"), settings=_QUICK, track=False)
    text = str(info.value)
    assert "static buffer 'slots' lie past the" in text
    assert "the graph reads them" in text


def test_a_wrong_output_row_is_named() -> None:
    with pytest.raises(ReplayFailure, match=r"output 'y': row 0 differs"):
        check_replay(lambda: Tiny("wrong_output"), settings=_QUICK, track=False)


def test_a_write_to_an_unaddressed_slot_is_named() -> None:
    with pytest.raises(ReplayFailure, match=r"pool 'pool': slot \d+ changed, but no live row"):
        check_replay(lambda: Tiny("touch_neighbour"), settings=_QUICK, track=False)


def test_an_exception_during_replay_is_reported_with_the_batch() -> None:
    with pytest.raises(ReplayFailure, match=r"raised (IndexError|RuntimeError).*\n  batch: Batch"):
        check_replay(lambda: Tiny("crash"), settings=_QUICK, track=False, fills=[TailFill.HUGE])


def test_buckets_must_end_at_max_bs() -> None:
    class BadBuckets(Tiny):
        @property
        def buckets(self) -> list[int]:
            return [1, 2]

    with pytest.raises(ValueError, match=r"buckets must be ascending.*max_bs=4"):
        check_replay(BadBuckets, settings=_QUICK, track=False)


def test_rows_rule() -> None:
    assert rows_rule(torch.zeros(4), 4) == (1, 0)
    assert rows_rule(torch.zeros(5), 4) == (1, 1)
    assert rows_rule(torch.zeros(12, 3), 4) == (3, 0)
    assert rows_rule(torch.zeros(7), 4) is None
    assert rows_rule(torch.zeros(()), 4) is None


def test_steps_the_failure_does_not_need_are_deleted() -> None:
    from hybridmeta.testing.replay import _reduce, replay_machine

    machine = replay_machine(lambda: Tiny("past_bucket"), track=False)
    noop = Batch(slots=(0, 1, 2, 3), track_slots=(-1,) * 4, track_mask=(False,) * 4,
                 extend_lens=(1,) * 4)  # fmt: skip
    bad = Batch(slots=(5,), track_slots=(-1,), track_mask=(False,), extend_lens=(1,))
    reduced = _reduce(machine, ReplayFailure("x", [(noop, TailFill.ZEROS), (bad, TailFill.ZEROS)]))
    assert reduced.steps == [(bad, TailFill.ZEROS)]
    assert "diagnosis:" in str(reduced)


def test_each_test_case_frees_its_graphs_when_it_ends() -> None:
    # The machine itself sits in a reference cycle (Hypothesis's rule strategy refers back
    # to it): its graphs must not wait for the cyclic collector, which could run inside the
    # next case's capture and keeps every earlier case's graph memory alive meanwhile.
    import gc
    import weakref

    from hybridmeta.testing.replay import _ReplayBase, replay_machine

    machine = replay_machine(Tiny, track=False)()
    assert isinstance(machine, _ReplayBase)
    machine.capture()
    graph = weakref.ref(machine._graphs[machine.backend.max_bs])
    backend = weakref.ref(machine.backend)
    gc.disable()
    try:
        machine.teardown()
        assert graph() is None and backend() is None
    finally:
        gc.enable()


def recorded_batches(run: Callable[[type[Tiny]], object]) -> list[Batch]:
    """The batches ``run(backend_class)`` steps a ``Tiny`` backend through (whether the run
    passes does not matter here)."""
    seen: list[Batch] = []

    class Recorder(Tiny):
        def make_inputs(self, batch: Batch, gen: torch.Generator) -> Mapping[str, torch.Tensor]:
            seen.append(batch)
            return super().make_inputs(batch, gen)

    with contextlib.suppress(ReplayFailure):
        run(Recorder)
    assert seen, "the machine ran no step"
    return seen


def _drawn_batches(**options: object) -> list[Batch]:
    """The batches ``check_replay`` steps ``Tiny`` through with these options."""
    return recorded_batches(
        lambda cls: check_replay(cls, settings=_QUICK, **options)  # type: ignore[arg-type]
    )


def test_check_replay_passes_its_batch_options_to_the_machine() -> None:
    assert any(-1 in b.slots for b in _drawn_batches(track=False, pad_rows=True))
    assert not any(-1 in b.slots for b in _drawn_batches(track=False))
    assert any(b.has_track for b in _drawn_batches(track=True))
    assert not any(b.has_track for b in _drawn_batches(track=False))
    assert {b.draft_token_num for b in _drawn_batches(track=False, draft_token_num=2)} == {2}
    # the defaults: tracked rows drawn, one token a row
    defaults = _drawn_batches()
    assert any(b.has_track for b in defaults)
    assert {b.draft_token_num for b in defaults} == {1}


def test_check_replay_fills_only_the_tails_it_is_given() -> None:
    tails: list[torch.Tensor] = []

    class Recorder(Tiny):
        def refresh(
            self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int
        ) -> None:
            tails.append(self.x[batch.bs :].clone())  # what the harness left past the batch
            super().refresh(batch, inputs, bucket)

    check_replay(Recorder, settings=_QUICK, track=False, fills=[TailFill.NAN])
    assert any(t.numel() for t in tails), "no step left a tail"
    assert all(bool(t.isnan().all()) for t in tails)


class SecondStep(Tiny):
    """Every step after the first returns row 0 off by one: a failure no single step shows."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = torch.zeros(())  # a tensor: the captured step reads it at every replay

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        self.steps += 1
        super().refresh(batch, inputs, bucket)

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        y = super().forward(bucket)["y"]
        row0 = (torch.arange(y.shape[0])[:, None] == 0).to(y.dtype)
        return {"y": y + row0 * (self.steps >= 2).to(y.dtype)}


def test_a_failure_that_needs_two_steps_is_reported_with_both() -> None:
    with pytest.raises(ReplayFailure) as info:
        check_replay(SecondStep, settings=_QUICK, track=False)
    assert len(info.value.steps) == 2  # the harness's reduction keeps both, drops no more
    text = str(info.value)
    assert text.count("\n  step(batch=Batch(") == 2
