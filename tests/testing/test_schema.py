"""``hybridmeta.testing._schema``: the declarations and annotations the harness reads.

This module deliberately has no ``from __future__ import annotations``: the string
annotations below are written as strings, and ``list["Missing"]`` is evaluated when its
class is created (an annotation object, not a string, that still cannot be resolved).
"""

from dataclasses import dataclass
from datetime import date
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.vendor.pretty import pretty

from hybridmeta import Conventions, ForwardMetadata, Mamba2Metadata, metadata
from hybridmeta.core import fields_of
from hybridmeta.integrations.vllm.metadata import VllmMamba2Step
from hybridmeta.testing import Batch, _schema, metadata_instances, sentinel_instances
from hybridmeta.testing.flow import class_fields

if TYPE_CHECKING:  # never true at run time: "Missing" does not resolve
    from fractions import Fraction as Missing

if TYPE_CHECKING:
    from fractions import Fraction as Scheduler
else:
    Scheduler = object  # the run-time placeholder some engines define for a checker-only type

_NOT_DEFINED = "NameError: name 'Missing' is not defined"


class Engine:
    """A type only this module defines (the harness's own module does not hold the name)."""


# --------------------------------------------------------------------------- type_hints


@dataclass
class Mixed:
    engine: "Engine"
    later: "Missing"


def test_one_unresolvable_hint_leaves_the_others_resolved_in_their_module() -> None:
    resolved, unresolved = _schema.type_hints(Mixed)
    assert resolved == {"engine": Engine}
    assert unresolved == {"later": _schema.UnresolvedHint("Missing", _NOT_DEFINED)}
    by_name = {f.name: f for f in class_fields(Mixed)}
    assert by_name["engine"].annotation is Engine and by_name["later"].unresolved


def test_a_class_whose_module_is_not_loaded_still_names_its_unresolvable_hint() -> None:
    # Classes generated at run time (exec, code generators) may name no loaded module.
    cls = type(
        "Generated",
        (),
        {"__annotations__": {"n": "int", "later": "Missing"}, "__module__": "hm_not_loaded"},
    )
    resolved, unresolved = _schema.type_hints(cls)
    assert resolved == {"n": int}
    assert unresolved == {"later": _schema.UnresolvedHint("Missing", _NOT_DEFINED)}


@dataclass
class Base:
    value: int


@dataclass
class Rebound(Base):
    value: "Missing"  # type: ignore[assignment]


@dataclass
class Deferred:
    value: "Missing"


@dataclass
class Concrete(Deferred):
    value: int  # type: ignore[assignment]


def test_a_subclass_annotation_replaces_the_base_one() -> None:
    # Resolvable in the base, not in the subclass: unresolved only (not the base's int).
    assert _schema.type_hints(Rebound) == (
        {},
        {"value": _schema.UnresolvedHint("Missing", _NOT_DEFINED)},
    )
    with pytest.raises(TypeError, match=r"Rebound field\(s\) 'value': 'Missing'"):
        sentinel_instances(Rebound)
    # Unresolvable in the base, resolvable in the subclass: resolved only.
    assert _schema.type_hints(Concrete) == ({"value": int}, {})


@dataclass
class WithPlaceholder:
    scheduler: "Scheduler | None" = None


def test_localns_wins_over_a_run_time_placeholder() -> None:
    assert _schema.type_hints(WithPlaceholder) == ({"scheduler": object | None}, {})
    resolved, unresolved = _schema.type_hints(WithPlaceholder, {"Scheduler": int})
    assert resolved == {"scheduler": int | None} and not unresolved


@dataclass
class Event:
    date: "date | None" = None  # a field named after its type: a class attribute None


def test_hints_resolve_like_typing_get_type_hints() -> None:
    # The module's ``date`` (the type), not the class attribute holding the default.
    assert _schema.type_hints(Event) == ({"date": date | None}, {})


@dataclass
class Eager:
    items: list["Missing"]


def test_an_unresolvable_annotation_object_is_named_as_text() -> None:
    _, unresolved = _schema.type_hints(Eager)
    assert unresolved == {"items": _schema.UnresolvedHint("list['Missing']", _NOT_DEFINED)}
    with pytest.raises(TypeError) as info:
        sentinel_instances(Eager)
    assert f"""field(s) 'items': "list['Missing']" ({_NOT_DEFINED})""" in str(info.value)


# --------------------------------------------------------------------------- the error


@dataclass
class TwoBad:
    b: "Missing | None"
    a: "Missing"


def test_the_unresolved_hints_error_names_each_field_and_both_ways_out() -> None:
    with pytest.raises(TypeError) as info:
        sentinel_instances(TwoBad)
    assert str(info.value) == (
        "sentinel_instances(TwoBad): cannot resolve the type hint of TwoBad field(s) "
        f"'a': 'Missing' ({_NOT_DEFINED}); 'b': 'Missing | None' ({_NOT_DEFINED}). "
        f"The annotation names something module {__name__!r} does not define at run time "
        "(an `if TYPE_CHECKING:` import under `from __future__ import annotations`?). "
        "Pass localns={'Name': the_class} to resolve it, or "
        "values={'a': strategy} to draw the field without its hint"
    )


# --------------------------------------------------------------------------- fields


@pytest.mark.parametrize("cls", [ForwardMetadata, Mamba2Metadata, VllmMamba2Step])
def test_fields_carry_each_declared_role_and_governing_flag(cls: type) -> None:
    infos = _schema.fields(cls)
    assert [f.name for f in infos] == [s.name for s in fields_of(cls)]
    for f, spec in zip(infos, fields_of(cls), strict=True):
        assert (f.role, f.slot_role) == (spec.role.value, spec.role.is_slot), f.name
        assert (f.governs, f.required_when_set) == (tuple(spec.governs), spec.required_when_set)


def test_fields_of_the_model_say_which_flag_governs_what() -> None:
    info = {f.name: f for f in _schema.fields(ForwardMetadata)}
    track = info["has_mamba_track_mask"]
    assert track.governs == ("mamba_track_mask", "mamba_track_indices")
    assert track.required_when_set is True
    verify = info["is_target_verify"]
    assert verify.governs == ("retrieve_parent_token",) and verify.required_when_set is False
    assert info["mamba_cache_indices"].role == "working_slot"
    assert info["mamba_track_mask"].role == "track_mask" and not info["mamba_track_mask"].is_slot


def test_a_slot_field_padded_with_a_null_slot_is_a_slot_field_by_its_role() -> None:
    # vLLM's null slot is 0: its slot fields are not recognisable by a -1 pad.
    info = {f.name: f for f in _schema.fields(VllmMamba2Step)}
    for name in ("state_indices", "mamba_cache_indices"):
        assert info[name].pad_value == 0 and info[name].slot_role is True
        assert info[name].is_slot, name
    assert not info["seq_lens"].is_slot  # an index field padded with 0, role ENGINE_ONLY


# --------------------------------------------------------------------------- Batch


def test_a_batch_pretty_prints_as_its_repr() -> None:
    # Hypothesis prints falsifying examples with its vendored pretty printer.
    b = Batch(slots=(0, -1, 2), track_slots=(1, 0, 0), track_mask=(True, True, False),
              extend_lens=(1, 1, 1))  # fmt: skip
    assert pretty(b) == repr(b)
    assert pretty(b).startswith("Batch(bs=3, slots=(0, -1, 2)")


@dataclass
class EventLater:
    date: "date | None" = None
    later: "Missing | None" = None


def test_one_unresolvable_hint_does_not_change_how_the_others_resolve() -> None:
    # Field by field, names are looked up as typing.get_type_hints looks them up: the
    # module's ``date`` (the type), not the class attribute holding the field's default.
    resolved, unresolved = _schema.type_hints(EventLater)
    assert resolved == {"date": date | None}
    assert set(unresolved) == {"later"}
    # localns given: looked up first.
    resolved, unresolved = _schema.type_hints(EventLater, {"Missing": int})
    assert resolved == {"date": date | None, "later": int | None} and not unresolved


@dataclass
class Nested:
    class Inner:
        """Defined in the class body only."""

    inner: "Inner"
    later: "Missing"


def test_a_name_of_the_class_body_resolves_with_or_without_localns() -> None:
    for localns in (None, {"Engine": Engine}):
        resolved, unresolved = _schema.type_hints(Nested, localns)
        assert resolved == {"inner": Nested.Inner} and set(unresolved) == {"later"}


@metadata(extension=True, conventions=Conventions(null_slot=0))
class Null0(ForwardMetadata):
    """Null slot 0: a reserved slot inside the pool (vLLM's null block)."""


@settings(max_examples=60, database=None, deadline=None, derandomize=True)
@given(data=st.data())
def test_drawn_slot_ids_respect_the_classs_null_slot(data: st.DataObject) -> None:
    # A class whose null slot is 0 never gets -1 (no slot at all under its conventions,
    # refused by its value checks) in a field that holds slots by its role.
    md = data.draw(metadata_instances(Null0))
    for f in _schema.fields(Null0):
        value = getattr(md, f.name)
        if f.slot_role and value is not None:
            assert int(value.min()) >= 0, (f.name, value)
