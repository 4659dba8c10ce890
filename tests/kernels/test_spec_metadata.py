"""The verify and commit ops' metadata entries: everything they index by comes from the carrier.

``ssm_verify_update_from_metadata`` / ``conv_verify_update_from_metadata`` read the working
slots, the tree and ``T`` from a target-verify ``Mamba2Metadata``; ``spec_commit_from_metadata``
reads slots, track fields and the verdict from a ``SpecCommitMetadata`` built through
``evolve_from`` of that verify metadata. Each entry equals its op called with the same
values spelled out, and refuses metadata of the wrong kind with a message that says so.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import ForwardMetadata, debug_mode, prepare_decode, prepare_target_verify
from hybridmeta.kernels import (
    conv_verify_update,
    conv_verify_update_from_metadata,
    spec_commit,
    spec_commit_from_metadata,
    ssm_state_update_from_metadata,
    ssm_verify_update,
    ssm_verify_update_from_metadata,
    track_save_from_metadata,
)
from hybridmeta.model import Mamba2Metadata, SpecCommitMetadata
from tests.kernels._support import bits

H, P, N, G, CD, K = 2, 3, 4, 1, 5, 3
SLOTS, L = 9, 2


def _verify_md(
    slots: list[int],
    T: int,
    *,
    parent: list[list[int]] | None = None,
    track: list[int] | None = None,
    mask: list[bool] | None = None,
) -> Mamba2Metadata:
    bs = len(slots)
    kw: dict[str, Any] = {}
    if parent is not None:
        kw["retrieve_parent_token"] = torch.tensor(parent)
    if track is not None and mask is not None:
        kw.update(
            mamba_track_indices=torch.tensor(track),
            mamba_track_mask=torch.tensor(mask),
            has_mamba_track_mask=any(mask),
        )
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(bs + 1) * T,
        mamba_cache_indices=torch.tensor(slots),
        is_target_verify=True,
        draft_token_num=T,
        **kw,
    )
    return prepare_target_verify(fwd)


def _ssm_inputs(bs: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "state": torch.randn(SLOTS, H, P, N, generator=g),
        "x": torch.randn(bs, T, H, P, generator=g),
        "dt": torch.rand(bs, T, H, generator=g),
        "A": -torch.rand(H, generator=g) - 0.1,
        "B": torch.randn(bs, T, G, N, generator=g),
        "C": torch.randn(bs, T, G, N, generator=g),
        "D": torch.randn(H, generator=g),
    }


def _conv_inputs(bs: int, T: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(bs, T, CD, generator=g),
        "conv_state": torch.randn(SLOTS, CD, K - 1, generator=g),
        "weight": torch.randn(CD, K, generator=g),
        "bias": torch.randn(CD, generator=g),
    }


TREE = [[-1, 0, 0, 1], [-1, -1, 1, 2], [-1, 0, 1, 2]]


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_ssm_verify_entry_reads_slots_tree_and_T_from_the_metadata(impl: Any) -> None:
    md = _verify_md([4, -1, 1], 4, parent=TREE)
    a = _ssm_inputs(3, 4)
    inter = torch.full((3, 4, H, P, N), float("nan"))
    out = ssm_verify_update_from_metadata(
        md, a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], inter=inter, impl=impl
    )
    want_inter = torch.full_like(inter, float("nan"))
    want = ssm_verify_update(
        a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"],
        state_indices=torch.tensor([4, -1, 1]), parent=torch.tensor(TREE), inter=want_inter,
        impl=impl,
    )  # fmt: skip
    assert torch.equal(bits(out), bits(want))
    assert torch.equal(bits(inter), bits(want_inter))
    # The tree mattered: as chains the same rows give other states.
    chain_inter = torch.full_like(inter, float("nan"))
    ssm_verify_update(
        a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"],
        state_indices=torch.tensor([4, -1, 1]), inter=chain_inter, impl=impl,
    )  # fmt: skip
    assert not torch.equal(bits(chain_inter[0]), bits(inter[0]))


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_conv_verify_entry_reads_slots_tree_and_T_from_the_metadata(impl: Any) -> None:
    md = _verify_md([2, 6, -1], 4, parent=TREE)
    c = _conv_inputs(3, 4)
    inter = torch.full((3, 4, CD, K - 1), float("nan"))
    out = conv_verify_update_from_metadata(
        md, c["x"], c["conv_state"], c["weight"], c["bias"], inter=inter, impl=impl
    )
    want_inter = torch.full_like(inter, float("nan"))
    want = conv_verify_update(
        c["x"], c["conv_state"], c["weight"], c["bias"], cache_indices=torch.tensor([2, 6, -1]),
        parent=torch.tensor(TREE), inter=want_inter, impl=impl,
    )  # fmt: skip
    assert torch.equal(bits(out), bits(want))
    assert torch.equal(bits(inter), bits(want_inter))


def test_verify_entries_refuse_metadata_that_is_not_this_verify() -> None:
    a, c = _ssm_inputs(2, 3), _conv_inputs(2, 3)
    inter = torch.zeros(2, 3, H, P, N)
    inter_c = torch.zeros(2, 3, CD, K - 1)
    before = (inter.clone(), inter_c.clone())

    def ssm(md: Mamba2Metadata) -> None:
        ssm_verify_update_from_metadata(
            md, a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], inter=inter, impl="reference"
        )

    def conv(md: Mamba2Metadata) -> None:
        conv_verify_update_from_metadata(
            md, c["x"], c["conv_state"], c["weight"], inter=inter_c, impl="reference"
        )

    decode = prepare_decode(
        ForwardMetadata(query_start_loc=torch.arange(3), mamba_cache_indices=torch.tensor([0, 1]))
    )
    for fn, op in ((ssm, "ssm_verify_update_from_metadata"), (conv, "conv_verify_update_from_metadata")):
        with pytest.raises(ValueError, match=rf"{op}: the metadata is not a target-verify forward"):
            fn(decode)
        with pytest.raises(ValueError, match=rf"{op}: the metadata has draft_token_num=2 but `x` has T=3"):
            fn(_verify_md([0, 1], 2))
        with pytest.raises(ValueError, match=rf"{op}: the metadata has 3 verify rows but `x` has bs=2"):
            fn(_verify_md([0, 1, 2], 3))
    assert torch.equal(inter, before[0]) and torch.equal(inter_c, before[1])  # nothing written


def test_decode_entries_and_track_save_refuse_a_verify_forward() -> None:
    md = _verify_md([0, 1], 1, track=[5, 6], mask=[True, False])
    a = _ssm_inputs(2, 1)
    with pytest.raises(ValueError, match=r"target-verify forward.*verify ops"):
        ssm_state_update_from_metadata(
            md, a["state"], a["x"][:, 0], a["dt"][:, 0], a["A"], a["B"][:, 0], a["C"][:, 0],
            impl="reference",
        )  # fmt: skip
    conv = torch.randn(L, SLOTS, CD, K - 1)
    ssm = torch.randn(L, SLOTS, H, P, N)
    before = (conv.clone(), ssm.clone())
    with pytest.raises(ValueError, match="track_save_from_metadata: the metadata is a target-verify"):
        track_save_from_metadata(md, conv, ssm, impl="reference")
    assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1])


# ----------------------------------------------------------------------- the commit


def _commit_args(T: int, bs: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "conv_pool": torch.randn(L, SLOTS, CD, K - 1, generator=g),
        "ssm_pool": torch.randn(L, SLOTS, H, P, N, generator=g),
        "inter_conv": torch.randn(L, bs, T, CD, K - 1, generator=g),
        "inter_ssm": torch.randn(L, bs, T, H, P, N, generator=g),
    }


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("tracking", [True, False])
def test_commit_entry_equals_the_op_with_the_metadata_spelled_out(impl: Any, tracking: bool) -> None:
    mask = [True, False, True] if tracking else [False, False, False]
    md = _verify_md([1, -1, 3], 3, track=[7, 8, 6], mask=mask)
    acc, tok = torch.tensor([2, 1, 0]), torch.tensor([1, 0, 2])
    cmd = SpecCommitMetadata.evolve_from(md, accepted_index=acc, track_token=tok)
    assert cmd.mamba_cache_indices is md.mamba_cache_indices  # copied, not rebuilt
    a = _commit_args(3, 3)
    want = {k: v.clone() for k, v in a.items()}
    spec_commit_from_metadata(cmd, a["conv_pool"], a["ssm_pool"], a["inter_conv"], a["inter_ssm"],
                              impl=impl)  # fmt: skip
    track: dict[str, Any] = {}
    if tracking:  # has_mamba_track_mask decides, without reading the mask
        track = {"track_indices": md.mamba_track_indices, "track_mask": md.mamba_track_mask,
                 "track_token": tok}  # fmt: skip
    spec_commit(want["conv_pool"], want["ssm_pool"], want["inter_conv"], want["inter_ssm"],
                state_indices=md.mamba_cache_indices, accepted_index=acc, impl=impl, **track)  # fmt: skip
    assert torch.equal(bits(a["ssm_pool"]), bits(want["ssm_pool"]))
    assert torch.equal(bits(a["conv_pool"]), bits(want["conv_pool"]))
    assert torch.equal(a["ssm_pool"][:, 1], a["inter_ssm"][:, 0, 2])
    saved = torch.equal(a["ssm_pool"][:, 7], a["inter_ssm"][:, 0, 1])
    assert saved == tracking


def test_commit_metadata_is_built_only_from_a_verify_metadata() -> None:
    md = _verify_md([0, 1], 2)
    acc = torch.tensor([0, 1])
    with pytest.raises(TypeError, match="cannot be constructed directly"):
        SpecCommitMetadata(**{})
    with pytest.raises(TypeError, match=r"missing derived field\(s\) 'track_token'"):
        SpecCommitMetadata.evolve_from(md, accepted_index=acc)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="accepted_index has 3 rows but its rows are BATCH"):
        SpecCommitMetadata.evolve_from(md, accepted_index=torch.tensor([0, 1, 1]), track_token=acc)
    with pytest.raises(ValueError, match=r"track_token dtype must be one of \(int32, int64\)"):
        SpecCommitMetadata.evolve_from(md, accepted_index=acc, track_token=acc.float())
    decode = prepare_decode(
        ForwardMetadata(query_start_loc=torch.arange(3), mamba_cache_indices=torch.tensor([0, 1]))
    )
    with pytest.raises(ValueError, match="is_target_verify must be set"):
        SpecCommitMetadata.evolve_from(decode, accepted_index=acc, track_token=acc)


def test_commit_entry_refuses_other_metadata_and_foreign_draft_widths() -> None:
    md = _verify_md([0, 1], 2)
    cmd = SpecCommitMetadata.evolve_from(
        md, accepted_index=torch.tensor([0, 1]), track_token=torch.tensor([-1, -1])
    )
    a = _commit_args(3, 2)
    before = {k: v.clone() for k, v in a.items()}
    with pytest.raises(TypeError, match="`cmd` must be a SpecCommitMetadata"):
        spec_commit_from_metadata(md, a["conv_pool"], a["ssm_pool"], a["inter_conv"],  # type: ignore[arg-type]
                                  a["inter_ssm"], impl="reference")  # fmt: skip
    with pytest.raises(ValueError, match=r"`inter_conv` must be \[layers, bs, T, ...\] with T = draft_token_num = 2"):
        spec_commit_from_metadata(cmd, a["conv_pool"], a["ssm_pool"], a["inter_conv"],
                                  a["inter_ssm"], impl="reference")  # fmt: skip
    for k, v in a.items():
        assert torch.equal(v, before[k]), k


def test_commit_entry_debug_mode_refuses_a_verdict_past_T() -> None:
    md = _verify_md([0, 1], 2)
    with debug_mode(False):
        cmd = SpecCommitMetadata.evolve_from(
            md, accepted_index=torch.tensor([0, 2]), track_token=torch.tensor([-1, -1])
        )
    a = _commit_args(2, 2)
    before = a["ssm_pool"].clone()
    with debug_mode(), pytest.raises(ValueError, match=r"`accepted_index` values must be -1 or a draft column"):
        spec_commit_from_metadata(cmd, a["conv_pool"], a["ssm_pool"], a["inter_conv"],
                                  a["inter_ssm"], impl="reference")  # fmt: skip
    assert torch.equal(a["ssm_pool"], before)
