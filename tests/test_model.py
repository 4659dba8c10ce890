"""The Mamba2 metadata model: constructors and cross-field validation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import (
    ForwardMetadata,
    Mamba2Metadata,
    Role,
    debug_mode,
    fields_of,
    plan_mixed_batch,
    prepare_decode,
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
        ValueError,
        match=r"retrieve_parent_token has 3 columns but its columns are draft_token_num = 2",
    ):
        _fwd(2, is_target_verify=True, draft_token_num=2, retrieve_parent_token=tree)
    with pytest.raises(ValueError, match=r"is_target_verify must be stated explicitly"):
        _fwd(2, draft_token_num=3, retrieve_parent_token=tree)
    with pytest.raises(ValueError, match=r"draft_token_num is 3 but is_target_verify is False"):
        _fwd(2, draft_token_num=3)


def test_mixed_metadata_from_the_planner() -> None:
    md = plan_mixed_batch(
        extend_lens=[5, 5, 1, 1],
        prefix_lens=[0, 3, 4, 9],
        slots=[4, 2, 7, 1],
        num_decodes=2,
        chunk_size=8,
        conv_kernel=4,
    )
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decodes) == (2, 10, 2)
    assert md.mixed is not None
    assert md.mixed.has_initial_states.tolist() == [False, True]
    assert md.prefill_slots.tolist() == [4, 2]
    assert md.mamba_cache_indices[md.decode_rows()].tolist() == [7, 1]


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
    with pytest.raises(ValueError, match="has_mamba_track_mask is set, so mamba_track_mask"):
        _fwd(2, has_mamba_track_mask=True)
    with pytest.raises(
        ValueError, match="mamba_track_mask and mamba_track_indices are given together"
    ):
        _fwd(2, mamba_track_mask=torch.ones(2, dtype=torch.bool), has_mamba_track_mask=False)
    with pytest.raises(ValueError, match="draft_token_num must be >= 1"):
        _fwd(2, draft_token_num=0)


def test_the_seed_omission_is_refused_at_construction() -> None:
    """sglang #26877 one layer up: a constructor that gives the track data but forgets the
    flag that decides whether the layers use it."""
    with pytest.raises(ValueError, match=r"has_mamba_track_mask must be stated explicitly"):
        _fwd(
            2,
            mamba_track_mask=torch.tensor([True, False]),
            mamba_track_indices=torch.tensor([5, -1], dtype=torch.int32),
        )


def test_forward_metadata_declares_the_roles_the_buffers_use() -> None:
    roles = {s.name: s.role for s in fields_of(ForwardMetadata)}
    assert roles["mamba_cache_indices"] is Role.WORKING_SLOT
    assert roles["mamba_track_indices"] is Role.TRACK_SLOT
    assert roles["mamba_track_mask"] is Role.TRACK_MASK
    assert roles["has_mamba_track_mask"] is Role.SUBSUMED_FLAG


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"query_start_loc": torch.tensor([0, 2, 1], dtype=torch.int32)}, "non-decreasing"),
        ({"query_start_loc": torch.tensor([1, 2, 3], dtype=torch.int32)}, "must start at 0"),
        ({"mamba_cache_indices": torch.tensor([3, 3], dtype=torch.int32)}, "duplicate slot"),
        ({"mamba_cache_indices": torch.tensor([-2, 3], dtype=torch.int32)}, "must be -1"),
        (
            {
                "mamba_track_mask": torch.tensor([True, False]),
                "mamba_track_indices": torch.tensor([-1, 5]),
                "has_mamba_track_mask": True,
            },
            r"mamba_track_indices is -1 \(none\) in a row whose mamba_track_mask is set",
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


def test_a_track_slot_equal_to_a_virtual_working_id_is_not_judged_at_construction() -> None:
    """With a slot table the working ids are virtual: comparing them with physical track
    slots at construction would refuse a legitimate step (table[3] = 4, track slot 3)."""
    with debug_mode():
        ForwardMetadata(
            query_start_loc=torch.arange(2),
            mamba_cache_indices=torch.tensor([3]),
            mamba_track_indices=torch.tensor([3]),
            mamba_track_mask=torch.tensor([True]),
            has_mamba_track_mask=True,
        )
