"""The plugin's layer math on vLLM-shaped forwards, against the token-by-token oracle.

No vLLM needed: a :class:`VllmMamba2Step` in vLLM's conventions (decode rows first,
state-cache blocks with 0 reserved as the null block, the block-table's running column,
align-mode checkpoint blocks) goes through the one translation and the layer body the
plugin's ``MambaMixer2`` runs; every row's output, final states and checkpoint state must
be the oracle's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmeta.integrations.vllm.layer import LayerShape, conv_ssm
from hybridmeta.integrations.vllm.metadata import VllmMamba2Step, mamba2_metadata
from hybridmeta.kernels import SSMParams
from tests.oracle import oracle_layer

H, P, G, N, K = 4, 8, 2, 8, 4
CONV = H * P + 2 * G * N
SLOTS = 16
# fp32 SSD scan vs the token-by-token recurrence (chunked sums of up to ~100 terms of
# O(1) values): well inside 1e-4 absolute / relative.
RTOL = ATOL = 1e-4


def _step(
    query: list[int],
    computed: list[int],
    slots: list[int],
    num_decodes: int,
    *,
    chunk: int = 8,
    ckpt: tuple[list[int], list[int], int] | None = None,
) -> VllmMamba2Step:
    n = len(query)
    qsl = torch.tensor([0, *torch.tensor(query).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([c + q for c, q in zip(computed, query, strict=True)], dtype=torch.int32)
    state = torch.tensor(slots, dtype=torch.int32).view(n, 1)
    return VllmMamba2Step(
        query_start_loc=qsl,
        mamba_cache_indices=state[:, 0],
        seq_lens=seq,
        state_indices=state,
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        checkpoint_slots=None if ckpt is None else torch.tensor(ckpt[1], dtype=torch.int32),
        num_decode_rows=num_decodes,
        num_decode_tokens=num_decodes,
        query_lens=np.array(query, dtype=np.int64),
        computed_lens=np.array(computed, dtype=np.int64),
        checkpoint_offsets=None if ckpt is None else tuple(ckpt[0]),
        chunk_size=chunk,
        conv_kernel=K,
        checkpoint_interval=0 if ckpt is None else ckpt[2],
    )


def _run(step: VllmMamba2Step, seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    T = int(step.query_lens.sum())
    conv_pool = torch.randn(SLOTS, K - 1, CONV, generator=g).transpose(-1, -2)  # vLLM's view
    ssm_pool = torch.randn(SLOTS, H, P, N, generator=g)
    init_conv, init_ssm = conv_pool.clone(), ssm_pool.clone()
    xbc = torch.randn(T + 3, CONV, generator=g)  # 3 padded tokens past T: ignored
    dt = torch.randn(T + 3, H, generator=g)
    weight = torch.randn(CONV, K, generator=g) * 0.5
    bias = torch.randn(CONV, generator=g) * 0.1
    A = -torch.rand(H, generator=g) * 2 - 0.1
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    out = torch.full((T + 3, H * P), float("nan"))
    md = mamba2_metadata(step)
    conv_ssm(
        md, xbc, dt, out, conv_state=conv_pool, ssm_state=ssm_pool, conv_weight=weight,
        conv_bias=bias, A=A, D=D, dt_bias=dt_bias, shape=LayerShape(heads=H, head_dim=P,
        groups=G, state=N),
    )  # fmt: skip
    slots = step.state_indices[:, 0].tolist()
    rows = oracle_layer(
        xbc[:T], dt[:T], step.query_lens.tolist(),
        [init_conv[s] if c > 0 else None for s, c in zip(slots, step.computed_lens, strict=True)],
        [init_ssm[s] if c > 0 else None for s, c in zip(slots, step.computed_lens, strict=True)],
        conv_weight=weight, conv_bias=bias, params=SSMParams(A=A, D=D, dt_bias=dt_bias),
        nheads=H, headdim=P, ngroups=G, dstate=N,
    )  # fmt: skip
    return {"out": out, "conv": conv_pool, "ssm": ssm_pool, "rows": rows, "T": T,
            "init_conv": init_conv, "init_ssm": init_ssm}  # fmt: skip


def _check_rows(step: VllmMamba2Step, r: dict[str, object]) -> None:
    out, conv, ssm, rows = r["out"], r["conv"], r["ssm"], r["rows"]
    assert isinstance(out, torch.Tensor) and isinstance(conv, torch.Tensor)
    assert isinstance(ssm, torch.Tensor) and isinstance(rows, list)
    start = 0
    for i, (q, s) in enumerate(zip(step.query_lens.tolist(), step.state_indices[:, 0].tolist(), strict=True)):
        torch.testing.assert_close(out[start : start + q], rows[i].y.reshape(q, -1), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(conv[s], rows[i].conv_states[q], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ssm[s], rows[i].ssm_states[q], rtol=RTOL, atol=ATOL)
        start += q
    T = r["T"]
    assert isinstance(T, int)
    assert out[T:].isnan().all(), "tokens past T were written"


def test_mixed_batch_decodes_first_matches_the_oracle() -> None:
    # vLLM's order: 3 decode rows, then a fresh prompt, a resumed chunk and a 1-token
    # first chunk of a prompt (no state: a prefill row, not a decode)
    step = _step(
        query=[1, 1, 1, 13, 9, 1],
        computed=[5, 20, 7, 0, 16, 0],
        slots=[3, 9, 4, 12, 1, 7],
        num_decodes=3,
    )
    md = mamba2_metadata(step)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (3, 3, 23)
    _check_rows(step, _run(step))


def test_decode_only_and_prefill_only_steps_match_the_oracle() -> None:
    _check_rows(_step([1, 1, 1, 1], [3, 1, 8, 2], [2, 5, 11, 6], 4), _run(_step([1, 1, 1, 1], [3, 1, 8, 2], [2, 5, 11, 6], 4)))
    pre = _step([30, 7], [0, 8], [10, 13], 0)
    _check_rows(pre, _run(pre, seed=3))


def test_align_mode_checkpoint_lands_in_its_block() -> None:
    # row 1 (a prefill of 40 tokens from 0): vLLM's checkpoint at 32 (interval 16 = the
    # mamba block, chunk 8), offset 32 into the query, into block 14
    step = _step(
        query=[1, 40, 21],
        computed=[9, 0, 16],
        slots=[3, 9, 4],
        num_decodes=1,
        ckpt=([0, 32, 0], [0, 14, 0], 16),
    )
    md = mamba2_metadata(step)
    assert md.mixed is not None and md.mixed.track.num_h + md.mixed.track.num_recompute == 1
    r = _run(step, seed=5)
    _check_rows(step, r)
    rows = r["rows"]
    conv, ssm = r["conv"], r["ssm"]
    assert isinstance(rows, list) and isinstance(conv, torch.Tensor) and isinstance(ssm, torch.Tensor)
    torch.testing.assert_close(conv[14], rows[1].conv_states[32], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ssm[14], rows[1].ssm_states[32], rtol=RTOL, atol=ATOL)
    # no other block was written, the null block 0 least of all
    init_ssm = r["init_ssm"]
    assert isinstance(init_ssm, torch.Tensor)
    for s in set(range(SLOTS)) - {3, 9, 4, 14}:
        assert torch.equal(ssm[s], init_ssm[s]), s


def test_checkpoint_before_a_row_end_on_a_boundary_lands_in_its_block() -> None:
    # a 32-token prompt (a decode row first) with blocks of 16: the row's end is itself a
    # boundary; vLLM wants the state at 16 (strictly before the row's last token) in
    # block 6, the running state at 32 in block 5
    step = _step([1, 32], [4, 0], [9, 5], 1, ckpt=([0, 16], [0, 6], 16))
    md = mamba2_metadata(step)
    assert md.mixed is not None and md.mixed.track.num_h == 1 and not md.has_mamba_track_mask
    r = _run(step, seed=7)
    _check_rows(step, r)
    rows, conv, ssm = r["rows"], r["conv"], r["ssm"]
    assert isinstance(rows, list) and isinstance(conv, torch.Tensor) and isinstance(ssm, torch.Tensor)
    torch.testing.assert_close(conv[6], rows[1].conv_states[16], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ssm[6], rows[1].ssm_states[16], rtol=RTOL, atol=ATOL)
    init_ssm = r["init_ssm"]
    assert isinstance(init_ssm, torch.Tensor)
    for s in set(range(SLOTS)) - {9, 5, 6}:
        assert torch.equal(ssm[s], init_ssm[s]), s


@pytest.mark.parametrize("with_prefill", [True, False])
def test_speculative_decode_rows_in_vllms_state_layout_match_the_oracle(with_prefill: bool) -> None:
    # ngram-style speculative decoding, num_spec = 2: each decode row has 3 state blocks
    # (columns) and 1 + drafts tokens (3, 1, 2); it starts from column num_accepted - 1
    # and leaves the state after each token in that token's column; conv blocks have
    # K - 1 + 2 columns, the window read at offset num_accepted - 1 of block 0. Then a
    # prefill row (a resumed chunk) in the same step, and block 0 is the null block.
    k = 2
    query, computed = [3, 1, 2, 9], [6, 11, 4, 8]
    blocks = torch.tensor([[3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 0, 0]], dtype=torch.int32)
    accepted = torch.tensor([2, 3, 1, 1], dtype=torch.int32)
    if not with_prefill:  # a decode-only speculative step: prepare_decode(step)
        query, computed, blocks, accepted = query[:3], computed[:3], blocks[:3], accepted[:3]
    n = len(query)
    qsl = torch.tensor([0, *torch.tensor(query).cumsum(0).tolist()], dtype=torch.int32)
    step = VllmMamba2Step(
        query_start_loc=qsl, mamba_cache_indices=blocks[:, 0],
        seq_lens=torch.tensor([c + q for c, q in zip(computed, query, strict=True)], dtype=torch.int32),
        state_indices=blocks, num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        num_accepted_tokens=accepted, num_decode_rows=3, num_decode_tokens=6,
        query_lens=np.array(query, dtype=np.int64), computed_lens=np.array(computed, dtype=np.int64),
        chunk_size=8, conv_kernel=K,
    )  # fmt: skip
    md = mamba2_metadata(step)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (3, n - 3, 9 * (n - 3))
    assert isinstance(md, VllmMamba2Step) and md.num_accepted_tokens is accepted
    g = torch.Generator().manual_seed(11)
    T = sum(query)
    conv_pool = torch.randn(SLOTS, K - 1 + k, CONV, generator=g).transpose(-1, -2)  # vLLM's
    ssm_pool = torch.randn(SLOTS, H, P, N, generator=g)
    init_conv, init_ssm = conv_pool.clone(), ssm_pool.clone()
    xbc = torch.randn(T, CONV, generator=g)
    dt = torch.randn(T, H, generator=g)
    weight = torch.randn(CONV, K, generator=g) * 0.5
    bias = torch.randn(CONV, generator=g) * 0.1
    A = -torch.rand(H, generator=g) * 2 - 0.1
    D = torch.randn(H, generator=g)
    dt_bias = torch.randn(H, generator=g) * 0.5
    out = torch.full((T, H * P), float("nan"))
    conv_ssm(
        md, xbc, dt, out, conv_state=conv_pool, ssm_state=ssm_pool, conv_weight=weight,
        conv_bias=bias, A=A, D=D, dt_bias=dt_bias,
        shape=LayerShape(heads=H, head_dim=P, groups=G, state=N),
    )  # fmt: skip
    na = accepted.tolist()
    b0 = blocks[:, 0].tolist()
    start_conv = [init_conv[b0[r], :, na[r] - 1 : na[r] - 1 + K - 1] for r in range(n)]
    start_ssm = [init_ssm[int(blocks[r, na[r] - 1])] for r in range(n)]
    rows = oracle_layer(
        xbc, dt, query, start_conv, start_ssm, conv_weight=weight, conv_bias=bias,
        params=SSMParams(A=A, D=D, dt_bias=dt_bias), nheads=H, headdim=P, ngroups=G, dstate=N,
    )  # fmt: skip
    written = set()
    for r in range(n):
        a, q = int(qsl[r]), query[r]
        torch.testing.assert_close(out[a : a + q], rows[r].y.reshape(q, -1), rtol=RTOL, atol=ATOL)
        if r < 3:  # speculative: the state after token t in column t
            for t in range(q):
                s = int(blocks[r, t])
                torch.testing.assert_close(ssm_pool[s], rows[r].ssm_states[t + 1], rtol=RTOL, atol=ATOL)
                written.add(s)
            # block 0's conv: the window's last K - 2 inputs, then the row's q inputs
            expect = torch.cat((start_conv[r][:, 1:], xbc[a : a + q].t()), dim=1)
            torch.testing.assert_close(conv_pool[b0[r], :, : K - 2 + q], expect, rtol=RTOL, atol=ATOL)
        else:  # the prefill row: its final state in its block, the window in columns 0..K-2
            torch.testing.assert_close(ssm_pool[b0[r]], rows[r].ssm_states[q], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(conv_pool[b0[r], :, : K - 1], rows[r].conv_states[q], rtol=RTOL, atol=ATOL)
            written.add(b0[r])
    for s in set(range(SLOTS)) - written:
        assert torch.equal(ssm_pool[s], init_ssm[s]), s
    assert torch.equal(conv_pool[0], init_conv[0])  # the null block


def test_a_row_carrying_the_null_block_is_a_pad_row() -> None:
    # vLLM pads a batch's rows with NULL_BLOCK_ID = 0 (its persistent buffers): such a row
    # reads and writes no state (block 0 stays as it was) and gets a zero output
    step = _step([1, 1, 1], [4, 4, 7], [5, 0, 2], 3)
    g = torch.Generator().manual_seed(2)
    conv_pool = torch.randn(SLOTS, K - 1, CONV, generator=g).transpose(-1, -2)
    ssm_pool = torch.randn(SLOTS, H, P, N, generator=g)
    init_conv, init_ssm = conv_pool.clone(), ssm_pool.clone()
    out = torch.full((3, H * P), float("nan"))
    conv_ssm(
        mamba2_metadata(step), torch.randn(3, CONV, generator=g), torch.randn(3, H, generator=g),
        out, conv_state=conv_pool, ssm_state=ssm_pool, conv_weight=torch.randn(CONV, K, generator=g),
        conv_bias=None, A=-torch.rand(H, generator=g), D=torch.randn(H, generator=g),
        dt_bias=torch.randn(H, generator=g), shape=LayerShape(heads=H, head_dim=P, groups=G, state=N),
    )  # fmt: skip
    assert bool((out[1] == 0).all()) and not out[[0, 2]].isnan().any()
    assert torch.equal(conv_pool[0], init_conv[0]) and torch.equal(ssm_pool[0], init_ssm[0])
    assert not torch.equal(ssm_pool[5], init_ssm[5]) and not torch.equal(ssm_pool[2], init_ssm[2])
