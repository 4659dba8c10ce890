"""The field-flow checker on dataclasses, attrs classes, NamedTuples and metadata classes."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import attrs
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

from hybridmeta import ForwardMetadata, prepare_decode
from hybridmeta.testing import FieldFlowError, assert_field_flow, check_field_flow, resolve_settings
from hybridmeta.testing.flow import Sentinel, class_fields

_QUICK = settings(resolve_settings(), max_examples=30)


@dataclasses.dataclass(kw_only=True)
class Src:
    slots: torch.Tensor
    count: int
    flag: bool = False
    name: str = "x"
    extra: object = None


@dataclasses.dataclass(kw_only=True)
class Dst(Src):
    total: int


def copy_all(s: Src) -> Dst:
    return Dst(**{f.name: getattr(s, f.name) for f in dataclasses.fields(Src)}, total=1)


def drop_flag(s: Src) -> Dst:
    return Dst(slots=s.slots, count=s.count, name=s.name, extra=s.extra, total=1)


def swap(s: Src) -> Dst:
    return Dst(slots=s.slots, count=len(s.name), flag=s.flag, name=s.name, extra=s.extra, total=1)


def test_a_complete_constructor_passes() -> None:
    report = assert_field_flow(Src, copy_all, derived=Dst, settings=_QUICK)
    assert report.ok and report.checked == ("slots", "count", "flag", "name", "extra")


def test_a_dropped_field_is_named_with_its_default() -> None:
    with pytest.raises(FieldFlowError) as info:
        assert_field_flow(Src, drop_flag, derived=Dst, settings=_QUICK)
    report = info.value.report
    assert report.dropped == ("flag",)
    (fail,) = report.failures
    assert fail.took_default and fail.source_value == "True" and fail.derived_value == "False"
    text = str(info.value)
    assert "Src.flag does not reach Dst through drop_flag" in text
    assert "silently took Dst's default" in text
    assert "falsifying source: Src(" in text and "flag=True" in text


def test_a_miswired_field_is_not_blamed_on_a_default() -> None:
    report = check_field_flow(Src, swap, derived=Dst, settings=_QUICK)
    assert report.dropped == ("count",)
    assert not report.failures[0].took_default


def test_ignore_rename_and_absent_attributes() -> None:
    @attrs.frozen
    class Out:
        indices: torch.Tensor
        count: int

    def build(s: Src) -> Out:
        return Out(indices=s.slots, count=s.count)

    report = check_field_flow(Src, build, rename={"slots": "indices"}, ignore=("name",),
                              settings=_QUICK)  # fmt: skip
    assert report.dropped == ("flag", "extra")
    assert all(f.derived_value == "<absent>" for f in report.failures)
    assert "Out has no attribute 'flag'" in report.format()


def test_namedtuple_and_attrs_sources() -> None:
    class Pair(NamedTuple):
        a: int
        b: int = 3

    @attrs.define
    class Both:
        a: int
        b: int = 0

    report = check_field_flow(Pair, lambda p: Both(a=p.a), derived=Both, settings=_QUICK)
    assert report.dropped == ("b",)
    assert [f.name for f in class_fields(Pair)] == ["a", "b"]
    assert class_fields(Both)[1].default == 0


def test_undrawable_fields_get_unique_sentinels() -> None:
    report = check_field_flow(Src, lambda s: copy_all(dataclasses.replace(s, extra=object())),
                              derived=Dst, settings=_QUICK)  # fmt: skip
    assert report.dropped == ("extra",)
    assert "<sentinel extra#" in report.failures[0].source_value
    assert repr(Sentinel("f", 3)) == "<sentinel f#3>"


def test_hybridmeta_metadata_classes_flow_through_evolve_from() -> None:
    # prepare_decode refuses target-verify sources: the strategy is told so.
    report = check_field_flow(
        ForwardMetadata, prepare_decode, settings=_QUICK,
        values={"is_target_verify": st.just(False)},
        fields=("mamba_cache_indices", "has_mamba_track_mask", "mamba_track_mask_indices"),
    )  # fmt: skip
    assert report.ok and report.derived == "Mamba2Metadata"


def test_unknown_fields_and_classes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"no field\(s\) \['nope'\]"):
        check_field_flow(Src, copy_all, fields=("nope",), settings=_QUICK)
    with pytest.raises(TypeError, match="not a dataclass, attrs class or NamedTuple"):
        class_fields(int)
