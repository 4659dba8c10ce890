"""Hypothesis strategies for the metadata core."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from hybridmeta import ForwardMetadata

_INDEX_DTYPES = st.sampled_from([torch.int32, torch.int64])


@st.composite
def seq_lens(draw: st.DrawFn, *, max_seqs: int = 8, max_len: int = 40) -> list[int]:
    """Sequence lengths, zeros included (empty sequences)."""
    return draw(st.lists(st.integers(0, max_len), min_size=0, max_size=max_seqs))


@st.composite
def index_tensor(draw: st.DrawFn, n: int, *, low: int = -1, high: int = 64) -> torch.Tensor:
    dtype = draw(_INDEX_DTYPES)
    values = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    return torch.tensor(values, dtype=dtype)


@st.composite
def forward_metadata_kwargs(draw: st.DrawFn, *, max_bs: int = 8) -> dict[str, Any]:
    """Keyword arguments of a valid ``ForwardMetadata``, optional fields present or absent."""
    bs = draw(st.integers(1, max_bs))
    lens = draw(st.lists(st.integers(0, 5), min_size=bs, max_size=bs))
    qsl = torch.zeros(bs + 1, dtype=draw(_INDEX_DTYPES))
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    kw: dict[str, Any] = {
        "query_start_loc": qsl,
        "mamba_cache_indices": draw(index_tensor(bs)),
    }
    tracked = draw(st.booleans())
    if tracked:
        kw["mamba_track_indices"] = draw(index_tensor(bs))
        kw["mamba_track_mask"] = torch.tensor(
            draw(st.lists(st.booleans(), min_size=bs, max_size=bs)), dtype=torch.bool
        )
        kw["has_mamba_track_mask"] = draw(st.booleans())
        kw["mamba_track_mask_indices"] = draw(index_tensor(draw(st.integers(0, bs))))
    if draw(st.booleans()):
        k = draw(st.integers(1, 4))
        kw["is_target_verify"] = True
        kw["draft_token_num"] = k
        for name in ("retrieve_next_token", "retrieve_next_sibling", "retrieve_parent_token"):
            if draw(st.booleans()):
                kw[name] = torch.full((bs, k), -1, dtype=torch.int64)
    if draw(st.booleans()):
        kw["conv_states_mask_indices"] = draw(index_tensor(draw(st.integers(0, 4))))
    return kw


def forward_metadata(*, max_bs: int = 8) -> st.SearchStrategy[ForwardMetadata]:
    """A valid ``ForwardMetadata`` with random field values."""
    return forward_metadata_kwargs(max_bs=max_bs).map(lambda kw: ForwardMetadata(**kw))
