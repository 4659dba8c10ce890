"""The field-flow checker: does every field of a source object reach the derived object?

Works for any pair of classes (``@hybridmeta.metadata`` classes, ``dataclasses``, attrs
classes, ``NamedTuple``) and any constructor function ``source -> derived``, such as an
engine's hand-written ``Mamba2Metadata.prepare_decode(forward_metadata)``. Sources are
drawn by Hypothesis with a distinct sentinel value per field (so a field wired to the wrong
source field is caught too); for each source field, one search looks for a source whose
value of that field does not arrive, and shrinks it. The report names every such field,
whether it silently took the derived class's default, and the shrunk source.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import attrs
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as Settings
from hypothesis import strategies as st

from hybridmeta.testing import _schema
from hybridmeta.testing.profiles import resolve_settings
from hybridmeta.testing.strategies import metadata_instances

__all__ = [
    "FieldFlowError",
    "FlowFailure",
    "FlowReport",
    "Sentinel",
    "assert_field_flow",
    "check_field_flow",
    "class_fields",
    "sentinel_instances",
]

@dataclass(frozen=True)
class ClassField:
    """One constructor field of a class: its name, default (if any) and annotation."""

    name: str
    default: Any  # _schema.NO_DEFAULT when the field has none
    annotation: Any
    init: bool = True

    @property
    def has_default(self) -> bool:
        return self.default is not _schema.NO_DEFAULT


def class_fields(cls: type) -> tuple[ClassField, ...]:
    """The fields of a dataclass, attrs class (``@hybridmeta.metadata`` included) or
    ``NamedTuple``, with defaults (a factory's default is called once)."""
    try:
        hints: dict[str, Any] = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references
        hints = {}
    if _schema.is_metadata_class(cls):
        # The declared defaults (attrs holds a placeholder for governing flags).
        return tuple(
            ClassField(f.name, f.default, hints.get(f.name))
            for f in _schema.fields(cls)
        )  # fmt: skip
    if attrs.has(cls):
        out = []
        for a in attrs.fields(cls):
            d = a.default
            if isinstance(d, attrs.Factory):  # type: ignore[arg-type]
                d = d.factory() if not d.takes_self else _schema.NO_DEFAULT
            elif d is attrs.NOTHING:
                d = _schema.NO_DEFAULT
            out.append(ClassField(a.name, d, hints.get(a.name, a.type), a.init))
        return tuple(out)
    if dataclasses.is_dataclass(cls):
        out = []
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                d = f.default
            elif f.default_factory is not dataclasses.MISSING:
                d = f.default_factory()
            else:
                d = _schema.NO_DEFAULT
            out.append(ClassField(f.name, d, hints.get(f.name, f.type), f.init))
        return tuple(out)
    names = getattr(cls, "_fields", None)
    if isinstance(names, tuple) and issubclass(cls, tuple):
        defaults: dict[str, Any] = getattr(cls, "_field_defaults", {})
        return tuple(
            ClassField(n, defaults.get(n, _schema.NO_DEFAULT), hints.get(n)) for n in names
        )
    raise TypeError(
        f"{cls.__qualname__} is not a dataclass, attrs class or NamedTuple; pass sources= "
        "and fields= to check it"
    )


# --------------------------------------------------------------------------- sentinels


class Sentinel:
    """A unique stand-in value for a field whose type cannot be drawn (compares by identity)."""

    __slots__ = ("field", "n")

    def __init__(self, field: str, n: int) -> None:
        self.field = field
        self.n = n

    def __repr__(self) -> str:
        return f"<sentinel {self.field}#{self.n}>"


def _sentinel_for(tp: Any, name: str, n: int, length: int) -> st.SearchStrategy[Any]:
    """A value of type ``tp`` derived from the field's unique number ``n``."""
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.just(n)
    if tp is float:
        return st.just(n + 0.5)
    if tp is str:
        return st.just(f"{name}#{n}")
    if tp is torch.Tensor:
        return st.just(torch.arange(length, dtype=torch.int64) + 100 * n)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = _sentinel_for(rest[0], name, n, length) if len(rest) == 1 else None
        return st.none() if inner is None else st.one_of(st.none(), inner)
    if origin in (tuple, list) and args:
        inner = _sentinel_for(args[0], name, n, length)
        return st.lists(inner, min_size=1, max_size=3).map(origin)
    return st.just(Sentinel(name, n))


@st.composite
def sentinel_instances(
    draw: st.DrawFn,
    cls: type,
    *,
    values: Mapping[str, st.SearchStrategy[Any]] | None = None,
    max_len: int = 4,
) -> Any:
    """Instances of a dataclass / attrs class / ``NamedTuple`` with a distinct sentinel per
    field: ints, floats, strings and 1-D int64 tensors (one shared length) derive from a
    unique number per field; bools are drawn; optionals may be ``None``; other types get a
    :class:`Sentinel`. ``values`` overrides fields by name."""
    fields = [f for f in class_fields(cls) if f.init]
    overrides = dict(values or {})
    nums = draw(
        st.lists(st.integers(1, 10_000), min_size=len(fields), max_size=len(fields), unique=True),
        label="sentinels",
    )
    length = draw(st.integers(1, max_len), label="tensor length")
    kwargs: dict[str, Any] = {}
    for f, n in zip(fields, nums, strict=True):
        strat = overrides.get(f.name) or _sentinel_for(f.annotation, f.name, n, length)
        kwargs[f.name] = draw(strat, label=f.name)
    return cls(**kwargs)


# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class FlowFailure:
    """A source field that does not reach the derived object.

    Attributes
    ----------
    field : str
        The source field.
    source_value, derived_value : str
        ``repr`` of the values in the shrunk example (``derived_value`` is
        ``"<absent>"`` when the derived object has no such attribute).
    took_default : bool
        The derived value is the derived class's default for the field.
    example : str
        ``repr`` of the shrunk source.
    """

    field: str
    source_value: str
    derived_value: str
    took_default: bool
    example: str

    def describe(self, source: str, derived: str, via: str) -> str:
        if self.derived_value == "<absent>":
            what = f"{derived} has no attribute {self.field!r}"
        elif self.took_default:
            what = (
                f"source {self.source_value}, derived {self.derived_value}: silently took "
                f"{derived}'s default"
            )
        else:
            what = f"source {self.source_value}, derived {self.derived_value}"
        return (
            f"{source}.{self.field} does not reach {derived} through {via}: {what}\n"
            f"    falsifying source: {self.example}"
        )


@dataclass(frozen=True)
class FlowReport:
    """The result of :func:`check_field_flow`."""

    source: str
    derived: str
    via: str
    checked: tuple[str, ...]
    failures: tuple[FlowFailure, ...]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def dropped(self) -> tuple[str, ...]:
        """Names of the source fields that do not reach the derived object."""
        return tuple(f.field for f in self.failures)

    def format(self) -> str:
        head = (
            f"field flow {self.source} -> {self.derived} through {self.via}: "
            f"{len(self.failures)} of {len(self.checked)} source fields do not arrive"
        )
        return "\n".join([head, *(f"  - {f.describe(self.source, self.derived, self.via)}"
                                   for f in self.failures)])  # fmt: skip


class FieldFlowError(AssertionError):
    """Raised by :func:`assert_field_flow`; ``report`` holds the :class:`FlowReport`."""

    def __init__(self, report: FlowReport) -> None:
        super().__init__(report.format())
        self.report = report


def _reaches(sv: Any, dv: Any) -> bool:
    if sv is dv:
        return True
    if isinstance(sv, torch.Tensor) or isinstance(dv, torch.Tensor):
        if not (isinstance(sv, torch.Tensor) and isinstance(dv, torch.Tensor)):
            return False
        if sv.shape != dv.shape or sv.dtype != dv.dtype:
            return False
        return bool(torch.equal(sv.detach().cpu(), dv.detach().cpu()))
    try:
        return bool(sv == dv)
    except Exception:  # values whose == is elementwise or raises
        return False


def _same_default(dv: Any, default: Any) -> bool:
    return default is not _schema.NO_DEFAULT and _reaches(default, dv)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def check_field_flow(
    source: type,
    construct: Callable[[Any], Any],
    *,
    derived: type | None = None,
    sources: st.SearchStrategy[Any] | None = None,
    values: Mapping[str, st.SearchStrategy[Any]] | None = None,
    fields: Collection[str] | None = None,
    ignore: Collection[str] = (),
    rename: Mapping[str, str] | None = None,
    settings: Settings | None = None,
) -> FlowReport:
    """Find the source fields whose value does not reach ``construct(source)``.

    Parameters
    ----------
    source : type
        The source class (a ``@hybridmeta.metadata`` class, dataclass, attrs class or
        ``NamedTuple``).
    construct : callable
        ``source instance -> derived instance`` (the engine's constructor under test).
    derived : type, optional
        The derived class, for its defaults (default: the type of the first result).
    sources : strategy, optional
        Source instances (default: :func:`sentinel_instances`, or
        :func:`~hybridmeta.testing.strategies.metadata_instances` for a metadata class).
    values : mapping of str to strategy, optional
        Per-field overrides for the default source strategy (fields the constructor
        computes with, such as offsets that must be consistent).
    fields : collection of str, optional
        The source fields to check (default: every constructor field of ``source``).
    ignore : collection of str
        Source fields that are not meant to reach the derived object.
    rename : mapping of str to str, optional
        Source field -> derived attribute, where the names differ.
    settings : hypothesis.settings, optional
        Default: the active hybridmeta profile.

    Returns
    -------
    FlowReport
        Every failing field with its shrunk source, in source field order.
    """
    src_fields = {f.name: f for f in class_fields(source)}
    names = [n for n in (fields if fields is not None else src_fields) if n not in set(ignore)]
    unknown = [n for n in names if n not in src_fields]
    if unknown:
        raise ValueError(f"check_field_flow: {source.__qualname__} has no field(s) {unknown}")
    renames = dict(rename or {})
    if sources is None:
        sources = (
            metadata_instances(source, values=values)
            if _schema.is_metadata_class(source)
            else sentinel_instances(source, values=values)
        )
    base = resolve_settings(settings)
    run_settings = Settings(
        base,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=[*base.suppress_health_check, HealthCheck.filter_too_much],
    )
    via = getattr(construct, "__qualname__", repr(construct))
    derived_defaults: dict[str, Any] | None = (
        {f.name: f.default for f in class_fields(derived)} if derived is not None else None
    )
    derived_name = derived.__qualname__ if derived is not None else "?"
    def check(src: Any, out: Any, name: str) -> FlowFailure | None:
        nonlocal derived_defaults, derived_name
        if derived_defaults is None:
            derived_defaults = {f.name: f.default for f in class_fields(type(out))}
            derived_name = type(out).__qualname__
        target = renames.get(name, name)
        sv = getattr(src, name)
        if not hasattr(out, target):
            return FlowFailure(name, _short(sv), "<absent>", False, repr(src))
        dv = getattr(out, target)
        if _reaches(sv, dv):
            return None
        default = derived_defaults.get(target, _schema.NO_DEFAULT)
        return FlowFailure(name, _short(sv), _short(dv), _same_default(dv, default), repr(src))

    def one_field(name: str, last: list[FlowFailure]) -> Callable[[Any], None]:
        def prop(src: Any) -> None:
            fail = check(src, construct(src), name)
            if fail is not None:
                last.append(fail)
                raise AssertionError(name)

        return prop

    def all_fields(remaining: list[str], seen: dict[str, FlowFailure]) -> Callable[[Any], None]:
        def prop(src: Any) -> None:
            out = construct(src)
            bad = {n: f for n in remaining if (f := check(src, out, n)) is not None}
            for n, f in bad.items():
                seen.setdefault(n, f)
            if bad:
                raise AssertionError(", ".join(bad))

        return prop

    # One search over all remaining fields at a time: a clean constructor costs one run.
    # Fields seen failing get a search of their own (each shrunk and reported); the rest
    # are searched again together, until a combined search passes.
    found: dict[str, FlowFailure] = {}
    remaining = list(names)
    while remaining:
        seen: dict[str, FlowFailure] = {}
        try:
            run_settings(given(sources)(all_fields(remaining, seen)))()
            break
        except AssertionError:
            if not seen:
                raise
        for name in [n for n in remaining if n in seen]:
            last: list[FlowFailure] = []
            try:
                run_settings(given(sources)(one_field(name, last)))()
            except AssertionError:
                if not last:
                    raise
                found[name] = last[-1]
            else:  # not found again on its own: report the (unshrunk) example seen
                found[name] = seen[name]
        remaining = [n for n in remaining if n not in seen]
    failures = [found[n] for n in names if n in found]
    return FlowReport(
        source=source.__qualname__,
        derived=derived_name,
        via=via,
        checked=tuple(names),
        failures=tuple(failures),
    )


def assert_field_flow(
    source: type, construct: Callable[[Any], Any], **kwargs: Any
) -> FlowReport:
    """:func:`check_field_flow`, raising :class:`FieldFlowError` when a field is dropped."""
    report = check_field_flow(source, construct, **kwargs)
    if not report.ok:
        raise FieldFlowError(report)
    return report
