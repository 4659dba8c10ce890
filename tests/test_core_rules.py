"""The declaration rules and value checks of ``hybridmeta.core``, case by case.

Each test states a rule an engine relies on: a bad declaration is refused when the class is
defined, with a message naming the argument or field and the rule; a bad value is refused
naming the field, the row and the value; equality compares tensors by identity; every
field flows through ``evolve_from`` and specialisations. (Written against the survivors of
a mutation run, ``scripts/mutation.sh core``; see docs/testing.md.)
"""

from __future__ import annotations

import inspect
import re
from typing import Any, ClassVar, Literal, Optional

import attrs
import pytest
import torch

from hybridmeta import ForwardMetadata, Mamba2Metadata
from hybridmeta.core import (
    BATCH,
    BOOL,
    FLOAT,
    INDEX,
    Conventions,
    Pad,
    Role,
    RowOrder,
    check_values,
    conventions_of,
    field,
    fields_of,
    is_extension,
    metadata,
    specialized,
    tensor_field,
)

#: a class defined in a test function is named "test_....<locals>.Name" in messages
_L = r"(?:\w+\.<locals>\.)?"
_LOCAL = "^" + _L


def _ids(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


# ------------------------------------------------------------------ tensor_field arguments


def test_tensor_field_refuses_bad_arguments_naming_the_rule() -> None:
    with pytest.raises(
        TypeError,
        match=r"^tensor_field\(rows='batch'\): rows must be a Dim \(BATCH, TOKENS, \.\.\.\) or a "
        r"Rows \(BATCH \+ 1\), not a string$",
    ):
        tensor_field(rows="batch", dtypes=INDEX, pad=Pad.value(-1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^tensor_field: role must be a Role, got 'slot'$"):
        tensor_field(dtypes=INDEX, role="slot")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^tensor_field: pad must be Pad\.value\(v\) or Pad\.CUMULATIVE, got -1$"
    ):
        tensor_field(dtypes=INDEX, pad=-1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^tensor_field: the only accepted default is None$"):
        tensor_field(dtypes=INDEX, default=0)
    with pytest.raises(
        TypeError,
        match=r"^tensor_field\(role=Role\.SLOT\): slot fields hold int32/int64 ids "
        r"\(dtypes=INDEX\); their pad is the class's declared null slot \(Conventions\.null_slot\)$",
    ):
        tensor_field(rows=BATCH, dtypes=None, role=Role.SLOT)
    with pytest.raises(
        TypeError, match=r"^tensor_field\(role=Role\.TRACK_MASK\): a mask has dtypes=BOOL$"
    ):
        tensor_field(rows=BATCH, dtypes=INDEX, role=Role.TRACK_MASK, pad=Pad.value(0))


def test_ndim_is_a_non_negative_int_and_covers_rows_and_cols() -> None:
    for bad in (-1, "2", 1.0):
        with pytest.raises(
            TypeError, match=rf"^tensor_field\(ndim={bad!r}\): ndim must be an int >= 0$"
        ):
            tensor_field(dtypes=INDEX, ndim=bad)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"^tensor_field\(ndim=1\): a field with rows=BATCH and cols='n' needs at least "
        r"2 dimension\(s\)$",
    ):
        tensor_field(rows=BATCH, cols="n", dtypes=INDEX, pad=Pad.value(0), ndim=1)
    with pytest.raises(
        TypeError, match=r"^tensor_field\(ndim=0\): a field with rows=None and cols='n' needs at least 1"
    ):
        tensor_field(cols="n", dtypes=INDEX, ndim=0)

    @metadata
    class _Shapes:
        n: int = field(default=2)
        scalar: torch.Tensor = tensor_field(dtypes=FLOAT, ndim=0)  # free length, 0-d
        plain: torch.Tensor = tensor_field(dtypes=INDEX)  # default: one dimension
        per_row: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0))
        table: torch.Tensor = tensor_field(rows=BATCH, cols="n", dtypes=INDEX, pad=Pad.value(0))
        cube: torch.Tensor = tensor_field(
            rows=BATCH, cols="n", dtypes=INDEX, pad=Pad.value(0), ndim=3
        )

    assert {s.name: s.ndim for s in fields_of(_Shapes) if s.is_tensor} == {
        "scalar": 0,
        "plain": 1,
        "per_row": 1,
        "table": 2,
        "cube": 3,
    }
    md = _Shapes(
        scalar=torch.tensor(1.0),
        plain=_ids(1, 2, 3),
        per_row=_ids(1, 2),
        table=torch.zeros(2, 2, dtype=torch.int64),
        cube=torch.zeros(2, 2, 5, dtype=torch.int64),
    )
    assert md.scalar.dim() == 0
    with pytest.raises(ValueError, match=_LOCAL + r"_Shapes\.table must have 2 dimension\(s\), got shape \(2,\)$"):
        _Shapes(scalar=md.scalar, plain=md.plain, per_row=md.per_row, table=_ids(1, 2), cube=md.cube)


def test_offsets_are_index_tensors() -> None:
    for dtypes in (FLOAT, None, (torch.int64, torch.float32)):
        with pytest.raises(
            TypeError,
            match=r"^tensor_field\(pad=Pad\.CUMULATIVE\): offsets are index tensors \(dtypes=INDEX\)$",
        ):
            tensor_field(rows=BATCH + 1, dtypes=dtypes, pad=Pad.CUMULATIVE)
    # INDEX and each of its members are accepted, as is a free field of any dtype
    for ok in (INDEX, (torch.int32,), (torch.int64,)):
        tensor_field(rows=BATCH + 1, dtypes=ok, pad=Pad.CUMULATIVE)
    tensor_field(dtypes=None)


@pytest.mark.parametrize(
    ("dtypes", "pad", "message"),
    [
        (INDEX, 1.5, r"the pad must be a plain int \(an integer field\), got float$"),
        (INDEX, True, r"the pad must be a plain int \(an integer field\), got bool$"),
        (BOOL, 0, r"the pad must be True or False \(a BOOL field\), got int$"),
        (FLOAT, True, r"the pad must be an int or a float \(a float field\), got bool$"),
        (FLOAT, "0", r"the pad must be an int or a float \(a float field\), got str$"),
    ],
)
def test_a_constant_pad_must_fit_the_dtypes(
    dtypes: tuple[torch.dtype, ...], pad: Any, message: str
) -> None:
    with pytest.raises(TypeError, match=rf"^tensor_field\(pad=Pad\.value\({pad!r}\)\): {message}"):
        tensor_field(rows=BATCH, dtypes=dtypes, pad=Pad.value(pad))


def test_constant_pads_that_fit_are_accepted() -> None:
    @metadata
    class _Pads:
        mask: torch.Tensor = tensor_field(rows=BATCH, dtypes=BOOL, pad=Pad.value(True))
        scale: torch.Tensor = tensor_field(rows=BATCH, dtypes=FLOAT, pad=Pad.value(0.5))
        count: torch.Tensor = tensor_field(rows=BATCH, dtypes=FLOAT, pad=Pad.value(1))
        tag: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(-7))
        free: torch.Tensor | None = tensor_field(rows=BATCH, pad=Pad.value(2.5), default=None)

    assert {s.name: s.pad for s in fields_of(_Pads)} == {
        "mask": Pad.value(True),
        "scale": Pad.value(0.5),
        "count": Pad.value(1),
        "tag": Pad.value(-7),
        "free": Pad.value(2.5),  # any dtype: any constant
    }


def test_a_slot_fields_pad_is_the_null_slot_and_the_error_names_the_pad_given() -> None:
    for pad, shown in ((Pad.value(0), r"Pad\.value\(0\)"), (Pad.CUMULATIVE, r"Pad\.CUMULATIVE")):
        with pytest.raises(
            TypeError,
            match=_LOCAL + rf"_S\.s: a slot field's pad is the class's null slot -1 "
            rf"\(Conventions\.null_slot\), got {shown}; omit pad=$",
        ):

            @metadata
            class _S:
                s: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=pad, role=Role.SLOT)


# ------------------------------------------------------------------ host fields, governs


def test_a_governing_flag_needs_a_default() -> None:
    for kw in ({"governs": ("m",)}, {"required_when_set": True}):
        with pytest.raises(
            TypeError, match=r"^field\(governs=\.\.\.\): a governing flag needs a default$"
        ):
            field(**kw)


@pytest.mark.parametrize(
    ("target", "decl"),
    [
        ("n", "host"),  # a host field
        ("t", "required"),  # a required tensor
        ("nowhere", "missing"),
    ],
)
def test_governs_names_an_optional_tensor_field(target: str, decl: str) -> None:
    with pytest.raises(
        TypeError, match=_LOCAL + rf"_G\.use: governs={target!r} must name an optional tensor field of "
        + _L + "_G$"
    ):

        @metadata
        class _G:
            n: int = field(default=0)
            t: torch.Tensor = tensor_field(dtypes=INDEX)
            use: bool = field(default=False, governs=(target,))


def test_host_roles_and_defaults_are_registered() -> None:
    @metadata
    class _H:
        t: torch.Tensor | None = tensor_field(dtypes=INDEX, default=None)
        flag: bool = field(default=True, role=Role.SUBSUMED_FLAG)
        use: bool = field(default=False, governs=("t",))
        n: int = 3

    specs = {s.name: s for s in fields_of(_H)}
    assert specs["flag"].role is Role.SUBSUMED_FLAG and specs["flag"].default is True
    assert specs["use"].governs == ("t",) and specs["use"].default is False
    assert specs["n"].role is Role.DATA and specs["n"].default == 3
    assert specs["t"].optional and specs["t"].default is None
    assert _H().use is False and _H().flag is True


def test_classvars_stay_class_attributes() -> None:
    @metadata
    class _C:
        LIMIT: ClassVar[int] = 8
        n: int = 1

    assert [s.name for s in fields_of(_C)] == ["n"]
    assert _C(n=2).LIMIT == 8
    with pytest.raises(TypeError):
        _C(LIMIT=3)  # type: ignore[call-arg]


# ------------------------------------------------------------------ class-level rules


def _host_only() -> tuple[Any, Any]:
    """A source and a derived class that adds only host fields (evolve_from from an
    unchanged source then validates only what it adds), built anew by each test that uses
    them: the rules run inside the test."""

    @metadata
    class _Src:
        slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
        label: str = "src"

    @metadata
    class _HostOnly(_Src):
        extra: int
        note: str

    return _Src, _HostOnly


def test_derived_fields_take_no_default_in_any_spelling() -> None:
    src_cls, _ = _host_only()
    for spelled in ("attrs", "tensor"):
        with pytest.raises(
            TypeError,
            match=_LOCAL + r"_D\.x: a field of a derived metadata class takes no default; evolve_from "
            r"requires it \(pass None explicitly for an optional one\); to add your engine's own "
            r"fields to " + _L + r"_Src \(built directly, defaults allowed\), declare the class "
            r"with @metadata\(extension=True\)$",
        ):

            @metadata
            class _D(src_cls):  # type: ignore[valid-type,misc]
                x: Any = (
                    attrs.field(default=0)
                    if spelled == "attrs"
                    else tensor_field(dtypes=INDEX, default=None)
                )


def test_derived_host_fields_are_type_checked_when_the_source_is_unchanged() -> None:
    _Src, _HostOnly = _host_only()
    src = _Src(slots=_ids(0, 1))
    md = _HostOnly.evolve_from(src, extra=1, note="n")
    assert (md.extra, md.note, md.slots, md.label) == (1, "n", src.slots, "src")
    with pytest.raises(TypeError, match=_LOCAL + r"_HostOnly\.extra must be int, got str '1'$"):
        _HostOnly.evolve_from(src, extra="1", note="n")
    with pytest.raises(TypeError, match=_LOCAL + r"_HostOnly\.note must be str, got int 2$"):
        _HostOnly.evolve_from(src, extra=1, note=2)
    # and with a changed source field, every field is checked
    with pytest.raises(TypeError, match=_LOCAL + r"_HostOnly\.label must be str, got int 3$"):
        _HostOnly.evolve_from(src, extra=1, note="n", label=3)


def test_a_host_only_derivation_of_a_host_only_source_checks_what_it_adds() -> None:
    @metadata
    class _Cfg:
        label: str = "cfg"

    @metadata
    class _Step(_Cfg):
        n: int

    assert _Step.evolve_from(_Cfg(), n=3).n == 3
    with pytest.raises(TypeError, match=_LOCAL + r"_Step\.n must be int, got str '3'$"):
        _Step.evolve_from(_Cfg(), n="3")  # type: ignore[arg-type]


def test_evolve_from_names_every_unknown_and_missing_field() -> None:
    _Src, _HostOnly = _host_only()
    src = _Src(slots=_ids(0, 1))
    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_HostOnly\.evolve_from: unknown field\(s\) 'bogus', 'other'; " + _L
        + r"_HostOnly has fields: slots, label, extra, note$",
    ):
        _HostOnly.evolve_from(src, extra=1, note="n", bogus=1, other=2)
    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_HostOnly\.evolve_from: missing derived field\(s\) 'extra', 'note'; every field "
        r"that " + _L + r"_HostOnly adds over its source must be passed explicitly \(pass None explicitly "
        r"for an optional one\)$",
    ):
        _HostOnly.evolve_from(src)


def test_a_derived_class_is_not_constructed_directly() -> None:
    _, _HostOnly = _host_only()
    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_HostOnly is derived from " + _L + r"_Src and cannot be constructed "
        r"directly: use " + _L + r"_HostOnly\.evolve_from\(source, \.\.\.\), which copies every "
        + _L + r"_Src field unless you change it \(to add your engine's own fields to " + _L
        + r"_Src and build it directly, declare the subclass with @metadata\(extension=True\)\)$",
    ):
        _HostOnly(slots=_ids(0), label="x", extra=1, note="n")


def test_registry_lookups_refuse_other_classes() -> None:
    _Src, _ = _host_only()
    with pytest.raises(TypeError, match=r"^int is not a @hybridmeta\.metadata class$"):
        fields_of(int)

    class _Undecorated(_Src):  # type: ignore[valid-type,misc]
        pass

    with pytest.raises(TypeError, match=_LOCAL + r"_Undecorated subclasses the metadata class "):
        _Undecorated(slots=_ids(0))  # its inherited validator refuses it
    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_Undecorated subclasses the metadata class " + _L + r"_Src but is not "
        r"decorated with @hybridmeta\.metadata: it would silently build or validate as " + _L
        + r"_Src\. Decorate it \(@metadata\(extension=True\) to add fields to a source class, "
        r"@metadata to derive\)$",
    ):
        fields_of(_Undecorated)


def test_conventions_are_typed_and_a_root_keeps_its_own() -> None:
    with pytest.raises(
        TypeError, match=_LOCAL + r"_R: conventions must be a hybridmeta\.Conventions, got dict$"
    ):

        @metadata(conventions={"null_slot": 0})  # type: ignore[call-overload]
        class _R:
            n: int = 0

    conv = Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0)

    @metadata(conventions=conv)
    class _Root:
        s: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.SLOT)

    assert conventions_of(_Root) is conv
    assert fields_of(_Root)[0].pad == Pad.value(0)
    with pytest.raises(TypeError, match=r"^Conventions\.row_order must be a RowOrder, got str$"):
        Conventions(row_order="decodes_first")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^Conventions\.null_slot must be a plain int >= -1 \(-1: no slot"
    ):
        Conventions(null_slot=True)


@metadata(extension=True)
class _ExtA(ForwardMetadata):
    tag_a: int = 0


@metadata(extension=True)
class _ExtB(ForwardMetadata):
    tag_b: int = 0


def test_at_most_two_metadata_bases() -> None:
    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_Three: a metadata class has at most two metadata bases \(a derived class and "
        r"the extended source it is specialised for\)$",
    ):

        @metadata
        class _Three(Mamba2Metadata, _ExtA, _ExtB):
            pass


_DECODE: dict[str, Any] = {"num_prefills": 0, "num_prefill_tokens": 0, "num_decodes": 2, "mixed": None}


def test_each_extension_gets_its_own_specialisation() -> None:
    a = _ExtA(query_start_loc=_ids(0, 1, 2), mamba_cache_indices=_ids(3, 4), tag_a=5)
    b = _ExtB(query_start_loc=_ids(0, 1, 2), mamba_cache_indices=_ids(3, 4), tag_b=6)
    spec_a: type = specialized(Mamba2Metadata, _ExtA)
    spec_b: type = specialized(Mamba2Metadata, _ExtB)
    assert spec_a is not spec_b
    assert issubclass(spec_a, _ExtA) and not issubclass(spec_a, _ExtB)
    assert issubclass(spec_b, _ExtB) and not issubclass(spec_b, _ExtA)
    assert (spec_a.__qualname__, spec_a.__module__) == ("Mamba2Metadata[_ExtA]", "hybridmeta.model")
    md_a: object = Mamba2Metadata.evolve_from(a, **_DECODE)
    md_b: object = Mamba2Metadata.evolve_from(b, **_DECODE)
    assert (type(md_a), type(md_b)) == (spec_a, spec_b)
    assert (getattr(md_a, "tag_a"), getattr(md_b, "tag_b")) == (5, 6)  # noqa: B009
    same: type = specialized(Mamba2Metadata, ForwardMetadata)
    assert same is Mamba2Metadata
    # errors from a specialisation name it
    with pytest.raises(
        TypeError, match=r"^Mamba2Metadata\[_ExtA\]\.num_decodes must be int, got float 2\.0$"
    ):
        Mamba2Metadata.evolve_from(a, **{**_DECODE, "num_decodes": 2.0})


def test_specialized_refuses_what_it_cannot_specialise() -> None:
    with pytest.raises(
        TypeError, match=r"^specialized: ForwardMetadata is not a derived metadata class$"
    ):
        specialized(ForwardMetadata, _ExtA)
    for bad in (int, Mamba2Metadata, 3):
        with pytest.raises(
            TypeError, match=rf"^specialized: {bad!r} is not ForwardMetadata nor a class extending it$"
        ):
            specialized(Mamba2Metadata, bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ equality and hashing


def test_equality_compares_tensors_by_identity_and_the_rest_by_value() -> None:
    @metadata
    class _Eq:
        t: torch.Tensor = tensor_field(dtypes=INDEX)
        label: str = "x"
        payload: object = None

    t = _ids(1, 2)
    a = _Eq(t=t, label="".join(["a", "b"]), payload=(1, 2))
    b = _Eq(t=t, label="ab", payload=(1, 2))
    assert a == b and hash(a) == hash(b)
    assert a != _Eq(t=_ids(1, 2), label="ab", payload=(1, 2))  # equal values, other tensor
    assert a != _Eq(t=t, label="other", payload=(1, 2))
    assert a != _Eq(t=t, label="ab", payload=(1, 3))
    # a tensor never equals a Python value, even one it would compare equal to elementwise
    assert _Eq(t=t, payload=torch.tensor(3)) != _Eq(t=t, payload=3)
    assert _Eq(t=t, payload=3) != _Eq(t=t, payload=torch.tensor(3))
    assert (a == object()) is False
    assert a.__eq__(object()) is NotImplemented


def test_a_class_without_fields_has_equal_instances() -> None:
    @metadata
    class _Empty:
        pass

    assert _Empty() == _Empty() and hash(_Empty()) == hash(_Empty())


def test_generated_functions_are_multi_line_source_of_the_class_module() -> None:
    _Src, _HostOnly = _host_only()
    for cls, name, first in (
        (_HostOnly, "evolve_from", "def evolve_from(cls, source, /, *, extra=_MISSING"),
        (_HostOnly, "__hm_validate__", "def __hm_validate__(self):"),
        (_Src, "__hm_validate__", "def __hm_validate__(self):"),
        (_Src, "__eq__", "def __eq__(self, other):"),
    ):
        fn = getattr(cls, name)
        lines = inspect.getsource(fn).splitlines(keepends=True)
        assert lines[0].startswith(first) and len(lines) > 3, (cls, name)
        assert all(line.endswith("\n") for line in lines), (cls, name)
        assert (fn.__module__, fn.__qualname__) == (__name__, f"{cls.__qualname__}.{name}")
    hash_ = _Src.__hash__
    assert (hash_.__module__, hash_.__qualname__) == (__name__, f"{_Src.__qualname__}.__hash__")


# ------------------------------------------------------------------ value checks


@metadata
class _Pool:
    n: int = 0  # a host field before the slot fields
    maybe: torch.Tensor | None = tensor_field(dtypes=INDEX, default=None)
    work: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)


@metadata
class _TrackOnly:
    work: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
    track: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.TRACK_SLOT)


@metadata
class _MaskOnly:
    work: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
    mask: torch.Tensor = tensor_field(rows=BATCH, dtypes=BOOL, role=Role.TRACK_MASK, pad=Pad.value(False))


@metadata
class _Tracked:
    offsets: torch.Tensor = tensor_field(rows=BATCH + 1, dtypes=INDEX, pad=Pad.CUMULATIVE)
    work: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
    track: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.TRACK_SLOT)
    mask: torch.Tensor = tensor_field(rows=BATCH, dtypes=BOOL, role=Role.TRACK_MASK, pad=Pad.value(False))


def _tracked(work: list[int], track: list[int], mask: list[bool]) -> _Tracked:
    return _Tracked(
        offsets=torch.arange(len(work) + 1),
        work=torch.tensor(work),
        track=torch.tensor(track),
        mask=torch.tensor(mask),
    )


def test_slot_ids_are_checked_against_the_pool_bounds() -> None:
    check_values(_Pool(work=_ids(0, 7, -1)), num_slots=8)  # slot 0, the last slot, a pad row
    with pytest.raises(
        ValueError,
        match=r"^_Pool\.work must be -1 \(pad\) or a slot >= 0 and < num_slots=8; row 1 holds 8$",
    ):
        check_values(_Pool(work=_ids(0, 8)), num_slots=8)
    with pytest.raises(ValueError, match=r"^_Pool\.work must be .* < num_slots=8; row 1 holds -2$"):
        check_values(_Pool(work=_ids(3, -2)), num_slots=8)
    # one row, behind a host field and an absent optional tensor: still checked
    with pytest.raises(ValueError, match=r"^_Pool\.work must be -1 \(pad\) or a slot >= 0; row 0 holds -5$"):
        check_values(_Pool(work=_ids(-5)))
    check_values(_Pool(work=_ids()))  # an empty batch has nothing to check


def test_check_values_reports_where_and_reads_overrides() -> None:
    md = _Pool(work=_ids(3, -2))
    with pytest.raises(ValueError, match=r"^StaticBuffers\[4\]\.work must be -1 \(pad\)"):
        check_values(md, where="StaticBuffers[4]")
    check_values(md, overrides={"work": _ids(3, 4)})  # the override is what gets checked
    with pytest.raises(ValueError, match=r"^_Pool\.work has a duplicate slot: two rows would update one state$"):
        check_values(_Pool(work=_ids(1, 2)), overrides={"work": _ids(5, 5)})


def test_live_rows_hold_slots_and_offsets_start_at_zero() -> None:
    check_values(_Pool(work=_ids(3, 0)), live=True)
    with pytest.raises(
        ValueError, match=r"^_Pool\.work holds the pad value -1 in live row 1 \(live rows must be slots\)$"
    ):
        check_values(_Pool(work=_ids(3, -1)), live=True)
    md = _Tracked(offsets=_ids(2, 3, 4), work=_ids(1, 2), track=_ids(-1, -1), mask=torch.tensor([False, False]))
    with pytest.raises(ValueError, match=r"^_Tracked\.offsets must start at 0, got 2$"):
        check_values(md)


def test_track_checks_need_both_the_track_slot_and_its_mask() -> None:
    check_values(_TrackOnly(work=_ids(1, 2), track=_ids(1, 1)))
    check_values(_MaskOnly(work=_ids(1, 2), mask=torch.tensor([True, True])))

    @metadata
    class _NoWorking:  # a track slot and its mask, no working slot to clash with
        track: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.TRACK_SLOT)
        mask: torch.Tensor = tensor_field(rows=BATCH, dtypes=BOOL, role=Role.TRACK_MASK, pad=Pad.value(False))

    check_values(_NoWorking(track=_ids(3, -1), mask=torch.tensor([True, False])), physical=True)
    with pytest.raises(ValueError, match=_LOCAL + r"_NoWorking\.track is -1 \(none\) in a row whose mask is set$"):
        check_values(_NoWorking(track=_ids(-1, 4), mask=torch.tensor([True, False])), physical=True)
    check_values(_tracked([1, 2], [5, -1], [True, False]), physical=True)
    with pytest.raises(
        ValueError, match=r"^_Tracked\.track has a duplicate track slot among rows whose mask is set$"
    ):
        check_values(_tracked([1, 2], [5, 5], [True, True]))
    with pytest.raises(
        ValueError,
        match=r"^_Tracked\.track slot 2 of a tracked row is also the work of a row: saving into "
        r"it would overwrite live state$",
    ):
        check_values(_tracked([1, 2], [2, -1], [True, False]), physical=True)


# ------------------------------------------------------------------ classes built in the test
# (the rules that run when a class is defined, exercised on classes each test defines)


class _Thing:
    """An engine type: host fields annotated with it are checked by its own code, not here."""


_Count = int  # a module-level alias: annotations resolve in the declaring class's module


def _host_class() -> Any:
    @metadata
    class _Host:
        Alias = str  # a class-level alias: annotations also resolve in the class body
        n: _Count = 0
        x: float = 0.0
        flag: bool = False
        name: Alias = ""  # type: ignore[valid-type]
        blob: bytes = b""
        opt: int | None = None
        old_opt: Optional[int] = None  # noqa: UP045 (typing.Union spelling on purpose)
        either: int | str = 0
        num: int | float = 0
        shape: tuple[int, ...] = ()
        anything: Any = None
        mixed: int | _Thing = 0  # a member not checked: the union is not checked
        engine: _Thing | None = None
        lit: Literal["a", "b"] = "a"
        LIMIT: ClassVar[int]  # a class variable without a value: no field either

    return _Host


def test_host_values_the_annotations_admit_are_accepted() -> None:
    _Host = _host_class()
    assert [s.name for s in fields_of(_Host)][:3] == ["n", "x", "flag"]
    assert "LIMIT" not in {s.name for s in fields_of(_Host)} and "Alias" not in {
        s.name for s in fields_of(_Host)
    }
    ok: list[dict[str, Any]] = [
        {"n": 3, "x": 1, "flag": True, "name": "s", "blob": b"b"},
        {"x": 2.5, "opt": 3, "old_opt": 4, "either": "s", "num": 1.5, "shape": (1, 2)},
        {"opt": None, "old_opt": None, "num": 2, "either": 5},
        {"anything": object(), "mixed": object(), "engine": _Thing(), "lit": "not checked"},
    ]
    for kw in ok:
        md = _Host(**kw)
        assert all(getattr(md, k) is v for k, v in kw.items())


@pytest.mark.parametrize(
    ("kw", "need_got"),
    [
        ({"n": 1.5}, "int, got float 1.5"),
        ({"n": None}, "int, got NoneType None"),
        ({"n": True}, "int, got bool True"),
        ({"n": "1"}, "int, got str '1'"),
        ({"x": True}, "float or int, got bool True"),
        ({"x": "1"}, "float or int, got str '1'"),
        ({"flag": 1}, "bool, got int 1"),
        ({"name": 1}, "str, got int 1"),
        ({"blob": "b"}, "bytes, got str 'b'"),
        ({"opt": "3"}, "int or None, got str '3'"),
        ({"old_opt": 2.0}, "int or None, got float 2.0"),
        ({"either": 1.5}, "int or str, got float 1.5"),
        ({"either": None}, "int or str, got NoneType None"),
        ({"num": "1"}, "int or float, got str '1'"),
        ({"shape": [1]}, "tuple, got list [1]"),
        ({"shape": None}, "tuple, got NoneType None"),
    ],
)
def test_host_values_of_the_wrong_type_are_refused(kw: dict[str, Any], need_got: str) -> None:
    _Host = _host_class()
    (name,) = kw
    with pytest.raises(TypeError, match=_LOCAL + rf"_Host\.{name} must be {re.escape(need_got)}$"):
        _Host(**kw)


def test_a_0d_tensor_for_a_host_value_is_refused_with_the_reason() -> None:
    _Host = _host_class()
    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_Host\.flag must be bool, got torch\.Tensor tensor\(True\) \(a 0-d tensor "
        r"would be read from the device at every use: pass a Python value\)$",
    ):
        _Host(flag=torch.tensor(True))


def test_unresolvable_annotations_skip_only_their_own_check() -> None:
    @metadata
    class _U:
        handle: NotImportedAnywhere = field(default=None)  # type: ignore[name-defined]  # noqa: F821
        count: int = 0

    assert _U(handle=object()).count == 0
    with pytest.raises(TypeError, match=_LOCAL + r"_U\.count must be int, got str '1'$"):
        _U(count="1")  # type: ignore[arg-type]


def test_tensor_declarations_reach_the_checks() -> None:
    @metadata
    class _T:
        need: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, pad=Pad.value(0))
        maybe: torch.Tensor | None = tensor_field(rows=BATCH, dtypes=BOOL, pad=Pad.value(False), default=None)
        given: torch.Tensor | None = tensor_field(dtypes=FLOAT, optional=True, ndim=2)
        n: int

    specs = {s.name: s for s in fields_of(_T)}
    assert (specs["need"].optional, specs["need"].default) == (False, attrs.NOTHING)
    assert (specs["maybe"].optional, specs["maybe"].default) == (True, None)
    assert (specs["given"].optional, specs["given"].default) == (True, attrs.NOTHING)
    assert (specs["need"].dtypes, specs["given"].ndim, specs["need"].ndim) == (INDEX, 2, 1)
    md = _T(need=_ids(1, 2), given=None, n=1)
    assert md.maybe is None and md.given is None
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'n'"):
        _T(need=_ids(1), given=None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"required keyword-only argument: 'given'"):
        _T(need=_ids(1), n=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=_LOCAL + r"_T\.need is required \(not optional\) and got None$"):
        _T(need=None, given=None, n=1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=_LOCAL + r"_T\.need dtype must be one of \(int32, int64\), got torch\.float32$"
    ):
        _T(need=torch.zeros(2), given=None, n=1)
    with pytest.raises(ValueError, match=_LOCAL + r"_T\.given must have 2 dimension\(s\), got shape \(3,\)$"):
        _T(need=_ids(1), given=torch.zeros(3), n=1)
    with pytest.raises(
        ValueError,
        match=_LOCAL + r"_T\.maybe has 3 rows but its rows are BATCH and need implies 2$",
    ):
        _T(need=_ids(1, 2), maybe=torch.ones(3, dtype=torch.bool), given=None, n=1)


def test_a_root_is_frozen_slotted_and_keyword_only_and_its_derived_class_too() -> None:
    _Src, _HostOnly = _host_only()
    src = _Src(slots=_ids(0, 1))
    md = _HostOnly.evolve_from(src, extra=1, note="n")
    for obj, name in ((src, "label"), (md, "extra")):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(obj, name, "changed")
        assert not hasattr(obj, "__dict__")
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        _Src(_ids(0))


def test_validate_hooks_must_be_methods() -> None:
    with pytest.raises(TypeError, match=_LOCAL + r"_V\.__validate__ must be a method$"):

        @metadata
        class _V:
            n: int = 0
            __validate__ = 3


def _governed() -> tuple[Any, Any, Any]:
    @metadata
    class _Gov:
        slots: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
        mask: torch.Tensor | None = tensor_field(rows=BATCH, dtypes=BOOL, pad=Pad.value(False), default=None)
        track: torch.Tensor | None = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.TRACK_SLOT, default=None)
        use: bool = field(default=False, governs=("mask", "track"), required_when_set=True)

    @metadata(extension=True)
    class _GovExt(_Gov):
        flag: bool = field(default=True, governs=("extra",))
        extra: torch.Tensor | None = tensor_field(dtypes=INDEX, default=None)

    @metadata
    class _GovDerived(_Gov):
        n: int

    return _Gov, _GovExt, _GovDerived


def test_a_governing_flag_resolves_and_guards_its_data() -> None:
    _Gov, _GovExt, _ = _governed()
    mask, track = torch.tensor([True]), _ids(3)
    assert _Gov(slots=_ids(0)).use is False
    assert _Gov(slots=_ids(0), mask=mask, track=track, use=True).use is True
    with pytest.raises(
        ValueError,
        match=_LOCAL + r"_Gov\.use must be stated explicitly when mask and track are given: it "
        r"decides whether the layers use them, and its default False would decide silently$",
    ):
        _Gov(slots=_ids(0), mask=mask, track=track)
    with pytest.raises(
        ValueError,
        match=_LOCAL + r"_Gov\.mask and track are given together or not at all \(use governs them\)$",
    ):
        _Gov(slots=_ids(0), mask=mask, use=True)
    with pytest.raises(ValueError, match=_LOCAL + r"_Gov\.use is set, so mask and track are required$"):
        _Gov(slots=_ids(0), use=True)
    with pytest.raises(TypeError, match=_LOCAL + r"_Gov\.use must be bool, got int 1$"):
        _Gov(slots=_ids(0), mask=mask, track=track, use=1)
    @metadata
    class _Three:
        a: torch.Tensor | None = tensor_field(dtypes=INDEX, default=None)
        b: torch.Tensor | None = tensor_field(dtypes=INDEX, default=None)
        c: torch.Tensor | None = tensor_field(dtypes=INDEX, default=None)
        use: bool = field(default=False, governs=("a", "b", "c"))

    with pytest.raises(
        ValueError,
        match=_LOCAL + r"_Three\.a and b, c are given together or not at all \(use governs them\)$",
    ):
        _Three(a=_ids(1), c=_ids(2), use=True)
    # an extension keeps its fields in the instance dict: its flag resolves there
    ext = _GovExt(slots=_ids(0))
    assert ext.use is False and ext.flag is True
    assert _GovExt(slots=_ids(0), extra=_ids(1), flag=False).flag is False


def test_evolve_from_that_changes_governed_data_restates_the_flag() -> None:
    _Gov, _GovExt, _GovDerived = _governed()
    mask, track = torch.tensor([True]), _ids(3)
    for src in (_Gov(slots=_ids(0)), _GovExt(slots=_ids(0))):
        with pytest.raises(
            TypeError,
            match=_LOCAL + r"_GovDerived(?:\[" + _L + r"_GovExt\])?\.evolve_from: changes mask / "
            r"track, which use governs; "
            r"pass use explicitly too \(the source's value was decided for other data\)$",
        ):
            _GovDerived.evolve_from(src, n=1, mask=mask, track=track)
        md = _GovDerived.evolve_from(src, n=1, mask=mask, track=track, use=True)
        assert (md.use, md.mask, md.track, md.n) == (True, mask, track, 1)


def test_extensions_flow_through_derived_classes_and_undecorated_classes_are_refused() -> None:
    _Gov, _GovExt, _GovDerived = _governed()
    ext = _GovExt(slots=_ids(0), extra=_ids(5), flag=False)
    md: Any = _GovDerived.evolve_from(ext, n=2)
    spec: Any = specialized(_GovDerived, _GovExt)
    assert type(md) is spec and issubclass(spec, _GovDerived) and issubclass(spec, _GovExt)
    assert spec.__qualname__ == f"{_GovDerived.__qualname__}[{_GovExt.__qualname__}]"
    assert (md.extra, md.flag, md.n, md.slots) == (ext.extra, False, 2, ext.slots)
    assert conventions_of(md) is conventions_of(_GovExt)
    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_GovDerived\[" + _L + r"_GovExt\]\.evolve_from: unknown field\(s\) "
        r"'bogus'; " + _L + r"_GovDerived\[" + _L + r"_GovExt\] has fields: slots, mask, track, use, "
        r"flag, extra, n$",
    ):
        _GovDerived.evolve_from(ext, n=2, bogus=1)

    class _Plain(_GovDerived):  # type: ignore[valid-type,misc]
        pass

    with pytest.raises(TypeError, match=_LOCAL + r"_Plain subclasses the metadata class "):
        _Plain.evolve_from(_Gov(slots=_ids(0)), n=1)


def test_conventions_flow_to_inherited_slot_fields_and_specialisations() -> None:
    conv = Conventions(null_slot=0)

    @metadata
    class _Base:
        s: torch.Tensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.SLOT)

    @metadata(extension=True, conventions=conv)
    class _Ext(_Base):
        pass

    @metadata
    class _Der(_Base):
        n: int

    assert fields_of(_Base)[0].pad == Pad.value(-1) and fields_of(_Ext)[0].pad == Pad.value(0)
    assert conventions_of(_Ext) is conv and conventions_of(_Der) == Conventions()
    md = _Der.evolve_from(_Ext(s=_ids(0)), n=1)
    assert conventions_of(md) is conv
    assert {s.name: s.pad for s in fields_of(type(md))}["s"] == Pad.value(0)
    assert is_extension(_Ext) and not is_extension(_Base) and not is_extension(_Der)


def test_class_level_rules_name_the_class_and_the_way_out() -> None:
    @metadata
    class _Base:
        n: int = 0

    class _Mid(_Base):
        pass

    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_D: its base " + _L + r"_Mid subclasses a metadata class but is not "
        r"decorated with @metadata; an undecorated class in between would make this class a "
        r"root with public construction \(and drop the evolve_from guarantee\)\. Decorate it, or "
        r"derive from the metadata class directly$",
    ):

        @metadata
        class _D(_Mid):
            extra: int

    @metadata
    class _Der(_Base):
        extra: int

    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_E: an extension \(@metadata\(extension=True\)\) extends exactly one "
        r"root or extension metadata class \(e\.g\. ForwardMetadata\); to add fields to a "
        r"derived class, derive from it$",
    ):

        @metadata(extension=True)
        class _E(_Der):
            more: int = 0

    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_Bad\.hidden: init=False fields are refused \(attrs\.evolve silently "
        r"re-defaults them, and evolve_from would too\)$",
    ):

        @metadata
        class _Bad:
            hidden: int = attrs.field(init=False, default=0)

    with pytest.raises(
        TypeError,
        match=_LOCAL + r"_P: define __validate__ \(cheap checks\) or __validate_debug__ \(checks "
        r"that read device values\), not __attrs_post_init__$",
    ):

        @metadata
        class _P:
            x: int = 0

            def __attrs_post_init__(self) -> None:
                pass
