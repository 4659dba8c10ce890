"""The legacy engine's metadata: plain dataclasses and hand-written constructors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class ForwardMetadata:
    """What the scheduler produces for one forward (rows: prefills first, decodes last)."""

    query_start_loc: torch.Tensor
    mamba_cache_indices: torch.Tensor
    mamba_track_indices: torch.Tensor | None = None
    mamba_track_mask: torch.Tensor | None = None
    is_target_verify: bool = False
    draft_token_num: int = 1
    # Added later, for the prefix cache: whether any row saves its state this step.
    has_mamba_track_mask: bool = False


@dataclass(kw_only=True)
class Mamba2Metadata(ForwardMetadata):
    """What the Mamba2 layers read."""

    num_prefills: int
    num_decodes: int


def prepare_decode_dropping(fwd: ForwardMetadata) -> Mamba2Metadata:
    """Seed defect 2: re-lists the fields by keyword and misses the one added later."""
    return Mamba2Metadata(
        query_start_loc=fwd.query_start_loc,
        mamba_cache_indices=fwd.mamba_cache_indices,
        mamba_track_indices=fwd.mamba_track_indices,
        mamba_track_mask=fwd.mamba_track_mask,
        is_target_verify=fwd.is_target_verify,
        draft_token_num=fwd.draft_token_num,
        num_prefills=0,
        num_decodes=fwd.mamba_cache_indices.shape[0],
    )


def prepare_decode(fwd: ForwardMetadata) -> Mamba2Metadata:
    """Fixed: every ``ForwardMetadata`` field is copied, including ones added later."""
    copied = {f.name: getattr(fwd, f.name) for f in dataclasses.fields(ForwardMetadata)}
    return Mamba2Metadata(**copied, num_prefills=0, num_decodes=fwd.mamba_cache_indices.shape[0])
