"""mypy plugin: a precise signature for the generated ``evolve_from`` of derived metadata.

Enable it in the engine's mypy configuration::

    [tool.mypy]
    plugins = ["hybridmeta.mypy_plugin"]

``@hybridmeta.metadata`` is a ``dataclass_transform`` decorator, so mypy already knows the
fields and ``__init__`` of every metadata class. For a derived class (one metadata base), and for the specialisation of a derived class
for an extended source (two metadata bases ``(Derived, ExtendedSource)``), this plugin
adds::

    @classmethod
    def evolve_from(cls, source: Source, /, *, <derived fields: required>,
                    <source fields: optional>) -> Derived: ...

so mypy rejects a call that omits a derived field, passes an unknown name, passes a value
of the wrong type, or passes a source of the wrong class, exactly as the run-time checks do.
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.nodes import (
    ARG_NAMED,
    ARG_NAMED_OPT,
    ARG_POS,
    Argument,
    CallExpr,
    Decorator,
    FuncDef,
    NameExpr,
    TypeInfo,
    Var,
)
from mypy.plugin import ClassDefContext, Plugin
from mypy.plugins.common import add_method_to_class
from mypy.plugins.dataclasses import DataclassAttribute, dataclass_class_maker_callback
from mypy.typevars import fill_typevars

_DECORATOR = "hybridmeta.core.metadata"


def _attributes(info: TypeInfo, ctx: ClassDefContext) -> list[DataclassAttribute] | None:
    data = info.metadata.get("dataclass")
    if data is None:
        return None
    return [DataclassAttribute.deserialize(info, a, ctx.api) for a in data["attributes"]]


def _is_extension(ctx: ClassDefContext) -> bool:
    """``@metadata(extension=True)``: built by its ``__init__``, like a root class."""
    reason = ctx.reason
    if not isinstance(reason, CallExpr):
        return False
    for name, arg in zip(reason.arg_names, reason.args, strict=True):
        if name == "extension":
            return isinstance(arg, NameExpr) and arg.fullname == "builtins.True"
    return False


def _metadata_class_hook(ctx: ClassDefContext) -> bool:
    if not dataclass_class_maker_callback(ctx):
        return False  # deferred: types not ready yet
    info = ctx.cls.info
    bases = [b.type for b in info.bases if "dataclass" in b.type.metadata]
    if not bases or _is_extension(ctx):
        return True  # a root or extension class: built by its __init__
    # One base: derived from it. Two bases (Derived, ExtendedSource): the specialisation
    # of Derived for ExtendedSource, whose evolve_from takes the extended source.
    source = bases[-1]
    own = _attributes(info, ctx)
    src = _attributes(source, ctx)
    if own is None or src is None:
        return False
    src_names = {a.name for a in src}
    source_type = fill_typevars(source)
    # A leading double underscore makes the parameter positional-only for mypy.
    args = [Argument(Var("__source", source_type), source_type, None, ARG_POS, pos_only=True)]
    # Derived fields first (required), then the source fields (optional overrides).
    for attr in sorted(own, key=lambda a: a.name in src_names):
        if attr.type is None:
            return False
        kind = ARG_NAMED_OPT if attr.name in src_names else ARG_NAMED
        args.append(Argument(Var(attr.name, attr.type), attr.type, None, kind))
    add_method_to_class(
        ctx.api, ctx.cls, "evolve_from", args, fill_typevars(info), is_classmethod=True
    )
    # Each derived class's evolve_from takes its own source class, so a class derived from
    # a derived class changes the signature on purpose: keep the generated method out of
    # the class body, where mypy would check it as an override (a false [override] error).
    ctx.cls.defs.body = [
        node
        for node in ctx.cls.defs.body
        if not (
            (isinstance(node, FuncDef) and node.name == "evolve_from")
            or (isinstance(node, Decorator) and node.func.name == "evolve_from")
        )
    ]
    return True


class HybridmetaPlugin(Plugin):
    """Adds ``evolve_from`` to derived ``@hybridmeta.metadata`` classes."""

    def get_class_decorator_hook_2(self, fullname: str) -> Callable[[ClassDefContext], bool] | None:
        if fullname == _DECORATOR:
            return _metadata_class_hook
        return None


def plugin(version: str) -> type[Plugin]:
    """Entry point named by mypy's ``plugins`` setting."""
    return HybridmetaPlugin
