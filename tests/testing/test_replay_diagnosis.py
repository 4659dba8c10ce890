"""One replay step, run by hand, and the report it raises: the step runner
(``_ReplayBase.run_step``) and the diagnosis of a failure (``_ReplayBase._diagnose``).

The diagnosis is what an engine developer reads first: which rows of which static buffer,
outside the live prefix, reach the graph. Each backend below plants one way rows can reach
it (or can seem to) and each test pins the report's lines for one fixed step, so that a
diagnosis that blames a row the graph never reads, or misses one it does, fails here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import torch

from hybridmeta import kernels
from hybridmeta.kernels import KernelFault, check_errors, reset_errors
from hybridmeta.testing import Batch, ReplayFailure, TailFill
from hybridmeta.testing import replay as replay_mod
from hybridmeta.testing.backend import GraphedDecodeBackend
from hybridmeta.testing.replay import _ReplayBase, replay_machine
from tests.testing.test_replay import Tiny
from tests.testing.test_replay_compare import _batch
from tests.testing.test_replay_faults import Faulting

NONE_FOUND = "  diagnosis: no static-buffer row outside the live prefix changes the result"


def _machine(factory: Callable[[], GraphedDecodeBackend]) -> _ReplayBase:
    m = replay_machine(factory, track=False)()
    assert isinstance(m, _ReplayBase)
    m.capture()
    return m


def _failure(m: _ReplayBase, batch: Batch, fill: TailFill) -> list[str]:
    """The lines of the :class:`ReplayFailure` that one step raises (outside a Hypothesis
    run every failure is final, so it carries the diagnosis)."""
    with pytest.raises(ReplayFailure) as info:
        m.run_step(batch, fill)
    assert info.value.steps == [(batch, fill)]
    return str(info.value).splitlines()


def _diagnosis(lines: list[str]) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.startswith("  diagnosis:"))
    return lines[start:]


def _pads(target: str, live: int, bucket: int) -> str:
    return (
        f"  - rows [{live}:{bucket}) of static buffer {target!r} (the pad rows of bucket "
        f"{bucket}) are not rewritten by refresh, and the graph reads them"
    )


def _past(target: str, rows_b: int, n: int, bucket: int) -> str:
    return (
        f"  - rows [{rows_b}:{n}) of static buffer {target!r} lie past the {rows_b} row(s) "
        f"of bucket {bucket}, yet changing them changes the result: the graph reads them"
    )


# --------------------------------------------------------------------------- backends


class OutputReadsPast(Tiny):
    """Adds the buffer ``x``'s last row (past every bucket but the largest) to every
    output row: the rows past the bucket reach the outputs, never a pool."""

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        y = super().forward(bucket)["y"]
        return {"y": y + self.x[-1:]}


class StaleAux(Tiny):
    """``no_pad`` (refresh leaves the pad rows of ``slots`` and ``x`` stale, the step reads
    them), plus a buffer ``aux`` that refresh never writes and the step never reads: its
    stale rows are harmless and must not be named."""

    def __init__(self) -> None:
        super().__init__("no_pad", max_bs=8)
        self.aux = torch.zeros(self.max_bs, 1)

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return {**super().static_buffers(), "aux": self.aux}


class StaleXReachesAll(Tiny):
    """Refresh pads ``slots`` but leaves the pad rows of ``x`` stale, and the step adds the
    bucket's ``x`` to every output row: only the stale ``x`` pad rows explain a failure."""

    def __init__(self) -> None:
        super().__init__(max_bs=8)

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        bs = batch.bs
        self.slots[:bs] = torch.tensor(batch.slots)
        self.x[:bs] = inputs["x"]
        self.slots[bs:bucket] = -1

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        return {"y": super().forward(bucket)["y"] + self.x[:bucket].sum()}


class ScalarFirst(Tiny):
    """``past_bucket``, with a scalar static buffer listed first: a buffer without a row
    dimension, which the diagnosis skips (and goes on to the others)."""

    def __init__(self) -> None:
        super().__init__("past_bucket")
        self.scale = torch.ones(())

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        return {"scale": self.scale, **super().static_buffers()}


class Drifting(Tiny):
    """Every output row is off by the number of refreshes so far: no replay reproduces the
    previous one, whatever the buffers hold."""

    def __init__(self) -> None:
        super().__init__()
        self.refreshes = torch.zeros(())  # a tensor: the captured step reads it

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        self.refreshes += 1
        super().refresh(batch, inputs, bucket)

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        return {"y": super().forward(bucket)["y"] + self.refreshes}


class FaultingWrongOutput(Faulting):
    """:class:`Faulting` (every replay records a kernel fault) whose row 0 is also off by
    one: a fault and a disagreement in the same step."""

    def __init__(self) -> None:
        super().__init__()
        self.defect = "wrong_output"


# --------------------------------------------------------------------------- run_step


def test_a_batch_larger_than_max_bs_is_refused_naming_both() -> None:
    m = _machine(Tiny)
    with pytest.raises(ValueError, match=r"^batch has bs=5 > max_bs=4$"):
        m.run_step(_batch((0, 1, 2, 3, 4)), TailFill.ZEROS)


def test_a_steps_inputs_are_drawn_from_its_batch_seed() -> None:
    # The reported steps reproduce a failure only if a batch always gets the same inputs.
    drawn: list[torch.Tensor] = []

    class Recording(Tiny):
        def make_inputs(self, batch: Batch, gen: torch.Generator) -> Mapping[str, torch.Tensor]:
            inputs = super().make_inputs(batch, gen)
            drawn.append(inputs["x"].clone())
            return inputs

    batch = Batch(slots=(1, 2), track_slots=(-1, -1), track_mask=(False, False),
                  extend_lens=(1, 1), seed=7)  # fmt: skip
    for _ in range(2):
        _machine(Recording).run_step(batch, TailFill.ZEROS)
    expected = torch.randn(2, 1, generator=torch.Generator().manual_seed(7))
    assert len(drawn) == 2
    assert all(torch.equal(x, expected) for x in drawn)


def test_the_report_is_one_line_each_then_the_diagnosis() -> None:
    # past_bucket reads its slot ids from the buffer's last rows: at bucket 1 from row 3,
    # which the ZEROS tail makes slot 0.
    m = _machine(lambda: Tiny("past_bucket"))
    batch = _batch((5,))
    assert _failure(m, batch, TailFill.ZEROS) == [
        "replay of bucket 1 (max_bs 4) for a batch of bs=1 with stale tails filled ZEROS "
        "disagrees with the backend's eager reference:",
        "  - output 'y': row 0 differs from the eager reference (max |diff| 5)",
        "  - pool 'pool': slot 0 changed, but no live row addresses it",
        "  - pool 'pool': slot 5 (working slot of row 0) does not hold the eager reference's value",
        f"  batch: {batch!r}",
        "  diagnosis:",
        _past("slots", 1, 4, 1),
    ]


def test_a_kernel_fault_is_reported_before_the_disagreements() -> None:
    reset_errors()
    m = _machine(FaultingWrongOutput)
    lines = _failure(m, _batch((1,)), TailFill.ZEROS)
    assert lines[1].startswith(
        "  - kernel fault in the replay or its reference: causal_conv1d_update: "
        "`cache_indices` values must be -1 (pad) or in [0, 2); row 0 holds 101 "
    )
    assert lines[2] == "  - output 'y': row 0 differs from the eager reference (max |diff| 1)"
    assert not any("kernel fault" in line for line in lines[2:])
    assert check_errors() is None, "the diagnosis replays' faults were read (and reset)"


def test_the_harness_reads_the_backends_own_device_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # check_errors(None) would read (and reset) every device's record: on a host with
    # several GPUs, a fault another engine left on another device would be reported as this
    # step's, and consumed. Every read must name the backend's device.
    seen: list[torch.device | str | None] = []

    def spy(device: torch.device | str | None = None) -> KernelFault | None:
        seen.append(device)
        return kernels.check_errors(device)

    monkeypatch.setattr(replay_mod, "check_errors", spy)
    m = _machine(Tiny)
    m.run_step(_batch((1, 2)), TailFill.NAN)  # passes: before the step, at the comparison
    assert seen == [m.backend.device] * 2
    seen.clear()
    m2 = _machine(lambda: Tiny("wrong_output"))
    _failure(m2, _batch((1,)), TailFill.NAN)  # and once more after the diagnosis
    assert seen == [m2.backend.device] * 3


# --------------------------------------------------------------------------- _diagnose


def test_a_failure_no_stale_row_explains_says_so() -> None:
    # bs 3 runs bucket 4 of max_bs 8: rows past the bucket and a pad row, neither read.
    m = _machine(lambda: Tiny("wrong_output", max_bs=8))
    lines = _failure(m, _batch((1, 2, 3)), TailFill.OTHER_SLOTS)
    assert lines[1] == "  - output 'y': row 0 differs from the eager reference (max |diff| 1)"
    assert _diagnosis(lines) == [NONE_FOUND]


def test_rows_past_the_bucket_that_reach_only_an_output_are_named() -> None:
    # bucket 2 of max_bs 4: row 3 of x, NaN, reaches every output row but no pool slot.
    m = _machine(OutputReadsPast)
    lines = _failure(m, _batch((1, 2)), TailFill.NAN)
    assert lines[1:3] == [
        "  - output 'y': row 0 differs from the eager reference (max |diff| nan)",
        "  - output 'y': row 1 differs from the eager reference (max |diff| nan)",
    ]
    assert not any(line.startswith("  - pool") for line in lines)
    assert _diagnosis(lines) == ["  diagnosis:", _past("x", 2, 4, 2)]


def test_stale_pad_rows_the_step_reads_are_named_and_harmless_ones_are_not() -> None:
    # bs 3 runs bucket 4 of max_bs 8. Every diagnosis replay refills the tails as the
    # failing step did (NaN in x): with any other filler the pad rows of x alone would
    # change the result and every buffer would seem to reach the graph.
    m = _machine(StaleAux)
    lines = _failure(m, _batch((1, 2, 3)), TailFill.NAN)
    assert _diagnosis(lines) == ["  diagnosis:", _pads("slots", 3, 4), _pads("x", 3, 4)]


@pytest.mark.parametrize("fill", list(TailFill))
def test_stale_float_rows_are_named_whatever_the_tail_holds(fill: TailFill) -> None:
    # The diagnosis changes a buffer's rows and watches the result. A float row holding
    # TailFill.HUGE's finfo.max was "changed" by + 1 (a no-op there), so its stale rows
    # went unnamed and the report said no row explained the failure.
    m = _machine(StaleXReachesAll)
    lines = _failure(m, _batch((1, 2, 3)), fill)
    assert _diagnosis(lines) == ["  diagnosis:", _pads("x", 3, 4)]


def test_a_buffer_without_rows_is_skipped_not_the_end() -> None:
    m = _machine(ScalarFirst)
    lines = _failure(m, _batch((5,)), TailFill.ZEROS)
    assert _diagnosis(lines) == ["  diagnosis:", _past("slots", 1, 4, 1)]


def test_with_no_row_outside_the_live_prefix_nothing_is_replayed_or_named() -> None:
    # bs = bucket = max_bs: no buffer has a row past the bucket or a pad row, so no
    # diagnosis replay runs (a replay that does not reproduce would blame empty ranges).
    m = _machine(Drifting)
    backend = m.backend
    assert isinstance(backend, Drifting)
    lines = _failure(m, _batch((1, 2, 3, 4)), TailFill.OTHER_SLOTS)
    assert lines[1] == "  - output 'y': row 0 differs from the eager reference (max |diff| 1)"
    assert _diagnosis(lines) == [NONE_FOUND]
    assert float(backend.refreshes) == 1.0
