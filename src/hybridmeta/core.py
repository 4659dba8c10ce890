"""The declarative metadata core.

``@metadata`` turns a class body into a frozen, slotted, keyword-only attrs class whose
tensor fields compare by identity. A metadata class that subclasses another metadata class
is *derived*: it can only be built through its generated classmethod
``evolve_from(source, **changes)``, which copies every field of the source unless
``changes`` names it and requires every field the derived class adds. A field added to the
source later flows through every derived class with no change to the derived class; a
field added to the derived class cannot be forgotten into a default.

The generated functions (``evolve_from`` and the validator) are real Python source,
compiled under a readable file name and registered with :mod:`linecache`, so tracebacks
and pdb show them. Read one with ``inspect.getsource(Mamba2Metadata.evolve_from)``.
"""

from __future__ import annotations

import enum
import inspect
import itertools
import linecache
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, TypeVar, overload

import attrs
import torch
from typing_extensions import dataclass_transform

from hybridmeta.debug import is_debug

__all__ = [
    "BATCH",
    "BOOL",
    "CHUNKS",
    "FLOAT",
    "INDEX",
    "PHYSICAL_CHUNKS",
    "PREFILLS",
    "PREFILL_TOKENS",
    "TOKENS",
    "Conventions",
    "Dim",
    "FieldSpec",
    "Pad",
    "PadRule",
    "Role",
    "RowOrder",
    "Rows",
    "check_values",
    "conventions_of",
    "field",
    "fields_of",
    "is_derived",
    "is_extension",
    "metadata",
    "source_of",
    "specialized",
    "tensor_field",
]

_T = TypeVar("_T")

#: Integer dtypes accepted for index tensors (slot ids, offsets).
INDEX: Final[tuple[torch.dtype, ...]] = (torch.int32, torch.int64)
#: Mask dtype.
BOOL: Final[tuple[torch.dtype, ...]] = (torch.bool,)
#: Floating dtypes.
FLOAT: Final[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)

_SPEC_KEY: Final = "hybridmeta.spec"
_GEN_COUNTER = itertools.count()


class _PadKind(enum.Enum):
    VALUE = "value"
    CUMULATIVE = "cumulative"


@attrs.frozen
class PadRule:
    """How rows ``[bs:B)`` of a static buffer are filled when a batch is padded to ``B``.

    ``kind == VALUE``: every padded row holds ``value`` (``-1`` for slot ids, ``False`` for
    masks, the neutral value for counts). ``kind == CUMULATIVE``: an offsets array
    (``query_start_loc``) repeats its last live value, so every padded row has length zero.
    """

    kind: _PadKind
    value: int | float | bool | None = None

    def __repr__(self) -> str:
        return (
            "Pad.CUMULATIVE" if self.kind is _PadKind.CUMULATIVE else f"Pad.value({self.value!r})"
        )

    @property
    def cumulative(self) -> bool:
        """Whether this is the offsets rule (``Pad.CUMULATIVE``)."""
        return self.kind is _PadKind.CUMULATIVE


class Pad:
    """Pad rules for the fields of static CUDA-graph buffers."""

    CUMULATIVE: ClassVar[PadRule] = PadRule(_PadKind.CUMULATIVE)

    @staticmethod
    def value(v: int | float | bool) -> PadRule:
        """Pad rows hold the constant ``v``."""
        return PadRule(_PadKind.VALUE, v)


@attrs.frozen
class Dim:
    """A named length that several fields share (``BATCH``: request rows of the forward).

    Every field whose ``rows`` names the same ``Dim`` must agree on construction. ``Dim`` +
    an int is the :class:`Rows` of an offsets array (``BATCH + 1``).
    """

    name: str

    def __add__(self, offset: int) -> Rows:
        return Rows(self, offset)

    def __repr__(self) -> str:
        return self.name.upper()


@attrs.frozen
class Rows:
    """The length of dimension 0 of a tensor field: ``dim`` plus ``offset``."""

    dim: Dim
    offset: int = 0

    def of(self, n: int) -> int:
        """Rows of the field when ``dim`` has length ``n``."""
        return n + self.offset

    def __repr__(self) -> str:
        return repr(self.dim) if not self.offset else f"{self.dim!r} + {self.offset}"


#: Request rows of a forward (prefill rows first, decode rows last, pad rows after them).
BATCH: Final = Dim("batch")
#: Tokens of a forward (all rows).
TOKENS: Final = Dim("tokens")
#: Prefill rows of a mixed forward.
PREFILLS: Final = Dim("prefills")
#: Flattened tokens of the prefill rows.
PREFILL_TOKENS: Final = Dim("prefill_tokens")
#: Logical chunks of the chunked scan (one per physical chunk and row start).
CHUNKS: Final = Dim("chunks")
#: Physical chunks of the scan's global grid over the flattened prefill tokens.
PHYSICAL_CHUNKS: Final = Dim("physical_chunks")


class Role(enum.Enum):
    """What a field means to the static buffers and the debug checks.

    Tensor roles:

    * ``DATA``: no slot semantics (offsets, counts, plans).
    * ``WORKING_SLOT``: the state-pool slot every live row reads and writes. Sentinel-padded
      (pad rows hold ``-1``, a live row never does), distinct over live rows, and the one
      *translated* slot field: with a virtual-to-physical slot table, it holds virtual ids.
    * ``TRACK_SLOT``: a physical slot a row may save its state into; ``-1`` in a live row
      means "none".
    * ``TRACK_MASK``: the rows that save into their ``TRACK_SLOT`` this step.
    * ``SLOT``: any other state-pool slot id (``-1``: none), physical: range-checked and
      padded like every slot field, paired with nothing (a second pool's slots, say).
    * ``ENGINE_ONLY``: carried for the engine; no Mamba2 entry point reads it.

    A class has at most one ``WORKING_SLOT``, one ``TRACK_SLOT`` and one ``TRACK_MASK``:
    the debug checks pair them.

    Host roles:

    * ``DATA``: frozen at graph capture; a step must match the captured value exactly.
    * ``SUBSUMED_FLAG``: a bool whose captured ``True`` also serves a ``False`` step (the
      captured work is masked per row, so with every row unmasked it does nothing).
    """

    DATA = "data"
    WORKING_SLOT = "working_slot"
    TRACK_SLOT = "track_slot"
    TRACK_MASK = "track_mask"
    SLOT = "slot"
    ENGINE_ONLY = "engine_only"
    SUBSUMED_FLAG = "subsumed_flag"

    @property
    def is_slot(self) -> bool:
        """Whether the field holds state-pool slot ids (range-checked against the pool)."""
        return self in (Role.WORKING_SLOT, Role.TRACK_SLOT, Role.SLOT)

    @property
    def translated(self) -> bool:
        """Whether the field holds virtual ids when a slot table is in use."""
        return self is Role.WORKING_SLOT


class RowOrder(enum.Enum):
    """The order of a mixed batch's request rows, declared once by the engine.

    * ``PREFILLS_FIRST``: prefill rows, then decode rows, then pad rows (hybridmeta's
      planner, sglang).
    * ``DECODES_FIRST``: decode rows, then prefill rows, then pad rows (vLLM's scheduler
      reorders every batch so).

    The tokens of the forward follow the rows in the same order.
    """

    PREFILLS_FIRST = "prefills_first"
    DECODES_FIRST = "decodes_first"


@attrs.frozen
class Conventions:
    """An engine's conventions for its metadata, declared once on its source class.

    ``@metadata(conventions=Conventions(...))`` on a root or extension class; every class
    derived from it (and every specialisation) inherits them. Ops, buffers and the debug
    checks read them through :func:`conventions_of`, never from a literal.

    Attributes
    ----------
    row_order : RowOrder
        Prefill rows first (default) or decode rows first.
    null_slot : int
        The id every slot field holds in a pad row, and a track / destination slot field
        where a row has none: ``-1`` (default: no slot) or a slot ``>= 0`` that the engine
        reserves in every pool and that is never read or written as a live row's state
        (vLLM's ``NULL_BLOCK_ID = 0``). A live row never holds it as its working slot.
    """

    row_order: RowOrder = RowOrder.PREFILLS_FIRST
    null_slot: int = -1

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.row_order, RowOrder):
            raise TypeError(
                f"Conventions.row_order must be a RowOrder, got {type(self.row_order).__name__}"
            )
        if type(self.null_slot) is not int or self.null_slot < -1:
            raise ValueError(
                "Conventions.null_slot must be a plain int >= -1 (-1: no slot; >= 0: a reserved "
                f"null slot), got {self.null_slot!r}"
            )

    @property
    def decodes_first(self) -> bool:
        """Whether decode rows come first (vLLM's order)."""
        return self.row_order is RowOrder.DECODES_FIRST


#: hybridmeta's own conventions (and sglang's): prefill rows first, pad slot -1.
DEFAULT_CONVENTIONS: Final = Conventions()


_TENSOR_ROLES: Final = frozenset(
    {Role.DATA, Role.WORKING_SLOT, Role.TRACK_SLOT, Role.TRACK_MASK, Role.SLOT, Role.ENGINE_ONLY}
)
_UNIQUE_ROLES: Final = (Role.WORKING_SLOT, Role.TRACK_SLOT, Role.TRACK_MASK)
_HOST_ROLES: Final = frozenset({Role.DATA, Role.SUBSUMED_FLAG, Role.ENGINE_ONLY})


@attrs.frozen(kw_only=True)
class FieldSpec:
    """What a metadata field declares about itself.

    Attributes
    ----------
    name : str
        Field name.
    owner : str
        Qualified name of the class that declared the field.
    is_tensor : bool
        Whether the field holds a ``torch.Tensor`` (or ``None`` when ``optional``).
    optional : bool
        Whether ``None`` is an accepted value.
    rows : Rows or None
        The length of dimension 0 (``BATCH``: one entry per request row; ``BATCH + 1``:
        offsets over the batch; ...). All fields sharing a ``Dim`` must agree on
        construction. ``None``: free length.
    cols : str or None
        Name of the int host field that gives dimension 1 (``"draft_token_num"``).
    dtypes : tuple of torch.dtype or None
        Accepted dtypes (``None``: any).
    pad : PadRule or None
        Pad rule for static buffers; required for per-row (``BATCH``) tensors, which is
        what makes them bufferable.
    ndim : int or None
        Required number of dimensions (``None``: any).
    role : Role
        What the field means to the buffers and the debug checks.
    default : object
        The declared default (``attrs.NOTHING``: none).
    governs : tuple of str
        For a host flag: the optional tensor fields whose use it decides. They are given
        together or not at all, and when they are given the flag must be stated
        explicitly (its default would silently decide for the caller).
    required_when_set : bool
        For a governing flag: ``True`` requires the governed fields.
    """

    name: str
    owner: str
    is_tensor: bool
    optional: bool
    rows: Rows | None
    dtypes: tuple[torch.dtype, ...] | None
    pad: PadRule | None
    ndim: int | None
    role: Role = Role.DATA
    cols: str | None = None
    default: object
    governs: tuple[str, ...] = ()
    required_when_set: bool = False

    @property
    def per_row(self) -> bool:
        """Whether this field has one entry per request row (a static-buffer field)."""
        return self.rows is not None and self.rows.dim == BATCH


@attrs.frozen
class _TensorDecl:
    rows: Rows | None
    cols: str | None
    dtypes: tuple[torch.dtype, ...] | None
    pad: PadRule | None
    optional: bool
    ndim: int | None
    role: Role


@attrs.frozen
class _HostDecl:
    role: Role
    default: object
    governs: tuple[str, ...]
    required_when_set: bool


class _Unstated:
    """Placeholder default of a governing flag until the validator resolves it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<unstated>"


_UNSTATED: Final = _Unstated()


def tensor_field(
    *,
    rows: Dim | Rows | None = None,
    cols: str | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    pad: PadRule | None = None,
    ndim: int | None = None,
    role: Role = Role.DATA,
    optional: bool = False,
    default: Any = attrs.NOTHING,
    doc: str = "",
) -> Any:
    """Declare a tensor field of a metadata class.

    Parameters
    ----------
    rows : Dim or Rows, optional
        Length of dimension 0 (``BATCH``, ``BATCH + 1``, ``TOKENS``, ...).
    cols : str, optional
        Name of an int host field of the class that gives dimension 1 (``"draft_token_num"``).
    dtypes : tuple of torch.dtype, optional
        Accepted dtypes, checked on construction.
    pad : PadRule, optional
        Pad rule for static CUDA-graph buffers. Required when ``rows`` is ``BATCH`` or
        ``BATCH + 1``.
    ndim : int, optional
        Required number of dimensions (default 1, or 2 with ``cols``).
    role : Role
        The field's role (slot ids, track mask, engine-only, ...).
    optional : bool
        Accept ``None``. Implied by ``default=None``.
    default : None, optional
        Only ``None`` is accepted as a default, and only on a source (root) class.
    doc : str
        Documentation of the field.
    """
    shape = Rows(rows) if isinstance(rows, Dim) else rows
    if shape is not None and not isinstance(shape, Rows):
        raise TypeError(
            f"tensor_field(rows={rows!r}): rows must be a Dim (BATCH, TOKENS, ...) or a Rows "
            "(BATCH + 1), not a string"
        )
    if not isinstance(role, Role):
        raise TypeError(f"tensor_field: role must be a Role, got {role!r}")
    if role not in _TENSOR_ROLES:
        raise TypeError(f"tensor_field: role {role} is a host-field role")
    if shape is not None and shape.dim == BATCH and pad is None and not role.is_slot:
        raise TypeError(
            f"tensor_field(rows={shape!r}) needs a pad rule: per-row fields are bufferable"
        )
    if pad is not None and not isinstance(pad, PadRule):
        raise TypeError(f"tensor_field: pad must be Pad.value(v) or Pad.CUMULATIVE, got {pad!r}")
    if default is not attrs.NOTHING and default is not None:
        raise TypeError("tensor_field: the only accepted default is None")
    if role.is_slot and (dtypes is None or not set(dtypes) <= set(INDEX)):
        raise TypeError(
            f"tensor_field(role={role}): slot fields hold int32/int64 ids (dtypes=INDEX); "
            "their pad is the class's declared null slot (Conventions.null_slot)"
        )
    if role is Role.TRACK_MASK and dtypes != BOOL:
        raise TypeError("tensor_field(role=Role.TRACK_MASK): a mask has dtypes=BOOL")
    if ndim is not None and (type(ndim) is not int or ndim < 0):
        raise TypeError(f"tensor_field(ndim={ndim!r}): ndim must be an int >= 0")
    resolved_ndim = ndim if ndim is not None else (2 if cols is not None else 1)
    if resolved_ndim < (1 if shape is not None else 0) + (1 if cols is not None else 0):
        raise TypeError(
            f"tensor_field(ndim={resolved_ndim}): a field with rows={shape!r}"
            f"{f' and cols={cols!r}' if cols is not None else ''} needs at least "
            f"{(shape is not None) + (cols is not None)} dimension(s)"
        )
    if pad is not None and pad.kind is _PadKind.VALUE:
        _check_pad_value(pad, dtypes)
    if pad is not None and pad.cumulative and (dtypes is None or not set(dtypes) <= set(INDEX)):
        raise TypeError("tensor_field(pad=Pad.CUMULATIVE): offsets are index tensors (dtypes=INDEX)")
    decl = _TensorDecl(
        rows=shape,
        cols=cols,
        dtypes=dtypes,
        pad=pad,
        optional=optional or default is None,
        ndim=resolved_ndim,
        role=role,
    )
    return attrs.field(default=default, metadata={_SPEC_KEY: decl, "doc": doc})


def _check_pad_value(pad: PadRule, dtypes: tuple[torch.dtype, ...] | None) -> None:
    """A constant pad must be representable, unchanged, in every accepted dtype."""
    v = pad.value
    if dtypes is None:
        return
    if all(d is torch.bool for d in dtypes):
        ok, need = type(v) is bool, "True or False (a BOOL field)"
    elif any(not d.is_floating_point for d in dtypes):
        ok, need = type(v) is int, "a plain int (an integer field)"
    else:
        ok, need = type(v) in (int, float), "an int or a float (a float field)"
    if not ok:
        raise TypeError(f"tensor_field(pad={pad!r}): the pad must be {need}, got {type(v).__name__}")


def field(
    *,
    default: Any = attrs.NOTHING,
    role: Role = Role.DATA,
    governs: tuple[str, ...] = (),
    required_when_set: bool = False,
    doc: str = "",
) -> Any:
    """Declare a non-tensor field (Python scalars, nested metadata, host-side tuples).

    Parameters
    ----------
    default : object, optional
        The default value.
    role : Role
        ``Role.SUBSUMED_FLAG`` for a bool whose captured ``True`` serves ``False`` steps.
    governs : tuple of str
        Optional tensor fields whose use this flag decides: they come together or not at
        all, and whenever they are given the flag must be passed explicitly (a clear error
        naming both otherwise), so its default can never silently decide.
    required_when_set : bool
        With ``governs``: a true flag requires the governed fields.
    doc : str
        Documentation of the field.
    """
    if role not in _HOST_ROLES:
        raise TypeError(f"field: role {role} is a tensor-field role")
    if (governs or required_when_set) and default is attrs.NOTHING:
        raise TypeError("field(governs=...): a governing flag needs a default")
    decl = _HostDecl(
        role=role, default=default, governs=tuple(governs), required_when_set=required_when_set
    )
    stored_default = _UNSTATED if governs else default
    return attrs.field(default=stored_default, metadata={_SPEC_KEY: decl, "doc": doc})


def _same(a: object, b: object) -> bool:
    # attrs' generated __eq__ would call Tensor.__eq__ (elementwise, then bool() syncs and
    # raises for more than one element): tensors compare by identity.
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)


def _hash_key(v: object) -> object:
    return ("tensor", id(v)) if isinstance(v, torch.Tensor) else v


def _make_eq_hash(
    cls: type, names: tuple[str, ...]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Generate ``__eq__`` (tensors by identity, everything else by ``==``) and a matching
    ``__hash__``."""
    ns: dict[str, Any] = {"_same": _same, "_key": _hash_key}
    cmp = " and ".join(f"_same(self.{n}, other.{n})" for n in names) or "True"
    keys = ", ".join(f"_key(self.{n})" for n in names)
    lines = [
        "def __eq__(self, other):",
        "    if other.__class__ is not self.__class__:",
        "        return NotImplemented",
        f"    return {cmp}",
        "",
        "def __hash__(self):",
        f"    return hash((self.__class__, {keys}))",
    ]
    eq = _compile(cls, "__eq__", lines, ns)
    hash_ = ns["__hash__"]
    hash_.__qualname__ = f"{cls.__qualname__}.__hash__"
    hash_.__module__ = cls.__module__
    return eq, hash_


# --------------------------------------------------------------------------------------
# registry of metadata classes


class _Kind(enum.Enum):
    ROOT = "root"  # built by its __init__
    EXTENSION = "extension"  # a root's (or extension's) fields plus the engine's own
    DERIVED = "derived"  # built only through evolve_from(source)
    SPECIALIZATION = "specialization"  # a derived class for an extended source


@attrs.frozen
class _ClassInfo:
    specs: tuple[FieldSpec, ...]
    source: type | None
    derived_names: tuple[str, ...]
    kind: _Kind
    conventions: Conventions
    #: extension: the class it extends; specialisation: the derived class it specialises
    base: type | None = None


_INFO_ATTR: Final = "__hybridmeta_info__"


def _info(cls: type) -> _ClassInfo:
    info = cls.__dict__.get(_INFO_ATTR)
    if not isinstance(info, _ClassInfo):
        if any(_is_metadata_class(b) for b in cls.__mro__[1:]):
            raise _undecorated(cls)
        raise TypeError(f"{cls.__qualname__} is not a @hybridmeta.metadata class")
    return info


def fields_of(cls: type) -> tuple[FieldSpec, ...]:
    """The declared fields of a metadata class, source fields first."""
    return _info(cls).specs


def source_of(cls: type) -> type | None:
    """The class a derived metadata class evolves from (``None`` for a root or extension)."""
    return _info(cls).source


def is_derived(cls: type) -> bool:
    """Whether ``cls`` is a derived metadata class (built only through ``evolve_from``)."""
    return _info(cls).source is not None


def is_extension(cls: type) -> bool:
    """Whether ``cls`` extends a source metadata class with an engine's own fields
    (``@metadata(extension=True)``): built directly, accepted wherever its base is."""
    return _info(cls).kind is _Kind.EXTENSION


def conventions_of(obj: object) -> Conventions:
    """The :class:`Conventions` declared for a metadata class or instance (inherited by
    every class derived from the class that declared them)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return _info(cls).conventions


def _is_metadata_class(cls: type) -> bool:
    return isinstance(cls.__dict__.get(_INFO_ATTR), _ClassInfo)


# --------------------------------------------------------------------------------------
# code generation


def _compile(
    cls: type, func_name: str, lines: list[str], namespace: dict[str, Any]
) -> Callable[..., Any]:
    """Compile generated source under a readable file name and register it with linecache."""
    source = "\n".join(lines) + "\n"
    filename = (
        f"<hybridmeta generated {func_name} {cls.__module__}.{cls.__qualname__}"
        f" #{next(_GEN_COUNTER)}>"
    )
    code = compile(source, filename, "exec")
    exec(code, namespace)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    fn = namespace[func_name]
    assert callable(fn)
    fn.__qualname__ = f"{cls.__qualname__}.{func_name}"
    fn.__module__ = cls.__module__
    return fn  # type: ignore[no-any-return]


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _type_rule(ann: object) -> tuple[tuple[type, ...], bool] | None:
    """``(classes, None allowed)`` a host field's resolved annotation admits; ``None``: no
    check (``Any``, literals, type variables, generics without a runtime class)."""
    origin = typing.get_origin(ann)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(ann)
        rules = [_type_rule(a) for a in args if a is not type(None)]
        if any(r is None for r in rules):
            return None  # a member we do not check: check none of them
        classes = tuple(c for r in rules if r is not None for c in r[0])
        return classes, type(None) in args or any(r is not None and r[1] for r in rules)
    if origin is not None:
        return ((origin,), False) if isinstance(origin, type) else None
    if ann is None or ann is type(None):
        return (), True
    if isinstance(ann, type) and ann in _CHECKED_HOST_TYPES:
        return (ann,), False
    # Other classes (nested metadata, engine types) are checked by their own constructors;
    # an isinstance check here would break under importlib.reload of their module.
    return None


_CHECKED_HOST_TYPES: Final = (bool, int, float, str, bytes, tuple, list, dict, torch.Tensor)


def _host_annotations(cls: type) -> dict[str, object]:
    """Every field's annotation, resolved in the module of the class that declared it; a
    name that cannot be resolved (a ``TYPE_CHECKING`` import) is left out: no type check."""
    out: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        own = inspect.get_annotations(klass)
        if not own:
            continue
        module = inspect.getmodule(klass)
        globalns = dict(vars(module)) if module is not None else {}
        for name, ann in own.items():
            if isinstance(ann, str):
                try:
                    ann = eval(ann, globalns, dict(vars(klass)))  # a string annotation
                except Exception:  # unresolvable: no check (documented)
                    out.pop(name, None)
                    continue
            out[name] = ann
    return out


def _host_check_lines(
    ns: dict[str, Any], spec: FieldSpec, ann: object, indent: str = "    "
) -> list[str]:
    """Generated lines refusing a host value of the wrong type (``num_decodes=3.0``, a
    string or a 0-d tensor for a flag), naming the field and the type it needs."""
    rule = _type_rule(ann)
    if rule is None:
        return []
    classes, allow_none = rule
    if not classes:
        return []
    n = spec.name
    if bool in classes:
        expr = f"isinstance(v, _types_{n})"
    elif int in classes or float in classes:
        # counts are plain ints: a bool is an int to Python, a float or a 0-d tensor is not
        expr = f"isinstance(v, _types_{n}) and not isinstance(v, bool)"
        if float in classes and int not in classes:
            classes = (*classes, int)
    else:
        expr = f"isinstance(v, _types_{n})"
    ns[f"_types_{n}"] = classes
    names = " or ".join(c.__name__ for c in classes) + (" or None" if allow_none else "")
    lines = [f"{indent}v = self.{n}"]
    cond = f"not ({expr})" if not allow_none else f"v is not None and not ({expr})"
    lines.append(f"{indent}if {cond}:")
    lines.append(
        f"{indent}    raise _type_err(self, {n!r}, {names!r}, v)"
    )
    return lines


def _type_error(self: object, field_name: str, need: str, v: object) -> TypeError:
    got = type(v).__module__ + "." + type(v).__qualname__ if type(v).__module__ != "builtins" else type(v).__qualname__
    extra = " (a 0-d tensor would be read from the device at every use: pass a Python value)" if isinstance(v, torch.Tensor) else ""
    return TypeError(f"{type(self).__qualname__}.{field_name} must be {need}, got {got} {v!r}{extra}")


def _make_validator(
    cls: type,
    specs: tuple[FieldSpec, ...],
    name: str = "__hm_validate__",
    annotations: Mapping[str, object] | None = None,
) -> Callable[[Any], None]:
    """Generate ``__hm_validate__(self)``: governing flags first (resolve an unstated flag
    to its default, refuse it unstated beside its governed data), the host fields' types,
    then cheap structural checks of ``specs`` (type, dtype, ndim, columns, device, row
    counts), then every class's own ``__validate__`` hook (bases first) and, in debug mode,
    the declared value checks (:func:`check_values`) and the ``__validate_debug__`` hooks.
    No device reads outside debug mode."""
    ns: dict[str, Any] = {
        "_err": _validation_error,
        "_type_err": _type_error,
        "_is_debug": is_debug,
        "_UNSTATED": _UNSTATED,
        "_check_values": check_values,
        "_Cls": cls,
        "_undecorated": _undecorated,
        "_Tensor": torch.Tensor,
    }
    anns = annotations or {}
    lines = [
        f"def {name}(self):",
        "    if self.__class__ is not _Cls:",
        "        raise _undecorated(self.__class__)",
        "    _dev = None",
    ]
    for spec in specs:
        if not spec.governs:
            continue
        n = spec.name
        ns[f"_set_{n}"] = _slot_setter(cls, n)
        ns[f"_default_{n}"] = spec.default
        given = ", ".join(f"self.{g} is not None" for g in spec.governs)
        group = " and ".join(spec.governs)
        lines += [
            f"    _g = ({given},)",
            "    if any(_g) and not all(_g):",
            f"        raise _err(self, {spec.governs[0]!r}, "
            f"{'and ' + ', '.join(spec.governs[1:]) + ' are given together or not at all (' + n + ' governs them)'!r})",
            f"    if self.{n} is _UNSTATED:",
            "        if _g[0]:",
            f"            raise _err(self, {n!r}, "
            f"{'must be stated explicitly when ' + group + ' are given: it decides whether the layers use them, and its default ' + repr(spec.default) + ' would decide silently'!r})",
            f"        _set_{n}(self, _default_{n})",
        ]
        if n in anns:
            lines += _host_check_lines(ns, spec, anns[n])
        if spec.required_when_set:
            lines += [
                f"    if self.{n} and not _g[0]:",
                f"        raise _err(self, {n!r}, {'is set, so ' + group + ' are required'!r})",
            ]
    for spec in specs:
        if not spec.is_tensor and not spec.governs and spec.name in anns:
            lines += _host_check_lines(ns, spec, anns[spec.name])
    bound: dict[str, str] = {}  # dim name -> the first field that binds it
    for spec in specs:
        n = spec.name
        if not spec.is_tensor:
            continue
        lines.append(f"    v = self.{n}")
        indent = "    "
        if spec.optional:
            lines.append("    if v is not None:")
            indent = "        "
        else:
            lines.append("    if v is None:")
            lines.append(
                f"        raise _err(self, {n!r}, 'is required (not optional) and got None')"
            )
        lines.append(f"{indent}if not isinstance(v, _Tensor):")
        lines.append(
            f"{indent}    raise _type_err(self, {n!r}, 'a torch.Tensor', v)"
        )
        if spec.dtypes is not None:
            ns[f"_dt_{n}"] = frozenset(spec.dtypes)
            lines.append(f"{indent}if v.dtype not in _dt_{n}:")
            lines.append(
                f"{indent}    raise _err(self, {n!r}, "
                f"'dtype must be one of ({_dtype_names(spec.dtypes)}), got ' + str(v.dtype))"
            )
        if spec.ndim is not None:
            lines.append(f"{indent}if v.dim() != {spec.ndim}:")
            lines.append(
                f"{indent}    raise _err(self, {n!r}, 'must have {spec.ndim} dimension(s), got shape ' + str(tuple(v.shape)))"
            )
        if spec.cols is not None:
            lines.append(f"{indent}if v.shape[1] != self.{spec.cols}:")
            lines.append(
                f"{indent}    raise _err(self, {n!r}, 'has ' + str(v.shape[1]) + "
                f"' columns but its columns are {spec.cols} = ' + str(self.{spec.cols}))"
            )
        lines.append(f"{indent}if _dev is None:")
        lines.append(f"{indent}    _dev = v.device; _dev_field = {n!r}")
        lines.append(f"{indent}elif v.device != _dev:")
        lines.append(
            f"{indent}    raise _err(self, {n!r}, 'must be on the same device as ' + _dev_field + ' (' + str(_dev) + '), got ' + str(v.device))"
        )
        if spec.rows is not None:
            sym, off = spec.rows.dim.name, spec.rows.offset
            var = f"_rows_{sym}"
            length = f"v.shape[0] - {off}" if off else "v.shape[0]"
            if sym not in bound:
                lines.insert(4, f"    {var} = None; {var}_field = None")
                bound[sym] = n
            lines.append(f"{indent}if {var} is None:")
            lines.append(f"{indent}    {var} = {length}; {var}_field = {n!r}")
            lines.append(f"{indent}elif {length} != {var}:")
            lines.append(
                f"{indent}    raise _err(self, {n!r}, 'has ' + str(v.shape[0]) + "
                f"{' rows but its rows are ' + repr(spec.rows) + ' and '!r} + {var}_field + "
                f"' implies ' + str({var} + {off}))"
            )
    for i, hook in enumerate(_hooks(cls, "__validate__")):
        ns[f"_hook_{i}"] = hook
        lines.append(f"    _hook_{i}(self)")
    lines.append("    if _is_debug():")
    lines.append("        _check_values(self)")
    for i, hook in enumerate(_hooks(cls, "__validate_debug__")):
        ns[f"_debug_hook_{i}"] = hook
        lines.append(f"        _debug_hook_{i}(self)")
    lines.append("    return None")
    return _compile(cls, name, lines, ns)


def _hooks(cls: type, name: str) -> list[Callable[[Any], None]]:
    """Each class's own ``name`` hook along the MRO, bases first (an extension's hooks run
    in every class specialised for it, though it is not a base of the derived class)."""
    out: list[Callable[[Any], None]] = []
    for klass in reversed(cls.__mro__):
        hook = klass.__dict__.get(name)
        if hook is not None:
            if not callable(hook):
                raise TypeError(f"{klass.__qualname__}.{name} must be a method")
            out.append(hook)
    return out


def check_values(
    obj: object,
    *,
    num_slots: int | None = None,
    live: bool = False,
    physical: bool = False,
    overrides: Mapping[str, torch.Tensor] | None = None,
    where: str | None = None,
) -> None:
    """The value checks every declaration implies; they read device values (debug only).

    Run on construction in debug mode, and by the static buffers before they write a step.

    * offsets (``Pad.CUMULATIVE``) start at 0 and never decrease;
    * slot fields (``Role.WORKING_SLOT``, ``Role.TRACK_SLOT``, ``Role.SLOT``) hold the
      class's null slot (``Conventions.null_slot``: ``-1`` unless declared) or a slot
      ``>= 0``, below ``num_slots`` when it is given;
    * working slots are distinct over the rows that hold one, and with ``live`` (every row
      is a live row: a step before padding) no row holds the pad;
    * a row whose ``Role.TRACK_MASK`` is set has a track slot, and track slots of such rows
      are distinct;
    * with ``physical`` (the ids are pool slots, not virtual ids of a slot table) a
      tracked row's track slot is not the working slot of any row: the save would
      overwrite live state. This comparison needs both fields in one id space, so it runs
      only where the translation is known: :meth:`StaticBuffers.refresh` asks for it; the
      planner (on host data) and the ops (``check_disjoint_writes`` in debug mode) make the
      same check on their own inputs.

    ``overrides`` replaces fields' values for the checks (the static buffers pass the
    physical ids of translated fields).

    Raises
    ------
    ValueError
        ``"<where or Class>.<field> <rule>"``.
    """
    specs = fields_of(type(obj))
    prefix = where if where is not None else type(obj).__qualname__

    def fail(name: str, rule: str) -> ValueError:
        return ValueError(f"{prefix}.{name} {rule}")

    null = conventions_of(obj).null_slot
    pad_word = "-1 (pad)" if null < 0 else f"the null slot {null} (pad)"
    working: tuple[str, torch.Tensor] | None = None
    track: tuple[str, torch.Tensor] | None = None
    mask: tuple[str, torch.Tensor] | None = None
    swap = overrides or {}
    for spec in specs:
        if not spec.is_tensor:
            continue
        v = swap[spec.name] if spec.name in swap else getattr(obj, spec.name)
        if v is None or v.numel() == 0:
            continue
        if spec.pad is not None and spec.pad.cumulative:
            if int(v[0]) != 0:
                raise fail(spec.name, f"must start at 0, got {int(v[0])}")
            if bool((v[1:] < v[:-1]).any()):
                raise fail(spec.name, "must be non-decreasing (offsets)")
        if spec.role.is_slot:
            bound = "" if num_slots is None else f" and < num_slots={num_slots}"
            bad = (v < 0) & (v != null)
            if num_slots is not None:
                bad |= v >= num_slots
            if bool(bad.any()):
                r = int(bad.nonzero()[0, 0])
                raise fail(spec.name, f"must be {pad_word} or a slot >= 0{bound}; row {r} holds {int(v[r])}")
        if spec.role is Role.WORKING_SLOT:
            working = (spec.name, v)
            if live and bool((v == null).any()):
                r = int((v == null).nonzero()[0, 0])
                raise fail(spec.name, f"holds the pad value {null} in live row {r} (live rows must be slots)")
            held = v[v != null]
            if torch.unique(held).numel() != held.numel():
                raise fail(spec.name, "has a duplicate slot: two rows would update one state")
        elif spec.role is Role.TRACK_SLOT:
            track = (spec.name, v)
        elif spec.role is Role.TRACK_MASK:
            mask = (spec.name, v)
    if track is None or mask is None:
        return
    tname, t = track
    mname, m = mask
    tracked = t[m.bool()]
    if bool((tracked == null).any()):
        raise fail(tname, f"is {null} (none) in a row whose {mname} is set")
    if torch.unique(tracked).numel() != tracked.numel():
        raise fail(tname, f"has a duplicate track slot among rows whose {mname} is set")
    if physical and working is not None:
        wname, w = working
        clash = torch.isin(tracked, w[w != null])
        if bool(clash.any()):
            raise fail(
                tname,
                f"slot {int(tracked[clash][0])} of a tracked row is also the {wname} of a "
                "row: saving into it would overwrite live state",
            )


def _all_attrs(cls: type) -> set[str]:
    return {k for klass in cls.__mro__ for k in klass.__dict__}


def _validation_error(self: object, field_name: str, rule: str) -> ValueError:
    return ValueError(f"{type(self).__qualname__}.{field_name} {rule}")


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<MISSING>"


_MISSING: Final = _Missing()


def _slot_descriptor(cls: type, name: str) -> Any:
    """The slot descriptor of field ``name`` (``None``: the field lives in the instance
    dict, as every field a non-root class adds does)."""
    for klass in cls.__mro__:
        descr = klass.__dict__.get(name)
        if (
            descr is not None
            and hasattr(descr, "__set__")
            and type(descr).__name__ == "member_descriptor"
        ):
            return descr
    return None


def _slot_setter(cls: type, name: str) -> Callable[[object, object], None]:
    """A setter that writes field ``name`` of a (frozen) instance of ``cls``."""
    descr = _slot_descriptor(cls, name)
    if descr is not None:
        return descr.__set__  # type: ignore[no-any-return]
    if any("__dict__" in k.__dict__ for k in cls.__mro__):

        def set_in_dict(obj: object, value: object) -> None:
            obj.__dict__[name] = value

        return set_in_dict
    raise TypeError(f"{cls.__qualname__}.{name}: no slot to write (internal error)")


def _undecorated(cls: type) -> TypeError:
    base = next(b for b in cls.__mro__[1:] if _is_metadata_class(b))
    return TypeError(
        f"{cls.__qualname__} subclasses the metadata class {base.__qualname__} but is not "
        "decorated with @hybridmeta.metadata: it would silently build or validate as "
        f"{base.__qualname__}. Decorate it (@metadata(extension=True) to add fields to a "
        "source class, @metadata to derive)"
    )


def _bad_source(cls: type, source_cls: type, source: object) -> TypeError:
    return TypeError(
        f"{cls.__qualname__}.evolve_from: source must be a {source_cls.__qualname__} (the "
        f"class {cls.__qualname__} derives from) or a @metadata class extending it, got "
        f"{type(source).__qualname__}"
    )


def _unknown_fields(cls: type, unknown: Mapping[str, object], known: tuple[str, ...]) -> TypeError:
    names = ", ".join(repr(k) for k in unknown)
    return TypeError(
        f"{cls.__qualname__}.evolve_from: unknown field(s) {names}; "
        f"{cls.__qualname__} has fields: {', '.join(known)}"
    )


def _missing_fields(cls: type, missing: list[str]) -> TypeError:
    names = ", ".join(repr(m) for m in missing)
    return TypeError(
        f"{cls.__qualname__}.evolve_from: missing derived field(s) {names}; every field that "
        f"{cls.__qualname__} adds over its source must be passed explicitly (pass None "
        "explicitly for an optional one)"
    )


def _unstated_flag(cls: type, flag: str, governed: tuple[str, ...]) -> TypeError:
    return TypeError(
        f"{cls.__qualname__}.evolve_from: changes {' / '.join(governed)}, which {flag} governs; "
        f"pass {flag} explicitly too (the source's value was decided for other data)"
    )


def _refuse_init(cls: type, source: type) -> Callable[..., None]:
    hint = (
        f" (to add your engine's own fields to {source.__qualname__} and build it directly, "
        "declare the subclass with @metadata(extension=True))"
        if not is_derived(source)
        else ""
    )

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        raise TypeError(
            f"{cls.__qualname__} is derived from {source.__qualname__} and cannot be constructed "
            f"directly: use {cls.__qualname__}.evolve_from(source, ...), which copies every "
            f"{source.__qualname__} field unless you change it{hint}"
        )

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


# Specialisations of derived classes for extended sources, built on first use:
# (derived class, source class) -> the class evolve_from builds for such a source.
_SPECIALIZED: dict[tuple[type, type], type] = {}


def specialized(derived: type, source: type) -> type:
    """The class ``derived.evolve_from`` builds from an instance of ``source``.

    ``source`` is the class ``derived`` evolves from (then ``derived`` itself), or a
    metadata class extending it (an ``@metadata(extension=True)`` class, or a
    specialisation): then the specialisation of ``derived`` for ``source``, a subclass of
    both generated on first use, so an engine's own fields flow through with every other
    source field. Declaring ``@metadata class EngineMd(Mamba2Metadata, EngineForward)``
    yourself gives the same class a name and a precise mypy signature.
    """
    info = _info(derived)
    if info.source is None:
        raise TypeError(f"specialized: {derived.__qualname__} is not a derived metadata class")
    if source is info.source:
        return derived
    key = (derived, source)
    found = _SPECIALIZED.get(key)
    if found is not None:
        return found
    if not (isinstance(source, type) and issubclass(source, info.source)) or issubclass(
        source, derived
    ):
        raise TypeError(
            f"specialized: {source!r} is not {info.source.__qualname__} nor a class extending it"
        )
    _info(source)  # refuses an undecorated subclass
    namespace = {
        "__module__": derived.__module__,
        "__qualname__": f"{derived.__qualname__}[{source.__qualname__}]",
    }
    made = types.new_class(
        f"{derived.__name__}[{source.__name__}]",
        (derived, source),
        exec_body=lambda ns: ns.update(namespace),
    )
    built: type = _build(made, extension=False, conventions=None)
    return _SPECIALIZED.setdefault(key, built)


def _specialize_for(cls: type, source: object) -> type:
    src_cls = _info(cls).source
    assert src_cls is not None
    t = type(source)
    if not (issubclass(t, src_cls) and _is_metadata_class(t)) or issubclass(t, cls):
        if issubclass(t, src_cls) and not _is_metadata_class(t):
            raise _undecorated(t)
        raise _bad_source(cls, src_cls, source)
    return specialized(cls, t)


def _make_evolve_from(
    cls: type,
    source: type,
    source_names: tuple[str, ...],
    derived_names: tuple[str, ...],
    validator: Callable[[Any], None],
    derived_validator: Callable[[Any], None],
) -> Callable[..., Any]:
    ns: dict[str, Any] = {
        "_MISSING": _MISSING,
        "_Source": source,
        "_Cls": cls,
        "_new": object.__new__,
        "_validate": validator,
        "_undecorated": _undecorated,
        "_specialize_for": _specialize_for,
        "_unknown_fields": _unknown_fields,
        "_missing_fields": _missing_fields,
        "_all_names": source_names + derived_names,
    }
    params = [f"{n}=_MISSING" for n in derived_names + source_names]
    forward = ", ".join(f"{n}={n}" for n in derived_names + source_names)
    lines = [
        f"def evolve_from(cls, source, /, *, {', '.join(params)}, **_unknown):",
        f'    """Build a {cls.__qualname__} from a {source.__qualname__}.',
        "",
        f"    Every {source.__qualname__} field is copied unless named here; every field",
        f"    {cls.__qualname__} adds ({', '.join(derived_names)}) must be passed. A source that",
        f"    extends {source.__qualname__} builds the specialisation of {cls.__qualname__} for",
        "    its class (hybridmeta.core.specialized), which carries its extra fields too.",
        '    """',
        "    if cls is not _Cls:",
        "        raise _undecorated(cls)",
        "    if source.__class__ is not _Source:",
        f"        return _specialize_for(_Cls, source).evolve_from(source, {forward}, **_unknown)",
        "    if _unknown:",
        "        raise _unknown_fields(_Cls, _unknown, _all_names)",
    ]
    if derived_names:
        cond = " or ".join(f"{n} is _MISSING" for n in derived_names)
        lines.append(f"    if {cond}:")
        names_list = ", ".join(f"({n!r}, {n})" for n in derived_names)
        lines.append(
            f"        raise _missing_fields(_Cls, [k for k, v in ({names_list},) if v is _MISSING])"
        )
    for spec in fields_of(source):
        if spec.governs:
            changed = " or ".join(f"{g} is not _MISSING" for g in spec.governs)
            ns["_unstated_flag"] = _unstated_flag
            lines.append(f"    if ({changed}) and {spec.name} is _MISSING:")
            lines.append(
                f"        raise _unstated_flag(_Cls, {spec.name!r}, {spec.governs!r})"
            )
    lines.append("    _changed = False")
    for n in source_names:
        lines.append(f"    if {n} is _MISSING:")
        lines.append(f"        {n} = source.{n}")
        lines.append("    else:")
        lines.append("        _changed = True")
    lines.append("    self = _new(_Cls)")
    in_dict = [n for n in source_names + derived_names if _slot_descriptor(cls, n) is None]
    if in_dict:
        lines.append("    _d = self.__dict__")
    for n in source_names + derived_names:
        if n in in_dict:
            lines.append(f"    _d[{n!r}] = {n}")
        else:
            ns[f"_set_{n}"] = _slot_setter(cls, n)
            lines.append(f"    _set_{n}(self, {n})")
    if derived_validator is validator:
        lines.append("    _validate(self)")
    else:
        # The source was validated when it was built and is frozen: when no source field
        # changes, only the derived fields and the cross-field hooks need checking.
        ns["_validate_derived"] = derived_validator
        lines.append("    if _changed:")
        lines.append("        _validate(self)")
        lines.append("    else:")
        lines.append("        _validate_derived(self)")
    lines.append("    return self")
    fn = _compile(cls, "evolve_from", lines, ns)
    return classmethod(fn)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# the decorator


@overload
def metadata(cls: type[_T], /) -> type[_T]: ...


@overload
def metadata(
    *, extension: bool = False, conventions: Conventions | None = None
) -> Callable[[type[_T]], type[_T]]: ...


@dataclass_transform(
    frozen_default=True,
    kw_only_default=True,
    eq_default=True,
    field_specifiers=(attrs.field, field, tensor_field),
)
def metadata(
    cls: type[_T] | None = None,
    /,
    *,
    extension: bool = False,
    conventions: Conventions | None = None,
) -> type[_T] | Callable[[type[_T]], type[_T]]:
    """Make ``cls`` a frozen, keyword-only metadata class.

    Four kinds, by the class's bases:

    * **root** (no metadata base): built by its ``__init__``, keyword-only.
    * **extension** (``@metadata(extension=True)`` over one root or extension base): the
      base's fields plus the engine's own (defaults allowed), built directly, accepted as
      a source wherever its base is: ``Mamba2Metadata.evolve_from(engine_forward, ...)``
      builds the specialisation of ``Mamba2Metadata`` for it, which carries every extra
      field (:func:`specialized`).
    * **derived** (one metadata base): gets ``evolve_from(source, /, **changes)`` and
      refuses any other construction; its own fields take no defaults.
    * **specialisation** (two metadata bases ``(Derived, ExtendedSource)``, the second
      extending the first's source): ``Derived`` for that source; what
      ``Derived.evolve_from`` builds for it anyway, here with a name of its own (and a
      precise mypy signature), and optionally more derived fields.

    ``conventions`` (root and extension classes only; every class built from one inherits
    them): the engine's row order and null slot id (:class:`Conventions`).

    Rules checked when the class is defined: no ``init=False`` fields (attrs' ``evolve``
    silently re-defaults them); a class may not redeclare an inherited field; a derived
    class's own fields have no defaults; no undecorated class between metadata classes.
    """
    if cls is None:

        def decorate(c: type[_T]) -> type[_T]:
            return _build(c, extension=extension, conventions=conventions)

        return decorate
    return _build(cls, extension=False, conventions=None)


def _build(cls: type[_T], *, extension: bool, conventions: Conventions | None) -> type[_T]:
    for between in cls.__mro__[1:-1]:
        if not _is_metadata_class(between) and any(
            _is_metadata_class(b) for b in between.__mro__
        ):
            raise TypeError(
                f"{cls.__qualname__}: its base {between.__qualname__} subclasses a metadata class "
                "but is not decorated with @metadata; an undecorated class in between would "
                "make this class a root with public construction (and drop the evolve_from "
                "guarantee). Decorate it, or derive from the metadata class directly"
            )
    if conventions is not None and not isinstance(conventions, Conventions):
        raise TypeError(
            f"{cls.__qualname__}: conventions must be a hybridmeta.Conventions, got "
            f"{type(conventions).__name__}"
        )
    meta_bases = [b for b in cls.__bases__ if _is_metadata_class(b)]
    source: type | None = None
    base: type | None = None
    if extension:
        if len(meta_bases) != 1 or _info(meta_bases[0]).kind not in (_Kind.ROOT, _Kind.EXTENSION):
            raise TypeError(
                f"{cls.__qualname__}: an extension (@metadata(extension=True)) extends exactly "
                "one root or extension metadata class (e.g. ForwardMetadata); to add fields to "
                "a derived class, derive from it"
            )
        base = meta_bases[0]
        kind = _Kind.EXTENSION
        conv = conventions if conventions is not None else _info(base).conventions
    elif len(meta_bases) == 2:
        derived, ext = meta_bases
        d_source = _info(derived).source
        if d_source is None or not issubclass(ext, d_source) or ext is d_source:
            raise TypeError(
                f"{cls.__qualname__}: a metadata class with two metadata bases specialises a "
                "derived class (first base) for a class extending its source (second base); "
                f"got {derived.__qualname__} and {ext.__qualname__}"
            )
        kind, source, base = _Kind.SPECIALIZATION, ext, derived
        conv = _info(ext).conventions
    elif len(meta_bases) > 2:
        raise TypeError(
            f"{cls.__qualname__}: a metadata class has at most two metadata bases (a derived "
            "class and the extended source it is specialised for)"
        )
    elif meta_bases:
        kind, source = _Kind.DERIVED, meta_bases[0]
        conv = _info(source).conventions
    else:
        kind = _Kind.ROOT
        conv = conventions if conventions is not None else DEFAULT_CONVENTIONS
    if conventions is not None and kind not in (_Kind.ROOT, _Kind.EXTENSION):
        raise TypeError(
            f"{cls.__qualname__}: conventions are declared on a root or extension class; a "
            f"derived class inherits its source's ({conv})"
        )
    own = inspect.get_annotations(cls)
    inherited = {s.name: b for b in reversed(meta_bases) for s in fields_of(b)}
    for name in own:
        if name in inherited:
            what = "source" if kind is _Kind.DERIVED else "base"
            raise TypeError(
                f"{cls.__qualname__}.{name}: redeclares a field of its {what} "
                f"{inherited[name].__qualname__}; a metadata class only adds fields"
            )
        if kind in (_Kind.DERIVED, _Kind.SPECIALIZATION) and _declared_default(
            cls.__dict__.get(name, attrs.NOTHING)
        ) is not attrs.NOTHING:
            hint = (
                f"; to add your engine's own fields to {cls.__mro__[1].__qualname__} (built "
                "directly, defaults allowed), declare the class with "
                "@metadata(extension=True)"
                if kind is _Kind.DERIVED and not is_derived(cls.__mro__[1])
                else ""
            )
            raise TypeError(
                f"{cls.__qualname__}.{name}: a field of a derived metadata class takes no "
                "default; evolve_from requires it (pass None explicitly for an optional one)"
                + hint
            )
    if "__attrs_post_init__" in cls.__dict__:
        raise TypeError(
            f"{cls.__qualname__}: define __validate__ (cheap checks) or __validate_debug__ "
            "(checks that read device values), not __attrs_post_init__"
        )
    # Fields without an explicit specifier still compare tensors by identity.
    for name, ann in own.items():
        if name.startswith("__") or name in cls.__dict__ or "ClassVar" in str(ann):
            continue
        setattr(cls, name, field())
    constructible = kind in (_Kind.ROOT, _Kind.EXTENSION)
    if constructible:
        cls.__attrs_post_init__ = _post_init_placeholder  # type: ignore[attr-defined]

    # Roots and derived classes keep their fields in slots; extensions and specialisations
    # keep their own in the instance dict, so a specialisation can combine a derived class
    # with a class extending its source without an instance layout clash.
    slots = kind in (_Kind.ROOT, _Kind.DERIVED)
    try:
        new_cls: type[_T] = attrs.define(
            cls, frozen=True, slots=slots, kw_only=True, eq=False, order=False,
            weakref_slot=False,
        )  # fmt: skip
    except TypeError as err:
        raise TypeError(
            f"{cls.__qualname__}: cannot combine its bases ({err}); two derived classes that "
            "both add fields to one source cannot be combined: derive one from the other, "
            "or declare the fields on an extension of the source"
        ) from err
    for a in attrs.fields(new_cls):  # type: ignore[arg-type]
        if not a.init:
            raise TypeError(
                f"{new_cls.__qualname__}.{a.name}: init=False fields are refused (attrs.evolve "
                "silently re-defaults them, and evolve_from would too)"
            )
    known = {s.name: s for b in meta_bases for s in fields_of(b)}  # the source's win
    specs = tuple(
        _resolve_pad(new_cls, _spec_of(new_cls, a, known), conv)
        for a in attrs.fields(new_cls)  # type: ignore[arg-type]
    )
    _check_declarations(new_cls, specs)
    source_names = tuple(s.name for s in fields_of(source)) if source is not None else ()
    derived_names = tuple(s.name for s in specs if s.name not in source_names)
    if source is None:
        derived_names = ()
    setattr(
        new_cls,
        _INFO_ATTR,
        _ClassInfo(
            specs=specs, source=source, derived_names=derived_names, kind=kind,
            conventions=conv, base=base,
        ),
    )  # fmt: skip

    eq, hash_ = _make_eq_hash(new_cls, tuple(s.name for s in specs))
    new_cls.__eq__ = eq  # type: ignore[method-assign]
    new_cls.__hash__ = hash_  # type: ignore[method-assign]
    anns = _host_annotations(new_cls)
    validator = _make_validator(new_cls, specs, annotations=anns)
    new_cls.__hm_validate__ = validator  # type: ignore[attr-defined]
    if constructible:
        # attrs' generated __init__ looks __attrs_post_init__ up on the instance: the
        # placeholder set before attrs.define is replaced by the generated validator.
        new_cls.__attrs_post_init__ = validator  # type: ignore[attr-defined]
    else:
        assert source is not None
        derived_specs = tuple(s for s in specs if s.name in derived_names)
        derived_tensors = any(s.is_tensor for s in derived_specs)
        derived_validator = (
            validator
            if derived_tensors  # its rows/devices must be checked against the source's
            else _make_validator(
                new_cls, derived_specs, name="__hm_validate_derived__", annotations=anns
            )
        )
        new_cls.evolve_from = _make_evolve_from(  # type: ignore[attr-defined]
            new_cls, source, source_names, derived_names, validator, derived_validator
        )
        new_cls.__init__ = _refuse_init(new_cls, source)  # type: ignore[method-assign]
    return new_cls


def _post_init_placeholder(self: object) -> None:  # replaced once the class is built
    raise AssertionError("unreachable")


def _declared_default(value: object) -> object:
    """The default a class-body value declares (``attrs.NOTHING``: none)."""
    if type(value).__name__ == "_CountingAttr":  # attrs.field(...) / tensor_field(...)
        default = getattr(value, "_default", attrs.NOTHING)
        decl = getattr(value, "metadata", {}).get(_SPEC_KEY)
        if isinstance(decl, _HostDecl):
            return decl.default
        return default
    return value


def _resolve_pad(cls: type, spec: FieldSpec, conv: Conventions) -> FieldSpec:
    """A slot field's pad is the class's null slot (declared once, :class:`Conventions`)."""
    if not spec.role.is_slot:
        return spec
    null = Pad.value(conv.null_slot)
    if spec.pad is None or spec.owner != cls.__qualname__:
        # declared without a pad, or inherited from a class with other conventions
        return attrs.evolve(spec, pad=null) if spec.pad != null else spec
    if spec.pad != null:
        raise TypeError(
            f"{cls.__qualname__}.{spec.name}: a slot field's pad is the class's null slot "
            f"{conv.null_slot} (Conventions.null_slot), got {spec.pad!r}; omit pad="
        )
    return spec


def _check_declarations(cls: type, specs: tuple[FieldSpec, ...]) -> None:
    by_name = {s.name: s for s in specs}
    for role in _UNIQUE_ROLES:
        named = [s.name for s in specs if s.role is role]
        if len(named) > 1:
            raise TypeError(
                f"{cls.__qualname__}: at most one field has role {role} (the debug checks "
                f"pair it), got {named}; declare the others Role.SLOT"
            )
    for s in specs:
        if s.cols is not None:
            col = by_name.get(s.cols)
            if col is None or col.is_tensor:
                raise TypeError(
                    f"{cls.__qualname__}.{s.name}: cols={s.cols!r} must name an int host field "
                    f"of {cls.__qualname__}"
                )
        for g in s.governs:
            target = by_name.get(g)
            if target is None or not target.is_tensor or not target.optional:
                raise TypeError(
                    f"{cls.__qualname__}.{s.name}: governs={g!r} must name an optional tensor "
                    f"field of {cls.__qualname__}"
                )


def _spec_of(cls: type, a: attrs.Attribute[Any], known: Mapping[str, FieldSpec]) -> FieldSpec:
    owner = cls.__qualname__
    if a.name in known:
        return known[a.name]
    decl = a.metadata.get(_SPEC_KEY)
    if isinstance(decl, _TensorDecl):
        return FieldSpec(
            name=a.name,
            owner=owner,
            is_tensor=True,
            optional=decl.optional,
            rows=decl.rows,
            dtypes=decl.dtypes,
            pad=decl.pad,
            ndim=decl.ndim,
            role=decl.role,
            cols=decl.cols,
            default=a.default,
        )
    host = decl if isinstance(decl, _HostDecl) else None
    return FieldSpec(
        name=a.name,
        owner=owner,
        is_tensor=False,
        optional=True,
        rows=None,
        dtypes=None,
        pad=None,
        ndim=None,
        role=host.role if host is not None else Role.DATA,
        default=host.default if host is not None else a.default,
        governs=host.governs if host is not None else (),
        required_when_set=host.required_when_set if host is not None else False,
    )
