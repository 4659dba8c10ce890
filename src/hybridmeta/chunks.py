"""Logical chunks of a chunked Mamba2 (SSD) prefill over a flattened variable-length batch.

The SSD scan splits the flattened prefill tokens into physical chunks of ``chunk_size``
tokens. With initial states, a chunk that contains the end of one sequence and the start
of the next must be split: a *logical* chunk changes at every sequence boundary and at every
physical chunk boundary. ``chunk_indices[i]`` is the physical chunk of logical chunk ``i``
and ``chunk_offsets[i]`` the offset of its first token inside that physical chunk.

Example (``docs/background.md``, section 3): ``query_start_loc=[0, 5, 10]``,
``chunk_size=8`` gives ``chunk_indices=[0, 0, 1]``, ``chunk_offsets=[0, 5, 0]``: logical
chunks start at tokens 0, 5 and 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["chunk_indices_offsets", "chunk_indices_offsets_oracle", "logical_chunk_starts"]


def logical_chunk_starts(
    query_start_loc: npt.NDArray[np.int64], chunk_size: int
) -> npt.NDArray[np.int64]:
    """First token of every logical chunk, ascending (the rule; no argument checks).

    A logical chunk starts at every physical chunk start and at every sequence start that
    lies inside the flattened tokens; empty sequences add no start of their own.
    ``query_start_loc`` is a valid ``[num_seqs + 1]`` host array (0 first, non-decreasing).
    """
    total = int(query_start_loc[-1])
    physical = np.arange(0, total, chunk_size, dtype=np.int64)
    seq_starts = query_start_loc[:-1]
    starts = np.concatenate((physical, seq_starts[seq_starts < total].astype(np.int64)))
    starts.sort()
    # Sorted: drop repeats (np.unique does the same with several times the host overhead).
    keep = np.ones(starts.shape[0], dtype=np.bool_)
    np.not_equal(starts[1:], starts[:-1], out=keep[1:])
    return starts[keep]


def chunk_indices_offsets(
    query_start_loc: torch.Tensor | npt.NDArray[Any], chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical chunk indices and offsets, vectorised (no Python loop over sequences).

    Parameters
    ----------
    query_start_loc : torch.Tensor or numpy array
        ``[num_seqs + 1]`` non-decreasing token offsets of the prefill rows, starting at 0,
        **on the CPU** (the plan is computed from host data; reading a device tensor here
        would sync the stream).
    chunk_size : int
        Physical chunk size of the SSD scan (> 0).

    Returns
    -------
    (chunk_indices, chunk_offsets) : tuple of torch.Tensor
        int64 CPU tensors ``[num_logical_chunks]``.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if isinstance(query_start_loc, torch.Tensor):
        if query_start_loc.device.type != "cpu":
            raise ValueError(
                "query_start_loc must be a CPU tensor: the chunk plan is computed from host "
                f"data (got device {query_start_loc.device})"
            )
        query_start_loc = query_start_loc.numpy()
    qsl = np.asarray(query_start_loc)
    if qsl.ndim != 1 or qsl.size < 1:
        raise ValueError(
            f"query_start_loc must be 1-D with at least one entry, got shape {tuple(qsl.shape)}"
        )
    qsl = qsl.astype(np.int64)
    if int(qsl[0]) != 0:
        raise ValueError(f"query_start_loc must start at 0, got {int(qsl[0])}")
    if qsl.size > 1 and bool((qsl[1:] < qsl[:-1]).any()):
        raise ValueError("query_start_loc must be non-decreasing")
    starts = torch.from_numpy(logical_chunk_starts(qsl, chunk_size))
    return starts // chunk_size, starts % chunk_size


def chunk_indices_offsets_oracle(
    seq_lens: Sequence[int], chunk_size: int
) -> tuple[list[int], list[int]]:
    """Brute force: walk the tokens one by one and open a chunk whenever the pair
    (physical chunk, sequence) changes."""
    indices: list[int] = []
    offsets: list[int] = []
    previous: tuple[int, int] | None = None
    t = 0
    for seq, n in enumerate(seq_lens):
        for _ in range(n):
            key = (t // chunk_size, seq)
            if key != previous:
                indices.append(t // chunk_size)
                offsets.append(t % chunk_size)
                previous = key
            t += 1
    return indices, offsets
