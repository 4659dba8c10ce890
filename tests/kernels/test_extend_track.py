"""Unit tests of the track saves of a prefill forward: one row of each kind (mid-row
on-grid, mid-row off-grid, final), against the oracle."""

from __future__ import annotations

import attrs
import pytest
import torch

from hybridmeta.kernels import extend_track_save, track_save_from_metadata
from hybridmeta.planner import plan_host
from tests.kernels.test_ssd_scan import spec_of
from tests.oracle import oracle_track_plan
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
    md = plan_of(spec)
    assert md.mixed is not None
    tr = md.mixed.track
    assert (tr.recompute_rows.tolist(), tr.h_rows.tolist()) == ([0], [1])
    assert md.mamba_track_mask is not None and md.mamba_track_mask.tolist() == [False, False, True]
    run_pipeline(spec, data, md)
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
    md = plan_of(spec)
    assert md.mixed is not None
    assert md.mixed.track.num_h == md.mixed.track.num_recompute == 0
    assert not md.has_mamba_track_mask
    assert not oracle_track_plan(
        spec.extend_lens,
        spec.prefix_lens,
        spec.track_mask,
        spec.track_slots,
        num_decodes=0,
        chunk_size=4,
        track_interval=8,
    )
    run_pipeline(spec, data, md)
    assert torch.equal(data.ssm_pool[2:], ssm0[2:])


def test_decode_only_batch_saves_through_the_forwards_track_save() -> None:
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
    md = plan_of(spec)
    assert md.mixed is None and md.mamba_track_mask is not None
    assert md.mamba_track_mask.tolist() == [True, False]
    track_save_from_metadata(md, data.conv_pool[None], data.ssm_pool[None])
    assert torch.equal(data.ssm_pool[2], ssm0[0])
    assert torch.equal(data.conv_pool[2], conv0[0])
    assert torch.equal(data.ssm_pool[[0, 1, 3]], ssm0[[0, 1, 3]])


def test_extend_track_save_refuses_another_forwards_scan() -> None:
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
    md = plan_of(spec)
    other = attrs.evolve(spec, track_mask=(False,))
    conv, scan = run_pipeline(other, make_layer(other), plan_of(other), track=False)
    with pytest.raises(ValueError, match=r"scan holds 0 / 0 boundary states but the plan has 0 / 1"):
        extend_track_save(
            md, xbc=data.xbc, conv=conv, scan=scan, conv_state=data.conv_pool,
            ssm_state=data.ssm_pool,
        )  # fmt: skip
    assert plan_host(
        extend_lens=[5], prefix_lens=[2], slots=[0], num_decodes=0, chunk_size=4, conv_kernel=4,
        track_interval=4, track_mask=[True], track_slots=[1],
    ).recompute_rows == (0,)  # fmt: skip
