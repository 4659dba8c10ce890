"""The one place :mod:`hybridmeta.testing` reads metadata declarations.

Everything the testing package needs to know about a ``@hybridmeta.metadata`` class goes
through :func:`fields` and :func:`derivation`, which translate the core's
:class:`~hybridmeta.core.FieldSpec` into the small :class:`FieldInfo` below. When the
declarations change, this module is the only one to adapt.

Attributes read here (and nowhere else in the package):

* ``FieldSpec.name``, ``.is_tensor``, ``.optional``, ``.ndim``, ``.dtypes``;
* ``FieldSpec.rows``: a :class:`hybridmeta.core.Rows` (``.dim.name``, ``.offset``) or
  ``None`` (free length);
* ``FieldSpec.cols``: the name of the int host field giving dimension 1, or ``None``;
* ``FieldSpec.pad``: compared with ``Pad.CUMULATIVE``, else its ``.value``;
* ``FieldSpec.role`` (its ``.value`` and ``.is_slot``), ``.default`` (``attrs.NOTHING``:
  none), ``.governs`` and ``.required_when_set``;
* ``hybridmeta.core.fields_of``, ``source_of``.

:func:`type_hints` resolves the annotations of any class (metadata or not) field by field,
so one annotation that cannot be resolved is named instead of hiding every other.
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import attrs
import torch

from hybridmeta.core import BOOL, INDEX, Pad, fields_of, source_of

#: ``FieldInfo.default`` of a field that declares none.
NO_DEFAULT: Final = object()

__all__ = [
    "NO_DEFAULT",
    "FieldInfo",
    "Rows",
    "UnresolvedHint",
    "derivation",
    "fields",
    "is_metadata_class",
    "type_hints",
    "unresolved_hints_error",
]


@dataclass(frozen=True)
class Rows:
    """The symbolic length of dimension 0: ``symbol + offset`` (``"batch+1"``: batch, 1)."""

    symbol: str
    offset: int = 0

    def __str__(self) -> str:
        return f"{self.symbol}+{self.offset}" if self.offset else self.symbol


@dataclass(frozen=True)
class FieldInfo:
    """What the strategies need to know about one metadata field.

    Attributes
    ----------
    name : str
        Field name.
    is_tensor : bool
        Whether the field holds a tensor.
    optional : bool
        Whether ``None`` is accepted.
    rows : Rows or None
        Symbolic length of dimension 0 (``None``: free length).
    dtypes : tuple of torch.dtype or None
        Accepted dtypes (``None``: any).
    ndim : int or None
        Required number of dimensions.
    pad_value : int, float, bool or None
        Declared pad value of a per-row field (``-1`` marks slot ids).
    cumulative : bool
        The field is an offsets array (pad rule ``Pad.CUMULATIVE``).
    cols : str, int or None
        What gives dimension 1 of a 2-D field: the name of an int field, a constant, or
        ``None`` when the declaration does not say.
    role : str
        The declared role (``"working_slot"``, ``"track_slot"``, ``"track_mask"``,
        ``"slot"``, ``"data"``, ...).
    slot_role : bool
        The role says the field holds state-pool slot ids.
    default : object
        The declared default, :data:`NO_DEFAULT` when there is none.
    governs : tuple of str
        For a host flag: the optional tensor fields it governs (given together or not at
        all).
    required_when_set : bool
        For a governing flag: ``True`` requires the governed fields.
    """

    name: str
    is_tensor: bool
    optional: bool
    rows: Rows | None
    dtypes: tuple[torch.dtype, ...] | None
    ndim: int | None
    pad_value: int | float | bool | None
    cumulative: bool
    cols: str | int | None
    role: str = "data"
    slot_role: bool = False
    default: object = NO_DEFAULT
    governs: tuple[str, ...] = ()
    required_when_set: bool = False

    @property
    def per_row(self) -> bool:
        """One entry per request row (``batch`` or ``batch+k``)."""
        return self.rows is not None and self.rows.symbol == "batch"

    @property
    def is_slot(self) -> bool:
        """Holds state-pool slot ids (by role, or an index field padded with ``-1``)."""
        return self.slot_role or (self.is_index and self.pad_value == -1 and not self.cumulative)

    @property
    def is_index(self) -> bool:
        return self.dtypes is not None and all(d in INDEX for d in self.dtypes)

    @property
    def is_bool(self) -> bool:
        return self.dtypes is not None and all(d in BOOL for d in self.dtypes)


@dataclass(frozen=True)
class UnresolvedHint:
    """A field annotation that cannot be evaluated (``text``: as written; ``error``: why)."""

    text: str
    error: str


def _evaluate(ann: object, globalns: dict[str, Any], localns: dict[str, Any]) -> Any:
    holder = type("_OneHint", (), {"__annotations__": {"x": ann}})
    return typing.get_type_hints(holder, globalns=globalns, localns=localns)["x"]


def type_hints(
    cls: type, localns: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, UnresolvedHint]]:
    """The annotations of ``cls`` and its bases, evaluated one by one.

    Returns ``(resolved, unresolved)``: ``resolved`` maps each field name whose annotation
    evaluates to its type; ``unresolved`` maps the others (string annotations naming
    something the defining module does not hold at run time, typically an ``if
    TYPE_CHECKING:`` import under ``from __future__ import annotations``) to an
    :class:`UnresolvedHint`. ``localns`` adds names to look up (``{"ForwardBatch": cls}``).
    """
    extra = dict(localns or {})
    try:
        return typing.get_type_hints(cls, localns=extra or None), {}
    except Exception:  # at least one annotation does not evaluate: find which
        pass
    resolved: dict[str, Any] = {}
    unresolved: dict[str, UnresolvedHint] = {}
    for base in reversed(cls.__mro__):
        if base is object:
            continue
        module = sys.modules.get(base.__module__)
        module_ns = dict(vars(module)) if module is not None else {}
        # Looked up as typing.get_type_hints looks them up: ``localns``, then the module,
        # then the class body (a field named after its type finds the type, not its
        # default); typing consults the body only without ``localns``, here it always does.
        globalns, local = {**dict(vars(base)), **module_ns}, extra
        for name, ann in inspect.get_annotations(base).items():
            resolved.pop(name, None)
            unresolved.pop(name, None)
            try:
                resolved[name] = _evaluate(ann, globalns, local)
            except Exception as e:
                text = ann if isinstance(ann, str) else repr(ann)
                unresolved[name] = UnresolvedHint(text, f"{type(e).__name__}: {e}")
    return resolved, unresolved


def unresolved_hints_error(
    who: str, cls: type, unresolved: Mapping[str, UnresolvedHint]
) -> TypeError:
    """The error for fields whose annotation cannot be evaluated (each named, with why)."""
    listed = "; ".join(
        f"{name!r}: {h.text!r} ({h.error})" for name, h in sorted(unresolved.items())
    )
    example = next(iter(sorted(unresolved)))
    return TypeError(
        f"{who}: cannot resolve the type hint of {cls.__qualname__} field(s) {listed}. "
        f"The annotation names something module {cls.__module__!r} does not define at run "
        "time (an `if TYPE_CHECKING:` import under `from __future__ import annotations`?). "
        "Pass localns={'Name': the_class} to resolve it, or "
        f"values={{{example!r}: strategy}} to draw the field without its hint"
    )


def is_metadata_class(cls: type) -> bool:
    """Whether ``cls`` is a ``@hybridmeta.metadata`` class."""
    try:
        fields_of(cls)
    except TypeError:
        return False
    return True


def fields(cls: type) -> tuple[FieldInfo, ...]:
    """The declared fields of a metadata class, source fields first."""
    out = []
    for spec in fields_of(cls):
        pad = spec.pad
        cumulative = pad is not None and pad == Pad.CUMULATIVE
        rows = spec.rows
        out.append(
            FieldInfo(
                name=spec.name,
                is_tensor=spec.is_tensor,
                optional=spec.optional,
                rows=None if rows is None else Rows(rows.dim.name, rows.offset),
                dtypes=spec.dtypes,
                ndim=spec.ndim,
                pad_value=None if pad is None or cumulative else pad.value,
                cumulative=cumulative,
                cols=spec.cols,
                role=spec.role.value,
                slot_role=spec.role.is_slot,
                default=NO_DEFAULT if spec.default is attrs.NOTHING else spec.default,
                governs=tuple(spec.governs),
                required_when_set=spec.required_when_set,
            )
        )
    return tuple(out)


def derivation(cls: type) -> tuple[type | None, tuple[str, ...]]:
    """``(source class, names of the fields cls adds)``; ``(None, ())`` for a root class."""
    src = source_of(cls)
    if src is None:
        return None, ()
    src_names = {f.name for f in fields_of(src)}
    return src, tuple(f.name for f in fields_of(cls) if f.name not in src_names)
