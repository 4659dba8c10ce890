"""Property: the planner's indices equal the ones implied by brute force over the tokens."""

from __future__ import annotations

import torch
from hypothesis import assume, given

from hybridmeta.chunks import chunk_indices_offsets_oracle
from hybridmeta.debug import debug_mode
from hybridmeta.prefill.oracle import oracle_track_plan
from tests.properties.strategies.prefill import BatchSpec, batch_specs, plan_of


def _walk(spec: BatchSpec) -> tuple[list[int], list[int], list[int], list[tuple[str, int, int]]]:
    """Per prefill token: its logical chunk, position in it, row; and the labels of the
    extended conv input (token i, then each row's initial window)."""
    L, k1 = spec.chunk_size, spec.conv_kernel - 1
    chunk: list[int] = []
    pos: list[int] = []
    row: list[int] = []
    labels: list[tuple[str, int, int]] = []
    key: tuple[int, int] | None = None
    t = 0
    for r in range(spec.num_prefills):
        for i in range(spec.extend_lens[r]):
            if (t // L, r) != key:
                key = (t // L, r)
                chunk.append(chunk[-1] + 1 if chunk else 0)
                pos.append(0)
            else:
                chunk.append(chunk[-1])
                pos.append(pos[-1] + 1)
            row.append(r)
            labels.append(("tok", r, spec.prefix_lens[r] + i))  # absolute position
            t += 1
    for r in range(spec.num_prefills):
        for c in range(k1):
            labels.append(("init", r, spec.prefix_lens[r] - k1 + c))
    return chunk, pos, row, labels


@given(spec=batch_specs(min_prefills=0, max_decodes=3))
def test_plan_matches_brute_force(spec: BatchSpec) -> None:
    assume(len(spec.extend_lens) > 0)
    with debug_mode():  # the metadata's syncing validators accept the plan too
        plan = plan_of(spec)
    md = plan.metadata
    n_pre = spec.num_prefills
    qsl = [0]
    for n in spec.extend_lens:
        qsl.append(qsl[-1] + n)
    assert md.query_start_loc.tolist() == qsl
    assert md.mamba_cache_indices.tolist() == list(spec.slots)
    assert md.num_prefills == n_pre
    assert md.num_decodes == spec.num_decodes
    assert md.num_prefill_tokens == qsl[n_pre]
    assert md.mamba_track_mask is not None
    assert md.mamba_track_indices is not None
    assert md.mamba_track_mask.tolist() == list(spec.track_mask)
    assert md.has_mamba_track_mask == any(spec.track_mask)

    chunk, pos, row, labels = _walk(spec)
    if n_pre:
        assert md.mixed is not None
        ind, off = chunk_indices_offsets_oracle(spec.extend_lens[:n_pre], spec.chunk_size)
        assert md.mixed.chunk_indices.tolist() == ind
        assert md.mixed.chunk_offsets.tolist() == off
        # the scan's own chunk table agrees with the metadata's logical chunks
        assert plan.chunk_start.tolist() == [
            i * spec.chunk_size + o for i, o in zip(ind, off, strict=True)
        ]
        assert md.mixed.seq_idx.tolist() == row
        assert md.mixed.has_initial_states.tolist() == [p > 0 for p in spec.prefix_lens[:n_pre]]
        assert md.mixed.prep_initial_states == any(p > 0 for p in spec.prefix_lens[:n_pre])
        assert plan.token_chunk.tolist() == chunk
        assert plan.token_pos.tolist() == pos
        last = [max(i for i, rr in enumerate(row) if rr == r) for r in range(n_pre)]
        assert plan.row_last_chunk.tolist() == [chunk[t] for t in last]
        T, L = len(row), spec.chunk_size
        assert plan.phys_last_chunk.tolist() == [
            chunk[min((j + 1) * L, T) - 1] for j in range(-(-T // L))
        ]
    else:
        assert md.mixed is None

    expected = oracle_track_plan(
        spec.extend_lens,
        spec.prefix_lens,
        spec.track_mask,
        spec.track_slots,
        num_decodes=spec.num_decodes,
        chunk_size=spec.chunk_size,
        track_interval=spec.track_interval,
    )
    finals = [t for t in expected if t.kind == "final"]
    hs = [t for t in expected if t.kind == "h"]
    rcs = [t for t in expected if t.kind == "recompute"]
    tr = plan.track
    assert tr.final_rows == tuple(t.row for t in finals)
    assert tr.final_src.tolist() == [spec.slots[t.row] for t in finals]
    assert tr.final_dst.tolist() == [t.dst for t in finals]
    assert tr.h_rows == tuple(t.row for t in hs)
    assert tr.h_src.tolist() == [t.h_index for t in hs]
    assert tr.h_dst.tolist() == [t.dst for t in hs]
    assert tr.recompute_rows == tuple(t.row for t in rcs)
    assert tr.recompute_dst.tolist() == [t.dst for t in rcs]
    for t, c, n in zip(rcs, tr.recompute_chunk.tolist(), tr.recompute_len.tolist(), strict=True):
        last_tok = qsl[t.row] + t.k - 1  # the boundary token
        assert (c, n) == (chunk[last_tok], pos[last_tok] + 1)
        assert 1 <= n < spec.chunk_size
    # every h entry's physical chunk ends right after the boundary token
    for t in hs:
        assert (t.h_index + 1) * spec.chunk_size == qsl[t.row] + t.k
    # conv windows: the K-1 inputs before the boundary, of the row itself
    k1 = spec.conv_kernel - 1
    mids = hs + rcs
    assert tr.conv_dst.tolist() == [t.dst for t in mids]
    assert tuple(tr.conv_indices.shape) == (len(mids), k1)
    for t, idx in zip(mids, tr.conv_indices.tolist(), strict=True):
        b = spec.prefix_lens[t.row] + t.k
        got = [labels[i][1:] for i in idx]
        assert got == [(t.row, b - k1 + c) for c in range(k1)]
    # the metadata carries the same plan (conv indices flattened)
    assert md.track_ssm_h_src is not None
    assert md.track_ssm_final_dst is not None
    assert torch.equal(md.track_ssm_h_src, tr.h_src)
    assert torch.equal(md.track_ssm_final_dst, tr.final_dst)
    assert md.track_conv_indices is not None
    assert md.track_conv_indices.tolist() == tr.conv_indices.reshape(-1).tolist()
