"""The replay state machine: capture once per bucket, replay random steps, compare with
the backend's eager reference while every static buffer's stale tail is poisoned.

For each step the machine draws a :class:`~hybridmeta.testing.strategies.Batch`
(``bs <= max_bs``) and a :class:`~hybridmeta.testing.strategies.TailFill`, overwrites
*every row* of every static buffer with the filler, lets the backend refresh the buffers,
replays the graph of the smallest bucket ``B >= bs`` and checks:

* every output row of the batch equals the eager reference (within the backend's
  tolerance; bit for bit by default);
* every state slot that a live row addresses (its working slot, the track slot of a
  flagged row), or that the reference writes, equals the reference;
* every other slot of every pool is bit-identical to before the step.

On a failure the final (shrunk) example also gets a diagnosis that names the static
buffers and rows that reach the graph: rows past the bucket that change the result when
changed, and pad rows that the refresh left stale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from hybridmeta.graphs.buffers import bucket_for
from hybridmeta.graphs.capture import CapturedGraph, GraphBackend
from hybridmeta.kernels import check_errors
from hybridmeta.testing.backend import GraphedDecodeBackend, Reference
from hybridmeta.testing.profiles import resolve_settings
from hybridmeta.testing.strategies import Batch, TailFill, batches, fill_tail, tail_fills

__all__ = ["ReplayFailure", "check_replay", "replay_machine"]

BackendFactory = Callable[[], GraphedDecodeBackend]
_Outputs = Mapping[str, torch.Tensor]


class ReplayFailure(AssertionError):
    """A replayed graph disagreed with the backend's eager reference.

    ``str(err)`` names the bucket, the batch, the filler, every disagreeing output row and
    state slot and (for the shrunk example) the static-buffer rows that reach the graph.
    :func:`check_replay` appends the steps that reproduce it; ``steps`` holds them as
    ``(batch, fill)`` pairs.
    """

    def __init__(self, message: str, steps: Sequence[tuple[Batch, TailFill]] = ()) -> None:
        super().__init__(message)
        self.steps = list(steps)


def _is_final() -> bool:
    try:
        from hypothesis.control import current_build_context

        return bool(current_build_context().is_final)
    except Exception:  # outside a Hypothesis run: always diagnose
        return True


def rows_rule(buf: torch.Tensor, max_bs: int) -> tuple[int, int] | None:
    """``(scale, extra)`` with ``rows(B) = B * scale + extra`` for a buffer of ``max_bs``
    rows (``max_bs + 1``: offsets; ``k * max_bs``: ``k`` rows per request); ``None`` when
    dimension 0 is not a row dimension."""
    if buf.dim() == 0:
        return None
    n = int(buf.shape[0])
    if n == max_bs + 1:
        return (1, 1)
    if n >= max_bs and n % max_bs == 0:
        return (n // max_bs, 0)
    return None


def _rows(rule_: tuple[int, int] | None, b: int) -> int:
    assert rule_ is not None
    return b * rule_[0] + rule_[1]


def _row_same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n] bool: row i of ``a`` is bit-identical to row i of ``b`` (NaN equals NaN)."""
    eq = a == b
    if a.is_floating_point():
        eq = eq | (a.isnan() & b.isnan())
    return eq.reshape(a.shape[0], -1).all(dim=1) if a.dim() > 1 else eq


def _row_close(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> torch.Tensor:
    if tol == (0.0, 0.0) or not a.is_floating_point():
        return _row_same(a, b)
    ok = torch.isclose(a.float(), b.float(), rtol=tol[0], atol=tol[1], equal_nan=True)
    return ok.reshape(a.shape[0], -1).all(dim=1) if a.dim() > 1 else ok


def _perturb(t: torch.Tensor, num_slots: int) -> None:
    """Change every element of ``t`` in place (to another legal value)."""
    if t.numel() == 0:
        return
    if t.dtype == torch.bool:
        t.logical_not_()
    elif t.is_floating_point():
        bumped = torch.where(t.isnan(), torch.ones_like(t), t + 1.0)
        # Where + 1 rounds away (infinities, and finite values past the dtype's integer
        # precision: TailFill.HUGE's finfo.max, fp32 from 2**24, bf16 from 256) the sign
        # flips instead: the diagnosis would otherwise miss a stale row holding one.
        t.copy_(torch.where(bumped == t, -t, bumped))
    else:
        t.copy_((t.clamp(min=-1) + 1) % max(num_slots, 2))


def _cpu(m: _Outputs) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in m.items()}


class _ReplayBase(RuleBasedStateMachine):
    """Subclassed by :func:`replay_machine` with a backend factory and a ``step`` rule."""

    factory: ClassVar[BackendFactory]

    def __init__(self) -> None:
        super().__init__()
        self._backend: GraphedDecodeBackend | None = None
        self._graphs: dict[int, CapturedGraph[_Outputs]] = {}
        self.history: list[tuple[Batch, TailFill]] = []

    @property
    def backend(self) -> GraphedDecodeBackend:
        if self._backend is None:  # not an assert: `python -O` would return None
            raise RuntimeError(
                f"{type(self).__name__}.backend: no backend (capture() runs first, and "
                "teardown() releases it)"
            )
        return self._backend

    @initialize()
    def capture(self) -> None:
        b = type(self).factory()
        buckets = list(b.buckets)
        if not buckets or buckets != sorted(set(buckets)) or buckets[-1] != b.max_bs:
            raise ValueError(
                f"{type(b).__name__}.buckets must be ascending, distinct and end at "
                f"max_bs={b.max_bs}, got {buckets}"
            )
        self._backend = b
        gb: GraphBackend = b.graph_backend()
        # Largest first: real CUDA graphs then share the largest bucket's pool memory.
        for bucket in reversed(buckets):
            b.prepare_capture(bucket)
            self._graphs[bucket] = gb.capture(functools.partial(b.forward, bucket))

    def teardown(self) -> None:
        """Free this test case's graphs and backend now, between test cases.

        A Hypothesis state machine sits in a reference cycle (its rule strategy refers back
        to it), so without this its graphs would wait for the cyclic garbage collector:
        freed at an arbitrary later allocation (captures pause the collector for this
        reason, :mod:`hybridmeta.graphs.capture`), they keep every earlier case's graph
        memory pool alive meanwhile.
        """
        self._graphs.clear()
        self._backend = None

    # ------------------------------------------------------------------ one step

    def _replay(
        self,
        batch: Batch,
        fill: TailFill,
        bucket: int,
        inputs: Mapping[str, torch.Tensor],
        edit: Callable[[str], None] | None = None,
        edit_after: Callable[[str], None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Poison, (edit), refresh, (edit), replay. Returns (pools before, after, outputs)."""
        b = self.backend
        for i, (name, buf) in enumerate(b.static_buffers().items()):
            fill_tail(buf, fill, num_slots=b.num_slots, seed=batch.seed * 131 + i)
            if edit is not None:
                edit(name)
        before = _cpu(b.state_pools())
        b.refresh(batch, {k: v.to(b.device) for k, v in inputs.items()}, bucket)
        if edit_after is not None:
            for name in b.static_buffers():
                edit_after(name)
        graph = self._graphs[bucket]
        try:
            graph.replay()
        except Exception as e:
            raise ReplayFailure(
                f"replay of bucket {bucket} (max_bs {b.max_bs}) for a batch of bs={batch.bs} "
                f"with stale tails filled {fill.name} raised {type(e).__name__}: {e}\n"
                f"  batch: {batch!r}"
            ) from e
        return before, _cpu(b.state_pools()), _cpu(graph.outputs)

    def _restore(self, pools: Mapping[str, torch.Tensor]) -> None:
        for name, p in self.backend.state_pools().items():
            p.copy_(pools[name].to(p.device))

    def run_step(self, batch: Batch, fill: TailFill) -> None:
        """One step: poison, refresh, replay, compare (raises :class:`ReplayFailure`)."""
        self.history.append((batch, fill))
        b = self.backend
        if batch.bs > b.max_bs:
            raise ValueError(f"batch has bs={batch.bs} > max_bs={b.max_bs}")
        bucket = bucket_for(list(b.buckets), batch.bs)
        inputs = b.make_inputs(batch, torch.Generator().manual_seed(batch.seed))
        snapshot = _cpu(b.state_pools())
        check_errors(b.device)  # a fault from before the step is not this step's
        ref = b.reference({k: v.clone() for k, v in b.state_pools().items()}, batch, inputs)
        before, after, outs = self._replay(batch, fill, bucket, inputs)
        # The kernels' error record (an id a kernel found invalid on the device): read at
        # the comparison's sync.
        fault = check_errors(b.device)
        problems = self._compare(batch, before, after, outs, ref)
        if fault is not None:
            problems.insert(0, f"kernel fault in the replay or its reference: {fault.message()}")
        if not problems:
            return
        lines = [
            f"replay of bucket {bucket} (max_bs {b.max_bs}) for a batch of bs={batch.bs} with "
            f"stale tails filled {fill.name} disagrees with the backend's eager reference:",
            *(f"  - {p}" for p in problems),
            f"  batch: {batch!r}",
        ]
        if _is_final():
            lines += self._diagnose(batch, fill, bucket, inputs, snapshot, after, outs)
            check_errors(b.device)  # what the diagnosis replays recorded: reported above
        raise ReplayFailure("\n".join(lines), self.history)

    def _compare(
        self,
        batch: Batch,
        before: Mapping[str, torch.Tensor],
        after: Mapping[str, torch.Tensor],
        outs: Mapping[str, torch.Tensor],
        ref: Reference,
    ) -> list[str]:
        b = self.backend
        tol = b.tolerance
        problems: list[str] = []
        for name, want in ref.outputs.items():
            want = want.detach().cpu()
            got = outs.get(name)
            if got is None:
                problems.append(f"output {name!r}: the captured forward did not return it")
                continue
            n = want.shape[0]
            got = got[:n]
            if got.shape != want.shape:
                problems.append(
                    f"output {name!r}: live rows have shape {tuple(got.shape)}, the reference "
                    f"{tuple(want.shape)}"
                )
                continue
            per = max(n // max(batch.bs, 1), 1)
            bad = (~_row_close(got, want.to(got.dtype), tol)).nonzero().flatten().tolist()
            rows: dict[int, str] = {}
            for r in bad:
                rows.setdefault(r // per, _maxdiff(got[r], want[r]))
            for row, diff in list(rows.items())[:4]:
                problems.append(
                    f"output {name!r}: row {row} differs from the eager reference "
                    f"(max |diff| {diff})"
                )
        addressed = batch.addressed()
        for name, ref_pool in ref.pools.items():
            exp = ref_pool.detach().cpu()[: b.num_slots]
            aft, bef = after[name][: b.num_slots], before[name][: b.num_slots]
            unchanged = _row_same(aft, bef)
            close = _row_close(aft, exp.to(aft.dtype), tol)
            # A slot the reference writes is expected to change even when the batch's
            # rows do not name it (a backend with its own write pattern).
            ref_wrote = ~_row_same(exp.to(bef.dtype), bef)
            for s in range(b.num_slots):
                if s in addressed or bool(ref_wrote[s]):
                    if not bool(close[s]):
                        owner = addressed.get(s, "written by the eager reference")
                        problems.append(
                            f"pool {name!r}: slot {s} ({owner}) does not hold the "
                            "eager reference's value"
                        )
                elif not bool(unchanged[s]):
                    problems.append(f"pool {name!r}: slot {s} changed, but no live row addresses it")
        return problems

    def _diagnose(
        self,
        batch: Batch,
        fill: TailFill,
        bucket: int,
        inputs: Mapping[str, torch.Tensor],
        snapshot: Mapping[str, torch.Tensor],
        after: Mapping[str, torch.Tensor],
        outs: Mapping[str, torch.Tensor],
    ) -> list[str]:
        """Which static-buffer rows outside the live prefix reach the graph."""
        b = self.backend
        found: list[str] = []

        def differs(res: tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> bool:
            _, aft2, outs2 = res
            same_pools = all(bool(_row_same(aft2[k], after[k]).all()) for k in after)
            same_outs = all(
                outs2[k].shape == outs[k].shape and bool(_row_same(outs2[k], outs[k]).all())
                for k in outs
            )
            return not (same_pools and same_outs)

        for target, buf in b.static_buffers().items():
            rule_ = rows_rule(buf, b.max_bs)
            if rule_ is None:
                continue
            n, live, rows_b = int(buf.shape[0]), _rows(rule_, batch.bs), _rows(rule_, bucket)
            if rows_b < n:

                def past(name: str, lo: int = rows_b, target: str = target) -> None:
                    if name == target:
                        _perturb(b.static_buffers()[name][lo:], b.num_slots)

                self._restore(snapshot)
                if differs(self._replay(batch, fill, bucket, inputs, edit_after=past)):
                    found.append(
                        f"rows [{rows_b}:{n}) of static buffer {target!r} lie past the "
                        f"{rows_b} row(s) of bucket {bucket}, yet changing them changes the "
                        "result: the graph reads them"
                    )
            if live < rows_b:
                kept: list[torch.Tensor] = []

                def pads(
                    name: str,
                    lo: int = live,
                    hi: int = rows_b,
                    target: str = target,
                    kept: list[torch.Tensor] = kept,
                ) -> None:
                    if name == target:
                        rows = b.static_buffers()[name][lo:hi]
                        _perturb(rows, b.num_slots)
                        kept.append(rows.detach().cpu().clone())

                self._restore(snapshot)
                res = self._replay(batch, fill, bucket, inputs, edit=pads)
                left = bool(_row_same(buf[live:rows_b].detach().cpu(), kept[0]).all())
                if left and differs(res):
                    found.append(
                        f"rows [{live}:{rows_b}) of static buffer {target!r} (the pad rows of "
                        f"bucket {bucket}) are not rewritten by refresh, and the graph reads them"
                    )
        self._restore(snapshot)
        if not found:
            return ["  diagnosis: no static-buffer row outside the live prefix changes the result"]
        return ["  diagnosis:", *(f"  - {f}" for f in found)]


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    if bool(d.isnan().any()):
        return "nan"
    return f"{float(d.max()):.3g}"


def replay_machine(
    factory: BackendFactory,
    *,
    pad_rows: bool = False,
    track: bool = True,
    draft_token_num: int = 1,
    fills: Sequence[TailFill] | None = None,
    name: str | None = None,
) -> type[RuleBasedStateMachine]:
    """A Hypothesis state machine that drives the backends ``factory()`` builds.

    ``factory`` is called once here (to read ``max_bs`` and ``num_slots``) and once per
    test case. The machine's one rule, ``step(batch, fill)``, runs a step as described in
    the module documentation; run it with :func:`check_replay` or
    ``hypothesis.stateful.run_state_machine_as_test``.
    """
    probe = factory()
    max_bs, num_slots = probe.max_bs, probe.num_slots
    label = name or f"{type(probe).__name__}Replay"
    del probe
    batch_st = batches(
        max_bs=max_bs, num_slots=num_slots, pad_rows=pad_rows, track=track,
        draft_token_num=draft_token_num,
    )  # fmt: skip
    fill_st = st.sampled_from(list(fills)) if fills else tail_fills()

    class Machine(_ReplayBase):
        @rule(batch=batch_st, fill=fill_st)
        def step(self, batch: Batch, fill: TailFill) -> None:
            self.run_step(batch, fill)

    Machine.factory = staticmethod(factory)
    Machine.__name__ = Machine.__qualname__ = label
    return Machine


def check_replay(
    factory: BackendFactory,
    *,
    settings: Settings | None = None,
    pad_rows: bool = False,
    track: bool = True,
    draft_token_num: int = 1,
    fills: Sequence[TailFill] | None = None,
) -> None:
    """Run the replay state machine on the backends ``factory`` builds.

    Parameters
    ----------
    factory : callable
        Builds a fresh :class:`~hybridmeta.testing.GraphedDecodeBackend` (pools, buffers)
        per test case.
    settings : hypothesis.settings, optional
        Default: the active hybridmeta profile (``hybridmeta-ci`` unless
        ``HYBRIDMETA_PROFILE`` names another).
    pad_rows, track, draft_token_num : optional
        Passed to :func:`~hybridmeta.testing.strategies.batches`.
    fills : sequence of TailFill, optional
        Restrict the stale-tail fillers (default: all).

    Raises
    ------
    ReplayFailure
        With the shrunk falsifying example: the disagreeing rows and slots, the static
        buffer rows that reach the graph, and Hypothesis's steps to reproduce.
    """
    machine = replay_machine(
        factory, pad_rows=pad_rows, track=track, draft_token_num=draft_token_num, fills=fills
    )
    try:
        # One shrunk example (not an ExceptionGroup of every distinct failure).
        chosen = Settings(resolve_settings(settings), report_multiple_bugs=False)
        run_state_machine_as_test(machine, settings=chosen)
    except ReplayFailure as e:
        final = _reduce(machine, e) if len(e.steps) > 1 else e
        text = "\n".join(
            [str(final), "steps to reproduce, after capture():",
             *(f"  step(batch={b!r}, fill=TailFill.{f.name})" for b, f in final.steps)]
        )  # fmt: skip
        raise ReplayFailure(text, final.steps) from None


def _replay_steps(
    machine: type[RuleBasedStateMachine], steps: list[tuple[Batch, TailFill]]
) -> ReplayFailure | None:
    m = machine()
    assert isinstance(m, _ReplayBase)
    m.capture()
    try:
        for batch, fill in steps:
            m.run_step(batch, fill)
    except ReplayFailure as e:
        return e
    except Exception:  # a different failure: not a reproduction of this one
        return None
    return None


def _reduce(machine: type[RuleBasedStateMachine], err: ReplayFailure) -> ReplayFailure:
    """Delete steps the failure does not need (Hypothesis's stateful shrinker sometimes
    keeps leading no-op steps); the last run also carries the diagnosis."""
    steps = list(err.steps)
    changed = True
    while changed and len(steps) > 1:
        changed = False
        for i in range(len(steps)):
            trial = steps[:i] + steps[i + 1 :]
            if trial and _replay_steps(machine, trial) is not None:
                steps, changed = trial, True
                break
    return _replay_steps(machine, steps) or err
