"""The public strategies: batches, draft trees, stale-tail fillers, metadata instances."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import find, given
from hypothesis import strategies as st

from hybridmeta import ForwardMetadata, Mamba2Metadata
from hybridmeta.testing import (
    Batch,
    DraftTree,
    TailFill,
    _schema,
    batches,
    draft_trees,
    fill_tail,
    metadata_instances,
)


@given(
    data=st.data(),
    max_bs=st.integers(1, 6),
    prefills=st.booleans(),
    pad_rows=st.booleans(),
    k=st.integers(1, 4),
)
def test_batches_respect_the_slot_rules(
    data: st.DataObject, max_bs: int, prefills: bool, pad_rows: bool, k: int
) -> None:
    num_slots = 2 * max_bs + data.draw(st.integers(0, 3))
    b = data.draw(
        batches(
            max_bs=max_bs, num_slots=num_slots, prefills=prefills, pad_rows=pad_rows,
            draft_token_num=k,
        )
    )
    assert 1 <= b.bs <= max_bs
    live = [s for s in b.slots if s >= 0]
    assert len(set(live)) == len(live), "live working slots are distinct"
    assert all(-1 <= s < num_slots for s in b.slots)
    if not pad_rows:
        assert len(live) == b.bs
    tracked = [b.track_slots[i] for i in b.tracked_rows()]
    assert len(set(tracked)) == len(tracked)
    assert not set(tracked) & set(live), "flagged track slots are disjoint from working slots"
    for m, t in zip(b.track_mask, b.track_slots, strict=True):
        assert not m or t >= 0, "a flagged row has a track slot"
    assert b.query_start_loc[-1] == b.num_tokens
    assert all(n == k for n in b.extend_lens[b.num_prefills :])
    assert prefills or b.num_prefills == 0
    assert (b.draft_trees is None) == (k == 1)
    assert set(b.addressed()) == set(live) | set(tracked)


def test_batches_refuse_a_pool_too_small_for_track_slots() -> None:
    with pytest.raises(ValueError, match="num_slots=3 < 4"):
        find(batches(max_bs=2, num_slots=3), lambda b: True)


def test_batch_repr_names_the_rows() -> None:
    b = Batch(slots=(3, -1), track_slots=(5, -1), track_mask=(True, False), extend_lens=(1, 1))
    assert repr(b) == (
        "Batch(bs=2, slots=(3, -1), track_slots=(5, -1), track_mask=(True, False), seed=0)"
    )
    assert b.live_rows() == (0,)
    assert b.tracked_rows() == (0,) and b.has_track, "row 0 alone saving is a tracked step"
    assert not Batch(slots=(3,), track_slots=(5,), track_mask=(False,), extend_lens=(1,)).has_track
    assert b.addressed() == {3: "working slot of row 0", 5: "track slot of row 0"}


@given(k=st.integers(1, 8), data=st.data())
def test_draft_trees_are_consistent(k: int, data: st.DataObject) -> None:
    tree: DraftTree = data.draw(draft_trees(k))
    assert tree.k == k and tree.parent[0] == -1
    # Rebuild each node's parent from first-child / next-sibling links.
    parent = [-1] * k
    for p in range(k):
        c = tree.next_token[p]
        while c != -1:
            parent[c] = p
            c = tree.next_sibling[c]
    assert tuple(parent) == tree.parent
    assert all(0 <= tree.parent[i] < i for i in range(1, k))


@pytest.mark.parametrize("fill", list(TailFill))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool])
def test_fill_tail(fill: TailFill, dtype: torch.dtype) -> None:
    t = torch.full((5, 2), 7).to(dtype)
    before = t.clone()
    fill_tail(t, fill, num_slots=4, seed=1)
    if fill is TailFill.PREVIOUS:
        assert torch.equal(t, before)
        return
    if dtype == torch.int32:
        assert int(t.min()) >= 0 and int(t.max()) < 4, "index fills stay legal slots"
        if fill is TailFill.ZEROS:
            assert not t.any()
        if fill is TailFill.HUGE:
            assert bool((t == 3).all())
    elif dtype.is_floating_point:
        if fill is TailFill.NAN:
            assert bool(t.isnan().all())
        elif fill is TailFill.HUGE:
            assert bool((t == torch.finfo(dtype).max).all())
        elif fill is TailFill.ZEROS:
            assert not t.any()
        else:
            assert not torch.equal(t, before)
    elif fill in (TailFill.NAN, TailFill.HUGE):
        assert bool(t.all())
    elif fill is TailFill.ZEROS:
        assert not t.any()


@given(md=metadata_instances(ForwardMetadata))
def test_metadata_instances_follow_the_declarations(md: ForwardMetadata) -> None:
    assert type(md) is ForwardMetadata
    bs = md.mamba_cache_indices.shape[0]
    assert 1 <= bs <= 4
    # Declarations read through the testing package's one adapter over FieldSpec.
    for spec in _schema.fields(ForwardMetadata):
        v = getattr(md, spec.name)
        if not spec.is_tensor or v is None:
            continue
        assert spec.dtypes is None or v.dtype in spec.dtypes, spec.name
        if spec.rows == _schema.Rows("batch"):
            assert v.shape[0] == bs, spec.name
        if spec.rows == _schema.Rows("batch", 1):
            assert v.shape[0] == bs + 1
            assert bool((v[1:] >= v[:-1]).all()) and int(v[0]) == 0, "offsets"
    assert int(md.mamba_cache_indices.min()) >= -1
    # Governed fields travel together with their flag; 2-D fields follow their declared cols.
    assert (md.mamba_track_mask is None) == (md.mamba_track_indices is None)
    assert not md.has_mamba_track_mask or md.mamba_track_mask is not None
    for name in ("retrieve_parent_token", "retrieve_next_token", "retrieve_next_sibling"):
        t = getattr(md, name)
        assert t is None or t.shape == (bs, md.draft_token_num), name


def test_metadata_instances_of_a_derived_class() -> None:
    strategy = metadata_instances(
        Mamba2Metadata,
        values={
            "num_prefills": st.just(0),
            "num_prefill_tokens": st.just(0),
            "num_decodes": lambda drawn: st.just(drawn["batch"]),
            "mixed": st.none(),
            "draft_token_num": st.just(1),
        },
        cols={"retrieve_next_token": 1, "retrieve_next_sibling": 1, "retrieve_parent_token": 1},
    )

    @given(strategy)
    def check(md: Mamba2Metadata) -> None:
        assert type(md) is Mamba2Metadata
        assert md.num_decodes == md.mamba_cache_indices.shape[0]

    check()


def test_metadata_instances_name_an_undrawable_field() -> None:
    from hybridmeta import metadata

    @metadata
    class Holder:
        thing: object

    with pytest.raises(
        TypeError,
        match=r"^metadata_instances\(.*Holder\): cannot draw field 'thing' \(annotation "
        r"<class 'object'>\); pass values=\{'thing': strategy\}",
    ):
        find(metadata_instances(Holder), lambda m: True)
    assert attrs.has(Holder)
