"""Properties of the track-save kernel against its pure-torch reference."""

from __future__ import annotations

import torch
from hypothesis import given

from hybridmeta.kernels import track_save
from tests.kernels._support import DEVICE, bits, track_save_ref
from tests.properties.strategies import kernels as kst


@given(case=kst.track_cases())
def test_track_save_matches_reference_bitwise(case: kst.TrackCase) -> None:
    t = kst.track_tensors(case, DEVICE)
    ref_conv, ref_ssm = track_save_ref(
        t["conv_pool"], t["ssm_pool"], t["src_indices"], t["track_indices"], t["track_mask"]
    )
    bs = case.plan.bs
    live = [s for s in case.plan.src if s >= 0]
    rows = {
        k: kst.garbage_rows(
            t[k], case.tail, live_slots=live, slots=case.plan.slots, seed=case.seed + i
        )[:bs]
        for i, k in enumerate(("src_indices", "track_indices", "track_mask"))
    }
    conv, ssm = t["conv_pool"].clone(), t["ssm_pool"].clone()
    track_save(
        conv,
        ssm,
        src_indices=rows["src_indices"],
        track_indices=rows["track_indices"],
        track_mask=rows["track_mask"],
    )
    # A copy is exact; every other slot (and every unflagged or pad row's track slot) is
    # bit-identical to before.
    assert torch.equal(bits(conv), bits(ref_conv))
    assert torch.equal(bits(ssm), bits(ref_ssm))
