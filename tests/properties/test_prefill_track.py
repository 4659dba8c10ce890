"""Property: every tracked state equals the oracle's state at that boundary."""

from __future__ import annotations

import torch
from hypothesis import event, given

from tests.oracle import oracle_track_plan
from tests.properties.strategies.prefill import (
    BatchSpec,
    batch_specs,
    close,
    make_layer,
    plan_of,
    run_oracle,
    run_pipeline,
)


@given(spec=batch_specs(max_decodes=3))
def test_tracked_states_match_oracle(spec: BatchSpec) -> None:
    data = make_layer(spec)
    n_pre = spec.num_prefills
    # Decode rows: stand in for the decode update, which writes each decode row's new
    # state into its working slot before the track-save copies it.
    g = torch.Generator().manual_seed(spec.seed + 1)
    for r in range(n_pre, len(spec.extend_lens)):
        data.ssm_pool[spec.slots[r]] = torch.randn(data.ssm_pool.shape[1:], generator=g)
        data.conv_pool[spec.slots[r]] = torch.randn(data.conv_pool.shape[1:], generator=g)
    conv0, ssm0 = data.conv_pool.clone(), data.ssm_pool.clone()
    rows = run_oracle(spec, data)
    plan = plan_of(spec)
    run_pipeline(spec, data, plan)

    expected = oracle_track_plan(
        spec.extend_lens,
        spec.prefix_lens,
        spec.track_mask,
        spec.track_slots,
        num_decodes=spec.num_decodes,
        chunk_size=spec.chunk_size,
        track_interval=spec.track_interval,
    )
    for t in expected:
        event(f"track kind: {t.kind}{'' if t.row < n_pre else ' (decode row)'}")
        if t.row < n_pre:
            close(data.ssm_pool[t.dst], rows[t.row].ssm_states[t.k])
            assert torch.equal(data.conv_pool[t.dst], rows[t.row].conv_states[t.k])
        else:
            slot = spec.slots[t.row]
            assert torch.equal(data.ssm_pool[t.dst], ssm0[slot])
            assert torch.equal(data.conv_pool[t.dst], conv0[slot])
    written = set(spec.slots[:n_pre]) | {t.dst for t in expected}
    others = [s for s in range(spec.pool_size) if s not in written]
    assert torch.equal(data.ssm_pool[others], ssm0[others])
    assert torch.equal(data.conv_pool[others], conv0[others])
