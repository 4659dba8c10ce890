"""hybridmeta.compat.vllm against the oracle of vLLM 0.32's semantics (tests/compat/_oracle.py)."""

from __future__ import annotations

import pytest
import torch

from hybridmeta import kernels as Kops
from hybridmeta.compat import vllm as V
from tests.compat._oracle import CONV_DIM, G, H, K, N, P, conv_row, expand_dt, layer, ssm_row
from tests.compat._support import assert_signature, close, same_bits

NULL = V.NULL_BLOCK_ID
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(
    "fn",
    ["selective_state_update", "causal_conv1d_update", "causal_conv1d_fn",
     "mamba_chunk_scan_combined_varlen"],
)  # fmt: skip
def test_signature_is_vllms(fn: str) -> None:
    assert_signature(getattr(V, fn), f"vllm.{fn}")


def _ssm_inputs(rows: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, H, P, generator=g).to(dtype),
        "dt": torch.randn(rows, H, generator=g).to(dtype),
        "B": torch.randn(rows, G, N, generator=g).to(dtype),
        "C": torch.randn(rows, G, N, generator=g).to(dtype),
        "z": torch.randn(rows, H, P, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssu_decode_null_rows_and_slot_zero(dtype: torch.dtype) -> None:
    """One token per row, 2-D indices [N, 1] as vLLM's builder passes them; the null id 0
    marks pad rows: slot 0 (vLLM's reserved null block) is never written, pad output 0."""
    lay = layer()
    slots = 9
    state = torch.randn(slots, H, P, N).to(dtype)
    orig = state.clone()
    inp = _ssm_inputs(4, dtype)
    sbi = torch.tensor([[3], [NULL], [7], [1]], dtype=torch.int32)
    out = torch.full((4, H, P), float("nan"), dtype=dtype)
    V.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        lay.bias2(), z=inp["z"], dt_softplus=True, state_batch_indices=sbi,
        dst_state_batch_indices=sbi, out=out,
    )  # fmt: skip
    for b, s in enumerate(sbi[:, 0].tolist()):
        if s == NULL:
            assert bool((out[b] == 0).all()), "a null row's output is zero"
            continue
        st, y = ssm_row(orig[s], inp["x"][b : b + 1], inp["dt"][b : b + 1], inp["B"][b : b + 1],
                        inp["C"][b : b + 1], lay, inp["z"][b : b + 1])  # fmt: skip
        close(out[b], y[0], f"out[{b}]")
        close(state[s], st[0], f"state[{s}]")
    for s in (0, 2, 4, 5, 6, 8):
        same_bits(state[s], orig[s], f"slot {s}")


def _varlen_case(dtype: torch.dtype, seed: int = 1) -> dict[str, object]:
    lens = [3, 0, 2, 1, 3]  # a zero-length sequence and a null row (row 3)
    T = 3
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    sbi = torch.tensor([[4, 5, 6], [8, 9, 10], [11, 12, 13], [NULL, NULL, NULL], [14, 15, NULL]],
                       dtype=torch.int32)  # fmt: skip
    na = torch.tensor([2, 1, 3, 1, 1], dtype=torch.int32)
    return {"lens": lens, "T": T, "cu": cu, "total": total, "sbi": sbi, "na": na, "seed": seed}


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssu_spec_varlen_accepted_counts_and_token_slots(dtype: torch.dtype) -> None:
    """Speculative decoding: row b starts from sbi[b, na[b] - 1]; token t's state goes to
    dst[b, t] unless null; a zero-length sequence and a null row write nothing."""
    case = _varlen_case(dtype)
    lens, cu, sbi, na = case["lens"], case["cu"], case["sbi"], case["na"]
    assert isinstance(lens, list) and isinstance(cu, torch.Tensor)
    assert isinstance(sbi, torch.Tensor) and isinstance(na, torch.Tensor)
    lay = layer(2)
    state = torch.randn(16, H, P, N).to(dtype)
    orig = state.clone()
    total = int(cu[-1])
    inp = _ssm_inputs(total, dtype, seed=3)
    out = torch.full((total, H, P), float("nan"), dtype=dtype)
    V.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        lay.bias2(), z=None, dt_softplus=True, state_batch_indices=sbi,
        dst_state_batch_indices=sbi, out=out, num_accepted_tokens=na, cu_seqlens=cu,
    )  # fmt: skip
    written: set[int] = set()
    for b, n in enumerate(lens):
        a, e = int(cu[b]), int(cu[b + 1])
        src = int(sbi[b, max(int(na[b]) - 1, 0)])
        if src == NULL:
            assert n == 0 or bool((out[a:e] == 0).all())
            continue
        sts, y = ssm_row(orig[src], inp["x"][a:e], inp["dt"][a:e], inp["B"][a:e],
                         inp["C"][a:e], lay)  # fmt: skip
        if n:
            close(out[a:e], y, f"out of row {b}")
        for t in range(n):
            d = int(sbi[b, t])
            if d != NULL:
                close(state[d], sts[t], f"row {b} token {t} -> slot {d}")
                written.add(d)
    for s in range(16):
        if s not in written:
            same_bits(state[s], orig[s], f"slot {s}")
    assert written == {4, 5, 6, 11, 12, 14, 15}


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssu_varlen_without_accepted_counts_writes_the_final_state(dtype: torch.dtype) -> None:
    """cu_seqlens without num_accepted_tokens: all tokens from sbi[b, 0], the state after
    the last one to dst[b, 0]."""
    lay = layer(4)
    lens = [2, 3, 1]
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int64)
    sbi = torch.tensor([[1, 9], [2, 9], [NULL, 9]], dtype=torch.int64)
    dst = torch.tensor([[5, 9], [6, 9], [7, 9]], dtype=torch.int64)
    state = torch.randn(10, H, P, N).to(dtype)
    orig = state.clone()
    inp = _ssm_inputs(6, dtype, seed=5)
    out = torch.empty(6, H, P, dtype=dtype)
    V.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        lay.bias2(), z=inp["z"], dt_softplus=True, state_batch_indices=sbi,
        dst_state_batch_indices=dst, out=out, cu_seqlens=cu,
    )  # fmt: skip
    for b, (s, d) in enumerate(((1, 5), (2, 6))):
        a, e = int(cu[b]), int(cu[b + 1])
        sts, y = ssm_row(orig[s], inp["x"][a:e], inp["dt"][a:e], inp["B"][a:e], inp["C"][a:e],
                         lay, inp["z"][a:e])  # fmt: skip
        close(out[a:e], y, f"out of row {b}")
        close(state[d], sts[lens[b] - 1], f"final state of row {b}")
    assert bool((out[5] == 0).all())
    for s in (0, 1, 2, 3, 4, 7, 8, 9):
        same_bits(state[s], orig[s], f"slot {s}")


def test_ssu_one_token_spec_reads_the_accepted_column() -> None:
    lay = layer(6)
    state = torch.randn(8, H, P, N)
    orig = state.clone()
    inp = _ssm_inputs(2, torch.float32, seed=7)
    sbi = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    dst = torch.tensor([[7, 0, 0], [0, 0, 0]], dtype=torch.int32)  # row 1: null destination
    out = torch.empty(2, H, P)
    V.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        lay.bias2(), dt_softplus=True, state_batch_indices=sbi, dst_state_batch_indices=dst,
        out=out, num_accepted_tokens=torch.tensor([3, 2], dtype=torch.int32),
    )  # fmt: skip
    for b, src in enumerate((3, 5)):
        sts, y = ssm_row(orig[src], inp["x"][b : b + 1], inp["dt"][b : b + 1],
                         inp["B"][b : b + 1], inp["C"][b : b + 1], lay)  # fmt: skip
        close(out[b], y[0], f"out[{b}]")
        if b == 0:
            close(state[7], sts[0], "row 0's destination")
    for s in range(7):
        same_bits(state[s], orig[s], f"slot {s}")


def test_ssu_unsupported_features_raise() -> None:
    lay = layer()
    state = torch.zeros(4, H, P, N)
    inp = _ssm_inputs(2, torch.float32)
    args = (state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
            lay.bias2())  # fmt: skip
    out = torch.empty(2, H, P)
    with pytest.raises(NotImplementedError, match="enable_stochastic_rounding"):
        V.selective_state_update(*args, out=out, enable_stochastic_rounding=True)
    with pytest.raises(NotImplementedError, match="`A` varies"):
        V.selective_state_update(*args[:3], -torch.rand(H, P, N), *args[4:], out=out)
    with pytest.raises(NotImplementedError, match="`dt` varies"):
        V.selective_state_update(*args[:2], torch.randn(2, H, P), *args[3:], out=out)
    with pytest.raises(NotImplementedError, match="`D` varies"):
        V.selective_state_update(*args[:6], torch.randn(H, P), args[7], out=out)
    with pytest.raises(ValueError, match="`out` is required"):
        V.selective_state_update(*args)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        V.selective_state_update(*args, state_batch_indices=torch.tensor([1, 2]), out=out,
                                 num_accepted_tokens=torch.tensor([1, 1]))  # fmt: skip
    assert bool((state == 0).all()), "nothing written before raising"


# --------------------------------------------------------------------------- conv update


def _conv_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CONV_DIM, K, generator=g) * 0.3, torch.randn(CONV_DIM, generator=g) * 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S", [1, 3])
def test_conv_update_shift_and_in_place_x(dtype: torch.dtype, S: int) -> None:
    """Without num_accepted_tokens: S tokens from columns 0..K-2, the window shifted by S
    stored there; columns past K-2 untouched; out=None overwrites x; null rows zero."""
    w, bias = _conv_weights()
    L = K + 1  # a longer state (vLLM keeps K - 2 + T columns under spec decode)
    state = torch.randn(6, CONV_DIM, L).to(dtype)
    orig = state.clone()
    x = torch.randn(3, CONV_DIM, S).to(dtype)
    x_in = x.clone()
    xin = x[:, :, 0] if S == 1 else x
    idx = torch.tensor([2, NULL, 4], dtype=torch.int32)
    res = V.causal_conv1d_update(xin, state, w, bias, "silu", conv_state_indices=idx)
    assert res.data_ptr() == xin.data_ptr(), "out=None: x is overwritten and returned"
    for b, s in enumerate(idx.tolist()):
        got = res[b] if S > 1 else res[b][:, None]
        if s == NULL:
            assert bool((got == 0).all())
            continue
        y, wins = conv_row(orig[s, :, : K - 1], x_in[b].t(), w, bias)
        close(got.t(), y, f"out[{b}]")
        close(state[s, :, : K - 1], wins[-1], f"state[{s}]")
        same_bits(state[s, :, K - 1 :], orig[s, :, K - 1 :], "columns past K-2")
    for s in (0, 1, 3, 5):
        same_bits(state[s], orig[s], f"slot {s}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_update_spec_varlen_sliding_window(dtype: torch.dtype) -> None:
    """num_accepted_tokens + query_start_loc: the first token reads columns na-1..na+K-3;
    the state becomes the window's last K-2 inputs and the row's inputs (K-2+len cols)."""
    w, bias = _conv_weights(1)
    T = 3
    L = K - 2 + T
    state = torch.randn(8, CONV_DIM, L).to(dtype)
    orig = state.clone()
    lens = [3, 1, 0, 2]
    qsl = torch.tensor([0, 3, 4, 4, 6], dtype=torch.int32)
    x = torch.randn(6, CONV_DIM).to(dtype)
    idx = torch.tensor([[1, 0, 0, 0], [3, 0, 0, 0], [5, 0, 0, 0], [NULL, 0, 0, 0]], dtype=torch.int32)
    na = torch.tensor([2, 3, 1, 1], dtype=torch.int32)
    out = torch.full_like(x, float("nan"))
    res = V.causal_conv1d_update(x, state, w, bias, True, conv_state_indices=idx,
                                 num_accepted_tokens=na, query_start_loc=qsl, max_query_len=T,
                                 out=out)  # fmt: skip
    assert res is out
    for b, s in enumerate((1, 3, 5, NULL)):
        a, e = int(qsl[b]), int(qsl[b + 1])
        if s == NULL:
            assert bool((out[a:e] == 0).all())
            continue
        if lens[b] == 0:
            same_bits(state[s], orig[s], "zero-length row")
            continue
        off = int(na[b]) - 1
        win = orig[s, :, off : off + K - 1]
        y, _ = conv_row(win, x[a:e], w, bias)
        close(out[a:e], y, f"out of row {b}")
        expect = torch.cat([win[:, 1:].float(), x[a:e].float().t()], dim=1)  # K-2+len cols
        close(state[s, :, : expect.shape[1]], expect, f"state[{s}]")
        same_bits(state[s, :, expect.shape[1] :], orig[s, :, expect.shape[1] :], "later columns")
    for s in (0, 2, 4, 6, 7):
        same_bits(state[s], orig[s], f"slot {s}")


def test_conv_update_rejects_before_writing() -> None:
    w, bias = _conv_weights()
    state = torch.zeros(4, CONV_DIM, K - 1)
    x = torch.randn(2, CONV_DIM)
    with pytest.raises(NotImplementedError, match="prefix caching 'all' mode"):
        V.causal_conv1d_update(x, state, w, bias, "silu", torch.tensor([1, 2]),
                               block_idx_last_scheduled_token=torch.tensor([0, 0]))  # fmt: skip
    with pytest.raises(ValueError, match="activation"):
        V.causal_conv1d_update(x, state, w, bias, "relu", torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="max_query_len"):
        V.causal_conv1d_update(x, state, w, bias, "silu", torch.tensor([1, 2]),
                               query_start_loc=torch.tensor([0, 1, 2]))  # fmt: skip
    with pytest.raises(ValueError, match="state_len"):
        V.causal_conv1d_update(x, state, w, bias, "silu", torch.tensor([1, 2]),
                               num_accepted_tokens=torch.tensor([1, 1]),
                               query_start_loc=torch.tensor([0, 1, 2]), max_query_len=2)  # fmt: skip
    with pytest.raises(ValueError, match="same dtype"):
        V.causal_conv1d_update(x, state, w, bias, "silu", torch.tensor([1, 2]),
                               out=torch.empty(2, CONV_DIM, dtype=torch.bfloat16))  # fmt: skip
    assert bool((state == 0).all())


# --------------------------------------------------------------------------- conv prefill


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_fn_varlen_initial_states_and_null_rows(dtype: torch.dtype) -> None:
    w, bias = _conv_weights(2)
    state = torch.randn(8, CONV_DIM, K - 1).to(dtype)
    orig = state.clone()
    lens = [5, 2, 3, 1]
    qsl = torch.tensor([0, 5, 7, 10, 11], dtype=torch.int32)
    cache = torch.tensor([3, NULL, 6, 2], dtype=torch.int32)
    init = torch.tensor([True, True, False, True])
    x_tok = torch.randn(11, CONV_DIM).to(dtype)
    x = x_tok.t()  # [dim, total], channel-last: what vLLM's mixer passes
    y = V.causal_conv1d_fn(x, w, bias, state, qsl, cache, init, activation="silu")
    assert y.shape == (CONV_DIM, 11) and y.dtype == dtype and y.stride(0) == 1
    for b, s in enumerate(cache.tolist()):
        a, e = int(qsl[b]), int(qsl[b + 1])
        if s == NULL:
            assert bool((y[:, a:e] == 0).all())
            continue
        win = orig[s] if bool(init[b]) else torch.zeros(CONV_DIM, K - 1)
        ref, wins = conv_row(win, x_tok[a:e], w, bias)
        close(y[:, a:e].t(), ref, f"out of row {b}")
        close(state[s], wins[-1], f"state[{s}]")
        assert lens[b] == e - a
    for s in (0, 1, 4, 5, 7):
        same_bits(state[s], orig[s], f"slot {s}")


def test_conv_fn_prefix_caching_all_mode_raises() -> None:
    w, bias = _conv_weights()
    state = torch.zeros(4, CONV_DIM, K - 1)
    with pytest.raises(NotImplementedError, match="all' mode"):
        V.causal_conv1d_fn(torch.randn(CONV_DIM, 2), w, bias, state, torch.tensor([0, 2]),
                           torch.tensor([1]), initial_state_idx=torch.tensor([0]))  # fmt: skip


# --------------------------------------------------------------------------- chunked scan


def _scan_case(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = 14
    return {
        "x": torch.randn(T, H, P, generator=g),
        "dt": torch.randn(T, H, generator=g),
        "B": torch.randn(T, G, N, generator=g),
        "C": torch.randn(T, G, N, generator=g),
        "z": torch.randn(T, H, P, generator=g),
        "init": torch.randn(3, H, P, N, generator=g),
    }


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("intermediate", [False, True])
def test_chunk_scan_varlen_against_the_recurrence(intermediate: bool, with_init: bool) -> None:
    """Three sequences (6, 5, 3 tokens) from initial states, z gate, genuine D [H, P];
    with return_intermediate_states the state at the end of every chunk of
    cu_chunk_seqlens (chunks of <= 4 tokens that never straddle a sequence)."""
    c = _scan_case(8)
    init = c["init"] if with_init else torch.zeros_like(c["init"])
    lay = layer(9)
    D2 = torch.randn(H, P)
    cu = torch.tensor([0, 6, 11, 14], dtype=torch.int32)
    cu_chunk = torch.tensor([0, 4, 6, 10, 11, 14], dtype=torch.int32)
    seq_idx = torch.tensor([0, 0, 1, 1, 2], dtype=torch.int32)
    last = torch.tensor([1, 3, 4], dtype=torch.int32)
    out = torch.full((14, H, P), float("nan"))
    res = V.mamba_chunk_scan_combined_varlen(
        c["x"], c["dt"], lay.A, c["B"], c["C"], 4, cu, cu_chunk, last, seq_idx, out, D=D2,
        z=c["z"], dt_bias=lay.dt_bias, initial_states=init if with_init else None, dt_softplus=True,
        return_intermediate_states=intermediate, state_dtype=torch.float32,
    )  # fmt: skip
    per_head = layer(9)
    bounds = cu.tolist()
    for b in range(3):
        a, e = bounds[b], bounds[b + 1]
        no_d = type(per_head)(A=per_head.A, D=torch.zeros(H), dt_bias=per_head.dt_bias)
        sts, y = ssm_row(init[b], c["x"][a:e], c["dt"][a:e], c["B"][a:e], c["C"][a:e], no_d)
        y = (y + D2[None] * c["x"][a:e]) * torch.nn.functional.silu(c["z"][a:e])
        close(out[a:e], y, f"out of sequence {b}")
        if not intermediate:
            close(res[b], sts[-1], f"final state {b}")
    if intermediate:
        assert res.shape == (5, H, P, N)
        for ch, (a, e) in enumerate(zip(cu_chunk.tolist()[:-1], cu_chunk.tolist()[1:], strict=True)):
            b = int(seq_idx[ch])
            sts, _ = ssm_row(init[b], c["x"][bounds[b] : e], c["dt"][bounds[b] : e],
                             c["B"][bounds[b] : e], c["C"][bounds[b] : e], per_head)  # fmt: skip
            close(res[ch], sts[-1], f"state after chunk {ch} [{a}, {e})")


def test_chunk_scan_dt_limit_clamps() -> None:
    c = _scan_case(10)
    lay = layer(11)
    cu = torch.tensor([0, 14], dtype=torch.int32)
    args = (c["x"], c["dt"], lay.A, c["B"], c["C"], 8, cu, torch.tensor([0, 8, 14]),
            torch.tensor([1]), torch.tensor([0, 0]))  # fmt: skip
    out_lim = torch.empty(14, H, P)
    s_lim = V.mamba_chunk_scan_combined_varlen(*args, out_lim, D=lay.D, dt_bias=lay.dt_bias,
                                               dt_softplus=True, dt_limit=(0.5, 1.0))  # fmt: skip
    # the oracle with dt clamped to [0.5, 1]: bias and softplus applied before the clamp
    d = torch.nn.functional.softplus(c["dt"] + lay.dt_bias).clamp(0.5, 1.0)
    raw = torch.log(torch.expm1(d)) - lay.dt_bias  # a raw dt whose softplus(dt + bias) is d
    sts, y = ssm_row(None, c["x"], raw, c["B"], c["C"], lay)
    close(out_lim, y, "out with dt_limit")
    close(s_lim[0], sts[-1], "state with dt_limit")


# --------------------------------------------------------------------------- Triton


@pytest.mark.interpreter
def test_triton_subset_matches_the_reference_path() -> None:
    """The speculative varlen SSM update and conv update under the Triton interpreter give
    what the reference path gives (tiny sizes)."""
    lay = layer(12)
    case = _varlen_case(torch.float32)
    cu, sbi, na = case["cu"], case["sbi"], case["na"]
    assert isinstance(cu, torch.Tensor) and isinstance(sbi, torch.Tensor)
    assert isinstance(na, torch.Tensor)
    total = int(cu[-1])
    inp = _ssm_inputs(total, torch.float32, seed=13)
    w, bias = _conv_weights(3)
    results = []
    for impl in ("reference", "triton"):
        state = torch.randn(16, H, P, N, generator=torch.Generator().manual_seed(1))
        out = torch.empty(total, H, P)
        conv = torch.randn(16, CONV_DIM, K - 2 + 3, generator=torch.Generator().manual_seed(2))
        xc = torch.randn(total, CONV_DIM, generator=torch.Generator().manual_seed(3))
        with Kops.implementation(impl):
            V.selective_state_update(
                state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
                lay.bias2(), dt_softplus=True, state_batch_indices=sbi,
                dst_state_batch_indices=sbi, out=out, num_accepted_tokens=na, cu_seqlens=cu,
            )  # fmt: skip
            yc = V.causal_conv1d_update(xc, conv, w, bias, "silu", sbi, na, cu, 3)
        results.append((state, out, conv, yc))
    for a, b, what in zip(results[0], results[1], ("state", "out", "conv", "conv out"), strict=True):
        close(b, a, what)


def test_conv_update_varlen_without_accepted_counts_shifts_by_each_length() -> None:
    w, bias = _conv_weights(4)
    state = torch.randn(5, CONV_DIM, K - 1)
    orig = state.clone()
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    x = torch.randn(3, CONV_DIM)
    out = V.causal_conv1d_update(x.clone(), state, w, bias, "silu", torch.tensor([4, 1]),
                                 query_start_loc=qsl, max_query_len=2)  # fmt: skip
    for b, s in enumerate((4, 1)):
        a, e = int(qsl[b]), int(qsl[b + 1])
        y, wins = conv_row(orig[s], x[a:e], w, bias)
        close(out[a:e], y, f"out of row {b}")
        close(state[s], wins[-1], f"state[{s}] shifted by {e - a}")


def test_the_null_id_reaches_the_ops_as_their_pad_id() -> None:
    """The null id is passed to the ops as their ``pad_slot_id`` (no translation): a null row
    is a pad row (zero output, nothing written), and any other id outside the pool,
    ``-1`` included, is the ops' invalid id (on the CPU: ``SlotIndexError`` naming the row,
    before anything is written), in both updates; a speculative per-token destination
    outside the pool is written nowhere."""
    lay = layer()
    state = torch.randn(9, H, P, N)
    orig = state.clone()
    inp = _ssm_inputs(3, torch.float32)
    out = torch.full((3, H, P), 5.0)
    args = (inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(), lay.bias2())
    V.selective_state_update(state, *args, dt_softplus=True, out=out,
                             state_batch_indices=torch.tensor([[3], [NULL], [2]], dtype=torch.int32))
    assert bool((out[1] == 0).all()) and not out.isnan().any()
    for s in (0, 1, 4, 5, 6, 7, 8):
        same_bits(state[s], orig[s], f"slot {s}")
    state = orig.clone()
    with pytest.raises(Kops.SlotIndexError, match=r"must be 0 \(pad\).*row 2 holds -1"):
        V.selective_state_update(state, *args, dt_softplus=True, out=out,
                                 state_batch_indices=torch.tensor([[3], [NULL], [-1]], dtype=torch.int32))
    assert torch.equal(state, orig)
    # speculative varlen: per-token destinations, one of them -1 (written nowhere)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    inp = _ssm_inputs(4, torch.float32, seed=3)
    out2 = torch.zeros(4, H, P)
    V.selective_state_update(
        state, inp["x"], expand_dt(inp["dt"]), lay.A3(), inp["B"], inp["C"], lay.D2(),
        lay.bias2(), dt_softplus=True, out=out2, cu_seqlens=cu,
        state_batch_indices=torch.tensor([[4, 5], [6, -1]], dtype=torch.int32),
        num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32),
    )  # fmt: skip
    for s in (0, 1, 2, 3, 7, 8):
        same_bits(state[s], orig[s], f"slot {s}")
    assert not torch.equal(state[5], orig[5]) and not torch.equal(state[6], orig[6])
    # the conv update: the null row a pad, a -1 row refused before any write
    w, bias = _conv_weights(2)
    cstate = torch.randn(6, CONV_DIM, K - 1)
    corig = cstate.clone()
    x = torch.randn(3, CONV_DIM)
    y = V.causal_conv1d_update(x.clone(), cstate, w, bias, True,
                               conv_state_indices=torch.tensor([2, NULL, 4], dtype=torch.int32))
    assert bool((y[1] == 0).all()) and not y.isnan().any()
    for s in (0, 1, 3, 5):
        same_bits(cstate[s], corig[s], f"conv slot {s}")
    cstate = corig.clone()
    with pytest.raises(Kops.SlotIndexError, match="row 2 holds -1"):
        V.causal_conv1d_update(x.clone(), cstate, w, bias, True,
                               conv_state_indices=torch.tensor([2, NULL, -1], dtype=torch.int32))
    assert torch.equal(cstate, corig)
