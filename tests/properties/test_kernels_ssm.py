"""Properties of the SSM state update kernel against its pure-torch reference."""

from __future__ import annotations

import attrs
import torch
from hypothesis import given

from hybridmeta.kernels import ssm_state_update
from tests.kernels._support import (
    DEVICE,
    assert_close,
    assert_slots_bitwise,
    bits,
    nan_empty,
    ssm_state_update_ref,
)
from tests.properties.strategies import kernels as kst


def _run(case: kst.SsmCase, t: kst.SsmTensors, state: torch.Tensor, *, tail: int) -> torch.Tensor:
    """Run the kernel with every per-row tensor a ``[:bs]`` view of a garbage-tailed buffer."""
    bs = case.plan.bs
    live = [s for s in case.plan.src if s >= 0]
    n = 0

    def rows(v: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        buf = kst.garbage_rows(v, tail, live_slots=live, slots=case.plan.slots, seed=case.seed + n)
        return buf[:bs]

    def opt(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else rows(v)

    out = nan_empty(bs + tail, case.nheads, case.headdim, dtype=case.act_dtype)
    res = ssm_state_update(
        state, rows(t.x), rows(t.dt), t.A, rows(t.B), rows(t.C),
        state_indices=rows(t.state_indices), D=t.D, z=opt(t.z), dt_bias=t.dt_bias,
        dt_softplus=case.dt_softplus, dst_indices=opt(t.dst_indices),
        track_indices=opt(t.track_indices), track_mask=opt(t.track_mask), out=out[:bs],
    )  # fmt: skip
    assert res.data_ptr() == out.data_ptr()
    # Rows past bs of the output buffer are never written.
    assert bool(torch.isnan(out[bs:]).all())
    return out[:bs]


@given(case=kst.ssm_cases())
def test_ssm_update_matches_reference(case: kst.SsmCase) -> None:
    t = kst.ssm_tensors(case, DEVICE)
    ref_state, ref_out = ssm_state_update_ref(
        t.state, t.x, t.dt, t.A, t.B, t.C, t.state_indices, D=t.D, z=t.z, dt_bias=t.dt_bias,
        dt_softplus=case.dt_softplus, dst_indices=t.dst_indices, track_indices=t.track_indices,
        track_mask=t.track_mask,
    )  # fmt: skip

    state = t.state.clone()
    out = _run(case, t, state, tail=0)
    pad = torch.tensor([s < 0 for s in case.plan.src], device=DEVICE)
    assert bool((out[pad] == 0).all()), "pad rows must get zero output"
    assert_close(out, ref_out, "out")
    written = sorted(case.plan.written())
    untouched = torch.tensor(
        [s for s in range(case.plan.slots) if s not in written], dtype=torch.long, device=DEVICE
    )
    assert_slots_bitwise(state, t.state, untouched, "state")
    if written:
        w = torch.tensor(written, dtype=torch.long, device=DEVICE)
        assert_close(state[w], ref_state[w], "written state slots")

    # Garbage past bs in every static buffer (other rows' live slots, out-of-range ids,
    # NaN, True flags) changes nothing: bit-identical to the clean run.
    state_g = t.state.clone()
    out_g = _run(case, t, state_g, tail=max(case.tail, 1))
    assert torch.equal(bits(out_g), bits(out))
    assert torch.equal(bits(state_g), bits(state))


@given(case=kst.ssm_cases(with_track=True, with_dst=False))
def test_fused_track_equals_update_then_copy(case: kst.SsmCase) -> None:
    """The fused track write stores exactly the state the update writes to the working slot."""
    t = kst.ssm_tensors(case, DEVICE)
    state = t.state.clone()
    out = _run(case, t, state, tail=0)
    # The same update without the track write, then each flagged row's copy done by hand.
    unfused = t.state.clone()
    out_u = _run(case, attrs.evolve(t, track_indices=None, track_mask=None), unfused, tail=0)
    p = case.plan
    assert p.track is not None
    assert p.track_mask is not None
    for b, s in enumerate(p.src):
        if s >= 0 and p.track_mask[b] and p.track[b] >= 0:
            assert torch.equal(bits(state[p.track[b]]), bits(state[s]))
            unfused[p.track[b]] = unfused[s]
    # Bitwise: the fused variant computes the new state with the same code, then stores it
    # once more; every other slot, unflagged rows' track slots included, is left alone.
    assert torch.equal(bits(state), bits(unfused))
    assert torch.equal(bits(out), bits(out_u))
