"""GPU runs of the prefill path (skipped where CUDA is absent): scan, conv and track-save
against the CPU oracle, and no host sync on the per-layer path."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given

from hybridmeta.kernels import Impl
from tests.kernels.test_ssd_scan import spec_of
from tests.oracle import oracle_track_plan
from tests.properties.strategies.prefill import (
    BF16,
    FP32,
    BatchSpec,
    batch_specs,
    close,
    make_layer,
    plan_of,
    run_oracle,
    run_pipeline,
    run_ssm_oracle,
)

pytestmark = pytest.mark.gpu


IMPLS: tuple[Impl, ...] = ("reference", "triton")


def _check_against_oracle(spec: BatchSpec, dtype: torch.dtype, impl: Impl = "reference") -> None:
    cpu = make_layer(spec)
    data = cpu.to("cuda", dtype)
    rows = run_oracle(spec, data)  # on the CPU, from the device data's (rounded) values
    ssm0 = data.ssm_pool.clone()
    conv0 = data.conv_pool.clone()
    md = plan_of(spec, "cuda")
    conv, scan = run_pipeline(spec, data, md, impl=impl)
    tol = FP32 if dtype == torch.float32 else BF16
    close(conv.out, torch.cat([r.u for r in rows]), tol)
    # the scan against the SSM oracle fed with the conv output it actually received
    ssm_rows = run_ssm_oracle(spec, attrs.evolve(data, ssm_pool=ssm0), conv.out)
    close(scan.y, torch.cat([y for y, _ in ssm_rows]), tol)
    tracked = oracle_track_plan(
        spec.extend_lens,
        spec.prefix_lens,
        spec.track_mask,
        spec.track_slots,
        num_decodes=spec.num_decodes,
        chunk_size=spec.chunk_size,
        track_interval=spec.track_interval,
    )
    for r in range(spec.num_prefills):
        close(data.ssm_pool[spec.slots[r]], ssm_rows[r][1][-1], tol)
        assert torch.equal(data.conv_pool[spec.slots[r]].cpu(), rows[r].conv_states[-1].to(dtype))
    for t in tracked:
        if t.row < spec.num_prefills:
            close(data.ssm_pool[t.dst], ssm_rows[t.row][1][t.k], tol)
            assert torch.equal(data.conv_pool[t.dst].cpu(), rows[t.row].conv_states[t.k].to(dtype))
        else:
            assert torch.equal(data.conv_pool[t.dst], conv0[spec.slots[t.row]])
            assert torch.equal(data.ssm_pool[t.dst], ssm0[spec.slots[t.row]])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_batch_on_gpu(dtype: torch.dtype, impl: Impl) -> None:
    _check_against_oracle(attrs.evolve(spec_of(), track_interval=4), dtype, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_larger_heads_on_gpu(dtype: torch.dtype, impl: Impl) -> None:
    # 64-token chunks, rows straddling several chunks, every track kind.
    spec = spec_of(
        nheads=16,
        headdim=16,
        ngroups=2,
        dstate=32,
        chunk_size=64,
        track_interval=128,
        extend_lens=(150, 1, 90, 37, 1),
        prefix_lens=(0, 200, 66, 91, 255),
        slots=(3, 0, 6, 2, 9),
        track_mask=(True, True, True, True, True),
        track_slots=(1, 4, 5, 7, 8),
        num_decodes=1,
        pool_size=10,
    )
    _check_against_oracle(spec, dtype, impl)


@given(spec=batch_specs(max_decodes=2))
def test_property_on_gpu(spec: BatchSpec) -> None:
    _check_against_oracle(spec, torch.float32)


@given(spec=batch_specs(max_decodes=2))
def test_property_on_gpu_triton(spec: BatchSpec) -> None:
    _check_against_oracle(spec, torch.float32, "triton")


@pytest.mark.parametrize("impl", IMPLS)
def test_layer_path_has_no_host_sync(impl: Impl) -> None:
    spec = attrs.evolve(spec_of(), track_interval=4)
    data = make_layer(spec).to("cuda")
    md = plan_of(spec, "cuda")
    assert md.mixed is not None and md.mixed.track.num_h + md.mixed.track.num_recompute
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_pipeline(spec, data, md, impl=impl)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
