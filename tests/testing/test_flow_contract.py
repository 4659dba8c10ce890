"""The field-flow checker's contract, piece by piece: what :func:`class_fields` reads from
each kind of class, which value :func:`_sentinel_for` draws for each type (and how it keeps
off a default), what :func:`sentinel_instances` and :func:`check_field_flow` build from
them, and the words of :class:`FlowFailure` / :class:`FlowReport`. ``test_flow.py`` shows the
checker on whole constructors; this file pins each documented behaviour so that a change
to one of them fails a test."""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import math
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import attrs
import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from hybridmeta import ForwardMetadata
from hybridmeta.testing import (
    FieldFlowError,
    FieldFlowUsageError,
    assert_field_flow,
    check_field_flow,
    resolve_settings,
)
from hybridmeta.testing._schema import NO_DEFAULT, UnresolvedHint
from hybridmeta.testing.flow import (
    FlowFailure,
    FlowReport,
    Sentinel,
    _call_text,
    _reaches,
    _same_default,
    _sentinel_for,
    _short,
    class_fields,
    sentinel_instances,
)
from tests.testing.test_flow import Dst, Src, copy_all, drop_flag

if TYPE_CHECKING:  # never true at run time: `Later` annotations do not evaluate
    from fractions import Fraction as Later

T = TypeVar("T")

_QUICK = settings(resolve_settings(), max_examples=30)
# Deterministic draws for the strategy-level checks: the same examples on every run.
_DRAW = settings(database=None, deadline=None, derandomize=True, max_examples=40,
                 suppress_health_check=list(HealthCheck))  # fmt: skip
_FIND = settings(_DRAW, max_examples=200)


def _draws(strategy: st.SearchStrategy[T]) -> list[T]:
    """The values Hypothesis draws from ``strategy`` (up to 40, the same every run)."""
    out: list[T] = []

    @_DRAW
    @given(strategy)
    def collect(value: T) -> None:
        out.append(value)

    collect()
    assert out
    return out


def _only(strategy: st.SearchStrategy[T]) -> T:
    """The one value ``strategy`` draws (failing if it draws several)."""
    values = _draws(strategy)
    assert all(v is values[0] or v == values[0] for v in values), values
    return values[0]


def _never(strategy: st.SearchStrategy[T], condition: Callable[[T], bool]) -> None:
    """No draw of ``strategy`` satisfies ``condition`` (Hypothesis searches for one)."""
    with pytest.raises(NoSuchExample):
        find(strategy, condition, settings=_FIND)


def _sometimes(strategy: st.SearchStrategy[T], condition: Callable[[T], bool]) -> T:
    return find(strategy, condition, settings=_FIND)


# --------------------------------------------------------------------------- class_fields

_factory_calls: list[object] = []


def _fresh() -> list[int]:
    _factory_calls.append(None)
    return [len(_factory_calls)]


@attrs.define
class AttrsKinds:
    required: int
    plain: int = 4
    falsy: int = 0
    made: list[int] = attrs.Factory(_fresh)
    selfish: int = attrs.Factory(lambda self: self.plain, takes_self=True)
    hidden: int = attrs.field(init=False, default=5)


@dataclasses.dataclass
class DataclassKinds:
    required: int
    plain: int = 4
    none: object = None
    made: list[int] = dataclasses.field(default_factory=_fresh)
    hidden: int = dataclasses.field(init=False, default=5)


class TupleKinds(NamedTuple):
    required: int
    plain: int = 4


Untyped = collections.namedtuple("Untyped", ["a", "b"], defaults=[9])


_MISSING: Any = "Missing"  # a declared type that is a string (mypy reads it as a name)


@attrs.define
class DeclaredOnly:  # no annotations: attrs.field(type=...) declares the types
    known = attrs.field(type=int)
    named = attrs.field(type=_MISSING)


@attrs.define
class StringAnnotated:  # `from __future__ import annotations`: attrs holds the strings
    known: int
    later: Later | None = None


class FieldsButNoTuple:
    _fields = ("a",)


class TupleWithListFields(tuple[int, ...]):
    _fields = ["a"]  # noqa: RUF012


def test_attrs_defaults_factories_and_init() -> None:
    before = len(_factory_calls)
    fields = {f.name: f for f in class_fields(AttrsKinds)}
    assert list(fields) == ["required", "plain", "falsy", "made", "selfish", "hidden"]
    # No default (attrs.NOTHING) is NO_DEFAULT; a falsy default is a default.
    assert fields["required"].default is NO_DEFAULT and not fields["required"].has_default
    assert fields["plain"].default == 4 and fields["plain"].has_default
    assert fields["falsy"].default == 0 and fields["falsy"].has_default
    # A factory is called once; its value is the default.
    assert len(_factory_calls) == before + 1
    assert fields["made"].default == [before + 1]
    # A factory of the instance has no value without one.
    assert fields["selfish"].default is NO_DEFAULT
    assert [f.init for f in fields.values()] == [True] * 5 + [False]
    assert fields["hidden"].default == 5
    assert fields["required"].annotation is int and not fields["required"].unresolved


def test_dataclass_defaults_factories_and_init() -> None:
    before = len(_factory_calls)
    fields = {f.name: f for f in class_fields(DataclassKinds)}
    assert list(fields) == ["required", "plain", "none", "made", "hidden"]
    assert fields["required"].default is NO_DEFAULT
    assert fields["plain"].default == 4
    assert fields["none"].default is None and fields["none"].has_default
    assert len(_factory_calls) == before + 1
    assert fields["made"].default == [before + 1]
    assert [f.init for f in fields.values()] == [True, True, True, True, False]
    assert fields["hidden"].default == 5
    assert fields["made"].annotation == list[int]


def test_namedtuple_defaults() -> None:
    fields = class_fields(TupleKinds)
    assert [(f.name, f.default, f.annotation, f.init) for f in fields] == [
        ("required", NO_DEFAULT, int, True), ("plain", 4, int, True),
    ]  # fmt: skip
    # collections.namedtuple: defaults, and no annotations at all (None, not unresolved).
    untyped = class_fields(Untyped)
    assert [(f.name, f.default, f.annotation) for f in untyped] == [
        ("a", NO_DEFAULT, None), ("b", 9, None),
    ]  # fmt: skip
    assert not any(f.unresolved for f in untyped)


def test_a_metadata_class_gives_its_declared_defaults() -> None:
    fields = {f.name: f for f in class_fields(ForwardMetadata)}
    # attrs holds a placeholder for a governing flag; the declared default is False.
    assert fields["has_mamba_track_mask"].default is False
    assert fields["draft_token_num"].default == 1
    assert fields["query_start_loc"].default is NO_DEFAULT
    assert fields["query_start_loc"].annotation is torch.Tensor
    assert fields["mamba_track_mask"].annotation == torch.Tensor | None


@pytest.mark.parametrize("cls", [int, FieldsButNoTuple, TupleWithListFields])
def test_other_classes_are_refused_with_what_to_pass(cls: type) -> None:
    with pytest.raises(TypeError) as info:
        class_fields(cls)
    assert str(info.value) == (
        f"{cls.__qualname__} is not a dataclass, attrs class or NamedTuple; pass sources= "
        "and fields= to check it"
    )


def test_annotations_resolved_declared_and_unresolved() -> None:
    # Evaluated annotations win over attrs' strings.
    known, later = class_fields(StringAnnotated)
    assert str(attrs.fields(StringAnnotated).known.type) == "int"
    assert known.annotation is int and not known.unresolved
    # An annotation that does not evaluate keeps its text and why.
    assert later.unresolved
    assert later.annotation == UnresolvedHint(
        "Later | None", "NameError: name 'Later' is not defined"
    )
    # localns resolves it.
    _, resolved = class_fields(StringAnnotated, localns={"Later": Fraction})
    assert resolved.annotation == Fraction | None
    # Without annotations, attrs' declared type is used; a declared string that no
    # annotation holds is unresolved, saying so.
    known, named = class_fields(DeclaredOnly)
    assert known.annotation is int
    assert named.annotation == UnresolvedHint("Missing", "not found in the class's annotations")


# --------------------------------------------------------------------------- _sentinel_for


class Color(enum.Enum):
    RED = 1
    GREEN = 2
    BLUE = 3


class Only(enum.Enum):
    ONE = 1


def test_a_bool_is_drawn_both_ways_unless_a_bool_default_is_avoided() -> None:
    assert set(_draws(_sentinel_for(bool, "f", 1, 1))) == {False, True}
    assert _only(_sentinel_for(bool, "f", 1, 1, avoid=True)) is False
    assert _only(_sentinel_for(bool, "f", 1, 1, avoid=False)) is True
    # A default that is not a bool (a bool field defaulting to None): both differ from it.
    assert set(_draws(_sentinel_for(bool, "f", 1, 1, avoid=None))) == {False, True}


@pytest.mark.parametrize("n", [1, 7, 9_999])
def test_an_int_is_its_number_and_moves_off_an_equal_default(n: int) -> None:
    assert _only(_sentinel_for(int, "f", n, 1)) == n
    for other in (n + 1, 0, None, "x"):
        assert _only(_sentinel_for(int, "f", n, 1, avoid=other)) == n
    moved = _only(_sentinel_for(int, "f", n, 1, avoid=n))
    assert moved != n
    # Past the numbers fields are drawn with (1..9_999), so no other field has it; its
    # last four digits still read as the field's number.
    assert 10_000 <= moved < 20_000 and moved % 10_000 == n


@pytest.mark.parametrize("n", [1, 7, 9_999])
def test_a_float_reads_as_its_number_and_is_not_integral(n: int) -> None:
    value = _only(_sentinel_for(float, "f", n, 1))
    assert isinstance(value, float) and not value.is_integer() and math.floor(value) == n
    assert value == _only(_sentinel_for(float, "f", n, 1, avoid=0.0))
    # A default equal to the field's value: moved off it, still reading as the number.
    moved = _only(_sentinel_for(float, "f", n, 1, avoid=value))
    assert moved != value and not moved.is_integer() and math.floor(moved) % 10_000 == n


def test_a_string_names_the_field_and_its_number() -> None:
    assert _only(_sentinel_for(str, "name", 12, 1)) == "name#12"
    assert _only(_sentinel_for(str, "name", 12, 1, avoid="")) == "name#12"
    moved = _only(_sentinel_for(str, "name", 12, 1, avoid="name#12"))
    assert moved != "name#12" and moved.startswith("name#")


@pytest.mark.parametrize(("n", "length"), [(1, 1), (3, 4), (42, 7)])
def test_a_tensor_is_one_dimensional_int64_of_the_length_reading_as_its_number(
    n: int, length: int
) -> None:
    (t,) = {id(v): v for v in _draws(_sentinel_for(torch.Tensor, "f", n, length))}.values()
    assert t.dtype == torch.int64 and t.shape == (length,)
    # Each element reads as the field's number (hundreds) and its position (units): two
    # fields' tensors share no element.
    assert (t // 100).tolist() == [n] * length
    assert (t % 100).tolist() == list(range(length))
    other = _only(_sentinel_for(torch.Tensor, "g", n + 1, length))
    assert not set(t.tolist()) & set(other.tolist())
    # A default tensor equal to it is avoided.
    moved = _only(_sentinel_for(torch.Tensor, "f", n, length, avoid=t.clone()))
    assert moved.shape == t.shape and moved.dtype == t.dtype and not torch.equal(moved, t)
    assert torch.equal(_only(_sentinel_for(torch.Tensor, "f", n, length, avoid=t + 1)), t)


def test_an_enum_draws_its_members_other_than_the_default() -> None:
    assert set(_draws(_sentinel_for(Color, "f", 1, 1))) == set(Color)
    assert set(_draws(_sentinel_for(Color, "f", 1, 1, avoid=Color.GREEN))) == {
        Color.RED, Color.BLUE,
    }  # fmt: skip
    assert set(_draws(_sentinel_for(Color, "f", 1, 1, avoid=None))) == set(Color)
    # A single member cannot be avoided: it is drawn all the same.
    assert _only(_sentinel_for(Only, "f", 1, 1, avoid=Only.ONE)) is Only.ONE


def test_an_optional_may_be_none_unless_none_is_the_default() -> None:
    free = _draws(_sentinel_for(int | None, "f", 5, 1))
    assert set(free) == {None, 5}
    assert _only(_sentinel_for(int | None, "f", 5, 1, avoid=None)) == 5
    # Another default: None differs from it, and so does the inner value.
    other = set(_draws(_sentinel_for(int | None, "f", 5, 1, avoid=5)))
    assert None in other and 5 not in other and len(other) == 2
    tensors = _draws(_sentinel_for(torch.Tensor | None, "f", 2, 3, avoid=None))
    assert all(isinstance(t, torch.Tensor) and t.shape == (3,) for t in tensors)
    colors = _draws(_sentinel_for(Color | None, "f", 1, 1, avoid=None))
    assert set(colors) == set(Color)


def test_an_optional_of_several_types_is_none_or_a_sentinel() -> None:
    free = _draws(_sentinel_for(int | str | None, "f", 5, 1))
    assert any(v is None for v in free)
    assert any(isinstance(v, Sentinel) for v in free)
    # A None default is avoided here too: such a dropped field must show.
    kept = _draws(_sentinel_for(int | str | None, "f", 5, 1, avoid=None))
    assert all(isinstance(v, Sentinel) and (v.field, v.n) == ("f", 5) for v in kept)


def test_tuples_and_lists_hold_one_to_three_sentinels_of_their_type() -> None:
    tuples = _draws(_sentinel_for(tuple[int, ...], "f", 6, 1))
    assert all(type(v) is tuple and set(v) == {6} for v in tuples)
    assert {len(v) for v in tuples} == {1, 2, 3}  # never empty, which a default often is
    lists = _draws(_sentinel_for(list[str], "name", 6, 1))
    assert all(type(v) is list and set(v) == {"name#6"} for v in lists)
    assert {len(v) for v in lists} == {1, 2, 3}
    nested = _draws(_sentinel_for(list[bool], "f", 6, 1))
    assert {b for v in nested for b in v} == {False, True}


@pytest.mark.parametrize("tp", [object, list, tuple, dict[str, int], int | str, "int"])
def test_other_types_get_a_sentinel_of_the_field(tp: Any) -> None:
    value = _only(_sentinel_for(tp, "f", 8, 1))
    assert isinstance(value, Sentinel) and (value.field, value.n) == ("f", 8)
    assert repr(value) == "<sentinel f#8>"


def test_sentinels_compare_by_identity() -> None:
    a, b = Sentinel("f", 1), Sentinel("f", 1)
    assert a == a and a != b


# --------------------------------------------------------------------------- sentinel_instances


@dataclasses.dataclass
class Many:
    a: int
    b: int
    c: int
    t: torch.Tensor
    u: torch.Tensor
    flag: bool = False
    hidden: int = dataclasses.field(init=False, default=-1)


def _ints(m: Many) -> list[int]:
    return [m.a, m.b, m.c]


def test_instances_draw_distinct_numbers_and_one_tensor_length() -> None:
    draws = _draws(sentinel_instances(Many, max_len=3))
    for m in draws:
        assert len(set(_ints(m))) == 3, m  # distinct: a miswired int shows
        assert all(1 <= v <= 9_999 for v in _ints(m)), m
        assert m.t.shape == m.u.shape and 1 <= m.t.shape[0] <= 3, m
        assert m.hidden == -1  # init=False fields are left to the class
    assert {m.t.shape[0] for m in draws} == {1, 2, 3}
    strategy = sentinel_instances(Many, max_len=2)
    _never(strategy, lambda m: m.t.shape[0] > 2 or min(_ints(m)) < 1)
    _sometimes(strategy, lambda m: m.a == 1)  # the smallest number is 1, not 0


def test_instances_take_overrides_and_avoid_defaults() -> None:
    over = _draws(sentinel_instances(Many, values={"a": st.just(-5)}))
    assert all(m.a == -5 and m.b > 0 for m in over)
    assert {m.flag for m in _draws(sentinel_instances(Many))} == {False, True}
    avoided = _draws(sentinel_instances(Many, avoid_defaults={"flag": False}))
    assert all(m.flag is True for m in avoided)
    # An int whose number is the avoided default is moved off it.
    moved = _sometimes(sentinel_instances(Many, avoid_defaults={"a": 1}), lambda m: m.a > 9_999)
    assert moved.a == 10_001
    _never(sentinel_instances(Many, avoid_defaults={"a": 1}), lambda m: m.a == 1)


def test_instances_need_each_annotation_or_a_value() -> None:
    with pytest.raises(TypeError, match=r"sentinel_instances\(StringAnnotated\).*'later'"):
        sentinel_instances(StringAnnotated)
    by_values = _draws(sentinel_instances(StringAnnotated, values={"later": st.just(Fraction(1))}))
    assert all(s.later == Fraction(1) for s in by_values)
    by_localns = _draws(sentinel_instances(StringAnnotated, localns={"Later": Fraction}))
    assert {type(s.later) for s in by_localns} == {type(None), Sentinel}


# --------------------------------------------------------------------------- report text

_ABSENT = FlowFailure("flag", "True", "<absent>", False, "Src(a)")
_DEFAULTED = FlowFailure("count", "3", "0", True, "Src(a)")
_WRONG = FlowFailure("name", "'n#1'", "''", False, "Src(b)")


def test_a_failure_says_what_arrived_instead() -> None:
    assert _ABSENT.what("Dst") == "Dst has no attribute 'flag'"
    assert _DEFAULTED.what("Dst") == "source 3, derived 0: silently took Dst's default"
    assert _WRONG.what("Dst") == "source 'n#1', derived ''"
    # An absent attribute is absent, whatever took_default says.
    assert dataclasses.replace(_ABSENT, took_default=True).what("D") == "D has no attribute 'flag'"
    assert _DEFAULTED.describe("Src", "Dst", "build") == (
        "Src.count does not reach Dst through build: source 3, derived 0: silently took "
        "Dst's default\n    falsifying source: Src(a)"
    )


def test_report_properties() -> None:
    ok = FlowReport("Src", "Dst", "build", ("a",), ())
    assert ok.ok and ok.dropped == () and ok.examples == ()
    report = FlowReport("Src", "Dst", "build", ("flag", "count", "name", "x"),
                        (_ABSENT, _WRONG, _DEFAULTED))  # fmt: skip
    assert not report.ok
    assert report.dropped == ("flag", "name", "count")
    assert report.examples == ("Src(a)", "Src(b)")  # each once, in failing-field order


def test_report_format_with_one_falsifying_source() -> None:
    report = FlowReport("Src", "Dst", "build", ("flag", "count", "x"), (_ABSENT, _DEFAULTED))
    assert report.format() == (
        "field flow Src -> Dst through build: 2 of 3 source fields do not arrive\n"
        "  - Src.flag does not reach Dst: Dst has no attribute 'flag'\n"
        "  - Src.count does not reach Dst: source 3, derived 0: silently took Dst's default\n"
        "  falsifying source: Src(a)"
    )
    assert str(FieldFlowError(report)) == report.format()


def test_report_format_with_several_falsifying_sources() -> None:
    report = FlowReport("Src", "Dst", "f", ("count", "name", "flag"), (_WRONG, _ABSENT, _DEFAULTED))
    assert report.format() == (
        "field flow Src -> Dst through f: 3 of 3 source fields do not arrive\n"
        "  - Src.name does not reach Dst: source 'n#1', derived '' [source 1]\n"
        "  - Src.flag does not reach Dst: Dst has no attribute 'flag' [source 2]\n"
        "  - Src.count does not reach Dst: source 3, derived 0: silently took Dst's default"
        " [source 2]\n"
        "  falsifying source 1 (name): Src(b)\n"
        "  falsifying source 2 (flag, count): Src(a)"
    )


def test_assert_field_flow_returns_the_report_or_raises_it() -> None:
    report = assert_field_flow(Src, copy_all, derived=Dst, settings=_QUICK)
    assert report.ok and isinstance(report, FlowReport)
    with pytest.raises(FieldFlowError) as info:
        assert_field_flow(Src, drop_flag, derived=Dst, settings=_QUICK)
    assert isinstance(info.value, AssertionError)
    assert info.value.report.dropped == ("flag",)
    assert str(info.value) == info.value.report.format()


# --------------------------------------------------------------------------- value helpers


class _Raises:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparison")

    __hash__ = object.__hash__


def test_reaches_compares_values_tensors_by_shape_dtype_and_content() -> None:
    nan = float("nan")
    assert _reaches(nan, nan)  # the same object reaches, though nan != nan
    assert not _reaches(nan, float("nan"))
    assert _reaches([1, 2], [1, 2]) and not _reaches([1, 2], [2, 1])
    t = torch.tensor([5])
    assert _reaches(t, torch.tensor([5])) and not _reaches(t, torch.tensor([6]))
    assert not _reaches(t, torch.tensor([5.0]))  # same values, other dtype
    assert not _reaches(t, torch.tensor([[5]]))  # other shape
    assert not _reaches(t, 5) and not _reaches(5, t)  # a tensor and a plain value
    grad = torch.ones(2, requires_grad=True)
    assert _reaches(grad, torch.ones(2))
    raising = _Raises()
    assert _reaches(raising, raising) and not _reaches(raising, _Raises())


def test_same_default_needs_a_default() -> None:
    assert _same_default(5, 5) and not _same_default(6, 5)
    assert _same_default(None, None)
    assert not _same_default(5, NO_DEFAULT) and not _same_default(NO_DEFAULT, NO_DEFAULT)
    assert _same_default(torch.zeros(2), torch.zeros(2))


def test_short_keeps_80_characters() -> None:
    exact = "x" * 78  # repr adds the quotes: 80 characters
    assert _short(exact) == repr(exact)
    longer = "x" * 79
    text = _short(longer)
    assert len(text) == 80 and text.endswith("...") and text[:77] == repr(longer)[:77]
    assert _short(3) == "3"


def test_call_text_names_the_call() -> None:
    assert _call_text("build", (), {}) == "build(source)"
    long = list(range(40))
    text = _call_text("build", (1, long), {"k": "v"})
    assert text == f"build(source, 1, {_short(long)}, k='v')" and _short(long).endswith("...")


# --------------------------------------------------------------------------- check_field_flow


@dataclasses.dataclass
class Knob:
    level: int = 3
    flag: bool = False


@dataclasses.dataclass
class Dial:
    level: int = 7
    flag: bool = False


def reset_level(k: Knob) -> Dial:
    return Dial(flag=k.flag)


def test_the_derived_class_and_its_defaults_come_from_the_first_result() -> None:
    for derived in (None, Dial):
        report = check_field_flow(Knob, reset_level, derived=derived, settings=_QUICK)
        assert (report.source, report.derived, report.via) == ("Knob", "Dial", "reset_level")
        assert report.checked == ("level", "flag")
        (fail,) = report.failures
        assert (fail.field, fail.derived_value, fail.took_default) == ("level", "7", True)
        assert fail.source_value == repr(_field_in(fail.example, "level"))
    # Told another derived class, its defaults decide: 7 is not Knob's default.
    (fail,) = check_field_flow(Knob, reset_level, derived=Knob, settings=_QUICK).failures
    assert fail.derived_value == "7" and not fail.took_default


def _field_in(example: str, name: str) -> int:
    return int(example.split(f"{name}=")[1].split(",")[0].rstrip(")"))


def test_values_are_shortened_and_the_example_is_whole() -> None:
    @dataclasses.dataclass
    class Wide:
        slots: torch.Tensor

    def lose(w: Wide) -> Wide:
        return Wide(slots=w.slots.flip(0))

    long_slots = st.just(torch.arange(60))
    (fail,) = check_field_flow(Wide, lose, values={"slots": long_slots}, settings=_QUICK).failures
    assert fail.source_value == _short(torch.arange(60)) and len(fail.source_value) == 80
    assert fail.derived_value == _short(torch.arange(60).flip(0))
    assert len(fail.derived_value) == 80
    assert fail.example == repr(Wide(slots=torch.arange(60)))


def test_via_is_the_qualname_or_the_repr() -> None:
    build = functools.partial(copy_all)
    report = check_field_flow(Src, build, derived=Dst, settings=_QUICK)
    assert report.ok and report.via == repr(build)


def test_fields_and_ignore_choose_the_checked_fields_in_source_order() -> None:
    report = check_field_flow(Src, drop_flag, fields=("name", "flag", "count", "flag"),
                              ignore=("count",), settings=_QUICK)  # fmt: skip
    assert report.checked == ("flag", "name")
    assert report.dropped == ("flag",)
    both = check_field_flow(Src, lambda s: Dst(slots=s.slots, count=s.count, total=1),
                            fields=("extra", "flag"), settings=_QUICK)  # fmt: skip
    assert both.dropped == ("flag", "extra")  # source field order, each once
    assert check_field_flow(Src, drop_flag, ignore=("flag",), settings=_QUICK).ok
    with pytest.raises(
        ValueError, match=r"^check_field_flow: Src has no field\(s\) \['no', 'pe'\]$"
    ):
        check_field_flow(Src, drop_flag, fields=("flag", "no", "pe"), settings=_QUICK)


def test_renamed_fields_are_looked_up_under_their_new_name() -> None:
    @dataclasses.dataclass
    class Out:
        total: int
        enabled: bool = False

    report = check_field_flow(Knob, lambda k: Out(total=k.level, enabled=k.flag),
                              rename={"level": "total", "flag": "enabled"},
                              settings=_QUICK)  # fmt: skip
    assert report.ok
    lost = check_field_flow(Knob, lambda k: Out(total=k.level), settings=_QUICK,
                            rename={"level": "total", "flag": "enabled"})  # fmt: skip
    (fail,) = lost.failures
    assert fail.field == "flag" and fail.took_default and fail.derived_value == "False"


def test_the_falsifying_source_shows_other_fields_at_their_defaults() -> None:
    (example,) = check_field_flow(Src, drop_flag, derived=Dst, settings=_QUICK).examples
    assert "flag=True" in example and "name='x'" in example and "extra=None" in example
    # Fields pinned by values= stay as drawn.
    pinned = check_field_flow(Src, drop_flag, derived=Dst, settings=_QUICK,
                              values={"name": st.just("kept")}).examples  # fmt: skip
    assert "name='kept'" in pinned[0] and "extra=None" in pinned[0]

    # A field the failure needs keeps its value.
    def drop_flag_unless_x(s: Src) -> Dst:
        return dataclasses.replace(copy_all(s), flag=s.flag and s.name == "x")

    (needs,) = check_field_flow(Src, drop_flag_unless_x, derived=Dst, settings=_QUICK).examples
    assert "name='x'" not in needs and "extra=None" in needs
    # Sources the caller draws are shown as drawn.
    own = sentinel_instances(Src, avoid_defaults={"flag": False})
    (drawn,) = check_field_flow(Src, drop_flag, derived=Dst, sources=own,
                                settings=_QUICK).examples  # fmt: skip
    assert "extra=<sentinel extra#" in drawn


@dataclasses.dataclass
class Picky:
    flag: bool = False
    extra: object = 0

    def __post_init__(self) -> None:
        if self.extra == 0:
            raise ValueError("extra must be set")


def test_a_source_class_refusing_its_defaults_keeps_the_drawn_values() -> None:
    (example,) = check_field_flow(Picky, lambda p: Picky(extra=p.extra), settings=_QUICK).examples
    assert "flag=True" in example and "extra=<sentinel extra#" in example


def test_a_dropped_optional_of_several_types_is_found() -> None:
    @dataclasses.dataclass
    class Loose:
        key: int
        tag: int | str | None = None

    report = check_field_flow(Loose, lambda s: Loose(key=s.key), settings=_QUICK)
    assert report.dropped == ("tag",)
    assert report.failures[0].took_default


# --------------------------------------------------------------------------- usage errors


def _one(a: Any) -> Any:
    return a


def _two(a: Any, b: Any) -> Any:
    return a


def _upto_two(a: Any, b: Any = None) -> Any:
    return a


def _keyword(a: Any, *, k: Any) -> Any:
    return a


def _positional(a: Any, /) -> Any:
    return a


def _none() -> Any:
    return None


_ANY: dict[str, Callable[..., Any]] = {
    "one": _one, "two": _two, "upto_two": _upto_two, "keyword": _keyword,
    "positional": _positional, "none": _none, "sizeof": object().__sizeof__,
}  # fmt: skip

_MISCALLS: list[tuple[Callable[[Src], Any], str]] = [
    (lambda s: _ANY["two"](s), "missing 1 required positional argument: 'b'"),
    (lambda s: _ANY["keyword"](s), "missing 1 required keyword-only argument: 'k'"),
    (lambda s: _ANY["one"](s, 1), "takes 1 positional argument but 2 were given"),
    (lambda s: _ANY["two"](s, 1, 2), "takes 2 positional arguments but 3 were given"),
    (lambda s: _ANY["none"](s), "takes 0 positional arguments but 1 was given"),
    (lambda s: _ANY["upto_two"](s, 1, 2), "takes from 1 to 2 positional arguments but 3 were"),
    (lambda s: _ANY["one"](s, z=1), "got an unexpected keyword argument 'z'"),
    (lambda s: _ANY["one"](s, a=1), "got multiple values for argument 'a'"),
    (lambda s: _ANY["sizeof"](s), "takes no arguments"),
    (lambda s: _ANY["positional"](a=s), "got some positional-only arguments passed as keyword"),
]


@pytest.mark.parametrize(("miscall", "why"), _MISCALLS)
def test_each_binding_error_inside_the_constructor_is_a_usage_error(
    miscall: Callable[[Src], Any], why: str
) -> None:
    calls = 0

    def construct(s: Src) -> Any:
        nonlocal calls
        calls += 1
        return miscall(s)

    with pytest.raises(FieldFlowUsageError) as info:
        check_field_flow(Src, construct, settings=_QUICK)
    msg = str(info.value)
    assert msg.startswith(
        "check_field_flow: test_each_binding_error_inside_the_constructor_is_a_usage_error."
        "<locals>.construct cannot be called as "
    )
    assert why in msg and msg.endswith(
        ". This is a usage error, not a field-flow finding: the constructor is called as "
        "construct(source, *args, **kwargs); pass its other arguments with args=(...) and "
        "kwargs={...}, or a callable of the source alone (e.g. lambda fwd: "
        "prepare_decode(fwd, seq_lens, is_target_verify=fwd.is_target_verify))"
    )
    assert isinstance(info.value.__cause__, TypeError) and why in str(info.value.__cause__)
    assert calls == 1  # the first usage error ends the search


def test_a_signature_that_cannot_bind_is_refused_before_any_example() -> None:
    def build(s: Src, seq: int) -> Dst:
        return copy_all(s)

    drawn = 0

    def count(s: Src) -> Src:
        nonlocal drawn
        drawn += 1
        return s

    sources = sentinel_instances(Src).map(count)
    with pytest.raises(FieldFlowUsageError) as info:
        check_field_flow(Src, build, args=(1, 2), kwargs={"k": "v"}, sources=sources,
                         settings=_QUICK)  # fmt: skip
    assert str(info.value).startswith(
        "check_field_flow: test_a_signature_that_cannot_bind_is_refused_before_any_example."
        "<locals>.build cannot be called as test_a_signature_that_cannot_bind_is_refused_"
        "before_any_example.<locals>.build(source, 1, 2, k='v'): too many positional arguments."
    )
    assert drawn == 0
    # Given what it needs, it runs.
    assert check_field_flow(Src, build, args=(1,), derived=Dst, settings=_QUICK).ok


class _NoSignature:
    """A callable whose signature cannot be read: the call decides."""

    __signature__ = "unreadable"

    def __call__(self, s: Src) -> Dst:
        return copy_all(s)


def test_a_constructor_without_a_readable_signature_is_called() -> None:
    assert check_field_flow(Src, _NoSignature(), derived=Dst, settings=_QUICK).ok
    with pytest.raises(FieldFlowUsageError, match="takes 2 positional arguments but 3"):
        check_field_flow(Src, _NoSignature(), args=(1,), settings=_QUICK)


def test_a_usage_error_raised_by_the_constructor_passes_through() -> None:
    inner = FieldFlowUsageError("inner: got an unexpected keyword argument 'x'")

    def nested(s: Src) -> Dst:
        raise inner

    with pytest.raises(FieldFlowUsageError) as info:
        check_field_flow(Src, nested, settings=_QUICK)
    assert info.value is inner


# ------------------------------------------------------------------ mutation survivors


def test_optional_and_sequence_sentinels_keep_the_field_name_and_tensor_length() -> None:
    # An optional string is the field's own text; a tuple of tensors has the drawn length.
    text = find(_sentinel_for(str | None, "tag", 3, 2), lambda v: v is not None, settings=_FIND)
    assert text == "tag#3"
    tensors = find(_sentinel_for(tuple[torch.Tensor, ...], "ts", 3, 2), lambda v: True,
                   settings=_FIND)  # fmt: skip
    assert isinstance(tensors, tuple) and all(t.tolist() == [300, 301] for t in tensors)


@dataclasses.dataclass(frozen=True)
class _Holder:
    data: torch.Tensor


def test_sentinel_tensors_are_one_to_four_long_by_default() -> None:
    lengths = sentinel_instances(_Holder).map(lambda h: int(h.data.shape[0]))
    assert find(lengths, lambda n: n == 4, settings=_FIND) == 4
    assert find(lengths, lambda n: n == 1, settings=_FIND) == 1
    with pytest.raises(NoSuchExample):
        find(lengths, lambda n: not 1 <= n <= 4, settings=_FIND)


def test_assert_field_flow_passes_its_options_on() -> None:
    with pytest.raises(FieldFlowError):
        assert_field_flow(Src, drop_flag, settings=_QUICK)
    # The dropped field ignored, the same constructor passes.
    report = assert_field_flow(Src, drop_flag, ignore=("flag",), settings=_QUICK)
    assert report.ok and "flag" not in report.checked


def test_an_absent_attribute_is_not_a_default_taken() -> None:
    @dataclasses.dataclass(frozen=True)
    class Narrow:
        slots: torch.Tensor

    report = check_field_flow(Src, lambda s: Narrow(slots=s.slots), settings=_QUICK)
    assert report.failures and all(f.derived_value == "<absent>" for f in report.failures)
    assert not any(f.took_default for f in report.failures)


def test_a_metadata_source_with_deferred_hints() -> None:
    from tests.testing.deferred_hints import DeferredMeta

    def copy(m: DeferredMeta) -> DeferredMeta:
        return DeferredMeta(slots=m.slots, scheduler_output=m.scheduler_output, count=m.count)

    def drop_count(m: DeferredMeta) -> DeferredMeta:
        return DeferredMeta(slots=m.slots, scheduler_output=m.scheduler_output)

    with pytest.raises(TypeError) as info:
        check_field_flow(DeferredMeta, copy, settings=_QUICK)
    msg = str(info.value)
    # Only the host field: the tensor field is drawn from its declaration.
    assert msg.startswith(
        "check_field_flow: cannot resolve the type hint of DeferredMeta field(s) "
        "'scheduler_output': 'SchedulerOutput | None'"
    )
    assert "'slots'" not in msg and not isinstance(info.value, FieldFlowUsageError)
    # Resolved through localns (to int: drawn as one) or drawn through values=.
    assert check_field_flow(DeferredMeta, copy, localns={"SchedulerOutput": int},
                            settings=_QUICK).ok  # fmt: skip
    by_values = check_field_flow(DeferredMeta, drop_count, settings=_QUICK,
                                 values={"scheduler_output": st.just(None)})  # fmt: skip
    assert by_values.dropped == ("count",)


def test_the_given_settings_bound_the_search() -> None:
    calls = 0

    def count(s: Src) -> Dst:
        nonlocal calls
        calls += 1
        return copy_all(s)

    few = settings(resolve_settings(), max_examples=3, derandomize=True)
    assert check_field_flow(Src, count, derived=Dst, settings=few).ok
    # Three examples (the search and the all-fields pass may each replay a few).
    assert 1 <= calls <= 12


# --------------------------------------------------------------------------- report fields


@dataclasses.dataclass
class _NoDefaultDst:
    count: int | None  # no default: a None here is the constructor's, not a default

    @property
    def n(self) -> int | None:  # an attribute that is no field: it has no default either
        return None


@dataclasses.dataclass
class _CountSrc:
    count: int | None = None


@pytest.mark.parametrize("rename", [None, {"count": "n"}], ids=["field", "property"])
def test_a_dropped_field_without_a_derived_default_did_not_take_one(
    rename: dict[str, str] | None,
) -> None:
    report = check_field_flow(
        _CountSrc, lambda s: _NoDefaultDst(count=None), rename=rename, settings=_QUICK
    )
    assert report.dropped == ("count",)
    (failure,) = report.failures
    assert failure.derived_value == "None" and failure.took_default is False


def test_a_clean_report_names_its_classes_and_has_an_empty_failure_tuple() -> None:
    report = check_field_flow(Src, copy_all, settings=_QUICK)
    assert report.source == "Src" and report.derived == "Dst"
    assert report.failures == () and report.ok


def test_a_run_saves_no_example_to_the_profiles_database(tmp_path: Any) -> None:
    # The one-shrink phase fails inside Hypothesis on purpose; with the profile's database
    # it would save that example and replay it in an unrelated later run.
    from hypothesis.database import DirectoryBasedExampleDatabase

    db = tmp_path / "examples"
    report = check_field_flow(
        Src, drop_flag, settings=settings(_QUICK, database=DirectoryBasedExampleDatabase(db))
    )
    assert report.dropped == ("flag",)
    assert not db.exists() or not any(p.is_file() for p in db.rglob("*"))
