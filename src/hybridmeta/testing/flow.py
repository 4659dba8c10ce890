"""The field-flow checker: does every field of a source object reach the derived object?

Works for any pair of classes (``@hybridmeta.metadata`` classes, ``dataclasses``, attrs
classes, ``NamedTuple``) and any constructor ``construct(source, *args, **kwargs) ->
derived``, such as an engine's hand-written ``Mamba2Metadata.prepare_decode(
forward_metadata, seq_lens, *, is_target_verify, draft_token_num)``. Sources are drawn by
Hypothesis with a distinct sentinel value per field (so a field wired to the wrong source
field is caught too). One search over every field finds the fields that do not arrive;
one shrink then looks for a small source on which all of them fail at once. The report
names each such field once, whether it silently took the derived class's default, and
prints each falsifying source once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import re
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import torch
from hypothesis import HealthCheck, Phase, given, target
from hypothesis import settings as Settings
from hypothesis import strategies as st

from hybridmeta.testing import _schema
from hybridmeta.testing.profiles import resolve_settings
from hybridmeta.testing.strategies import metadata_instances

__all__ = [
    "FieldFlowError",
    "FieldFlowUsageError",
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
    """One constructor field of a class: its name, default (if any) and annotation.

    ``annotation`` is a :class:`~hybridmeta.testing._schema.UnresolvedHint` when the
    annotation cannot be evaluated."""

    name: str
    default: Any  # _schema.NO_DEFAULT when the field has none
    annotation: Any
    init: bool = True

    @property
    def has_default(self) -> bool:
        return self.default is not _schema.NO_DEFAULT

    @property
    def unresolved(self) -> bool:
        return isinstance(self.annotation, _schema.UnresolvedHint)


def class_fields(cls: type, *, localns: Mapping[str, Any] | None = None) -> tuple[ClassField, ...]:
    """The fields of a dataclass, attrs class (``@hybridmeta.metadata`` included) or
    ``NamedTuple``, with defaults (a factory's default is called once) and evaluated
    annotations (``localns`` adds names for string annotations)."""
    resolved, unresolved = _schema.type_hints(cls, localns)

    def hint(name: str, declared: Any = None) -> Any:
        if name in resolved:
            return resolved[name]
        if name in unresolved:
            return unresolved[name]
        if isinstance(declared, str):
            return _schema.UnresolvedHint(declared, "not found in the class's annotations")
        return declared

    if _schema.is_metadata_class(cls):
        # The declared defaults (attrs holds a placeholder for governing flags).
        return tuple(ClassField(f.name, f.default, hint(f.name)) for f in _schema.fields(cls))
    if attrs.has(cls):
        out = []
        for a in attrs.fields(cls):
            d = a.default
            if isinstance(d, attrs.Factory):  # type: ignore[arg-type]
                d = d.factory() if not d.takes_self else _schema.NO_DEFAULT
            elif d is attrs.NOTHING:
                d = _schema.NO_DEFAULT
            out.append(ClassField(a.name, d, hint(a.name, a.type), a.init))
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
            out.append(ClassField(f.name, d, hint(f.name, f.type), f.init))
        return tuple(out)
    names = getattr(cls, "_fields", None)
    if isinstance(names, tuple) and issubclass(cls, tuple):
        defaults: dict[str, Any] = getattr(cls, "_field_defaults", {})
        return tuple(
            ClassField(n, defaults.get(n, _schema.NO_DEFAULT), hint(n)) for n in names
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


_NOT_GIVEN = _schema.NO_DEFAULT


def _sentinel_for(
    tp: Any, name: str, n: int, length: int, avoid: Any = _NOT_GIVEN
) -> st.SearchStrategy[Any]:
    """A value of type ``tp`` derived from the field's unique number ``n``.

    ``avoid`` (a default): draw only values that differ from it (``None`` is never drawn
    for an optional then, a bool is the other one), so a dropped field always shows."""
    strict = avoid is not _NOT_GIVEN

    def off(value_of: Callable[[int], Any]) -> st.SearchStrategy[Any]:
        # The value of the field's number; of a number past every field's (1..9_999)
        # when that equals the default.
        value = value_of(n)
        return st.just(value_of(n + 10_000) if strict and _reaches(avoid, value) else value)

    if tp is bool:
        return st.just(not avoid) if strict and isinstance(avoid, bool) else st.booleans()
    if tp is int:
        return off(lambda k: k)
    if tp is float:
        return off(lambda k: k + 0.5)
    if tp is str:
        return off(lambda k: f"{name}#{k}")
    if tp is torch.Tensor:
        return off(lambda k: torch.arange(length, dtype=torch.int64) + 100 * k)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = [m for m in tp if not (strict and m == avoid)] or list(tp)
        return st.sampled_from(members)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = (
            _sentinel_for(rest[0], name, n, length, avoid)
            if len(rest) == 1
            else st.just(Sentinel(name, n))  # a union of several types: as for one
        )
        return inner if strict and avoid is None else st.one_of(st.none(), inner)
    if origin in (tuple, list) and args:
        inner = _sentinel_for(args[0], name, n, length)
        return st.lists(inner, min_size=1, max_size=3).map(origin)
    return st.just(Sentinel(name, n))


def sentinel_instances(
    cls: type,
    *,
    values: Mapping[str, st.SearchStrategy[Any]] | None = None,
    max_len: int = 4,
    avoid_defaults: Mapping[str, Any] | None = None,
    localns: Mapping[str, Any] | None = None,
) -> st.SearchStrategy[Any]:
    """Instances of a dataclass / attrs class / ``NamedTuple`` with a distinct sentinel per
    field: ints, floats, strings and 1-D int64 tensors (one shared length) derive from a
    unique number per field; bools are drawn; optionals may be ``None``; other types get a
    :class:`Sentinel`. ``values`` overrides fields by name.

    ``avoid_defaults`` (field -> default): those fields only take values that differ from
    the given default (optionals are never ``None`` when it is ``None``, bools are the
    other value), so a constructor that drops them cannot pass by luck.

    Raises
    ------
    TypeError
        A field whose annotation cannot be evaluated (named, with the reason) and that
        ``values`` does not cover: pass ``localns=`` or ``values=``.
    """
    fields = [f for f in class_fields(cls, localns=localns) if f.init]
    overrides = dict(values or {})
    bad = {f.name: f.annotation for f in fields if f.unresolved and f.name not in overrides}
    if bad:
        raise _schema.unresolved_hints_error(f"sentinel_instances({cls.__qualname__})", cls, bad)
    avoid = dict(avoid_defaults or {})

    @st.composite
    def draw_one(draw: st.DrawFn) -> Any:
        nums = draw(
            st.lists(st.integers(1, 9_999), min_size=len(fields), max_size=len(fields),
                     unique=True),
            label="sentinels",
        )  # fmt: skip
        length = draw(st.integers(1, max_len), label="tensor length")
        kwargs: dict[str, Any] = {}
        for f, n in zip(fields, nums, strict=True):
            strat = overrides.get(f.name)
            if strat is None:
                strat = _sentinel_for(
                    f.annotation, f.name, n, length, avoid.get(f.name, _NOT_GIVEN)
                )
            kwargs[f.name] = draw(strat, label=f.name)
        return cls(**kwargs)

    return draw_one()


# --------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class FlowFailure:
    """A source field that does not reach the derived object.

    Attributes
    ----------
    field : str
        The source field.
    source_value, derived_value : str
        ``repr`` of the values in the falsifying source (``derived_value`` is
        ``"<absent>"`` when the derived object has no such attribute).
    took_default : bool
        The derived value is the derived class's default for the field.
    example : str
        ``repr`` of the falsifying source (one source is shared by every field that fails
        on it; :attr:`FlowReport.examples` lists each once).
    """

    field: str
    source_value: str
    derived_value: str
    took_default: bool
    example: str

    def what(self, derived: str) -> str:
        """What arrived instead, in words."""
        if self.derived_value == "<absent>":
            return f"{derived} has no attribute {self.field!r}"
        if self.took_default:
            return (
                f"source {self.source_value}, derived {self.derived_value}: silently took "
                f"{derived}'s default"
            )
        return f"source {self.source_value}, derived {self.derived_value}"

    def describe(self, source: str, derived: str, via: str) -> str:
        return (
            f"{source}.{self.field} does not reach {derived} through {via}: "
            f"{self.what(derived)}\n    falsifying source: {self.example}"
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

    @property
    def examples(self) -> tuple[str, ...]:
        """The distinct falsifying sources, in the order of the fields failing on them."""
        return tuple(dict.fromkeys(f.example for f in self.failures))

    def format(self) -> str:
        """One line per failing field, then each falsifying source once."""
        head = (
            f"field flow {self.source} -> {self.derived} through {self.via}: "
            f"{len(self.failures)} of {len(self.checked)} source fields do not arrive"
        )
        examples = self.examples
        number = {ex: i + 1 for i, ex in enumerate(examples)}
        lines = [head]
        for f in self.failures:
            tag = f" [source {number[f.example]}]" if len(examples) > 1 else ""
            lines.append(
                f"  - {self.source}.{f.field} does not reach {self.derived}: "
                f"{f.what(self.derived)}{tag}"
            )
        if len(examples) == 1:
            lines.append(f"  falsifying source: {examples[0]}")
        else:
            for ex in examples:
                names = ", ".join(f.field for f in self.failures if f.example == ex)
                lines.append(f"  falsifying source {number[ex]} ({names}): {ex}")
        return "\n".join(lines)


class FieldFlowError(AssertionError):
    """Raised by :func:`assert_field_flow`; ``report`` holds the :class:`FlowReport`."""

    def __init__(self, report: FlowReport) -> None:
        super().__init__(report.format())
        self.report = report


class FieldFlowUsageError(TypeError):
    """The constructor cannot be called the way :func:`check_field_flow` was told to call
    it (wrong number of arguments, an unknown keyword): a usage error, not a finding."""


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


# CPython's messages for a call whose arguments do not bind to the signature.
_BINDING = re.compile(
    r"missing \d+ required (positional|keyword-only) argument"
    r"|takes \d+ positional arguments? but \d+ (was|were) given"
    r"|takes from \d+ to \d+ positional arguments but \d+ (was|were) given"
    r"|got an unexpected keyword argument"
    r"|got multiple values for argument"
    r"|takes no arguments"
    r"|got some positional-only arguments passed as keyword arguments"
)


def _call_text(via: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    parts = ["source", *(_short(a) for a in args), *(f"{k}={_short(v)}" for k, v in kwargs.items())]
    return f"{via}({', '.join(parts)})"


def _usage_error(
    via: str, args: Sequence[Any], kwargs: Mapping[str, Any], why: str
) -> FieldFlowUsageError:
    return FieldFlowUsageError(
        f"check_field_flow: {via} cannot be called as {_call_text(via, args, kwargs)}: "
        f"{why}. This is a usage error, not a field-flow finding: the constructor is called "
        "as construct(source, *args, **kwargs); pass its other arguments with args=(...) "
        "and kwargs={...}, or a callable of the source alone (e.g. lambda fwd: "
        "prepare_decode(fwd, seq_lens, is_target_verify=fwd.is_target_verify))"
    )


def _check_signature(
    construct: Callable[..., Any], via: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> None:
    """Refuse, before any example runs, a constructor whose signature cannot take
    ``(source, *args, **kwargs)``."""
    try:
        sig = inspect.signature(construct)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call decides
        return
    try:
        sig.bind(object(), *args, **kwargs)
    except TypeError as e:
        raise _usage_error(via, args, kwargs, str(e)) from None


def check_field_flow(
    source: type,
    construct: Callable[..., Any],
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    derived: type | None = None,
    sources: st.SearchStrategy[Any] | None = None,
    values: Mapping[str, st.SearchStrategy[Any]] | None = None,
    fields: Collection[str] | None = None,
    ignore: Collection[str] = (),
    rename: Mapping[str, str] | None = None,
    localns: Mapping[str, Any] | None = None,
    settings: Settings | None = None,
) -> FlowReport:
    """Find the source fields whose value does not reach ``construct(source, *args, **kwargs)``.

    Parameters
    ----------
    source : type
        The source class (a ``@hybridmeta.metadata`` class, dataclass, attrs class or
        ``NamedTuple``).
    construct : callable
        The engine's constructor under test, called as ``construct(src, *args,
        **kwargs)`` with a drawn source ``src``. A constructor of several arguments, such
        as sglang's ``prepare_decode(forward_metadata, seq_lens, *, is_target_verify,
        draft_token_num)``: pass the fixed ones in ``args`` / ``kwargs``, or wrap it in a
        callable of the source alone when an argument depends on the source (``lambda
        fwd: prepare_decode(fwd, seq_lens, is_target_verify=fwd.is_target_verify,
        draft_token_num=fwd.draft_token_num)``).
    args, kwargs : optional
        Fixed extra arguments of every call.
    derived : type, optional
        The derived class, for its defaults (default: the type of the first result).
    sources : strategy, optional
        Source instances (default: :func:`sentinel_instances`, or
        :func:`~hybridmeta.testing.strategies.metadata_instances` for a metadata class).
    values : mapping of str to strategy, optional
        Per-field overrides for the default source strategy (fields the constructor
        computes with, such as offsets that must be consistent, and fields whose
        annotation cannot be evaluated).
    fields : collection of str, optional
        The source fields to check (default: every constructor field of ``source``).
    ignore : collection of str
        Source fields that are not meant to reach the derived object.
    rename : mapping of str to str, optional
        Source field -> derived attribute, where the names differ.
    localns : mapping of str to object, optional
        Names for string annotations that the source's module does not define at run
        time (``if TYPE_CHECKING:`` imports): ``{"ForwardBatch": ForwardBatch}``.
    settings : hypothesis.settings, optional
        Default: the active hybridmeta profile.

    Returns
    -------
    FlowReport
        Every failing field once, in source field order, with the falsifying source(s).

    Raises
    ------
    FieldFlowUsageError
        ``construct`` cannot be called with ``(source, *args, **kwargs)`` (checked against
        its signature before any example, and on every call).
    TypeError
        A source field whose annotation cannot be evaluated and that ``values`` does not
        cover (the default strategies need the annotation).
    ValueError
        ``fields`` names a field the source class does not have.
    """
    call_args = tuple(args)
    call_kwargs = dict(kwargs or {})
    via = getattr(construct, "__qualname__", repr(construct))
    _check_signature(construct, via, call_args, call_kwargs)
    src_fields = {f.name: f for f in class_fields(source, localns=localns)}
    chosen = [n for n in (fields if fields is not None else src_fields) if n not in set(ignore)]
    unknown = [n for n in chosen if n not in src_fields]
    if unknown:
        raise ValueError(f"check_field_flow: {source.__qualname__} has no field(s) {unknown}")
    names = [n for n in src_fields if n in set(chosen)]  # source field order, each once
    renames = dict(rename or {})
    derived_fields: dict[str, Any] | None = (
        {f.name: f.default for f in class_fields(derived, localns=localns)}
        if derived is not None
        else None
    )
    own_sources = sources is None
    if sources is None:
        if _schema.is_metadata_class(source):
            # metadata_instances draws tensors from the declarations; only the non-tensor
            # fields need their annotation.
            tensors = {f.name for f in _schema.fields(source) if f.is_tensor}
            bad = {
                n: f.annotation for n, f in src_fields.items()
                if f.unresolved and n not in tensors and n not in (values or {})
            }  # fmt: skip
            if bad:
                raise _schema.unresolved_hints_error("check_field_flow", source, bad)
            sources = metadata_instances(source, values=values, localns=localns)
        else:
            # Half the draws keep every checked field away from the derived default (a
            # dropped field always shows there, and shrinking prefers that branch); the
            # other half draw freely (None, False, ...), for constructors that misbehave
            # on particular values.
            defaults = derived_fields or {n: f.default for n, f in src_fields.items()}
            avoid = {
                n: defaults[renames.get(n, n)]
                for n in names
                if defaults.get(renames.get(n, n), _schema.NO_DEFAULT) is not _schema.NO_DEFAULT
            }  # fmt: skip
            sources = st.one_of(
                sentinel_instances(source, values=values, localns=localns),
                sentinel_instances(source, values=values, avoid_defaults=avoid, localns=localns),
            )
    base = resolve_settings(settings)
    run_settings = Settings(
        base,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=[*base.suppress_health_check, HealthCheck.filter_too_much],
    )
    derived_name = derived.__qualname__ if derived is not None else "?"
    usage: list[FieldFlowUsageError] = []

    def call(src: Any) -> Any:
        try:
            return construct(src, *call_args, **call_kwargs)
        except TypeError as e:
            if isinstance(e, FieldFlowUsageError) or _BINDING.search(str(e)) is None:
                raise
            err = _usage_error(via, call_args, call_kwargs, str(e))
            err.__cause__ = e
            usage.append(err)
            return _USAGE

    def failing(src: Any, out: Any) -> dict[str, FlowFailure]:
        nonlocal derived_fields, derived_name
        if derived_fields is None:
            derived_fields = {f.name: f.default for f in class_fields(type(out))}
            derived_name = type(out).__qualname__
        bad: dict[str, FlowFailure] = {}
        example: str | None = None
        for name in names:
            target_name = renames.get(name, name)
            sv = getattr(src, name)
            if not hasattr(out, target_name):
                dv_text, took = "<absent>", False
            else:
                dv = getattr(out, target_name)
                if _reaches(sv, dv):
                    continue
                default = derived_fields.get(target_name, _schema.NO_DEFAULT)
                dv_text, took = _short(dv), _same_default(dv, default)
            if example is None:
                example = repr(src)
            bad[name] = FlowFailure(name, _short(sv), dv_text, took, example)
        return bad

    # 1. Search: every example is checked for every field; nothing fails inside
    #    Hypothesis (no shrink per field), each failing field is recorded with the
    #    examples it fails on.
    seen: list[tuple[Any, dict[str, FlowFailure]]] = []

    def explore(src: Any) -> None:
        if usage:
            return
        out = call(src)
        if out is _USAGE:
            return
        bad = failing(src, out)
        if bad:
            seen.append((src, bad))

    search = Settings(run_settings, phases=[Phase.explicit, Phase.generate])
    search(given(sources)(explore))()
    if usage:
        raise usage[0]
    found = [n for n in names if any(n in bad for _, bad in seen)]
    if not found:
        return FlowReport(source.__qualname__, derived_name, via, tuple(names), ())

    # 2. One shrink: the smallest source on which every found field fails at once.
    wanted = set(found)
    shrunk: list[tuple[Any, dict[str, FlowFailure]]] = []

    class _AllFail(Exception):
        pass

    def all_fail(src: Any) -> None:
        out = call(src)
        if out is _USAGE:
            return
        bad = failing(src, out)
        target(float(len(wanted & bad.keys())), label="failing fields")
        if wanted <= bad.keys():
            shrunk.append((src, bad))
            raise _AllFail

    with contextlib.suppress(_AllFail):
        run_settings(given(sources)(all_fail))()
    if usage:
        raise usage[0]
    if shrunk:
        groups = [(set(found), *shrunk[-1])]  # Hypothesis replays the shrunk example last
    else:
        # No single source makes them all fail: the fewest search examples covering them.
        groups = []
        todo = set(found)
        while todo:
            src, bad = max(seen, key=lambda e: (len(todo & e[1].keys()), -_example_len(e[1])))
            groups.append((todo & bad.keys(), src, bad))
            todo -= bad.keys()
    by_name: dict[str, FlowFailure] = {}
    for group, src, bad in groups:
        if own_sources:
            bad = _defaults_elsewhere(src, bad, group, keep=set(values or ()), call=call,
                                      failing=failing)  # fmt: skip
        by_name.update({n: bad[n] for n in group})
    failures = [by_name[n] for n in found]
    return FlowReport(
        source=source.__qualname__,
        derived=derived_name,
        via=via,
        checked=tuple(names),
        failures=tuple(failures),
    )


_USAGE = object()  # what call() returns after recording a usage error


def _example_len(bad: Mapping[str, FlowFailure]) -> int:
    return len(next(iter(bad.values())).example)


def _defaults_elsewhere(
    src: Any,
    bad: dict[str, FlowFailure],
    group: set[str],
    *,
    keep: set[str],
    call: Callable[[Any], Any],
    failing: Callable[[Any, Any], dict[str, FlowFailure]],
) -> dict[str, FlowFailure]:
    """Set each field outside ``group`` (and not pinned by ``values=``) back to its
    default while every field of ``group`` still fails: the falsifying source then shows
    only what the failure needs (one call per field; a class that refuses is left as is)."""
    try:
        fields = [f for f in class_fields(type(src)) if f.init]
        current = {f.name: getattr(src, f.name) for f in fields}
    except (TypeError, AttributeError):
        return bad
    for f in fields:
        if f.name in group or f.name in keep or not f.has_default:
            continue
        if _reaches(current[f.name], f.default):
            continue
        trial = {**current, f.name: f.default}
        try:
            cand = type(src)(**trial)
            out = call(cand)
        except Exception:  # the class or the constructor refuses this combination
            continue
        if out is _USAGE:
            continue
        cand_bad = failing(cand, out)
        if group <= cand_bad.keys():
            current, bad = trial, cand_bad
    return bad


def assert_field_flow(
    source: type, construct: Callable[..., Any], **options: Any
) -> FlowReport:
    """:func:`check_field_flow`, raising :class:`FieldFlowError` when a field is dropped."""
    report = check_field_flow(source, construct, **options)
    if not report.ok:
        raise FieldFlowError(report)
    return report
