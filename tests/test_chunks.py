"""Logical chunk indices and offsets: examples and error cases."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.chunks import chunk_indices_offsets, chunk_indices_offsets_oracle


def test_reference_example() -> None:
    idx, off = chunk_indices_offsets(torch.tensor([0, 5, 10]), 8)
    assert idx.tolist() == [0, 0, 1]
    assert off.tolist() == [0, 5, 0]
    assert chunk_indices_offsets_oracle([5, 5], 8) == ([0, 0, 1], [0, 5, 0])


def test_boundary_on_a_chunk_edge_adds_no_split() -> None:
    idx, off = chunk_indices_offsets(torch.tensor([0, 8, 12]), 8)
    assert (idx.tolist(), off.tolist()) == ([0, 1], [0, 0])


def test_empty_batch_and_empty_sequences() -> None:
    idx, _ = chunk_indices_offsets(torch.tensor([0]), 4)
    assert idx.numel() == 0
    idx, off = chunk_indices_offsets(torch.tensor([0, 0, 3, 3, 6]), 4)
    assert (idx.tolist(), off.tolist()) == ([0, 0, 1], [0, 3, 0])


@pytest.mark.parametrize(
    ("qsl", "chunk", "message"),
    [
        (torch.tensor([0, 3, 2]), 4, "non-decreasing"),
        (torch.tensor([1, 3]), 4, "must start at 0"),
        (torch.tensor([0, 3]), 0, "chunk_size must be > 0"),
        (torch.tensor([[0, 3]]), 4, "must be 1-D"),
        (torch.tensor([0, 3], device="meta"), 4, "must be a CPU tensor"),
    ],
)
def test_bad_input(qsl: torch.Tensor, chunk: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_indices_offsets(qsl, chunk)
