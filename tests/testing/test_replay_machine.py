"""The replay state machine itself: its life cycle (``capture`` / ``teardown``), what one
step hands the backend (the tails it poisons, the bucket it refreshes and replays), the
machine :func:`replay_machine` builds (defaults, name), the harness's reduction of a
failure's steps, and the default capture of :class:`GraphedDecodeBackend`."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hybridmeta.graphs import EmulatedGraphBackend
from hybridmeta.testing import Batch, GraphedDecodeBackend, ReplayFailure, TailFill, check_replay
from hybridmeta.testing.replay import _reduce, _ReplayBase, replay_machine
from tests.testing.test_replay import _QUICK, Tiny, recorded_batches
from tests.testing.test_replay_compare import _batch
from tests.testing.test_replay_diagnosis import _machine

# Reproducible draws for the tests that run Hypothesis.
_FIXED = settings(_QUICK, derandomize=True, report_multiple_bugs=False)


# --------------------------------------------------------------------------- life cycle


def test_the_backend_is_refused_before_capture_and_after_teardown() -> None:
    m = replay_machine(Tiny, track=False)()
    assert isinstance(m, _ReplayBase)
    with pytest.raises(
        RuntimeError, match=r"TinyReplay.backend: no backend \(capture\(\) runs first"
    ):
        m.backend  # noqa: B018
    m.capture()
    assert isinstance(m.backend, Tiny)
    m.teardown()
    with pytest.raises(
        RuntimeError, match=r"TinyReplay.backend: no backend \(capture\(\) runs first"
    ):
        m.backend  # noqa: B018


# --------------------------------------------------------------------------- one step


class TailRecorder(Tiny):
    """Records, at each refresh, what the harness left in the static buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, torch.Tensor]] = []

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        self.seen.append({k: v.clone() for k, v in self.static_buffers().items()})
        super().refresh(batch, inputs, bucket)


def _random_tail(seed: int) -> dict[str, torch.Tensor]:
    """The buffers' poisoned contents for one OTHER_SLOTS step of a batch with ``seed``."""
    m = _machine(TailRecorder)
    m.run_step(Batch(slots=(1,), track_slots=(-1,), track_mask=(False,), extend_lens=(1,),
                     seed=seed), TailFill.OTHER_SLOTS)  # fmt: skip
    backend = m.backend
    assert isinstance(backend, TailRecorder)
    (seen,) = backend.seen
    return seen


def test_random_tails_follow_the_batch_seed() -> None:
    # A reported step reproduces only if its random tail does; and Hypothesis explores
    # random tails only through the seeds it draws: a fixed tail would be one pattern for
    # every step of every test case.
    first, again, other = _random_tail(1), _random_tail(1), _random_tail(2)
    for name in first:
        assert torch.equal(first[name], again[name]), name
        assert not torch.equal(first[name], other[name]), name


class BucketSpy(Tiny):
    """Records the bucket each refresh is given; each captured graph, when replayed,
    writes its own bucket into ``replayed``."""

    def __init__(self) -> None:
        super().__init__(max_bs=8)
        self.refreshed: list[int] = []
        self.replayed = torch.zeros((), dtype=torch.int64)

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        self.replayed.fill_(bucket)
        return super().forward(bucket)

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        self.refreshed.append(bucket)
        super().refresh(batch, inputs, bucket)


def test_each_step_refreshes_and_replays_the_smallest_bucket_that_holds_it() -> None:
    # Refreshing one bucket's rows and replaying another's graph is the stale-tail defect.
    m = _machine(BucketSpy)
    spy = m.backend
    assert isinstance(spy, BucketSpy)
    assert list(spy.buckets) == [1, 2, 4, 8]
    for bs, bucket in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)]:
        m.run_step(_batch(tuple(range(bs))), TailFill.ZEROS)
        assert spy.refreshed[-1] == bucket, bs
        assert int(spy.replayed) == bucket, bs


# --------------------------------------------------------------------------- replay_machine


def test_replay_machine_has_check_replays_defaults() -> None:
    # The two documented ways to run the machine (check_replay, or replay_machine with
    # run_state_machine_as_test) draw the same batches unless told otherwise.
    machine, check = inspect.signature(replay_machine), inspect.signature(check_replay)
    for option in ("pad_rows", "track", "draft_token_num", "fills"):
        assert machine.parameters[option].default == check.parameters[option].default, option

    seen = recorded_batches(
        lambda cls: run_state_machine_as_test(replay_machine(cls), settings=_FIXED)
    )
    assert not any(-1 in b.slots for b in seen)  # no pad rows
    assert any(b.has_track for b in seen)  # tracked rows
    assert {b.draft_token_num for b in seen} == {1}  # one token a row


def test_hypothesis_reports_the_machine_by_the_backends_name() -> None:
    assert replay_machine(Tiny).__name__ == "TinyReplay"
    assert replay_machine(Tiny, name="Mine").__name__ == "Mine"
    with pytest.raises(ReplayFailure) as info:
        run_state_machine_as_test(
            replay_machine(lambda: Tiny("wrong_output"), track=False), settings=_FIXED
        )
    assert "state = TinyReplay()" in getattr(info.value, "__notes__", [])


# --------------------------------------------------------------------------- _reduce


class ArmedBy7(Tiny):
    """Once a step has addressed slot 7, a later step that addresses slot 8 returns row 0
    off by one: the failure needs those two steps, and no other."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = torch.zeros(())
        self.bump = torch.zeros(())  # a tensor: the captured step reads it at every replay

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        self.bump.copy_(self.armed if 8 in batch.slots else torch.zeros(()))
        if 7 in batch.slots:
            self.armed.fill_(1.0)
        super().refresh(batch, inputs, bucket)

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        y = super().forward(bucket)["y"]
        row0 = (torch.arange(y.shape[0])[:, None] == 0).to(y.dtype)
        return {"y": y + row0 * self.bump}


def test_reduction_keeps_exactly_the_steps_the_failure_needs() -> None:
    arm, fire = _batch((7,)), _batch((8, 1))
    noops = [_batch((0,)), _batch((1, 2)), _batch((3,)), _batch((8,))]  # (8,) before arming
    steps = [noops[0], noops[3], arm, noops[1], noops[2], fire]
    machine = replay_machine(ArmedBy7, track=False)
    reduced = _reduce(machine, ReplayFailure("x", [(b, TailFill.ZEROS) for b in steps]))
    assert reduced.steps == [(arm, TailFill.ZEROS), (fire, TailFill.ZEROS)]
    text = str(reduced)  # the reduced steps' own failure, with its diagnosis
    assert "output 'y': row 0 differs from the eager reference" in text
    assert "diagnosis:" in text


# --------------------------------------------------------------------------- backend


def test_the_default_capture_off_cuda_is_the_emulation_on_the_backends_device() -> None:
    gb = GraphedDecodeBackend.graph_backend(Tiny())  # Tiny overrides it: call the default
    assert isinstance(gb, EmulatedGraphBackend)
    assert gb.device == torch.device("cpu")
