"""Properties of the decode attention kernels (KV write, attention with or without split
keys) against their references: only live tokens' cells are written, pad rows get zeros,
and stale cache cells past each position (NaN here) are never read."""

from __future__ import annotations

import torch
from hypothesis import given

from hybridmeta.kernels import decode_attention_reference, kv_cache_write
from hybridmeta.kernels.attention_decode import launch_decode_attention
from tests.kernels._support import DEVICE, assert_close, bits, nan_empty
from tests.properties.strategies import kernels as kst


def _tensors(case: kst.AttentionCase) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    B, T, kvh, hd = case.bs, case.T, case.kv_heads, case.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(DEVICE, case.dtype)

    # stale garbage everywhere; each live row's prefix before its first token is finite
    kc = torch.full((case.slots + 1, case.max_len, kvh, hd), float("nan"), device=DEVICE,
                    dtype=case.dtype)  # fmt: skip
    vc = kc.clone()
    for s, f in zip(case.src, case.first, strict=True):
        if s >= 0 and f > 0:
            kc[s, :f] = rnd(f, kvh, hd)
            vc[s, :f] = rnd(f, kvh, hd)
    first = torch.tensor(case.first, device=DEVICE)
    return {
        "q": rnd(B, T, kvh * case.group, hd),
        "k": rnd(B, T, kvh, hd),
        "v": rnd(B, T, kvh, hd),
        "kc": kc,
        "vc": vc,
        "slots": torch.tensor(case.src, device=DEVICE),
        "pos": first[:, None] + torch.arange(T, device=DEVICE)[None, :],
    }


@given(case=kst.attention_cases())
def test_write_then_attend_matches_the_reference(case: kst.AttentionCase) -> None:
    t = _tensors(case)
    kc0, vc0 = t["kc"].clone(), t["vc"].clone()
    kv_cache_write(t["k"], t["v"], t["kc"], t["vc"], t["slots"], t["pos"])
    # exactly the live tokens' cells changed, to k / v (pad rows: nothing, scratch row too)
    cells = torch.zeros(case.slots + 1, case.max_len, dtype=torch.bool, device=DEVICE)
    for b, s in enumerate(case.src):
        if s >= 0:
            cells[s, t["pos"][b]] = True
            assert torch.equal(bits(t["kc"][s, t["pos"][b]]), bits(t["k"][b]))
            assert torch.equal(bits(t["vc"][s, t["pos"][b]]), bits(t["v"][b]))
    assert torch.equal(bits(t["kc"][~cells]), bits(kc0[~cells]))
    assert torch.equal(bits(t["vc"][~cells]), bits(vc0[~cells]))

    scale = case.head_dim**-0.5
    out = nan_empty(case.bs, case.T, case.kv_heads * case.group * case.head_dim, dtype=case.dtype)
    launch_decode_attention(t["q"], t["kc"], t["vc"], t["slots"], t["pos"], scale, out,
                            block_n=16, splits=case.splits)  # fmt: skip
    want = decode_attention_reference(t["q"], t["kc"], t["vc"], t["slots"], t["pos"], scale)
    pad = torch.tensor([s < 0 for s in case.src], device=DEVICE)
    assert bool((out[pad] == 0).all()), "pad rows get zeros"
    assert bool(torch.isfinite(out[~pad]).all()), "a stale (NaN) cell was read"
    assert_close(out, want, "attention")
