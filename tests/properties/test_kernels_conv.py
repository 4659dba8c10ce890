"""Properties of the causal-conv1d update kernel against its pure-torch reference."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridmeta.kernels import causal_conv1d_update
from hybridmeta.kernels._config import ConvLaunchConfig
from hybridmeta.kernels.conv_update import launch_conv_update
from tests.kernels._support import (
    DEVICE,
    assert_close,
    assert_slots_bitwise,
    bits,
    causal_conv1d_update_ref,
    nan_empty,
)
from tests.properties.strategies import kernels as kst


def _run(case: kst.ConvCase, t: kst.ConvTensors, state: torch.Tensor, tail: int) -> torch.Tensor:
    bs = case.plan.bs
    live = [s for s in case.plan.src if s >= 0]
    xb = kst.garbage_rows(t.x, tail, live_slots=live, slots=case.plan.slots, seed=case.seed)
    ib = kst.garbage_rows(
        t.cache_indices, tail, live_slots=live, slots=case.plan.slots, seed=case.seed + 1
    )
    out = nan_empty(bs + tail, case.conv_dim, dtype=case.act_dtype)
    causal_conv1d_update(
        xb[:bs], state, t.weight, t.bias, cache_indices=ib[:bs],
        activation="silu" if case.silu else None, out=out[:bs],
    )  # fmt: skip
    assert bool(torch.isnan(out[bs:]).all())
    return out[:bs]


@given(case=kst.conv_cases())
def test_conv_update_matches_reference(case: kst.ConvCase) -> None:
    t = kst.conv_tensors(case, DEVICE)
    ref_state, ref_out = causal_conv1d_update_ref(
        t.x, t.conv_state, t.weight, t.bias, t.cache_indices, silu=case.silu
    )
    state = t.conv_state.clone()
    out = _run(case, t, state, 0)
    pad = torch.tensor([s < 0 for s in case.plan.src], device=DEVICE)
    assert bool((out[pad] == 0).all()), "pad rows must get zero output"
    assert_close(out, ref_out, "out")
    written = sorted(case.plan.written())
    untouched = torch.tensor(
        [s for s in range(case.plan.slots) if s not in written], dtype=torch.long, device=DEVICE
    )
    assert_slots_bitwise(state, t.conv_state, untouched, "conv_state")
    if written:
        w = torch.tensor(written, dtype=torch.long, device=DEVICE)
        # Columns shifted from the old state are a pure move: bit-exact. The new column is
        # x cast to the state dtype (the CPU interpreter truncates fp32 -> bf16, the GPU
        # rounds to nearest): compare it with the tolerance.
        assert torch.equal(bits(state[w][..., :-1]), bits(ref_state[w][..., :-1]))
        assert_close(state[w], ref_state[w], "written conv-state slots")

    state_g = t.conv_state.clone()
    out_g = _run(case, t, state_g, max(case.tail, 1))
    assert torch.equal(bits(out_g), bits(out))
    assert torch.equal(bits(state_g), bits(state))


@given(
    case=kst.conv_cases(),
    rows=st.sampled_from([1, 2, 4, 8]),
    block_c=st.sampled_from([16, 64, 128]),
    warps=st.sampled_from([1, 2, 4]),
)
def test_conv_launch_shapes_agree(case: kst.ConvCase, rows: int, block_c: int, warps: int) -> None:
    """Every tile shape (rows and channels per program) computes the same update.

    The new state is a pure move: bit-identical. The output is a k-term dot product whose
    summation order (and FMA contraction) follows the tile layout on the GPU: equal within
    the tolerance table, not bitwise.
    """
    t = kst.conv_tensors(case, DEVICE)
    state_a, state_b = t.conv_state.clone(), t.conv_state.clone()
    out_a = causal_conv1d_update(
        t.x, state_a, t.weight, t.bias, cache_indices=t.cache_indices,
        activation="silu" if case.silu else None,
    )  # fmt: skip
    out_b = nan_empty(case.plan.bs, case.conv_dim, dtype=case.act_dtype)
    launch_conv_update(
        t.x, state_b, t.weight, t.bias, out_b, t.cache_indices, silu=case.silu,
        config=ConvLaunchConfig(block_c=block_c, num_warps=warps, rows=rows),
    )  # fmt: skip
    assert torch.equal(bits(state_a), bits(state_b))
    assert_close(out_b, out_a, "out")
