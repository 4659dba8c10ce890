"""Properties of ``evolve_from``: every source field flows through unless changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridmeta import ForwardMetadata, Mamba2Metadata, fields_of, metadata, tensor_field
from hybridmeta.core import BATCH, INDEX, Pad
from tests.properties.strategies.metadata import forward_metadata, forward_metadata_kwargs

_SOURCE_NAMES = [s.name for s in fields_of(ForwardMetadata)]


def _decode_changes(fwd: ForwardMetadata) -> dict[str, Any]:
    return {
        "num_prefills": 0,
        "num_prefill_tokens": 0,
        "num_decodes": fwd.mamba_cache_indices.shape[0],
        "mixed": None,
    }


@given(fwd=forward_metadata())
def test_every_source_field_survives(fwd: ForwardMetadata) -> None:
    md = Mamba2Metadata.evolve_from(fwd, **_decode_changes(fwd))
    for name in _SOURCE_NAMES:
        # Same object, not an equal copy: tensors are never re-created on the way.
        assert getattr(md, name) is getattr(fwd, name), name


@given(kw=forward_metadata_kwargs(), data=st.data())
def test_overrides_change_only_the_named_fields(kw: dict[str, Any], data: st.DataObject) -> None:
    fwd = ForwardMetadata(**kw)
    bs = fwd.mamba_cache_indices.shape[0]
    candidates: dict[str, Any] = {
        "mamba_cache_indices": torch.arange(bs, dtype=torch.int64),
        "has_mamba_track_mask": False,
        "conv_states_mask_indices": torch.zeros(3, dtype=torch.int32),
        "mamba_track_mask_indices": None,
        "query_start_loc": torch.arange(bs + 1, dtype=torch.int32),
    }
    names = data.draw(st.sets(st.sampled_from(sorted(candidates))))
    changes = {n: candidates[n] for n in names}
    md = Mamba2Metadata.evolve_from(fwd, **_decode_changes(fwd), **changes)
    for name in _SOURCE_NAMES:
        expected = changes[name] if name in changes else getattr(fwd, name)
        assert getattr(md, name) is expected, name
    assert md.num_decodes == bs
    assert md.mixed is None


def test_a_field_added_to_a_source_flows_through_unchanged_derived_class() -> None:
    @metadata
    class Source:
        slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-1))
        brand_new_flag: bool = False  # the field a later change adds to the source

    @metadata
    class Derived(Source):  # written before anyone knew about brand_new_flag
        count: int

    src = Source(slots=torch.tensor([1, 2]), brand_new_flag=True)
    out = Derived.evolve_from(src, count=2)
    assert out.brand_new_flag is True
    assert out.slots is src.slots
    assert [s.name for s in fields_of(Derived)] == ["slots", "brand_new_flag", "count"]


@given(fwd=forward_metadata())
def test_equality_compares_tensors_by_identity(fwd: ForwardMetadata) -> None:
    a = Mamba2Metadata.evolve_from(fwd, **_decode_changes(fwd))
    b = Mamba2Metadata.evolve_from(fwd, **_decode_changes(fwd))
    assert a == b
    assert hash(a) == hash(b)
    c = Mamba2Metadata.evolve_from(
        fwd, **_decode_changes(fwd), mamba_cache_indices=fwd.mamba_cache_indices.clone()
    )
    assert a != c  # equal values, different tensor: not the same metadata


def test_missing_unknown_and_wrong_source_fail_at_run_time() -> None:
    fwd = ForwardMetadata(
        query_start_loc=torch.arange(3, dtype=torch.int32),
        mamba_cache_indices=torch.tensor([0, 1], dtype=torch.int32),
    )
    with pytest.raises(
        TypeError, match=r"Mamba2Metadata\.evolve_from: missing derived field\(s\) 'mixed'"
    ):
        Mamba2Metadata.evolve_from(fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unknown field\(s\) 'mamba_track_maks'"):
        Mamba2Metadata.evolve_from(
            fwd,
            num_prefills=0,
            num_prefill_tokens=0,
            num_decodes=2,
            mixed=None,
            mamba_track_maks=None,  # type: ignore[call-arg]
        )
    md = Mamba2Metadata.evolve_from(
        fwd, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None
    )
    with pytest.raises(TypeError, match=r"source must be a ForwardMetadata .* got Mamba2Metadata"):
        Mamba2Metadata.evolve_from(
            md, num_prefills=0, num_prefill_tokens=0, num_decodes=2, mixed=None
        )
    with pytest.raises(
        TypeError, match=r"cannot be constructed directly: use Mamba2Metadata\.evolve_from"
    ):
        Mamba2Metadata(query_start_loc=fwd.query_start_loc)  # type: ignore[call-arg]
