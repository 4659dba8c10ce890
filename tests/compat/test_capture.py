"""The decode and verify paths of hybridmeta.compat capture into a graph: no host read
(the CPU graph emulation refuses every syncing op), and a replay on new inputs equals an
eager call on them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hybridmeta.compat import flashinfer as FI
from hybridmeta.compat import sglang as S
from hybridmeta.compat import vllm as V
from hybridmeta.graphs import EmulatedGraphBackend
from tests.compat._oracle import CONV_DIM, G, H, K, N, P, expand_dt, layer
from tests.kernels._support import bits

LAY = layer(70)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_randn.gen)  # type: ignore[attr-defined]


_randn.gen = torch.Generator().manual_seed(71)  # type: ignore[attr-defined]


def _vllm_ssu() -> tuple[Callable[[], object], list[torch.Tensor], list[torch.Tensor]]:
    state = _randn(12, H, P, N)
    x, dt, B, C = _randn(5, H, P), _randn(5, H), _randn(5, G, N), _randn(5, G, N)
    out = torch.empty(5, H, P)
    sbi = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 0, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5, 5], dtype=torch.int32)
    na = torch.tensor([2, 1, 1], dtype=torch.int32)

    def run() -> object:
        V.selective_state_update(state, x, expand_dt(dt), LAY.A3(), B, C, LAY.D2(), LAY.bias2(),
                                 dt_softplus=True, state_batch_indices=sbi,
                                 dst_state_batch_indices=sbi, out=out, num_accepted_tokens=na,
                                 cu_seqlens=cu)  # fmt: skip
        return out

    return run, [x, dt, B, C, na], [state, out]


def _vllm_conv() -> tuple[Callable[[], object], list[torch.Tensor], list[torch.Tensor]]:
    w, b = _randn(CONV_DIM, K), _randn(CONV_DIM)
    state = _randn(8, CONV_DIM, K - 2 + 3)
    x = _randn(5, CONV_DIM)
    out = torch.empty(5, CONV_DIM)
    idx = torch.tensor([[3, 0, 0], [5, 0, 0], [0, 0, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, 3, 5, 5], dtype=torch.int32)
    na = torch.tensor([2, 3, 1], dtype=torch.int32)

    def run() -> object:
        return V.causal_conv1d_update(x, state, w, b, "silu", idx, na, qsl, 3, out=out)

    return run, [x, na], [state, out]


def _sglang_verify() -> tuple[Callable[[], object], list[torch.Tensor], list[torch.Tensor]]:
    T = 3
    state, buf = _randn(6, H, P, N), torch.zeros(2, T, H, P, N)
    x, dt, B, C = _randn(2, T, H, P), _randn(2, T, H), _randn(2, T, G, N), _randn(2, T, G, N)
    out = torch.empty(2, T, H, P)
    w, bias = _randn(CONV_DIM, K), _randn(CONV_DIM)
    conv, xc = _randn(6, CONV_DIM, K - 1), _randn(2, CONV_DIM, T)
    win = torch.zeros(2, T, CONV_DIM, K - 1)
    nxt, sib = torch.tensor([[1, 2, -1], [1, -1, -1]]), torch.tensor([[-1, -1, -1], [-1, 2, -1]])
    rpt = torch.zeros(2, T, dtype=torch.long)
    rows = torch.arange(2, dtype=torch.int32)
    idx = torch.tensor([4, 1], dtype=torch.int32)

    def run() -> object:
        y = S.causal_conv1d_update(xc, conv, w, bias, "silu", conv_state_indices=idx,
                                   intermediate_conv_window=win, intermediate_state_indices=rows,
                                   retrieve_next_token=nxt, retrieve_next_sibling=sib,
                                   retrieve_parent_token=rpt)  # fmt: skip
        S.selective_state_update(state, x, expand_dt(dt), LAY.A3(), B, C, LAY.D2(),
                                 dt_bias=LAY.bias2(), dt_softplus=True, state_batch_indices=idx,
                                 out=out, disable_state_update=True,
                                 intermediate_states_buffer=buf, cache_steps=T,
                                 retrieve_parent_token=rpt, intermediate_state_indices=rows)  # fmt: skip
        return y

    return run, [x, dt, xc, nxt, sib], [state, buf, out, conv, win, rpt]


def _flashinfer_varlen() -> tuple[Callable[[], object], list[torch.Tensor], list[torch.Tensor]]:
    state = _randn(12, H, P, N)
    x, dt, B, C = _randn(5, H, P), _randn(5, H), _randn(5, G, N), _randn(5, G, N)
    out = torch.empty(5, H, P)
    sbi = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    dst = torch.tensor([[7, 8, 9], [10, -1, 11]], dtype=torch.int32)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)

    def run() -> object:
        return FI.selective_state_update(state, x, expand_dt(dt), LAY.A3(), B, C, LAY.D2(),
                                         dt_bias=LAY.bias2(), dt_softplus=True,
                                         state_batch_indices=sbi, out=out, cache_steps=3,
                                         dst_state_batch_indices=dst, cu_seqlens=cu,
                                         num_accepted_tokens=torch.tensor([2, 1]))  # fmt: skip

    return run, [x, dt, B, C], [state, out]


@pytest.mark.parametrize("case", [_vllm_ssu, _vllm_conv, _sglang_verify, _flashinfer_varlen])
def test_captures_without_host_reads_and_replays_like_eager(
    case: Callable[[], tuple[Callable[[], object], list[torch.Tensor], list[torch.Tensor]]],
) -> None:
    run, inputs, mutated = case()
    start = [t.clone() for t in mutated]
    graph = EmulatedGraphBackend("cpu").capture(run, warmup=0)  # raises on a host read
    for t, s in zip(mutated, start, strict=True):
        t.copy_(s)
    for t in inputs:  # new values in the static inputs (integer inputs keep theirs)
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(72)))
    graph.replay()
    replayed = [t.clone() for t in mutated]
    for t, s in zip(mutated, start, strict=True):
        t.copy_(s)
    run()
    for i, (a, b) in enumerate(zip(replayed, mutated, strict=True)):
        assert torch.equal(bits(a), bits(b)), f"mutated tensor {i}: replay != eager"
