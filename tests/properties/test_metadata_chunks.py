"""Chunk indices and offsets equal the brute-force oracle."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridmeta.chunks import chunk_indices_offsets, chunk_indices_offsets_oracle
from tests.properties.strategies.metadata import seq_lens


@given(lens=seq_lens(), chunk=st.integers(1, 16))
def test_chunk_plan_equals_oracle(lens: list[int], chunk: int) -> None:
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    idx, off = chunk_indices_offsets(qsl, chunk)
    assert (idx.tolist(), off.tolist()) == chunk_indices_offsets_oracle(lens, chunk)


@given(
    lens=st.lists(st.integers(1, 5), min_size=1, max_size=6).map(
        lambda ks: [4 * k for k in ks]  # every sequence ends exactly on a chunk boundary
    )
)
def test_sequences_ending_on_chunk_boundaries(lens: list[int]) -> None:
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    idx, off = chunk_indices_offsets(qsl, 4)
    assert off.eq(0).all()
    assert idx.tolist() == list(range(sum(lens) // 4))
    assert (idx.tolist(), off.tolist()) == chunk_indices_offsets_oracle(lens, 4)
