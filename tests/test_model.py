"""The Mamba2 metadata model: constructors and cross-field validation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import (
    ForwardMetadata,
    Mamba2Metadata,
    debug_mode,
    prepare_decode,
    prepare_mixed,
    prepare_target_verify,
)


def _fwd(bs: int = 3, **kw: object) -> ForwardMetadata:
    return ForwardMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32),
        mamba_cache_indices=torch.arange(bs, dtype=torch.int32),
        **kw,  # type: ignore[arg-type]
    )


def test_prepare_decode() -> None:
    fwd = _fwd(
        4,
        has_mamba_track_mask=True,
        mamba_track_mask=torch.ones(4, dtype=torch.bool),
        mamba_track_indices=torch.arange(4, 8),
    )
    md = prepare_decode(fwd)
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decodes, md.mixed) == (0, 0, 4, None)
    # The defect of sglang PR #26877: this flag must survive the derivation.
    assert md.has_mamba_track_mask is True
    with pytest.raises(ValueError, match="use prepare_target_verify"):
        prepare_decode(_fwd(2, is_target_verify=True))


def test_prepare_target_verify() -> None:
    tree = torch.full((2, 3), -1)
    fwd = _fwd(
        2,
        is_target_verify=True,
        draft_token_num=3,
        retrieve_next_token=tree,
        retrieve_next_sibling=tree,
        retrieve_parent_token=tree,
    )
    md = prepare_target_verify(fwd)
    assert md.retrieve_parent_token is tree and md.draft_token_num == 3
    with pytest.raises(ValueError, match="is_target_verify must be set"):
        prepare_target_verify(_fwd(2))
    with pytest.raises(
        ValueError, match=r"retrieve_next_token has 3 columns but draft_token_num is 2"
    ):
        _fwd(2, is_target_verify=True, draft_token_num=2, retrieve_next_token=tree)


def test_prepare_mixed() -> None:
    fwd = ForwardMetadata(
        query_start_loc=torch.tensor([0, 5, 10, 11, 12], dtype=torch.int32),
        mamba_cache_indices=torch.tensor([4, 2, 7, 1], dtype=torch.int32),
    )
    md = prepare_mixed(fwd, extend_seq_lens_cpu=[5, 5], extend_prefix_lens_cpu=[0, 3], chunk_size=8)
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decodes) == (2, 10, 2)
    assert md.mixed is not None
    assert md.mixed.chunk_indices.tolist() == [0, 0, 1]
    assert md.mixed.chunk_offsets.tolist() == [0, 5, 0]
    assert md.mixed.seq_idx.tolist() == [0] * 5 + [1] * 5
    assert md.mixed.has_initial_states.tolist() == [False, True]
    assert md.mixed.prep_initial_states is True
    with pytest.raises(ValueError, match="extend_prefix_lens_cpu has 1 rows"):
        prepare_mixed(fwd, extend_seq_lens_cpu=[5, 5], extend_prefix_lens_cpu=[0], chunk_size=8)
    with pytest.raises(
        ValueError,
        match=r"has 5 prefill rows but ForwardMetadata\.mamba_cache_indices has only 4 rows",
    ):
        prepare_mixed(
            fwd, extend_seq_lens_cpu=[1] * 5, extend_prefix_lens_cpu=[0] * 5, chunk_size=8
        )


def test_mamba2_cross_field_rules() -> None:
    fwd = _fwd(3)
    with pytest.raises(
        ValueError, match=r"num_prefills \+ num_decodes = 2 but mamba_cache_indices has 3 rows"
    ):
        Mamba2Metadata.evolve_from(
            fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None
        )
    with pytest.raises(ValueError, match="mixed must be given exactly when num_prefills > 0"):
        Mamba2Metadata.evolve_from(
            fwd, num_prefills=1, num_prefill_tokens=1, num_decodes=2, mixed=None
        )
    with pytest.raises(ValueError, match="num_prefill_tokens must be 0 without prefill rows"):
        Mamba2Metadata.evolve_from(
            fwd, num_prefills=0, num_prefill_tokens=4, num_decodes=3, mixed=None
        )


def test_forward_cross_field_rules() -> None:
    with pytest.raises(ValueError, match="has_mamba_track_mask is True, so mamba_track_mask"):
        _fwd(2, has_mamba_track_mask=True)
    with pytest.raises(ValueError, match="track_ssm_h_src and track_ssm_h_dst are given together"):
        _fwd(2, track_ssm_h_src=torch.arange(2))
    with pytest.raises(
        ValueError, match="track_ssm_final_dst has 1 entries but track_ssm_final_src has 2"
    ):
        _fwd(2, track_ssm_final_src=torch.arange(2), track_ssm_final_dst=torch.arange(1))
    with pytest.raises(ValueError, match="draft_token_num must be >= 1"):
        _fwd(2, draft_token_num=0)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"query_start_loc": torch.tensor([0, 2, 1], dtype=torch.int32)}, "non-decreasing"),
        ({"query_start_loc": torch.tensor([1, 2, 3], dtype=torch.int32)}, "must start at 0"),
        ({"mamba_cache_indices": torch.tensor([3, 3], dtype=torch.int32)}, "duplicate live slot"),
        ({"mamba_cache_indices": torch.tensor([-2, 3], dtype=torch.int32)}, "must be >= -1"),
        (
            {
                "mamba_track_mask": torch.tensor([True, False]),
                "mamba_track_indices": torch.tensor([0, 5]),
            },
            "equals the working slot of a tracked row",
        ),
    ],
)
def test_syncing_checks_only_in_debug_mode(kw: dict[str, torch.Tensor], message: str) -> None:
    args: dict[str, Any] = {
        "query_start_loc": torch.arange(3, dtype=torch.int32),
        "mamba_cache_indices": torch.tensor([0, 1], dtype=torch.int32),
    }
    args.update(kw)
    ForwardMetadata(**args)  # accepted: reading device values is not allowed on the hot path
    with debug_mode(), pytest.raises(ValueError, match=message):
        ForwardMetadata(**args)
