"""The Triton scan against the oracle and the scan's reference (interpreter on the CPU)."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings

from hybridmeta.kernels import causal_conv1d_prefill, ssd_chunked_scan
from tests.kernels.test_ssd_scan import spec_of
from tests.properties.strategies.prefill import (
    BF16,
    BatchSpec,
    batch_specs,
    close,
    make_layer,
    plan_of,
    run_oracle,
    run_pipeline,
    split_of,
)

# These run the Triton scan on CPU tensors (interpreted); tests/kernels/test_prefill_gpu.py runs it
# compiled on a GPU.
pytestmark = pytest.mark.interpreter


def test_matches_torch_scan_and_oracle() -> None:
    spec = attrs.evolve(spec_of(), track_interval=4)  # every track kind in one batch
    data = make_layer(spec)
    rows = run_oracle(spec, data)
    md = plan_of(spec)
    conv = causal_conv1d_prefill(
        data.xbc, data.conv_weight, data.conv_bias, md=md, conv_state=data.conv_pool
    )
    x, B, C = split_of(spec, conv.out)
    pool_t = data.ssm_pool.clone()
    ref = ssd_chunked_scan(
        x, data.dt, B, C, params=data.params, md=md, ssm_state=pool_t, return_chunk_states=True,
        impl="reference",
    )  # fmt: skip
    out = ssd_chunked_scan(
        x,
        data.dt,
        B,
        C,
        params=data.params,
        md=md,
        ssm_state=data.ssm_pool,
        return_chunk_states=True,
        impl="triton",
    )
    close(out.y, torch.cat([r.y for r in rows]))
    close(out.y, ref.y)
    close(data.ssm_pool, pool_t)
    assert out.chunk_states is not None
    assert ref.chunk_states is not None
    close(out.chunk_states, ref.chunk_states)
    assert md.mixed is not None and md.mixed.track.num_recompute
    close(out.recomputed, ref.recomputed)
    close(out.tracked_h, ref.tracked_h)


def test_fresh_rows_never_read_their_slot() -> None:
    spec = spec_of()
    data = make_layer(spec)
    rows = run_oracle(spec, data)
    for r, slot in enumerate(spec.slots):
        if spec.prefix_lens[r] == 0:
            data.ssm_pool[slot] = float("nan")
    _, scan = run_pipeline(spec, data, plan_of(spec), track=False, impl="triton")
    close(scan.y, torch.cat([r.y for r in rows]))


@settings(max_examples=max(3, settings().max_examples // 4))
@given(spec=batch_specs(max_decodes=1))
def test_property_tracked_states(spec: BatchSpec) -> None:
    data = make_layer(spec)
    ref = attrs.evolve(data, conv_pool=data.conv_pool.clone(), ssm_pool=data.ssm_pool.clone())
    _, s_ref = run_pipeline(spec, ref, plan_of(spec))
    _, s_tri = run_pipeline(spec, data, plan_of(spec), impl="triton")
    close(s_tri.y, s_ref.y)
    close(data.ssm_pool, ref.ssm_pool)
    assert torch.equal(data.conv_pool, ref.conv_pool)


def test_bf16_activations_within_bf16_tolerance() -> None:
    # bf16 loads and stores; on the GPU C.B also takes bf16 tensor-core operands (exact for
    # bf16 activations) and the other products tf32x3; here every product is exact fp32.
    spec = attrs.evolve(spec_of(), track_interval=4)
    data = make_layer(spec).to("cpu", torch.bfloat16)
    rows = run_oracle(spec, data)
    _, scan = run_pipeline(spec, data, plan_of(spec), impl="triton")
    assert scan.y.dtype == torch.bfloat16
    close(scan.y, torch.cat([r.y for r in rows]), BF16)
    for r, slot in enumerate(spec.slots):
        close(data.ssm_pool[slot], rows[r].ssm_states[-1], BF16)


def test_shape_errors() -> None:
    spec = spec_of()
    data = make_layer(spec)
    md = plan_of(spec)
    x = torch.zeros(3, spec.nheads, spec.headdim)
    with pytest.raises(ValueError, match="x has 3 tokens but the metadata has 21"):
        ssd_chunked_scan(
            x, data.dt[:3], x, x, params=data.params, md=md, ssm_state=data.ssm_pool,
            impl="triton",
        )  # fmt: skip
