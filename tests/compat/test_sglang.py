"""hybridmeta.compat.sglang against the oracle of sglang 0.5.23's semantics."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta.compat import sglang as S
from tests.compat._oracle import CONV_DIM, G, H, K, N, P, conv_row, expand_dt, layer, ssm_row
from tests.compat._support import assert_signature, close, same_bits

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("fn", ["selective_state_update", "causal_conv1d_update"])
def test_signature_is_sglangs(fn: str) -> None:
    assert_signature(getattr(S, fn), f"sglang.{fn}")


def _inputs(bs: int, T: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(bs, T, H, P, generator=g).to(dtype),
        "dt": torch.randn(bs, T, H, generator=g).to(dtype),
        "B": torch.randn(bs, T, G, N, generator=g).to(dtype),
        "C": torch.randn(bs, T, G, N, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssu_decode_with_pad_rows(dtype: torch.dtype) -> None:
    lay = layer(20)
    state = torch.randn(6, H, P, N).to(dtype)
    orig = state.clone()
    inp = _inputs(3, 1, dtype, 21)
    idx = torch.tensor([4, -1, 0], dtype=torch.int32)  # slot 0 is a live slot for sglang
    out = torch.full((3, H, P), float("nan"), dtype=dtype)
    S.selective_state_update(
        state, inp["x"][:, 0], expand_dt(inp["dt"][:, 0]), lay.A3(), inp["B"][:, 0],
        inp["C"][:, 0], lay.D2(), dt_bias=lay.bias2(), dt_softplus=True,
        state_batch_indices=idx, out=out,
    )  # fmt: skip
    for b, s in ((0, 4), (2, 0)):
        sts, y = ssm_row(orig[s], inp["x"][b], inp["dt"][b], inp["B"][b], inp["C"][b], lay)
        close(out[b], y[0], f"out[{b}]")
        close(state[s], sts[0], f"state[{s}]")
    assert bool((out[1] == 0).all())
    for s in (1, 2, 3, 5):
        same_bits(state[s], orig[s], f"slot {s}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True])
def test_ssu_verify_buffer_indices_and_tree(dtype: torch.dtype, tree: bool) -> None:
    """Target verify as sglang's backend runs it: T draft tokens, disable_state_update, the
    state after each token in the buffer at entry intermediate_state_indices[b]; a tree
    continues token t from retrieve_parent_token[b, t] (-1: token t - 1)."""
    lay = layer(22)
    T = 4
    state = torch.randn(6, H, P, N).to(dtype)
    orig = state.clone()
    inp = _inputs(3, T, dtype, 23)
    idx = torch.tensor([5, -1, 2], dtype=torch.int32)
    entries = torch.tensor([2, 0, 0], dtype=torch.int32)
    buf = torch.full((3, T, H, P, N), 7.0, dtype=dtype)
    buf_orig = buf.clone()
    rpt = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, -1, 0, 2]]) if tree else None
    out = torch.full((3, T, H, P), float("nan"), dtype=dtype)
    S.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        dt_bias=lay.bias2(), dt_softplus=True, state_batch_indices=idx, out=out,
        disable_state_update=True, intermediate_states_buffer=buf, cache_steps=T,
        retrieve_parent_token=rpt, intermediate_state_indices=entries,
    )  # fmt: skip
    for b, s in ((0, 5), (2, 2)):
        parents = None
        if rpt is not None:
            parents = [-1] + [int(p) if int(p) >= 0 else t - 1 for t, p in enumerate(rpt[b].tolist()) if t]
        sts, y = ssm_row(orig[s], inp["x"][b], inp["dt"][b], inp["B"][b], inp["C"][b], lay,
                         parents=parents)  # fmt: skip
        close(out[b], y, f"out of row {b}")
        for t in range(T):
            close(buf[int(entries[b]), t], sts[t], f"buffer entry {int(entries[b])} step {t}")
    assert bool((out[1] == 0).all())
    same_bits(buf[1], buf_orig[1], "buffer entry of no live row")
    same_bits(state, orig, "pool (disable_state_update)")


def test_ssu_multi_token_writes_the_last_state_unless_disabled() -> None:
    lay = layer(24)
    state = torch.randn(4, H, P, N)
    orig = state.clone()
    inp = _inputs(2, 3, torch.float32, 25)
    out = torch.empty(2, 3, H, P)
    S.selective_state_update(state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"],
                             inp["C"], lay.D2(), dt_bias=lay.bias2(), dt_softplus=True,
                             state_batch_indices=torch.tensor([3, 1]), out=out)  # fmt: skip
    for b, s in ((0, 3), (1, 1)):
        sts, y = ssm_row(orig[s], inp["x"][b], inp["dt"][b], inp["B"][b], inp["C"][b], lay)
        close(out[b], y, f"out[{b}]")
        close(state[s], sts[-1], f"state[{s}]")


def test_ssu_rejects() -> None:
    lay = layer()
    state = torch.zeros(4, H, P, N)
    inp = _inputs(2, 2, torch.float32, 0)
    args = (state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2())
    out = torch.empty(2, 2, H, P)
    with pytest.raises(NotImplementedError, match="enable_stochastic_rounding"):
        S.selective_state_update(*args, out=out, enable_stochastic_rounding=True)
    with pytest.raises(ValueError, match="cache_steps"):
        S.selective_state_update(*args, out=out, intermediate_states_buffer=torch.zeros(2, 2, H, P, N))
    with pytest.raises(NotImplementedError, match="dtype"):
        S.selective_state_update(*args, out=out, cache_steps=2,
                                 intermediate_states_buffer=torch.zeros(2, 2, H, P, N,
                                                                        dtype=torch.bfloat16))  # fmt: skip
    assert bool((state == 0).all())


# --------------------------------------------------------------------------- conv update


def _w(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CONV_DIM, K, generator=g) * 0.3, torch.randn(CONV_DIM, generator=g) * 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True])
def test_conv_update_verify_windows_and_tree(dtype: torch.dtype, tree: bool) -> None:
    """sglang's verify call: x [bs, dim, T], the windows after each token in
    intermediate_conv_window at entry intermediate_state_indices[b]; the pool shifted by T
    along the token order; a tree from retrieve_next_token / _sibling, its parents written
    into retrieve_parent_token."""
    w, bias = _w(30)
    T = 4
    state = torch.randn(6, CONV_DIM, K - 1).to(dtype)
    orig = state.clone()
    x = torch.randn(3, CONV_DIM, T).to(dtype)
    idx = torch.tensor([1, -1, 4], dtype=torch.int32)
    entries = torch.tensor([2, 1, 0], dtype=torch.int32)
    win_buf = torch.full((3, T, CONV_DIM, K - 1), 5.0, dtype=dtype)
    kw: dict[str, Any] = {}
    parents_of = [None, None, None]
    if tree:
        # row tree: 0 -> {1, 3}, 1 -> {2}: next_token (first child), next_sibling
        nxt = torch.tensor([[1, 2, -1, -1]] * 3)
        sib = torch.tensor([[-1, 3, -1, -1]] * 3)
        kw = {"retrieve_next_token": nxt, "retrieve_next_sibling": sib,
              "retrieve_parent_token": torch.full((3, T), 9)}  # fmt: skip
        parents_of = [[-1, 0, 1, 0]] * 3  # type: ignore[list-item]
    y = S.causal_conv1d_update(x, state, w, bias, "silu", conv_state_indices=idx,
                               intermediate_conv_window=win_buf,
                               intermediate_state_indices=entries, **kw)  # fmt: skip
    assert y.shape == x.shape and y.dtype == dtype
    for b, s in ((0, 1), (2, 4)):
        ref, wins = conv_row(orig[s], x[b].t(), w, bias, parents=parents_of[b])
        close(y[b].t(), ref, f"out of row {b}")
        for t in range(T):
            close(win_buf[int(entries[b]), t], wins[t], f"window {b}, {t}")
        chain = torch.cat([orig[s].float(), x[b].float()], dim=1)[:, -(K - 1) :]
        close(state[s], chain, f"state[{s}] shifted along the token order")
    assert bool((y[1] == 0).all())
    same_bits(win_buf[1], torch.full_like(win_buf[1], 5.0), "window entry of the pad row")
    if tree:
        rpt = kw["retrieve_parent_token"]
        assert rpt[0].tolist() == [0, 0, 1, 0] and rpt[2].tolist() == [0, 0, 1, 0]
        assert rpt[1].tolist() == [9, 9, 9, 9], "a pad row's parents are not written"
    for s in (0, 2, 3, 5):
        same_bits(state[s], orig[s], f"slot {s}")


def test_conv_update_accepted_tokens_and_unsupported() -> None:
    w, bias = _w(31)
    T = 3
    state = torch.randn(4, CONV_DIM, K - 2 + T)
    orig = state.clone()
    x = torch.randn(2, CONV_DIM, T)
    na = torch.tensor([2, 1], dtype=torch.int32)
    y = S.causal_conv1d_update(x, state, w, bias, True, conv_state_indices=torch.tensor([3, 0]),
                               num_accept_tokens=na)  # fmt: skip
    for b, s in ((0, 3), (1, 0)):
        off = int(na[b]) - 1
        win = orig[s, :, off : off + K - 1]
        ref, _ = conv_row(win, x[b].t(), w, bias)
        close(y[b].t(), ref, f"out {b}")
        close(state[s], torch.cat([win[:, 1:], x[b]], dim=1), f"state {s}")
    with pytest.raises(NotImplementedError, match="cache_seqlens"):
        S.causal_conv1d_update(x, state, w, bias, True, cache_seqlens=torch.tensor([1, 1]))


@pytest.mark.interpreter
def test_triton_subset_tree_verify_matches_the_reference_path() -> None:
    """A tree verify (conv windows + SSM buffer) under the Triton interpreter gives what the
    reference path gives (tiny sizes)."""
    from hybridmeta import kernels as Kops

    lay = layer(90)
    T = 3
    inp = _inputs(2, T, torch.float32, 91)
    w, bias = _w(92)
    xc = torch.randn(2, CONV_DIM, T, generator=torch.Generator().manual_seed(93))
    nxt, sib = torch.tensor([[1, -1, -1], [1, 2, -1]]), torch.tensor([[-1, 2, -1], [-1, -1, -1]])
    idx = torch.tensor([3, -1], dtype=torch.int32)
    results = []
    for impl in ("reference", "triton"):
        state = torch.randn(5, H, P, N, generator=torch.Generator().manual_seed(94))
        conv = torch.randn(5, CONV_DIM, K - 1, generator=torch.Generator().manual_seed(95))
        buf, win = torch.zeros(2, T, H, P, N), torch.zeros(2, T, CONV_DIM, K - 1)
        rpt = torch.zeros(2, T, dtype=torch.long)
        out = torch.empty(2, T, H, P)
        rows = torch.arange(2, dtype=torch.int32)
        with Kops.implementation(impl):
            y = S.causal_conv1d_update(xc, conv, w, bias, "silu", conv_state_indices=idx,
                                       intermediate_conv_window=win,
                                       intermediate_state_indices=rows, retrieve_next_token=nxt,
                                       retrieve_next_sibling=sib, retrieve_parent_token=rpt)  # fmt: skip
            S.selective_state_update(state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"],
                                     inp["C"], lay.D2(), dt_bias=lay.bias2(), dt_softplus=True,
                                     state_batch_indices=idx, out=out,
                                     intermediate_states_buffer=buf, cache_steps=T,
                                     retrieve_parent_token=rpt, intermediate_state_indices=rows)  # fmt: skip
        results.append((y, conv, win, state, buf, out))
    for i, (a, b) in enumerate(zip(results[0], results[1], strict=True)):
        close(b, a, f"tensor {i}")
