"""Long-context prefill on the GPU (skipped where CUDA is absent): past 2^31 elements.

Peers report int32 overflow in long-context prefill (state-spaces/mamba#1015: wrong output
past about 61K tokens at batch 1). The chunked scan's token offsets times its row strides
are int64 in every kernel; these tests run the scan where that matters and compare it with
the same scan computed in pieces that stay far below 2^31 elements each (each piece resumes
from the state the previous one wrote: the prefix-continuation path the runtime uses), so
an overflow in the one-shot run shows as a difference.

* one prefill of 2^20 tokens at batch 1 (narrow heads, so the pieces fit in memory);
* a batch whose flattened token count times the widest row stride of ``x`` passes 2^31
  elements (Nemotron-Nano-9B-v2's 128 heads of 80 share one token row: a stride of
  10,240 elements, so 2^18 tokens reach 2.7e9).

Tolerances: both runs are the same fp32 arithmetic on the same chunk grid except at the
piece boundaries, where one run carries the state through the pool instead of the scan's
chunk-state pass; the two orders of fp32 sums differ by rounding only (relative 1e-5 of
the values' scale, bounded here by 1e-4 relative RMS over the whole output).
"""

from __future__ import annotations

import pytest
import torch

from hybridmeta import plan_mixed_batch
from hybridmeta.kernels import SSMParams, ssd_chunked_scan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_CHUNK = 128
_REL_RMS = 1e-4  # see the module docstring


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.float() - b.float()).pow(2).mean().sqrt()
    return float(d / b.float().pow(2).mean().sqrt().clamp_min(1e-30))


_Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, SSMParams]


def _layer(tokens: int, heads: int, headdim: int, groups: int, dstate: int, seed: int) -> _Layer:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    x = torch.randn(tokens, heads, headdim, device=dev, generator=g).mul_(0.5)
    dt = torch.randn(tokens, heads, device=dev, generator=g).mul_(0.5).sub_(2.0)
    B = torch.randn(tokens, groups, dstate, device=dev, generator=g).mul_(0.3)
    C = torch.randn(tokens, groups, dstate, device=dev, generator=g).mul_(0.3)
    A = -torch.rand(heads, device=dev, generator=g).add_(0.5)
    params = SSMParams(
        A=A, D=torch.randn(heads, device=dev, generator=g), dt_bias=torch.zeros(heads, device=dev)
    )
    return x, dt, B, C, params


def _one_shot(
    lens: list[int], layer: _Layer, headdim: int, dstate: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x, dt, B, C, params = layer
    n, heads = len(lens), x.shape[1]
    pool = torch.zeros(n + 1, heads, headdim, dstate, device="cuda")
    md = plan_mixed_batch(
        extend_lens=lens, prefix_lens=[0] * n, slots=list(range(n)), num_decodes=0,
        chunk_size=_CHUNK, conv_kernel=4, device="cuda",
    )  # fmt: skip
    out = ssd_chunked_scan(x, dt, B, C, params=params, md=md, ssm_state=pool, impl="triton")
    return out.y, pool[:n].clone()


def _in_pieces(
    lens: list[int], piece: int, layer: _Layer, headdim: int, dstate: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's tokens in pieces of ``piece`` tokens, one row and one piece a forward,
    resuming from the state the previous piece wrote into the row's slot."""
    x, dt, B, C, params = layer
    n, heads = len(lens), x.shape[1]
    pool = torch.zeros(n + 1, heads, headdim, dstate, device="cuda")
    ys = []
    start = 0
    for r, length in enumerate(lens):
        done = 0
        while done < length:
            k = min(piece, length - done)
            sl = slice(start + done, start + done + k)
            md = plan_mixed_batch(
                extend_lens=[k], prefix_lens=[done], slots=[r], num_decodes=0,
                chunk_size=_CHUNK, conv_kernel=4, device="cuda",
            )  # fmt: skip
            out = ssd_chunked_scan(
                x[sl].contiguous(), dt[sl].contiguous(), B[sl].contiguous(), C[sl].contiguous(),
                params=params, md=md, ssm_state=pool, impl="triton",
            )  # fmt: skip
            ys.append(out.y)
            done += k
        start += length
    return torch.cat(ys), pool[:n].clone()


@pytest.mark.slow
def test_a_prefill_of_a_million_tokens_at_batch_1_equals_the_scan_in_pieces() -> None:
    heads, headdim, groups, dstate = 4, 64, 1, 64
    tokens = 1 << 20
    layer = _layer(tokens, heads, headdim, groups, dstate, seed=1)
    assert tokens * layer[0].stride(0) >= 1 << 28  # the per-token offsets of x alone
    y1, s1 = _one_shot([tokens], layer, headdim, dstate)
    y2, s2 = _in_pieces([tokens], 1 << 16, layer, headdim, dstate)
    assert torch.isfinite(y1).all() and torch.isfinite(s1).all()
    assert _rel_rms(y1, y2) < _REL_RMS
    assert _rel_rms(s1, s2) < _REL_RMS
    # the last 4K tokens, where an int32 offset would have wrapped first
    assert _rel_rms(y1[-4096:], y2[-4096:]) < _REL_RMS


@pytest.mark.slow
def test_a_batch_past_2_31_elements_of_x_equals_the_scan_in_pieces() -> None:
    heads, headdim, groups, dstate = 128, 80, 8, 16  # Nano-9B-v2's x row: 10,240 elements
    lens = [(1 << 17) + 37, (1 << 17) - 11, 4099]
    tokens = sum(lens)
    layer = _layer(tokens, heads, headdim, groups, dstate, seed=2)
    assert tokens * layer[0].stride(0) > 1 << 31
    y1, s1 = _one_shot(lens, layer, headdim, dstate)
    y2, s2 = _in_pieces(lens, 1 << 15, layer, headdim, dstate)
    assert torch.isfinite(y1).all()
    assert _rel_rms(y1, y2) < _REL_RMS
    assert _rel_rms(s1, s2) < _REL_RMS
    tail = slice(tokens - lens[-1], tokens)  # the last row lives past 2^31 elements
    assert _rel_rms(y1[tail], y2[tail]) < _REL_RMS
