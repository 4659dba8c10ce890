"""hybridmeta.compat.vllm_v033: vLLM 0.33's signatures over the 0.32 implementation."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.compat import vllm as V32
from hybridmeta.compat import vllm_v033 as V
from tests.compat._oracle import G, H, N, P, layer
from tests.compat._support import assert_signature, same_bits


@pytest.mark.parametrize(
    "fn",
    ["selective_state_update", "causal_conv1d_update", "causal_conv1d_fn",
     "mamba_chunk_scan_combined_varlen"],
)  # fmt: skip
def test_signature_is_vllm_033s(fn: str) -> None:
    assert_signature(getattr(V, fn), f"vllm_v033.{fn}")


def test_final_states_out_receives_the_final_states() -> None:
    g = torch.Generator().manual_seed(60)
    lay = layer(61)
    x, dt = torch.randn(7, H, P, generator=g), torch.randn(7, H, generator=g)
    B, C = torch.randn(7, G, N, generator=g), torch.randn(7, G, N, generator=g)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    rest = (torch.tensor([0, 3, 7]), torch.tensor([0, 1]), torch.tensor([0, 1]))
    out32, out33 = torch.empty(7, H, P), torch.empty(7, H, P)
    states = V32.mamba_chunk_scan_combined_varlen(x, dt, lay.A, B, C, 4, cu, *rest, out32, D=lay.D,
                                                  dt_bias=lay.dt_bias, dt_softplus=True)  # fmt: skip
    pool = torch.zeros(5, H, P, N)
    before = pool.clone()
    res = V.mamba_chunk_scan_combined_varlen(
        x, dt, lay.A, B, C, 4, cu, *rest, out33, D=lay.D, dt_bias=lay.dt_bias,
        dt_softplus=True, final_states_out=pool, final_state_indices=torch.tensor([4, 1]),
    )  # fmt: skip
    assert res is None
    assert torch.equal(pool[4], states[0]) and torch.equal(pool[1], states[1])
    assert torch.equal(out32, out33)
    for s in (0, 2, 3):
        same_bits(pool[s], before[s], f"slot {s}")
