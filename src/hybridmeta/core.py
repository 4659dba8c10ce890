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
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, Literal, TypeVar

import attrs
import torch
from typing_extensions import dataclass_transform

from hybridmeta.debug import is_debug

__all__ = [
    "BOOL",
    "FLOAT",
    "INDEX",
    "FieldSpec",
    "Pad",
    "PadRule",
    "field",
    "fields_of",
    "is_derived",
    "metadata",
    "source_of",
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


class Pad:
    """Pad rules for the fields of static CUDA-graph buffers."""

    CUMULATIVE: ClassVar[PadRule] = PadRule(_PadKind.CUMULATIVE)

    @staticmethod
    def value(v: int | float | bool) -> PadRule:
        """Pad rows hold the constant ``v``."""
        return PadRule(_PadKind.VALUE, v)


Rows = Literal["batch", "batch+1", "tokens", "prefills", "prefills+1", "prefill_tokens", "chunks"]


@attrs.frozen
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
    rows : str or None
        The symbolic length of dimension 0: ``"batch"`` (one entry per request row),
        ``"batch+1"`` (offsets over the batch), ``"tokens"``, ... All fields sharing a symbol
        must agree on construction. ``None``: free length (track plans, index lists).
    dtypes : tuple of torch.dtype or None
        Accepted dtypes (``None``: any).
    pad : PadRule or None
        Pad rule for static buffers; required for per-row (``"batch"``/``"batch+1"``)
        tensors, which is what makes them bufferable.
    ndim : int or None
        Required number of dimensions (``None``: any).
    """

    name: str
    owner: str
    is_tensor: bool
    optional: bool
    rows: str | None
    dtypes: tuple[torch.dtype, ...] | None
    pad: PadRule | None
    ndim: int | None

    @property
    def per_row(self) -> bool:
        """Whether this field has one entry per request row (a static-buffer field)."""
        return self.rows in ("batch", "batch+1")


@attrs.frozen
class _TensorDecl:
    rows: str | None
    dtypes: tuple[torch.dtype, ...] | None
    pad: PadRule | None
    optional: bool
    ndim: int | None


def tensor_field(
    *,
    rows: Rows | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    pad: PadRule | None = None,
    ndim: int | None = 1,
    optional: bool = False,
    default: Any = attrs.NOTHING,
    doc: str = "",
) -> Any:
    """Declare a tensor field of a metadata class.

    Parameters
    ----------
    rows : str, optional
        Symbolic length of dimension 0 (see :class:`FieldSpec`).
    dtypes : tuple of torch.dtype, optional
        Accepted dtypes, checked on construction.
    pad : PadRule, optional
        Pad rule for static CUDA-graph buffers. Required when ``rows`` is ``"batch"`` or
        ``"batch+1"``.
    ndim : int or None
        Required number of dimensions (default 1).
    optional : bool
        Accept ``None``. Implied by ``default=None``.
    default : None, optional
        Only ``None`` is accepted as a default, and only on a source (root) class.
    doc : str
        Documentation of the field.
    """
    if rows in ("batch", "batch+1") and pad is None:
        raise TypeError(
            f"tensor_field(rows={rows!r}) needs a pad rule: per-row fields are bufferable"
        )
    if default is not attrs.NOTHING and default is not None:
        raise TypeError("tensor_field: the only accepted default is None")
    decl = _TensorDecl(
        rows=rows, dtypes=dtypes, pad=pad, optional=optional or default is None, ndim=ndim
    )
    return attrs.field(default=default, metadata={_SPEC_KEY: decl, "doc": doc})


def field(*, default: Any = attrs.NOTHING, doc: str = "") -> Any:
    """Declare a non-tensor field (Python scalars, nested metadata, host-side tuples)."""
    return attrs.field(default=default, metadata={"doc": doc})


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


@attrs.frozen
class _ClassInfo:
    specs: tuple[FieldSpec, ...]
    source: type | None
    derived_names: tuple[str, ...]


_INFO_ATTR: Final = "__hybridmeta_info__"


def _info(cls: type) -> _ClassInfo:
    info = cls.__dict__.get(_INFO_ATTR)
    if not isinstance(info, _ClassInfo):
        raise TypeError(f"{cls.__qualname__} is not a @hybridmeta.metadata class")
    return info


def fields_of(cls: type) -> tuple[FieldSpec, ...]:
    """The declared fields of a metadata class, source fields first."""
    return _info(cls).specs


def source_of(cls: type) -> type | None:
    """The source class a derived metadata class evolves from (``None`` for a root class)."""
    return _info(cls).source


def is_derived(cls: type) -> bool:
    """Whether ``cls`` is a derived metadata class (built only through ``evolve_from``)."""
    return _info(cls).source is not None


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


def _make_validator(
    cls: type, specs: tuple[FieldSpec, ...], name: str = "__hm_validate__"
) -> Callable[[Any], None]:
    """Generate ``__hm_validate__(self)``: cheap structural checks of ``specs`` (dtype, ndim,
    device, row counts), then the class's ``__validate__`` and, in debug mode,
    ``__validate_debug__`` hooks. No device reads outside debug mode."""
    ns: dict[str, Any] = {"_err": _validation_error, "_is_debug": is_debug}
    lines = [f"def {name}(self):", "    _dev = None"]
    bound: dict[str, str] = {}  # rows symbol -> the first field that binds it
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
        lines.append(f"{indent}if _dev is None:")
        lines.append(f"{indent}    _dev = v.device; _dev_field = {n!r}")
        lines.append(f"{indent}elif v.device != _dev:")
        lines.append(
            f"{indent}    raise _err(self, {n!r}, 'must be on the same device as ' + _dev_field + ' (' + str(_dev) + '), got ' + str(v.device))"
        )
        if spec.rows is not None:
            sym, _, plus = spec.rows.partition("+")
            off = int(plus) if plus else 0
            var = f"_rows_{sym}"
            length = f"v.shape[0] - {off}" if off else "v.shape[0]"
            if sym not in bound:
                # Bind the symbol on the first non-None field that carries it.
                lines.append(f"{indent}if {var} is None:")
                lines.append(f"{indent}    {var} = {length}; {var}_field = {n!r}")
                lines.append(f"{indent}elif {length} != {var}:")
                lines.insert(1, f"    {var} = None; {var}_field = None")
                bound[sym] = n
            else:
                lines.append(f"{indent}if {var} is None:")
                lines.append(f"{indent}    {var} = {length}; {var}_field = {n!r}")
                lines.append(f"{indent}elif {length} != {var}:")
            lines.append(
                f"{indent}    raise _err(self, {n!r}, 'has ' + str(v.shape[0]) + "
                f"{' rows but its rows are ' + repr(spec.rows) + ' and '!r} + {var}_field + "
                f"' implies ' + str({var} + {off}))"
            )
    if "__validate__" in _all_attrs(cls):
        lines.append("    self.__validate__()")
    if "__validate_debug__" in _all_attrs(cls):
        lines.append("    if _is_debug():")
        lines.append("        self.__validate_debug__()")
    lines.append("    return None")
    return _compile(cls, name, lines, ns)


def _all_attrs(cls: type) -> set[str]:
    return {k for klass in cls.__mro__ for k in klass.__dict__}


def _validation_error(self: object, field_name: str, rule: str) -> ValueError:
    return ValueError(f"{type(self).__qualname__}.{field_name} {rule}")


class _Missing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<MISSING>"


_MISSING: Final = _Missing()


def _slot_setter(cls: type, name: str) -> Callable[[object, object], None]:
    for klass in cls.__mro__:
        descr = klass.__dict__.get(name)
        if (
            descr is not None
            and hasattr(descr, "__set__")
            and type(descr).__name__ == "member_descriptor"
        ):
            return descr.__set__  # type: ignore[no-any-return]
    raise TypeError(f"{cls.__qualname__}.{name}: no slot to write (internal error)")


def _bad_source(cls: type, source_cls: type, source: object) -> TypeError:
    return TypeError(
        f"{cls.__qualname__}.evolve_from: source must be exactly a {source_cls.__qualname__} "
        f"(the class {cls.__qualname__} derives from), got {type(source).__qualname__}; "
        "a subclass could carry fields this copy would drop"
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


def _refuse_init(cls: type, source: type) -> Callable[..., None]:
    def __init__(self: object, *args: object, **kwargs: object) -> None:
        raise TypeError(
            f"{cls.__qualname__} is derived from {source.__qualname__} and cannot be constructed "
            f"directly: use {cls.__qualname__}.evolve_from(source, ...), which copies every "
            f"{source.__qualname__} field unless you change it"
        )

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


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
        "_bad_source": _bad_source,
        "_unknown_fields": _unknown_fields,
        "_missing_fields": _missing_fields,
        "_all_names": source_names + derived_names,
    }
    params = [f"{n}=_MISSING" for n in derived_names + source_names]
    lines = [
        f"def evolve_from(cls, source, /, *, {', '.join(params)}, **_unknown):",
        f'    """Build a {cls.__qualname__} from a {source.__qualname__}.',
        "",
        f"    Every {source.__qualname__} field is copied unless named here; every field",
        f"    {cls.__qualname__} adds ({', '.join(derived_names)}) must be passed.",
        '    """',
        "    if source.__class__ is not _Source:",
        "        raise _bad_source(_Cls, _Source, source)",
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
    lines.append("    _changed = False")
    for n in source_names:
        lines.append(f"    if {n} is _MISSING:")
        lines.append(f"        {n} = source.{n}")
        lines.append("    else:")
        lines.append("        _changed = True")
    lines.append("    self = _new(_Cls)")
    for n in source_names + derived_names:
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


@dataclass_transform(
    frozen_default=True,
    kw_only_default=True,
    eq_default=True,
    field_specifiers=(attrs.field, field, tensor_field),
)
def metadata(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a frozen, slotted, keyword-only metadata class.

    A class whose base is a metadata class is *derived*: it gets
    ``evolve_from(source, /, **changes)`` and refuses any other construction.

    Rules checked when the class is defined:

    * no ``init=False`` fields (attrs' ``evolve`` silently re-defaults them);
    * a derived class may not redeclare a source field, and its own fields have no
      defaults (each must be passed to ``evolve_from``);
    * single inheritance from at most one metadata class.
    """
    meta_bases = [b for b in cls.__bases__ if _is_metadata_class(b)]
    if len(meta_bases) > 1:
        raise TypeError(f"{cls.__qualname__}: a metadata class derives from at most one source")
    source = meta_bases[0] if meta_bases else None
    own = inspect.get_annotations(cls)
    if source is not None:
        src_names = {s.name for s in fields_of(source)}
        for name in own:
            if name in src_names:
                raise TypeError(
                    f"{cls.__qualname__}.{name}: redeclares a field of its source "
                    f"{source.__qualname__}; a derived class only adds fields"
                )
            if name in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__}.{name}: a field of a derived metadata class takes no "
                    "default; evolve_from requires it (pass None explicitly for an optional one)"
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
    if source is None:
        cls.__attrs_post_init__ = _post_init_placeholder  # type: ignore[attr-defined]

    new_cls: type[_T] = attrs.define(
        cls, frozen=True, slots=True, kw_only=True, eq=False, order=False, weakref_slot=False
    )
    for a in attrs.fields(new_cls):  # type: ignore[arg-type]
        if not a.init:
            raise TypeError(
                f"{new_cls.__qualname__}.{a.name}: init=False fields are refused (attrs.evolve "
                "silently re-defaults them, and evolve_from would too)"
            )
    specs = tuple(_spec_of(new_cls, a, source) for a in attrs.fields(new_cls))  # type: ignore[arg-type]
    source_names = tuple(s.name for s in fields_of(source)) if source is not None else ()
    derived_names = tuple(s.name for s in specs if s.name not in source_names)
    setattr(
        new_cls, _INFO_ATTR, _ClassInfo(specs=specs, source=source, derived_names=derived_names)
    )

    eq, hash_ = _make_eq_hash(new_cls, tuple(s.name for s in specs))
    new_cls.__eq__ = eq  # type: ignore[method-assign]
    new_cls.__hash__ = hash_  # type: ignore[method-assign]
    validator = _make_validator(new_cls, specs)
    new_cls.__hm_validate__ = validator  # type: ignore[attr-defined]
    if source is None:
        # attrs' generated __init__ looks __attrs_post_init__ up on the instance: the
        # placeholder set before attrs.define is replaced by the generated validator.
        new_cls.__attrs_post_init__ = validator  # type: ignore[attr-defined]
    else:
        derived_tensors = any(s.is_tensor for s in specs if s.name in derived_names)
        derived_validator = (
            validator
            if derived_tensors  # its rows/devices must be checked against the source's
            else _make_validator(new_cls, (), name="__hm_validate_derived__")
        )
        new_cls.evolve_from = _make_evolve_from(  # type: ignore[attr-defined]
            new_cls, source, source_names, derived_names, validator, derived_validator
        )
        new_cls.__init__ = _refuse_init(new_cls, source)  # type: ignore[method-assign]
    return new_cls


def _post_init_placeholder(self: object) -> None:  # replaced once the class is built
    raise AssertionError("unreachable")


def _spec_of(cls: type, a: attrs.Attribute[Any], source: type | None) -> FieldSpec:
    owner = cls.__qualname__
    if source is not None:
        for s in fields_of(source):
            if s.name == a.name:
                return s
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
        )
    return FieldSpec(
        name=a.name,
        owner=owner,
        is_tensor=False,
        optional=True,
        rows=None,
        dtypes=None,
        pad=None,
        ndim=None,
    )
