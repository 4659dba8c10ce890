"""Every refusal before any write: invalid steps leave every buffer and the pool byte-identical.

The replay machine of ``test_graphs_replay`` (a Mamba2-like step captured per bucket over a
virtual -> physical slot table, every buffer poisoned before each step) gains two rules:

* ``invalid_step``: a step that breaks one rule, of a kind drawn at random (a live row's
  pad id, working ids outside the table, duplicate working slots, a flagged row without a
  track slot, track ids outside the pool, two flagged rows saving into one slot, a save
  onto a working slot; too many rows, a wrong dtype, wrong inputs, a host value the graphs
  were not captured with, a field without a buffer). ``runner.run`` must refuse it naming
  the field, and every static buffer and the whole state pool must be byte-identical to
  before, the refreshed bucket unchanged;
* ``stale_replay``: a valid refresh for one bucket, then the graph of another bucket (or
  of the same bucket after its rows were poisoned) through ``runner.graph(B).replay()``:
  refused, nothing written; then the refreshed bucket's graph replays the step exactly.

The machine's own rules keep running valid steps between refusals, with its invariants
(outputs equal the eager per-row reference, unreferenced slots bit-identical, track slots
exact). Two more properties: a commit's draft columns out of ``[-1, T)`` are refused in
debug mode with nothing written, and the refresh refuses a step's slot values exactly when
an independent statement of the slot rules says they are broken (the generated fast check,
the one-by-one checks and the oracle agree).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from hybridmeta import ForwardMetadata, Pad, debug_mode, prepare_target_verify
from hybridmeta.graphs import StaticBuffers
from hybridmeta.model import SpecCommitMetadata, prepare_commit
from tests.properties.strategies.graphs import (
    TRACK_PAD,
    WORKING_PAD,
    InvalidStepSpec,
    SlotValues,
    VerifyStepSpec,
    decode_steps,
    invalid_decode_steps,
    poison_fill,
    slot_values,
    verify_steps,
)
from tests.properties.test_graphs_replay import ReplayMachine


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class RefusalMachine(ReplayMachine):
    """The replay machine, plus refused steps and refused replays between its valid steps."""

    max_bs_choices = (2, 3, 5)

    def _state(self) -> dict[str, torch.Tensor]:
        snap = self.buffers.snapshot()
        snap["<state pool>"] = self.model.state.clone()
        return snap

    def _assert_unchanged(self, before: dict[str, torch.Tensor], what: str) -> None:
        after = self._state()
        assert after.keys() == before.keys()
        changed = [k for k, t in before.items() if not torch.equal(_bytes(after[k]), _bytes(t))]
        assert not changed, f"{what} wrote into {changed}"

    def _build(self, bad: InvalidStepSpec) -> tuple[ForwardMetadata, dict[str, torch.Tensor]]:
        spec = bad.step
        bs = spec.bs
        inputs = self.model.random_inputs(torch.Generator().manual_seed(spec.seed), bs)
        kw: dict[str, Any] = {
            "query_start_loc": torch.arange(bs + 1),
            "mamba_cache_indices": torch.tensor(spec.slots),
            "mamba_track_indices": torch.tensor(spec.track),
            "mamba_track_mask": torch.tensor(spec.mask),
            "has_mamba_track_mask": any(spec.mask),
        }
        first = next(iter(inputs))
        if bad.kind == "index_dtype":
            kw["query_start_loc"] = kw["query_start_loc"].to(torch.int32)
        elif bad.kind == "input_rows":
            inputs[first] = torch.cat([inputs[first], inputs[first][:1]])
        elif bad.kind == "input_dtype":
            inputs[first] = inputs[first].double()
        elif bad.kind == "missing_input":
            inputs = {}
        elif bad.kind == "host_value":
            kw["is_target_verify"] = True
        elif bad.kind == "unbuffered_field":
            kw["conv_states_mask_indices"] = torch.tensor([0])
        return ForwardMetadata(**kw), inputs

    @rule(data=st.data())
    def invalid_step(self, data: st.DataObject) -> None:
        bad = data.draw(
            invalid_decode_steps(
                table=tuple(self.table.tolist()), num_slots=self.num_slots, max_bs=self.max_bs
            ),
            label="invalid",
        )
        event(f"refused: {bad.kind}")
        fwd, inputs = self._build(bad)
        self._poison(bad.step.seed)  # junk everywhere: any write would show
        before = self._state()
        held = self.buffers.refreshed_bucket
        with pytest.raises((ValueError, TypeError)) as refusal:
            self.runner.run(fwd, inputs)
        assert bad.field in str(refusal.value), (bad.kind, str(refusal.value))
        self._assert_unchanged(before, f"the refused {bad.kind} step")
        assert self.buffers.refreshed_bucket == held

    @precondition(lambda self: self.last_bs > 0)
    @rule(data=st.data())
    def stale_replay(self, data: st.DataObject) -> None:
        spec = data.draw(decode_steps(num_slots=self.num_slots, max_bs=self.max_bs), label="step")
        fits = [b for b in self.buckets if b >= spec.bs]
        refreshed = data.draw(st.sampled_from(fits), label="refreshed")
        others = [b for b in self.buckets if b != refreshed]
        poisoned = not others or data.draw(st.booleans(), label="poisoned")
        self._poison(spec.seed)
        inputs = self.model.random_inputs(torch.Generator().manual_seed(spec.seed + 1), spec.bs)
        virtual = self.inverse[torch.tensor(spec.slots)]
        fwd = ForwardMetadata(
            query_start_loc=torch.arange(spec.bs + 1),
            mamba_cache_indices=virtual,
            mamba_track_indices=torch.tensor(spec.track),
            mamba_track_mask=torch.tensor(spec.mask),
            has_mamba_track_mask=any(spec.mask),
        )
        before_pool = self.model.state[: self.num_slots].clone()
        self.buffers.refresh(fwd, refreshed, inputs)
        if poisoned:  # the refreshed rows overwritten: no bucket is whole any more
            target = refreshed
            start = data.draw(st.integers(0, refreshed - 1), label="poison_from")
            self.buffers.poison_(start, poison_fill(spec.seed + 2, self.num_slots))
        else:
            target = data.draw(st.sampled_from(others), label="replayed")
        event("refused replay: " + ("poisoned rows" if poisoned else "another bucket"))
        before = self._state()
        with pytest.raises(RuntimeError, match=rf"static buffers hold .*not \({target}, 1\)"):
            self.runner.graph(target).replay()
        self._assert_unchanged(before, f"the refused replay of bucket {target}")
        # The refreshed bucket's graph, after a refresh for it, replays the step exactly.
        self.buffers.refresh(fwd, refreshed, inputs)
        graph = self.runner.graph(refreshed)
        graph.replay()
        pool, y_ref = self.model.oracle(
            before_pool, inputs, list(spec.slots), list(spec.track), list(spec.mask)
        )
        self.result = {
            "before": before_pool,
            "expected": pool,
            "y_ref": y_ref,
            "y": graph.outputs["y"][: spec.bs].clone(),
            "after": self.model.state[: self.num_slots].clone(),
        }
        self.spec = spec
        self.last_bs = spec.bs


def test_refusals_write_nothing_and_valid_steps_still_replay() -> None:
    run_state_machine_as_test(
        RefusalMachine, settings=settings(settings.default, stateful_step_count=12)
    )


# ---------------------------------------------------------------- commit draft columns

MAX_BS, MAX_DRAFT, SLOTS = 3, 3, 10


@given(
    spec=verify_steps(num_slots=SLOTS, max_bs=MAX_BS, max_draft=MAX_DRAFT, trees=False),
    data=st.data(),
)
def test_commit_columns_outside_the_draft_are_refused_in_debug_mode(
    spec: VerifyStepSpec, data: st.DataObject
) -> None:
    buffers = StaticBuffers(
        max_bs=MAX_BS, num_slots=SLOTS, device="cpu", max_draft=MAX_DRAFT,
        metadata_class=SpecCommitMetadata, static={"is_target_verify": True},
    )  # fmt: skip
    bs, T = spec.bs, spec.T
    flagged = [r for r, m in enumerate(spec.step.mask) if m]
    field = data.draw(
        st.sampled_from(["accepted_index", "track_token"] if flagged else ["accepted_index"])
    )
    row = data.draw(st.sampled_from(flagged if field == "track_token" else list(range(bs))))
    bad = data.draw(st.sampled_from([T, T + 2, -2, -5]), label="bad column")
    cols = {"accepted_index": list(spec.accepted), "track_token": list(spec.track_token)}

    def command(cols: dict[str, list[int]]) -> SpecCommitMetadata:
        verify = prepare_target_verify(
            ForwardMetadata(
                query_start_loc=torch.arange(bs + 1) * T,
                mamba_cache_indices=torch.tensor(spec.step.slots),
                mamba_track_indices=torch.tensor(spec.step.track),
                mamba_track_mask=torch.tensor(spec.step.mask),
                has_mamba_track_mask=bool(flagged),
                is_target_verify=True,
                draft_token_num=T,
            )
        )
        return prepare_commit(
            verify,
            accepted_index=torch.tensor(cols["accepted_index"]),
            track_token=torch.tensor(cols["track_token"]),
        )

    good = command(cols)
    cols[field][row] = bad
    wrong = command(cols)  # built outside debug mode: the core's own checks stay quiet
    B = data.draw(st.integers(bs, MAX_BS), label="B")
    Tb = data.draw(st.integers(T, MAX_DRAFT), label="T bucket")
    buffers.poison_(0, poison_fill(spec.step.seed, SLOTS))
    before = buffers.snapshot()
    with (
        debug_mode(),
        pytest.raises(
            ValueError,
            match=rf"SpecCommitMetadata\.{field} row {row} holds {bad}: must be -1 \(none\) or a "
            rf"draft column in \[0, draft_token_num={T}\)",
        ),
    ):
        buffers.refresh(wrong, (B, Tb))
    after = buffers.snapshot()
    assert all(torch.equal(_bytes(after[k]), _bytes(v)) for k, v in before.items())
    with debug_mode():
        md = buffers.refresh(good, (B, Tb))
    assert isinstance(md, SpecCommitMetadata)
    assert md.accepted_index.tolist() == list(spec.accepted) + [-1] * (B - bs)


# ---------------------------------------------------------------- the slot rules, exactly

POOL, ROWS = 6, 4


def _rules_broken(
    v: SlotValues,
    table: list[int] | None,
    working_pad: int = WORKING_PAD,
    track_pad: int = TRACK_PAD,
) -> bool:
    """The slot rules of a live step, stated independently of the implementation."""
    if table is not None:
        if any(not 0 <= w < len(table) for w in v.working):
            return True
        phys = [table[w] for w in v.working]
    else:
        if any(not 0 <= w < POOL or w == working_pad for w in v.working):
            return True
        phys = list(v.working)
    ids = list(phys)
    if v.with_track and v.flag:  # the track fields are used only with the flag on
        if any(t != track_pad and not 0 <= t < POOL for t in v.track):
            return True
        tracked = [t for t, m in zip(v.track, v.mask, strict=True) if m]
        if track_pad in tracked:
            return True
        ids += tracked
    return len(set(ids)) != len(ids)


def _step_of(v: SlotValues, index_dtype: torch.dtype) -> ForwardMetadata:
    bs = len(v.working)
    return ForwardMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=index_dtype),
        mamba_cache_indices=torch.tensor(v.working, dtype=index_dtype),
        mamba_track_indices=torch.tensor(v.track, dtype=index_dtype) if v.with_track else None,
        mamba_track_mask=torch.tensor(v.mask) if v.with_track else None,
        has_mamba_track_mask=v.flag,
    )


# Cheap examples (no graph, a few host ops each): ten times the profile's count, so that
# every rule is met by many of them (tests/properties/strategies/graphs.py:slot_values).
@settings(max_examples=10 * settings().max_examples)
@given(
    use_table=st.booleans(),
    index_dtype=st.sampled_from([torch.int64, torch.int32]),
    list_rows=st.sampled_from([0, ROWS]),
    data=st.data(),
)
def test_the_refresh_refuses_exactly_the_steps_that_break_a_slot_rule(
    use_table: bool, index_dtype: torch.dtype, list_rows: int, data: st.DataObject
) -> None:
    # list_rows: the host check runs on Python lists up to that many rows, on numpy arrays
    # past them: 0 takes the arrays for every step, ROWS the lists.
    table = data.draw(st.permutations(range(POOL)), label="table")[:5] if use_table else None
    v: SlotValues = data.draw(
        slot_values(bound=POOL, max_bs=ROWS, table=tuple(table) if table else None), label="ids"
    )
    buffers = StaticBuffers(
        max_bs=ROWS, num_slots=POOL, device="cpu", index_dtype=index_dtype,
        slot_table=torch.tensor(table, dtype=index_dtype) if table is not None else None,
    )  # fmt: skip
    buffers._slot_check = buffers._make_slot_check(list_rows=list_rows)
    bs = len(v.working)
    step = _step_of(v, index_dtype)
    broken = _rules_broken(v, table)
    present = buffers._present(step)
    assert buffers._slot_check(step, present) is not broken  # the generated fast check
    before = buffers.snapshot()
    if broken:
        with pytest.raises(ValueError, match=r"StaticBuffers\.refresh: mamba_(cache|track)_ind"):
            buffers.refresh(step, ROWS)
        after = buffers.snapshot()
        assert all(torch.equal(after[k], t) for k, t in before.items())
    else:
        md = buffers.refresh(step, ROWS)
        want = [table[w] for w in v.working] if table is not None else list(v.working)
        assert md.mamba_cache_indices.tolist() == want + [WORKING_PAD] * (ROWS - bs)


@settings(max_examples=5 * settings().max_examples)
@given(use_table=st.booleans(), list_rows=st.sampled_from([0, ROWS]), data=st.data())
def test_the_slot_rules_follow_the_declared_pad(
    use_table: bool, list_rows: int, data: st.DataObject
) -> None:
    # The slot check takes each slot field's pad from its declaration (vLLM's null slot 0,
    # a reserved slot of the pool, as well as -1): declarations with pad 0, the generated
    # check and the one-by-one checks against the oracle with that pad.
    null = 0
    table = data.draw(st.permutations(range(1, POOL)), label="table") if use_table else None
    buffers = StaticBuffers(max_bs=ROWS, num_slots=POOL, device="cpu")
    buffers._buffered = tuple(
        attrs.evolve(s, pad=Pad.value(null)) if s.role.is_slot else s for s in buffers._buffered
    )
    if table is not None:  # the table check reads the declared pad too: it refuses slot 0
        with pytest.raises(ValueError, match=r"virtual slot 2 maps to 0 .*other than the pad"):
            buffers._check_slot_table(torch.tensor([3, 1, 0]))
        buffers._slot_table, buffers._table_host = buffers._check_slot_table(torch.tensor(table))
    buffers._slot_check = buffers._make_slot_check(list_rows=list_rows)
    v: SlotValues = data.draw(
        slot_values(bound=POOL, max_bs=ROWS, table=tuple(table) if table else None), label="ids"
    )
    step = _step_of(v, torch.int64)
    broken = _rules_broken(v, table, working_pad=null, track_pad=null)
    present = buffers._present(step)
    assert buffers._slot_check(step, present) is not broken
    if broken:
        with pytest.raises(ValueError, match=r"StaticBuffers\.refresh: mamba_(cache|track)_ind"):
            buffers._validate_slots(step, present)
