"""Unit tests of the chunked SSD scan's reference and the prefill conv (CPU)."""

from __future__ import annotations

import attrs
import pytest
import torch

from hybridmeta.kernels import causal_conv1d_prefill, ssd_chunked_scan
from tests.properties.strategies.prefill import (
    BF16,
    BatchSpec,
    close,
    make_layer,
    plan_of,
    run_oracle,
    run_pipeline,
    split_of,
)


def spec_of(**over: object) -> BatchSpec:
    base = BatchSpec(
        nheads=4,
        headdim=3,
        ngroups=2,
        dstate=4,
        conv_kernel=4,
        chunk_size=4,
        track_interval=8,
        extend_lens=(11, 1, 6, 3),
        prefix_lens=(0, 5, 9, 0),
        slots=(3, 0, 6, 2),
        track_mask=(True, False, True, True),
        track_slots=(1, 4, 5, 7),
        num_decodes=0,
        pool_size=10,
        seed=1234,
    )
    return attrs.evolve(base, **over)  # type: ignore[arg-type]


def test_long_rows_straddling_chunks_match_oracle() -> None:
    spec = spec_of()
    data = make_layer(spec)
    rows = run_oracle(spec, data)
    conv, scan = run_pipeline(spec, data, plan_of(spec), track=False)
    close(conv.out, torch.cat([r.u for r in rows]))
    close(scan.y, torch.cat([r.y for r in rows]))
    for r, slot in enumerate(spec.slots):
        close(data.ssm_pool[slot], rows[r].ssm_states[-1])


def test_bf16_activations_within_bf16_tolerance() -> None:
    spec = spec_of()
    data = make_layer(spec).to("cpu", torch.bfloat16)
    rows = run_oracle(spec, data)  # the oracle sees the same bf16-rounded inputs, in fp32
    conv, scan = run_pipeline(spec, data, plan_of(spec), track=False)
    assert scan.y.dtype == torch.bfloat16
    assert conv.out.dtype == torch.bfloat16
    close(scan.y.float(), torch.cat([r.y for r in rows]), BF16)
    for r, slot in enumerate(spec.slots):
        close(data.ssm_pool[slot], rows[r].ssm_states[-1], BF16)
        torch.testing.assert_close(
            data.conv_pool[slot].float(), rows[r].conv_states[-1].to(torch.bfloat16).float()
        )


def test_rows_without_initial_state_ignore_their_slot() -> None:
    # The slot of a fresh row may hold anything (a freed request's state, NaN): never read.
    spec = spec_of()
    data = make_layer(spec)
    rows = run_oracle(spec, data)
    for r, slot in enumerate(spec.slots):
        if spec.prefix_lens[r] == 0:
            data.ssm_pool[slot] = float("nan")
            data.conv_pool[slot] = float("nan")
    _, scan = run_pipeline(spec, data, plan_of(spec), track=False)
    close(scan.y, torch.cat([r.y for r in rows]))


def test_single_token_rows_and_one_chunk() -> None:
    spec = spec_of(
        extend_lens=(1, 1, 1),
        prefix_lens=(0, 3, 1),
        slots=(0, 1, 2),
        track_mask=(False,) * 3,
        track_slots=(3, 4, 5),
        chunk_size=8,
    )
    data = make_layer(spec)
    rows = run_oracle(spec, data)
    md = plan_of(spec)
    assert md.mixed is not None
    assert md.mixed.chunks.num_logical == 3
    assert md.mixed.chunks.phys_last_chunk.shape[0] == 1
    _, scan = run_pipeline(spec, data, md, track=False)
    close(scan.y, torch.cat([r.y for r in rows]))


def test_shape_errors_name_the_argument() -> None:
    spec = spec_of()
    data = make_layer(spec)
    md = plan_of(spec)
    conv = causal_conv1d_prefill(
        data.xbc, data.conv_weight, data.conv_bias, md=md, conv_state=data.conv_pool
    )
    x, B, C = split_of(spec, conv.out)
    with pytest.raises(ValueError, match="x has 20 tokens but the metadata has 21"):
        ssd_chunked_scan(
            x[:-1],
            data.dt[:-1],
            B[:-1],
            C[:-1],
            params=data.params,
            md=md,
            ssm_state=data.ssm_pool,
        )
    with pytest.raises(ValueError, match="dt must be"):
        ssd_chunked_scan(
            x, data.dt[:, :1], B, C, params=data.params, md=md, ssm_state=data.ssm_pool
        )
    with pytest.raises(ValueError, match="ssm_state must be"):
        ssd_chunked_scan(
            x, data.dt, B, C, params=data.params, md=md, ssm_state=data.ssm_pool[..., :1]
        )
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d_prefill(
            data.xbc,
            data.conv_weight,
            data.conv_bias,
            md=md,
            conv_state=data.conv_pool[..., :1],
        )
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d_prefill(
            data.xbc, data.conv_weight[:, :2], data.conv_bias, md=md, conv_state=data.conv_pool
        )
