"""hybridmeta.compat.flashinfer against the oracle of FlashInfer 0.7.4's documented semantics."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.compat import flashinfer as FI
from tests.compat._oracle import G, H, N, P, expand_dt, layer, ssm_row
from tests.compat._support import assert_signature, close, same_bits

DTYPES = [torch.float32, torch.bfloat16]


def test_signature_is_flashinfers() -> None:
    assert_signature(FI.selective_state_update, "flashinfer.selective_state_update")


def _inputs(rows: int, T: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, T, H, P, generator=g).to(dtype),
        "dt": torch.randn(rows, T, H, generator=g).to(dtype),
        "B": torch.randn(rows, T, G, N, generator=g).to(dtype),
        "C": torch.randn(rows, T, G, N, generator=g).to(dtype),
        "z": torch.randn(rows, T, H, P, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_token_pad_id_and_destinations(dtype: torch.dtype) -> None:
    """x [bs, H, P]: read state_batch_indices[b], write dst_state_batch_indices[b]; the
    row whose source is pad_slot_id (here 7, a custom id) writes nothing and gets zeros."""
    lay = layer(50)
    state = torch.randn(8, H, P, N).to(dtype)
    orig = state.clone()
    inp = _inputs(3, 1, dtype, 51)
    src = torch.tensor([2, 7, 4], dtype=torch.int32)
    dst = torch.tensor([5, 6, 7], dtype=torch.int32)  # row 2's destination is the pad id
    y = FI.selective_state_update(
        state, inp["x"][:, 0], expand_dt(inp["dt"][:, 0]), lay.A3(), inp["B"][:, 0],
        inp["C"][:, 0], lay.D2(), z=inp["z"][:, 0], dt_bias=lay.bias2(), dt_softplus=True,
        state_batch_indices=src, pad_slot_id=7, dst_state_batch_indices=dst,
    )  # fmt: skip
    assert y.shape == (3, H, P)
    for b in (0, 2):
        s = int(src[b])
        _, ref = ssm_row(orig[s], inp["x"][b], inp["dt"][b], inp["B"][b], inp["C"][b], lay,
                           inp["z"][b])  # fmt: skip
        close(y[b], ref[0], f"out[{b}]")
    close(state[5], ssm_row(orig[2], inp["x"][0], inp["dt"][0], inp["B"][0], inp["C"][0], lay)[0][0],
          "row 0 -> slot 5")  # fmt: skip
    assert bool((y[1] == 0).all())
    for s in (0, 1, 2, 3, 4, 6, 7):
        same_bits(state[s], orig[s], f"slot {s}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("disable", [True, False])
def test_multi_token_intermediate_states(dtype: torch.dtype, disable: bool) -> None:
    """x [bs, T, H, P] with intermediate_states_buffer: every token's state at entry
    intermediate_state_indices[b] (written whatever disable_state_update); the final state
    to the source slot unless disable_state_update."""
    lay = layer(52)
    T = 3
    state = torch.randn(6, H, P, N).to(dtype)
    orig = state.clone()
    inp = _inputs(2, T, dtype, 53)
    buf = torch.zeros(2, T, H, P, N, dtype=dtype)
    out = torch.empty(2, T, H, P, dtype=dtype)
    FI.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        dt_bias=lay.bias2(), dt_softplus=True, state_batch_indices=torch.tensor([4, 1]),
        out=out, disable_state_update=disable, intermediate_states_buffer=buf,
        intermediate_state_indices=torch.tensor([1, 0]), cache_steps=T,
    )  # fmt: skip
    for b, (s, e) in enumerate(((4, 1), (1, 0))):
        sts, ref = ssm_row(orig[s], inp["x"][b], inp["dt"][b], inp["B"][b], inp["C"][b], lay)
        close(out[b], ref, f"out[{b}]")
        for t in range(T):
            close(buf[e, t], sts[t], f"buffer[{e}, {t}]")
        if disable:
            same_bits(state[s], orig[s], f"slot {s}")
        else:
            close(state[s], sts[-1], f"final state of row {b}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_accepted_counts_and_token_destinations(dtype: torch.dtype) -> None:
    """vLLM-style call: packed tokens with cu_seqlens, 2-D indices, num_accepted_tokens;
    cache_steps is the max sequence length."""
    lay = layer(54)
    state = torch.randn(12, H, P, N).to(dtype)
    orig = state.clone()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    g = torch.Generator().manual_seed(55)
    x = torch.randn(5, H, P, generator=g).to(dtype)
    dt = torch.randn(5, H, generator=g).to(dtype)
    Bm = torch.randn(5, G, N, generator=g).to(dtype)
    Cm = torch.randn(5, G, N, generator=g).to(dtype)
    sbi = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    dst = torch.tensor([[7, -1, -1], [8, 9, 10]], dtype=torch.int32)
    y = FI.selective_state_update(
        state, x, expand_dt(dt), lay.A3(), Bm, Cm, lay.D2(), dt_bias=lay.bias2(),
        dt_softplus=True, state_batch_indices=sbi, dst_state_batch_indices=dst,
        cache_steps=3, cu_seqlens=cu, num_accepted_tokens=torch.tensor([2, 3]),
    )  # fmt: skip
    for b, src in ((0, 2), (1, 6)):
        a, e = int(cu[b]), int(cu[b + 1])
        sts, ref = ssm_row(orig[src], x[a:e], dt[a:e], Bm[a:e], Cm[a:e], lay)
        close(y[a:e], ref, f"out of row {b}")
        for t in range(e - a):
            d = int(dst[b, t])
            if d >= 0:
                close(state[d], sts[t], f"row {b} token {t} -> {d}")
    for s in range(7):
        same_bits(state[s], orig[s], f"slot {s}")


def test_unsupported_features_raise_naming_them() -> None:
    lay = layer()
    state = torch.zeros(4, H, P, N)
    inp = _inputs(2, 1, torch.float32, 0)
    args = (state, inp["x"][:, 0], expand_dt(inp["dt"][:, 0]), lay.A3(), inp["B"][:, 0],
            inp["C"][:, 0], lay.D2())  # fmt: skip
    with pytest.raises(NotImplementedError, match="state_scale"):
        FI.selective_state_update(*args, state_scale=torch.ones(4, H, P))
    with pytest.raises(NotImplementedError, match="intermediate_state_scales"):
        FI.selective_state_update(*args, intermediate_state_scales=torch.ones(2, 1, H, P))
    with pytest.raises(NotImplementedError, match="rand_seed"):
        FI.selective_state_update(*args, rand_seed=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="cake"):
        FI.selective_state_update(*args, backend="cake")
    with pytest.raises(ValueError, match="mutually exclusive"):
        FI.selective_state_update(*args, intermediate_states_buffer=torch.zeros(2, 1, H, P, N),
                                  dst_state_batch_indices=torch.tensor([0, 1]))  # fmt: skip
    with pytest.raises(ValueError, match="Unknown algorithm"):
        FI.selective_state_update(*args, algorithm="fast")
    assert bool((state == 0).all())


def test_multi_token_one_destination_column_keeps_the_last_state() -> None:
    """1-D dst_state_batch_indices in a multi-token call: every token writes the row's one
    destination; the last token's state stays (FlashInfer's stride-0 token index)."""
    lay = layer(56)
    T = 3
    state = torch.randn(6, H, P, N)
    orig = state.clone()
    inp = _inputs(2, T, torch.float32, 57)
    FI.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        dt_bias=lay.bias2(), dt_softplus=True, state_batch_indices=torch.tensor([0, 1]),
        dst_state_batch_indices=torch.tensor([4, 5]),
    )  # fmt: skip
    for b, (s, d) in enumerate(((0, 4), (1, 5))):
        sts, _ = ssm_row(orig[s], inp["x"][b], inp["dt"][b], inp["B"][b], inp["C"][b], lay)
        close(state[d], sts[-1], f"row {b} -> slot {d}")
    for s in (0, 1, 2, 3):
        same_bits(state[s], orig[s], f"slot {s}")
