"""The target-verify planner: host data in, one staged copy, ``prepare_target_verify`` out."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import Conventions, ForwardMetadata, RowOrder, metadata, plan_verify
from hybridmeta.planner import plan_verify_host
from hybridmeta.staging import to_device_packed


def test_verify_plan_builds_the_target_verify_metadata() -> None:
    hp = plan_verify_host(slots=[4, 1, 7], draft_token_num=3, track_mask=[False, True, False],
                          track_slots=[-1, 9, 5])  # fmt: skip
    assert (hp.num_rows, hp.draft_token_num, hp.track, hp.any_track) == (3, 3, True, True)
    md = hp.metadata(to_device_packed(hp.arrays, torch.device("cpu")))
    assert md.is_target_verify and md.draft_token_num == 3
    assert (md.num_prefills, md.num_decodes, md.mixed) == (0, 3, None)
    assert md.query_start_loc.tolist() == [0, 3, 6, 9]
    assert md.mamba_cache_indices.tolist() == [4, 1, 7]
    assert md.mamba_track_mask is not None and md.mamba_track_mask.tolist() == [False, True, False]
    # an unflagged row's track slot is cleared: only flagged rows may save
    assert md.mamba_track_indices is not None and md.mamba_track_indices.tolist() == [-1, 9, -1]
    assert md.has_mamba_track_mask and md.retrieve_parent_token is None


def test_a_tree_and_other_engine_fields_pass_through_the_one_constructor() -> None:
    tree = torch.tensor([[-1, 0, 0], [-1, -1, 1]])
    md = plan_verify(slots=[0, 1], draft_token_num=3, retrieve_parent_token=tree,
                     retrieve_next_token=tree)  # fmt: skip
    assert md.retrieve_parent_token is tree and md.retrieve_next_token is tree
    assert md.mamba_track_mask is None and not md.has_mamba_track_mask
    with pytest.raises(ValueError, match="retrieve_parent_token has 3 columns but its columns are draft_token_num = 2"):
        plan_verify(slots=[0, 1], draft_token_num=2, retrieve_parent_token=tree)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"draft_token_num": 0}, "draft_token_num must be an int >= 1"),
        ({"slots": []}, "no rows"),
        ({"slots": [0, 0]}, "slots must be distinct"),
        ({"slots": [0, -1]}, "slots must be distinct working slots >= 0"),
        ({"track_mask": [True, False]}, "track_mask and track_slots are given together"),
        ({"track_mask": [True, False], "track_slots": [-1, -1]}, r"track_slots\[0\] = -1 but track_mask\[0\] is set"),
        ({"track_mask": [True, False], "track_slots": [1, -1]}, "is also a working slot"),
        ({"slots": torch.tensor([0, 1], device="meta")}, "must be host data"),
    ],
)
def test_bad_verify_plans_are_refused(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"slots": [0, 1], "draft_token_num": 2}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        plan_verify_host(**args)


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"draft_token_num": 1.5}, TypeError, r"^plan_verify: draft_token_num must be an int, got float 1\.5$"),
        ({"draft_token_num": True}, TypeError, r"^plan_verify: draft_token_num must be an int, got bool True$"),
        ({"slots": [[0], [1]]}, ValueError, r"^plan_verify: slots must be 1-D \(one entry per row\), got shape \(2, 1\)$"),
        ({"slots": 3}, TypeError, r"^plan_verify: slots must be a 1-D sequence of ints"),
        ({"slots": [0.0, 1.0]}, ValueError, r"^plan_verify: slots must hold integers"),
        ({"slots": [0, 2**64]}, ValueError, r"^plan_verify: slots\[1\] = 18446744073709551616 does not fit int64$"),
        ({"track_mask": [1, 0], "track_slots": [4, 5]}, ValueError, r"^plan_verify: track_mask must be bool"),
        ({"track_mask": [True], "track_slots": [4]}, ValueError, r"^plan_verify: track_mask has 1 rows but slots has 2$"),
        (
            {"track_mask": [True, False], "track_slots": [0, -1]},
            ValueError,
            r"^plan_verify: track_slots\[0\] = 0 is also a working slot",
        ),
        (
            {"draft_token_num": 2**62},
            ValueError,
            r"^plan_verify: 2 rows of draft_token_num = 4611686018427387904 tokens: the token offsets overflow int64$",
        ),
    ],
)
def test_verify_plan_arguments_are_typed_and_named(
    kw: dict[str, Any], exc: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {"slots": [0, 1], "draft_token_num": 2}
    args.update(kw)
    with pytest.raises(exc, match=match):
        plan_verify_host(**args)
    with pytest.raises(exc, match=match):
        plan_verify(**args)


def test_verify_plan_refuses_a_device_that_is_no_device() -> None:
    with pytest.raises(TypeError, match=r"^plan_verify: device must be a torch\.device or a str, got int 0$"):
        plan_verify(slots=[0, 1], draft_token_num=2, device=0)  # type: ignore[arg-type]


@metadata(extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0))
class _VllmForward(ForwardMetadata):
    """vLLM's conventions: decode rows first, null slot 0."""


def test_verify_plan_follows_the_declared_null_slot() -> None:
    # The engine's class is built, and its null slot (0) is what rows without a track
    # slot hold; no row may hold it as its working or reserved track slot.
    hp = plan_verify_host(slots=[4, 1, 7], draft_token_num=3, track_mask=[False, True, False],
                          track_slots=[-1, 9, 5], forward_cls=_VllmForward)  # fmt: skip
    assert hp.forward_cls is _VllmForward
    md = hp.metadata(to_device_packed(hp.arrays, torch.device("cpu")))
    assert md.conventions.null_slot == 0 and md.is_target_verify
    assert isinstance(hp.forward(to_device_packed(hp.arrays, torch.device("cpu"))), _VllmForward)
    assert md.mamba_track_indices is not None and md.mamba_track_indices.tolist() == [0, 9, 0]
    with pytest.raises(ValueError, match=r"^plan_verify: slots\[1\] = 0 is the null slot 0"):
        plan_verify(slots=[4, 0], draft_token_num=2, forward_cls=_VllmForward)
    with pytest.raises(ValueError, match=r"^plan_verify: track_slots\[0\] = 0 is the null slot 0"):
        plan_verify(slots=[4, 1], draft_token_num=2, track_mask=[True, False],
                    track_slots=[0, 5], forward_cls=_VllmForward)  # fmt: skip
