"""Property: splitting a prompt anywhere and resuming from the saved state gives the same
outputs, final states and tracked states as one whole prefill."""

from __future__ import annotations

import attrs
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.properties.strategies.prefill import (
    BatchSpec,
    LayerData,
    batch_specs,
    close,
    make_layer,
    plan_of,
    run_pipeline,
)


def _clone(data: LayerData) -> LayerData:
    return attrs.evolve(data, conv_pool=data.conv_pool.clone(), ssm_pool=data.ssm_pool.clone())


@given(spec=batch_specs(max_decodes=0), choice=st.data())
def test_split_equals_whole(spec: BatchSpec, choice: st.DataObject) -> None:
    n_pre = spec.num_prefills
    long_rows = [r for r in range(n_pre) if spec.extend_lens[r] >= 2]
    assume(long_rows)
    r = choice.draw(st.sampled_from(long_rows), label="row")
    s = choice.draw(st.integers(1, spec.extend_lens[r] - 1), label="split")
    data = make_layer(spec)
    qsl = [0]
    for n in spec.extend_lens:
        qsl.append(qsl[-1] + n)
    a, e = qsl[r], qsl[r + 1]

    whole = _clone(data)
    _, scan_w = run_pipeline(spec, whole, plan_of(spec))

    # step 1: the same batch with row r cut after s tokens
    ext1 = list(spec.extend_lens)
    ext1[r] = s
    spec1 = attrs.evolve(spec, extend_lens=tuple(ext1))
    keep = torch.cat([torch.arange(0, a + s), torch.arange(e, qsl[n_pre])])
    part = _clone(data)
    step1 = attrs.evolve(part, xbc=data.xbc[keep], dt=data.dt[keep])
    _, scan_1 = run_pipeline(spec1, step1, plan_of(spec1))
    # step 2: row r alone, resuming from its working slot
    spec2 = attrs.evolve(
        spec,
        extend_lens=(e - a - s,),
        prefix_lens=(spec.prefix_lens[r] + s,),
        slots=(spec.slots[r],),
        track_mask=(spec.track_mask[r],),
        track_slots=(spec.track_slots[r],),
    )
    step2 = attrs.evolve(step1, xbc=data.xbc[a + s : e], dt=data.dt[a + s : e])
    _, scan_2 = run_pipeline(spec2, step2, plan_of(spec2))

    y_split = torch.cat([scan_1.y[a : a + s], scan_2.y])
    close(y_split, scan_w.y[a:e])
    slot, tslot = spec.slots[r], spec.track_slots[r]
    close(step2.ssm_pool[slot], whole.ssm_pool[slot])
    assert torch.equal(step2.conv_pool[slot], whole.conv_pool[slot])
    if spec.track_mask[r]:
        # the track slot holds the row's last boundary in both schedules
        close(step2.ssm_pool[tslot], whole.ssm_pool[tslot])
        assert torch.equal(step2.conv_pool[tslot], whole.conv_pool[tslot])
