"""Unit tests of the extend track-save: one row of each kind, against the oracle."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.prefill import extend_track_save
from hybridmeta.prefill.oracle import oracle_track_plan
from tests.prefill.test_scan import spec_of
from tests.properties.strategies.prefill import close, make_layer, plan_of, run_oracle, run_pipeline


def test_each_kind_lands_in_its_track_slot() -> None:
    # chunk 4, interval 4, as in test_planner: row 0 recompute, row 1 h[1], row 2 final.
    spec = spec_of(
        extend_lens=(5, 4, 3),
        prefix_lens=(2, 1, 5),
        slots=(0, 1, 2),
        track_mask=(True, True, True),
        track_slots=(6, 7, 8),
        chunk_size=4,
        track_interval=4,
    )
    data = make_layer(spec)
    conv0, ssm0 = data.conv_pool.clone(), data.ssm_pool.clone()
    rows = run_oracle(spec, data)
    plan = plan_of(spec)
    assert (plan.track.recompute_rows, plan.track.h_rows, plan.track.final_rows) == (
        (0,),
        (1,),
        (2,),
    )
    run_pipeline(spec, data, plan)
    for row, k, dst in ((0, 2, 6), (1, 3, 7), (2, 3, 8)):
        close(data.ssm_pool[dst], rows[row].ssm_states[k])
        assert torch.equal(data.conv_pool[dst], rows[row].conv_states[k])
    for s in (3, 4, 5, 9):  # neither working nor track slots
        assert torch.equal(data.ssm_pool[s], ssm0[s])
        assert torch.equal(data.conv_pool[s], conv0[s])


def test_no_boundary_writes_nothing() -> None:
    spec = spec_of(
        extend_lens=(3, 2),
        prefix_lens=(1, 0),
        slots=(0, 1),
        track_mask=(True, True),
        track_slots=(2, 3),
        chunk_size=4,
        track_interval=8,
    )
    data = make_layer(spec)
    ssm0 = data.ssm_pool.clone()
    plan = plan_of(spec)
    assert plan.track.empty
    assert not oracle_track_plan(
        spec.extend_lens,
        spec.prefix_lens,
        spec.track_mask,
        spec.track_slots,
        num_decodes=0,
        chunk_size=4,
        track_interval=8,
    )
    run_pipeline(spec, data, plan)
    assert torch.equal(data.ssm_pool[2:], ssm0[2:])


def test_decode_only_batch_needs_no_prefill_outputs() -> None:
    # decode rows 0 (prefix 7: 7+1 = 8 is a boundary) and 1 (prefix 8: none)
    spec = spec_of(
        extend_lens=(1, 1),
        prefix_lens=(7, 8),
        slots=(0, 1),
        track_mask=(True, True),
        track_slots=(2, 3),
        num_decodes=2,
        chunk_size=4,
        track_interval=4,
        pool_size=4,
    )
    data = make_layer(spec)
    ssm0, conv0 = data.ssm_pool.clone(), data.conv_pool.clone()
    plan = plan_of(spec)
    assert plan.track.final_rows == (0,)
    extend_track_save(
        plan, xbc=None, conv=None, scan=None, conv_state=data.conv_pool, ssm_state=data.ssm_pool
    )
    assert torch.equal(data.ssm_pool[2], ssm0[0])
    assert torch.equal(data.conv_pool[2], conv0[0])
    assert torch.equal(data.ssm_pool[[0, 1, 3]], ssm0[[0, 1, 3]])


def test_mid_row_entries_need_the_prefill_outputs() -> None:
    spec = spec_of(
        extend_lens=(5,),
        prefix_lens=(2,),
        slots=(0,),
        track_mask=(True,),
        track_slots=(1,),
        chunk_size=4,
        track_interval=4,
        pool_size=2,
    )
    data = make_layer(spec)
    plan = plan_of(spec)
    with pytest.raises(ValueError, match=r"mid-row boundaries \(rows \(0,\)\)"):
        extend_track_save(
            plan, xbc=None, conv=None, scan=None, conv_state=data.conv_pool, ssm_state=data.ssm_pool
        )
