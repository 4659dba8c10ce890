"""``hybridmeta audit PATH...``: find hand-written metadata constructors that drop fields.

A static check (Python :mod:`ast`; the audited code is never imported). It resolves the
class definitions across the given files (dataclasses, attrs classes, ``NamedTuple`` and
``@hybridmeta.metadata`` classes, with inheritance) and looks at every call that builds an
instance of one of them:

``HM001``
    ``Derived(a=src.a, b=src.b, ...)``, ``cls(**{"a": src.a, ...})``: a class built from
    another object's fields. Every field of the source's class that the call does not
    pass, and that the derived class declares *with a default*, silently takes that
    default: the shape of sglang PR #26877 (``has_mamba_track_mask`` dropped in
    ``Mamba2Metadata.prepare_decode``). The source is the name whose attributes the call
    copies by the same name at least twice; its class comes from a parameter annotation,
    an assignment, ``self``, or (failing those) the known class with the fewest fields
    that has every attribute the call reads from it, when that choice is unambiguous and
    the call copies at least half of its fields.
``HM002``
    ``dataclasses.replace(obj, ...)`` / ``attrs.evolve(obj, ...)`` on a class with
    ``init=False`` fields: those are not copied but re-initialised to their default.

What counts as passed: keywords and positional arguments; ``**{"a": ...}``,
``**dict(a=...)``; ``**{k: getattr(src, k) for k in FIELDS}`` where ``FIELDS`` is a tuple,
list or set of strings written out in the function, the module or the class; ``**kw``
where ``kw`` is a dict built in the function (literal keys, ``kw["a"] = ...``,
``kw.update(a=...)``); and attributes assigned on the result afterwards in the same
function (``md = Md(...); md.a = ...``, ``setattr(md, "a", ...)``, a loop of ``setattr``
over ``FIELDS``, and ``self.a = ...`` in a method of the class called on the result), the
construct-then-assign shape of sglang's ``ForwardBatch.init_new``.

Calls that pass ``**mapping`` of unknown keys (``**vars(src)``, ``**asdict(src)``) are
taken as passing everything. Every call that copies fields but is not checked (the class
it builds is chosen at run time, ``self.metadata_cls(...)``, or defined outside the given
files; its source's class is unknown; an unknown ``**mapping``) gets a ``note:``, and so
does every file that does not parse (it is skipped, the others are audited). Exit status:
1 with findings, 0 without, 2 on a usage error or when no given file can be read.

The module imports nothing beyond the standard library (``hybridmeta audit`` starts
without torch).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["AuditResult", "ClassInfo", "Finding", "audit_paths", "main"]

_DATACLASS = {"dataclass", "dataclasses.dataclass", "pydantic.dataclasses.dataclass"}
_ATTRS = {
    "attr.s", "attr.attrs", "attr.define", "attr.frozen", "attr.mutable", "attr.dataclass",
    "attrs.define", "attrs.frozen", "attrs.mutable", "define", "frozen", "mutable",
    "metadata", "hybridmeta.metadata", "hybridmeta.core.metadata",
}  # fmt: skip
_FIELD_CALLS = {
    "field", "dataclasses.field", "attr.ib", "attr.attrib", "attrs.field", "attr.field",
    "tensor_field", "hybridmeta.tensor_field", "hybridmeta.field",
}  # fmt: skip
_REPLACE = {"replace", "dataclasses.replace", "attrs.evolve", "attr.evolve", "evolve"}
@dataclass(frozen=True)
class FieldDef:
    """One constructor field of a class as declared in source."""

    name: str
    default: str | None  # source text of the default, None when there is none
    init: bool = True


@dataclass
class ClassInfo:
    """A class definition found in the audited files."""

    name: str
    qualname: str
    path: str
    line: int
    kind: str  # dataclass | attrs | namedtuple | inherited
    bases: list[str]
    own: list[FieldDef]
    fields: list[FieldDef] = field(default_factory=list)
    complete: bool = True  # False when a base class was not found in the given files
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    consts: dict[str, ast.expr] = field(default_factory=dict)  # class-level NAME = value
    resolved_bases: list[ClassInfo] = field(default_factory=list)


@dataclass(frozen=True)
class Finding:
    """One field that a constructor call does not carry over."""

    path: str
    line: int
    col: int
    rule: str
    function: str
    derived: str
    source: str
    source_expr: str
    field: str
    default: str
    message: str

    def text(self) -> str:
        return f"{self.path}:{self.line}:{self.col + 1}: {self.rule} {self.message}"


@dataclass
class AuditResult:
    """What :func:`audit_paths` found."""

    files: list[str]
    classes: int
    calls_checked: int
    findings: list[Finding]
    notes: list[str]
    skipped_files: list[str] = field(default_factory=list)
    calls_skipped: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "version": 1,
            "files": self.files,
            "skipped_files": self.skipped_files,
            "classes": self.classes,
            "calls_checked": self.calls_checked,
            "calls_skipped": self.calls_skipped,
            "findings": [asdict(f) for f in self.findings],
            "notes": self.notes,
        }


class AuditError(Exception):
    """A usage error, or no given file can be read (exit status 2)."""


# --------------------------------------------------------------------------- helpers


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def _decorator_name(node: ast.expr) -> str | None:
    return _dotted(node.func if isinstance(node, ast.Call) else node)


def _type_names(ann: ast.expr | None) -> list[str]:
    """Class names an annotation may denote (``Optional[X]``, ``X | None``, ``"X"``)."""
    if ann is None:
        return []
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return _type_names(ast.parse(ann.value, mode="eval").body)
        except SyntaxError:
            return []
    if isinstance(ann, ast.Name):
        return [ann.id]
    if isinstance(ann, ast.Attribute):
        return [ann.attr]
    if isinstance(ann, ast.BinOp):
        return _type_names(ann.left) + _type_names(ann.right)
    if isinstance(ann, ast.Subscript):
        head = _dotted(ann.value) or ""
        if head.split(".")[-1] in ("Optional", "Union", "Annotated", "Final"):
            sl = ann.slice
            parts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
            return [n for p in parts[:1] if head.endswith("Annotated")
                    for n in _type_names(p)] or [n for p in parts for n in _type_names(p)]  # fmt: skip
    return []


def _field_from_call(call: ast.Call) -> tuple[str | None, bool]:
    default: str | None = None
    init = True
    for kw in call.keywords:
        if kw.arg == "default":
            default = ast.unparse(kw.value)
        elif kw.arg in ("default_factory", "factory"):
            default = f"{ast.unparse(kw.value)}()"
        elif kw.arg == "init" and isinstance(kw.value, ast.Constant):
            init = bool(kw.value.value)
    return default, init


def _is_classvar(ann: ast.expr) -> bool:
    head = _dotted(ann.value if isinstance(ann, ast.Subscript) else ann) or ""
    return head.split(".")[-1] in ("ClassVar", "KW_ONLY") or (
        isinstance(ann, ast.Constant) and isinstance(ann.value, str) and "ClassVar" in ann.value
    )


def _own_fields(node: ast.ClassDef, kind: str) -> list[FieldDef]:
    out: list[FieldDef] = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if _is_classvar(stmt.annotation):
                continue
            value = stmt.value
            if isinstance(value, ast.Call) and _dotted(value.func) in _FIELD_CALLS:
                default, init = _field_from_call(value)
                out.append(FieldDef(stmt.target.id, default, init))
            else:
                out.append(FieldDef(stmt.target.id, None if value is None else ast.unparse(value)))
        elif (
            kind == "attrs"
            and isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, ast.Call)
            and _dotted(stmt.value.func) in _FIELD_CALLS
        ):
            default, init = _field_from_call(stmt.value)
            out.append(FieldDef(stmt.targets[0].id, default, init))
    return out


def _class_kind(node: ast.ClassDef) -> str | None:
    for dec in node.decorator_list:
        name = _decorator_name(dec)
        if name in _DATACLASS:
            return "dataclass"
        if name in _ATTRS:
            return "attrs"
    for base in node.bases:
        if (_dotted(base) or "").split(".")[-1] == "NamedTuple":
            return "namedtuple"
    return None


# --------------------------------------------------------------------------- classes


class _Classes:
    def __init__(self) -> None:
        self.by_name: dict[str, list[ClassInfo]] = {}
        self.all: list[ClassInfo] = []
        self._pending: list[tuple[ClassInfo, bool]] = []  # (info, decorated)
        #: path -> {name imported there: ("module", name in the module)}, set by
        #: audit_paths (imports disambiguate classes of the same name in different files).
        self.imports: dict[str, dict[str, tuple[str, str]]] = {}
        self._given: dict[str, str] | None = None  # resolved path -> path as given

    def collect(self, tree: ast.Module, path: str) -> None:
        def visit(body: list[ast.stmt], prefix: str) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef):
                    kind = _class_kind(node)
                    info = ClassInfo(
                        name=node.name,
                        qualname=f"{prefix}{node.name}",
                        path=path,
                        line=node.lineno,
                        kind=kind or "inherited",
                        bases=[(_dotted(b) or "").split(".")[-1] for b in node.bases],
                        own=_own_fields(node, kind) if kind else [],
                        methods={
                            m.name: m for m in node.body
                            if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                        },
                        consts=_constants(node.body),
                    )  # fmt: skip
                    self._pending.append((info, kind is not None))
                    visit(node.body, f"{prefix}{node.name}.")

        visit(tree.body, "")

    def resolve(self) -> None:
        infos = {id(i): (i, decorated) for i, decorated in self._pending}
        names: dict[str, list[ClassInfo]] = {}
        for info, _ in infos.values():
            names.setdefault(info.name, []).append(info)
        done: set[int] = set()
        keep: set[int] = set()

        def fields_of(info: ClassInfo, stack: tuple[int, ...]) -> tuple[list[FieldDef], bool]:
            if id(info) in done:
                return info.fields, info.complete
            decorated = infos[id(info)][1]
            merged: dict[str, FieldDef] = {}
            complete = True
            any_base = False
            for base in info.bases:
                if base in ("object", "NamedTuple", "Generic", "ABC", "Protocol", ""):
                    continue
                cands = [c for c in names.get(base, []) if id(c) not in stack]
                same_file = [c for c in cands if c.path == info.path]
                imported = self.imports.get(info.path, {}).get(base)
                if not same_file and imported is not None:
                    # The base its file imports: that module's class (or none given),
                    # through the re-exports of the given files (``pkg/__init__.py``).
                    target = self.module_path(imported[0], info.path)
                    original = imported[1]
                    cands = []
                    seen: set[tuple[str, str]] = set()
                    while target is not None and (target, original) not in seen:
                        seen.add((target, original))
                        cands = [
                            c for c in names.get(original, [])
                            if c.path == target and id(c) not in stack
                        ]  # fmt: skip
                        further = self.imports.get(target, {}).get(original)
                        if cands or further is None:
                            break
                        target, original = self.module_path(further[0], target), further[1]
                pick = (same_file or cands)[:1]
                if not pick:
                    complete = False
                    continue
                bf, bcomplete = fields_of(pick[0], (*stack, id(info)))
                info.resolved_bases.append(pick[0])
                if id(pick[0]) in keep:
                    any_base = True
                    complete = complete and bcomplete
                    for f in bf:
                        merged[f.name] = f
            for f in info.own:
                merged[f.name] = f
            info.fields, info.complete = list(merged.values()), complete
            done.add(id(info))
            if decorated or any_base:
                keep.add(id(info))
            return info.fields, info.complete

        for info, _ in infos.values():
            fields_of(info, ())
        for info, _ in infos.values():
            if id(info) in keep:
                self.by_name.setdefault(info.name, []).append(info)
                self.all.append(info)

    def lookup(
        self, name: str, path: str, _seen: tuple[tuple[str, str], ...] = ()
    ) -> ClassInfo | None:
        """The class ``name`` means in file ``path``: defined there; else the one its import
        names (through re-exports of the given files), ``None`` when that module is not
        among them; else the only candidate of that name."""
        short = name.split(".")[-1]
        cands = self.by_name.get(short, [])
        same = [c for c in cands if c.path == path]
        if same:
            return same[0]
        imported = self.imports.get(path, {}).get(short)
        if imported is not None and "." not in name:
            module, original = imported
            target = self.module_path(module, path)
            if target is None or (target, original) in _seen or target == path:
                return None  # defined outside the given files
            return self.lookup(original, target, (*_seen, (target, original)))
        return cands[0] if cands else None

    def module_path(self, module: str, path: str) -> str | None:
        """The given file that is ``module`` as imported from ``path``, if any."""
        level = len(module) - len(module.lstrip("."))
        parts = [p for p in module.lstrip(".").split(".") if p]
        if self._given is None:
            self._given = {str(Path(p).resolve()): p for p in self.imports}
        given = self._given
        if level:
            base = Path(path).resolve().parent
            for _ in range(level - 1):
                base = base.parent
            for cand in (base.joinpath(*parts).with_suffix(".py") if parts else None,
                         base.joinpath(*parts, "__init__.py")):  # fmt: skip
                if cand is not None and str(cand) in given:
                    return given[str(cand)]
            return None
        tails = [(*parts[:-1], parts[-1] + ".py"), (*parts, "__init__.py")]
        for resolved, original in given.items():
            rparts = Path(resolved).parts
            if any(rparts[-len(t):] == t for t in tails):
                return original
        return None

    def any_class(self, name: str, path: str) -> ClassInfo | None:
        """A class of that name in the given files, metadata-like or not (for methods and
        constants)."""
        cands = [i for i, _ in self._pending if i.name == name.split(".")[-1]]
        same = [c for c in cands if c.path == path]
        pick = same or cands
        return pick[0] if pick else None


def _mro(info: ClassInfo) -> Iterator[ClassInfo]:
    """``info`` and its bases found in the given files, nearest first."""
    seen: set[int] = set()
    todo = [info]
    while todo:
        c = todo.pop(0)
        if id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        todo.extend(c.resolved_bases)


def _constants(body: list[ast.stmt]) -> dict[str, ast.expr]:
    """``NAME = value`` / ``NAME: T = value`` statements of a module or class body."""
    out: dict[str, ast.expr] = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            t = stmt.targets[0]
            if isinstance(t, ast.Name):
                out[t.id] = stmt.value
        elif (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and stmt.value is not None
        ):
            out[stmt.target.id] = stmt.value
    return out


# --------------------------------------------------------------------------- calls


@dataclass
class _FileFacts:
    """Per-file names: module-level constants, imported names and functions."""

    path: str
    consts: dict[str, ast.expr] = field(default_factory=dict)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> "module" (dotted)
    originals: dict[str, str] = field(default_factory=dict)  # local name -> name in module
    functions: set[str] = field(default_factory=set)


def _file_facts(tree: ast.Module, path: str) -> _FileFacts:
    facts = _FileFacts(path, consts=_constants(tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                facts.imports[alias.asname or alias.name] = module
                facts.originals[alias.asname or alias.name] = alias.name
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            facts.functions.add(node.name)
    return facts


def _module_file(module: str, path: str) -> str:
    """Where the file of an imported module would be (``a.b`` -> ``a/b.py``)."""
    level = len(module) - len(module.lstrip("."))
    rel = module.lstrip(".").replace(".", "/")
    if not level:
        return f"{rel}.py" if rel else "?"
    base = Path(path).parent
    for _ in range(level - 1):
        base = base.parent
    return str(base / f"{rel}.py") if rel else str(base / "__init__.py")


@dataclass
class _FnFacts:
    """What one function does with its local names (flow-insensitive)."""

    bound: dict[int, str] = field(default_factory=dict)  # id(call) -> name it is assigned to
    # name -> attributes assigned on it (with the assigned value where there is one)
    attrs_set: dict[str, list[tuple[str, ast.expr | None]]] = field(default_factory=dict)
    methods_called: dict[str, set[str]] = field(default_factory=dict)
    dict_parts: dict[str, list[ast.expr]] = field(default_factory=dict)  # name -> dict exprs
    dict_items: dict[str, list[tuple[str, ast.expr]]] = field(default_factory=dict)
    dict_unknown: dict[str, str] = field(default_factory=dict)  # name -> why its keys are unknown
    loops: dict[str, list[ast.expr]] = field(default_factory=dict)  # loop variable -> iterables
    local_consts: dict[str, list[ast.expr]] = field(default_factory=dict)
    star_params: set[str] = field(default_factory=set)  # **kwargs parameters


_DICT_MUTATORS = {"pop", "popitem", "clear", "__delitem__"}


def _setattr_target(call: ast.Call) -> tuple[ast.expr, ast.expr, ast.expr | None] | None:
    """``(object, name, value)`` of ``setattr(o, n, v)`` / ``object.__setattr__(o, n, v)``."""
    name = _dotted(call.func)
    if name == "setattr" and len(call.args) >= 2:
        return call.args[0], call.args[1], call.args[2] if len(call.args) > 2 else None
    if name == "object.__setattr__" and len(call.args) >= 2:
        return call.args[0], call.args[1], call.args[2] if len(call.args) > 2 else None
    return None


def _fn_facts(fn: _Fn) -> _FnFacts:
    facts = _FnFacts()
    if fn.args.kwarg is not None:
        facts.star_params.add(fn.args.kwarg.arg)

    def targets_of(t: ast.expr) -> Iterator[ast.expr]:
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets_of(e.value if isinstance(e, ast.Starred) else e)
        else:
            yield t

    for node in _own_nodes(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            tlist = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            single = len(tlist) == 1 and isinstance(tlist[0], ast.Name)
            if single and isinstance(value, ast.Call):
                assert isinstance(tlist[0], ast.Name)
                facts.bound[id(value)] = tlist[0].id
            if single and value is not None:
                assert isinstance(tlist[0], ast.Name)
                nm = tlist[0].id
                facts.local_consts.setdefault(nm, []).append(value)
                facts.dict_parts.setdefault(nm, []).append(value)
            for t in tlist:
                for one in targets_of(t):
                    if isinstance(one, ast.Attribute) and isinstance(one.value, ast.Name):
                        v = value if len(tlist) == 1 and one is t else None
                        facts.attrs_set.setdefault(one.value.id, []).append((one.attr, v))
                    elif isinstance(one, ast.Subscript) and isinstance(one.value, ast.Name):
                        key = one.slice
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            v2 = value if one is t and value is not None else ast.Constant(None)
                            facts.dict_items.setdefault(one.value.id, []).append((key.value, v2))
                        else:
                            facts.dict_unknown.setdefault(
                                one.value.id, f"{ast.unparse(one)} = ... with a computed key"
                            )
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            nm = node.target.id
            facts.dict_parts.setdefault(nm, []).append(node.value)
            # ``names += [...]`` rebinds the name: a name list no longer known from one
            # assignment (``names = names + [...]``, which only refers to itself).
            grown = ast.BinOp(left=ast.Name(id=nm, ctx=ast.Load()), op=node.op, right=node.value)
            facts.local_consts.setdefault(nm, []).append(grown)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                    facts.dict_unknown.setdefault(t.value.id, f"del {ast.unparse(t)}")
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            tgt = node.target
            if isinstance(tgt, ast.Name):
                facts.loops.setdefault(tgt.id, []).append(node.iter)
        elif isinstance(node, ast.Call):
            sa = _setattr_target(node)
            if sa is not None and isinstance(sa[0], ast.Name):
                obj, key, val = sa
                assert isinstance(obj, ast.Name)
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    facts.attrs_set.setdefault(obj.id, []).append((key.value, val))
                elif isinstance(key, ast.Name):
                    facts.attrs_set.setdefault(obj.id, []).append((f"<loop {key.id}>", val))
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                owner = func.value.id
                facts.methods_called.setdefault(owner, set()).add(func.attr)
                if func.attr == "update":
                    facts.dict_parts.setdefault(owner, []).extend(node.args)
                    facts.dict_items.setdefault(owner, []).extend(
                        (k.arg, k.value) for k in node.keywords if k.arg is not None
                    )
                    if any(k.arg is None for k in node.keywords):
                        facts.dict_unknown.setdefault(owner, f"{owner}.update(**...)")
                elif func.attr == "setdefault" and node.args:
                    key = node.args[0]
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        v3 = node.args[1] if len(node.args) > 1 else ast.Constant(None)
                        facts.dict_items.setdefault(owner, []).append((key.value, v3))
                    else:
                        facts.dict_unknown.setdefault(
                            owner,
                            f"{owner}.setdefault({ast.unparse(key)}, ...) with a computed key",
                        )
                elif func.attr in _DICT_MUTATORS:
                    facts.dict_unknown.setdefault(owner, f"{owner}.{func.attr}(...)")
    return facts


@dataclass
class _Scope:
    path: str
    function: str
    enclosing_class: str | None
    types: dict[str, list[str]]  # local name -> candidate class names
    facts: _FnFacts = field(default_factory=_FnFacts)
    file: _FileFacts | None = None


_Fn = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(tree: ast.Module) -> Iterator[tuple[_Fn, str | None, str, _Fn | None]]:
    """Every function with its class, qualified name and enclosing function (parents first)."""

    def visit(
        body: list[ast.stmt], cls: str | None, prefix: str, parent: _Fn | None
    ) -> Iterator[tuple[_Fn, str | None, str, _Fn | None]]:
        for node in body:
            if isinstance(node, ast.ClassDef):
                yield from visit(node.body, node.name, f"{prefix}{node.name}.", None)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield node, cls, f"{prefix}{node.name}", parent
                yield from visit(node.body, cls, f"{prefix}{node.name}.", node)

    yield from visit(tree.body, None, "", None)


def _own_nodes(fn: _Fn) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s own body: nested functions and classes are their own scopes."""
    todo: list[ast.AST] = [*fn.body]
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


@dataclass
class _Module:
    """Per-file facts used to type local names: TypeVar bounds, function return types."""

    typevars: dict[str, list[str]] = field(default_factory=dict)
    returns: dict[str, list[str]] = field(default_factory=dict)

    def expand(self, names: list[str]) -> list[str]:
        out: list[str] = []
        for n in names:
            out.extend(self.typevars.get(n, [n]))
        return out


def _module_facts(tree: ast.Module) -> _Module:
    facts = _Module()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and (_dotted(node.value.func) or "").split(".")[-1] == "TypeVar"
        ):
            for kw in node.value.keywords:
                if kw.arg == "bound":
                    facts.typevars[node.targets[0].id] = _type_names(kw.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            facts.returns.setdefault(node.name, _type_names(node.returns))
    return facts


def _scope_types(fn: _Fn, facts: _Module | None = None) -> dict[str, list[str]]:
    facts = facts or _Module()
    types: dict[str, list[str]] = {}
    args = fn.args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        names = facts.expand(_type_names(a.annotation))
        if names:
            types[a.arg] = names
    for node in _own_nodes(fn):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            types.setdefault(node.target.id, facts.expand(_type_names(node.annotation)))
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
        ):
            func = node.value.func
            head = func.attr if isinstance(func, ast.Attribute) else _dotted(func)
            if head is not None:
                last = head.split(".")[-1]
                # A constructor call, or a function whose return annotation is known.
                names = [last] if last[:1].isupper() else facts.returns.get(last, [])
                if names:
                    types.setdefault(node.targets[0].id, facts.expand(names))
    return types


def _source_reads(expr: ast.AST) -> Iterator[tuple[str, str]]:
    """``(name, attr)`` for every ``name.attr`` inside ``expr``."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            yield node.value.id, node.attr


_KEYS_UNKNOWN = "keys unknown"
# Attribute or variable names that hold a class (``self.metadata_cls``, ``builder_class``).
_RUNTIME_CLASS = re.compile(r"(^|_)(cls|class|klass|type|factory|ctor|constructor)$")


class _Auditor:
    def __init__(self, classes: _Classes, files: dict[str, _FileFacts]) -> None:
        self.classes = classes
        self.files = files
        self.findings: list[Finding] = []
        self.calls = 0
        self.skipped = 0
        self.notes: list[str] = []
        self.outside: dict[str, str] = {}  # class name -> where to find it, for the hint
        self.constructed: dict[str, str] = {}  # imported classes called here -> their file
        self._method_memo: dict[tuple[int, str], set[str]] = {}
        self._all_consts: dict[str, list[ast.expr]] = {}
        self._functions: set[str] = set()
        for f in files.values():
            self._functions |= f.functions
            for k, v in f.consts.items():
                self._all_consts.setdefault(k, []).append(v)

    def _skip(self, scope: _Scope, call: ast.Call, what: str) -> None:
        self.skipped += 1
        self.notes.append(f"{scope.path}:{call.lineno}: {what}; skipped")

    def _class_of_name(self, name: str, scope: _Scope) -> ClassInfo | None:
        if name in ("self", "cls") and scope.enclosing_class:
            return self.classes.lookup(scope.enclosing_class, scope.path)
        for cand in scope.types.get(name, []):
            info = self.classes.lookup(cand, scope.path)
            if info is not None:
                return info
        return None

    def _callee(self, func: ast.expr, scope: _Scope) -> ClassInfo | None:
        if scope.enclosing_class and (
            (isinstance(func, ast.Name) and func.id == "cls")
            or _dotted(func) in ("self.__class__", "cls.__class__")
            or (
                isinstance(func, ast.Call)
                and _dotted(func.func) == "type"
                and len(func.args) == 1
                and _dotted(func.args[0]) == "self"
            )
        ):
            return self.classes.lookup(scope.enclosing_class, scope.path)
        name = _dotted(func)
        if name is None:
            return None
        last = name.split(".")[-1]
        if not last[:1].isupper():
            return None
        return self.classes.lookup(last, scope.path)

    # ----------------------------------------------------------------- name lists

    def _literal_names(self, expr: ast.expr, scope: _Scope, depth: int = 0) -> list[str] | None:
        """The strings of a tuple/list/set literal, directly or through a constant's name."""
        if depth > 8:
            return None
        if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            out: list[str] = []
            for e in expr.elts:
                if isinstance(e, ast.Constant) and isinstance(e.value, str):
                    out.append(e.value)
                elif isinstance(e, ast.Starred):
                    inner = self._literal_names(e.value, scope, depth + 1)
                    if inner is None:
                        return None
                    out.extend(inner)
                else:
                    return None
            return out
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.BitOr)):
            left = self._literal_names(expr.left, scope, depth + 1)
            right = self._literal_names(expr.right, scope, depth + 1)
            return None if left is None or right is None else left + right
        if (
            isinstance(expr, ast.Call)
            and _dotted(expr.func) in ("tuple", "list", "set", "frozenset", "sorted")
            and len(expr.args) == 1
            and not expr.keywords
        ):
            return self._literal_names(expr.args[0], scope, depth + 1)
        if isinstance(expr, ast.Name):
            local = scope.facts.local_consts.get(expr.id, [])
            if len(local) == 1:
                return self._literal_names(local[0], scope, depth + 1)
            if local:
                return None  # reassigned in the function: which one is not known
            if scope.enclosing_class:
                info = self.classes.any_class(scope.enclosing_class, scope.path)
                for c in _mro(info) if info is not None else ():
                    if expr.id in c.consts:
                        return self._literal_names(c.consts[expr.id], scope, depth + 1)
            if scope.file is not None and expr.id in scope.file.consts:
                return self._literal_names(scope.file.consts[expr.id], scope, depth + 1)
            anywhere = self._all_consts.get(expr.id, [])
            if len(anywhere) == 1:  # imported from another given file
                return self._literal_names(anywhere[0], scope, depth + 1)
            return None
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            owner = expr.value.id
            cname = scope.enclosing_class if owner in ("self", "cls") else owner
            info = self.classes.any_class(cname, scope.path) if cname else None
            for c in _mro(info) if info is not None else ():
                if expr.attr in c.consts:
                    return self._literal_names(c.consts[expr.attr], scope, depth + 1)
        return None

    def _declared_names(self, expr: ast.expr, scope: _Scope) -> list[str] | None:
        """The init fields of ``Cls`` for ``dataclasses.fields(Cls)``, ``attrs.fields(Cls)``
        or ``fields_of(Cls)`` of a class found in the given files."""
        if not (isinstance(expr, ast.Call) and len(expr.args) == 1 and not expr.keywords):
            return None
        if (_dotted(expr.func) or "").split(".")[-1] not in ("fields", "fields_of"):
            return None
        cls_name = _dotted(expr.args[0])
        if cls_name is None:
            return None
        info = self.classes.lookup(cls_name, scope.path)
        if info is None or not info.complete:
            return None
        return [f.name for f in info.fields if f.init]

    # ----------------------------------------------------------------- ** mappings

    def _dict_items(
        self, expr: ast.expr, scope: _Scope, depth: int = 0
    ) -> list[tuple[str, ast.expr]] | str:
        """The ``(key, value)`` pairs a ``**expr`` passes, or why they are unknown."""
        unknown = f"**{ast.unparse(expr)} ({_KEYS_UNKNOWN})"
        if depth > 8:
            return unknown
        if isinstance(expr, ast.Dict):
            out: list[tuple[str, ast.expr]] = []
            for k, v in zip(expr.keys, expr.values, strict=True):
                if k is None:  # {**other, ...}
                    inner = self._dict_items(v, scope, depth + 1)
                    if isinstance(inner, str):
                        return inner
                    out.extend(inner)
                elif isinstance(k, ast.Constant) and isinstance(k.value, str):
                    out.append((k.value, v))
                else:
                    return unknown
            return out
        if isinstance(expr, ast.Call) and _dotted(expr.func) == "dict":
            out = []
            for arg in expr.args:
                inner = self._dict_items(arg, scope, depth + 1)
                if isinstance(inner, str):
                    return inner
                out.extend(inner)
            for kw in expr.keywords:
                if kw.arg is None:
                    inner = self._dict_items(kw.value, scope, depth + 1)
                    if isinstance(inner, str):
                        return inner
                    out.extend(inner)
                else:
                    out.append((kw.arg, kw.value))
            return out
        if isinstance(expr, ast.DictComp) and len(expr.generators) == 1:
            gen = expr.generators[0]
            if gen.ifs or gen.is_async or not isinstance(gen.target, ast.Name):
                return unknown
            var = gen.target.id
            key = expr.key
            names: list[str] | None = None
            if isinstance(key, ast.Name) and key.id == var:  # {k: ... for k in FIELDS}
                names = self._literal_names(gen.iter, scope)
            elif _dotted(key) == f"{var}.name":  # {f.name: ... for f in fields(Cls)}
                names = self._declared_names(gen.iter, scope)
            if names is None:
                return unknown
            value = expr.value
            src: str | None = None
            if (
                isinstance(value, ast.Call)
                and _dotted(value.func) == "getattr"
                and len(value.args) >= 2
                and isinstance(value.args[0], ast.Name)
                and ast.unparse(value.args[1]) == ast.unparse(key)
            ):
                src = value.args[0].id
            return [
                (n, ast.Attribute(value=ast.Name(id=src, ctx=ast.Load()), attr=n, ctx=ast.Load())
                 if src is not None else value)
                for n in names
            ]  # fmt: skip
        if isinstance(expr, ast.Name):
            facts = scope.facts
            name = expr.id
            if name in facts.star_params:
                return f"**{name} (the function's own **{name}: {_KEYS_UNKNOWN})"
            if name in facts.dict_unknown:
                return f"**{name} ({facts.dict_unknown[name]}: {_KEYS_UNKNOWN})"
            parts = facts.dict_parts.get(name)
            if not parts:
                return unknown
            out = []
            for part in parts:
                inner = self._dict_items(part, scope, depth + 1)
                if isinstance(inner, str):
                    return f"**{name} (built from {ast.unparse(part)}: {_KEYS_UNKNOWN})"
                out.extend(inner)
            out.extend(facts.dict_items.get(name, []))
            return out
        return unknown

    # ----------------------------------------------------------------- construct, then assign

    def _set_by_method(self, info: ClassInfo, method: str, seen: frozenset[str]) -> set[str]:
        """Attributes a method of ``info`` (or of its bases) assigns on ``self``."""
        key = (id(info), method)
        if key in self._method_memo:
            return self._method_memo[key]
        fn = next((c.methods[method] for c in _mro(info) if method in c.methods), None)
        out: set[str] = set()
        if fn is not None and fn.args.args and method not in seen:
            me = fn.args.args[0].arg
            facts = _fn_facts(fn)
            out = {a for a, _ in facts.attrs_set.get(me, []) if not a.startswith("<")}
            for m in facts.methods_called.get(me, set()):
                out |= self._set_by_method(info, m, seen | {method})
        self._method_memo[key] = out
        return out

    def _assigned_after(
        self, call: ast.Call, scope: _Scope, derived: ClassInfo
    ) -> tuple[set[str], list[tuple[str, ast.expr]]]:
        """Fields assigned on the result of ``call`` later in the function (directly, with
        setattr, or by a method of the class called on it), and the assigned values."""
        name = scope.facts.bound.get(id(call))
        if name is None:
            return set(), []
        names: set[str] = set()
        values: list[tuple[str, ast.expr]] = []
        for attr, value in scope.facts.attrs_set.get(name, []):
            if attr.startswith("<loop "):  # setattr(md, k, ...) in a loop over a name list
                var = attr[len("<loop ") : -1]
                for it in scope.facts.loops.get(var, []):
                    for n in self._literal_names(it, scope) or []:
                        names.add(n)
                        if (
                            isinstance(value, ast.Call)
                            and _dotted(value.func) == "getattr"
                            and len(value.args) >= 2
                            and isinstance(value.args[0], ast.Name)
                        ):
                            values.append((n, ast.Attribute(
                                value=ast.Name(id=value.args[0].id, ctx=ast.Load()), attr=n,
                                ctx=ast.Load(),
                            )))  # fmt: skip
                continue
            names.add(attr)
            if value is not None:
                values.append((attr, value))
        for m in scope.facts.methods_called.get(name, set()):
            names |= self._set_by_method(derived, m, frozenset())
        return names, values

    # ----------------------------------------------------------------- one call

    def _where(self, cls_name: str, scope: _Scope) -> str:
        """Where a class used but not defined in the given files comes from."""
        module = scope.file.imports.get(cls_name) if scope.file is not None else None
        if module is None:
            return "not defined in the given files"
        where = _module_file(module, scope.path)
        self.outside.setdefault(cls_name, where)
        return f"not defined in the given files (imported from {module}: pass {where})"

    def _note_constructed(self, func: ast.expr, scope: _Scope) -> None:
        """Remember a class imported from outside the given files that is called here (for
        the hint when no class is defined in them)."""
        last = (_dotted(func) or "").split(".")[-1]
        module = scope.file.imports.get(last) if scope.file is not None else None
        if not last[:1].isupper() or module is None:
            return
        if module.lstrip(".").split(".")[0] in sys.stdlib_module_names and not module.startswith("."):
            return
        self.constructed.setdefault(last, _module_file(module, scope.path))

    def _unresolved_callee(self, func: ast.expr, scope: _Scope) -> str | None:
        """What a call that copies fields builds when it is not a known class: a class
        outside the given files, a class chosen at run time, or ``None`` for what looks
        like a plain function (not noted)."""
        name = _dotted(func)
        if isinstance(func, ast.Call):  # type(x)(...), make_cls()(...)
            return f"a class chosen at run time ({ast.unparse(func)})"
        if name is None:
            # backends[i].metadata_cls(...): a class attribute of a computed object
            if isinstance(func, ast.Attribute) and _RUNTIME_CLASS.search(func.attr):
                return f"a class chosen at run time ({ast.unparse(func)})"
            return None
        last = name.split(".")[-1]
        if last in self._functions:
            return None  # a function of the given files
        if last[:1].isupper():
            module = scope.file.imports.get(last) if scope.file is not None else None
            top = (module or "").lstrip(".").split(".")[0]
            if module is not None and not module.startswith(".") and top in sys.stdlib_module_names:
                return None  # SimpleNamespace, OrderedDict, ...: not metadata
            return f"class {last!r}, which is {self._where(last, scope)}"
        if _RUNTIME_CLASS.search(last):
            return f"a class chosen at run time ({name})"
        return None

    def check_call(self, call: ast.Call, scope: _Scope) -> None:
        name = _dotted(call.func)
        if name in _REPLACE and call.args:
            self._check_replace(call, scope, name)
            return
        derived = self._callee(call.func, scope)
        # What the call passes, by name.
        passed: set[str] = set()
        values: list[tuple[str, ast.expr]] = []
        opaque: str | None = None
        init_fields = [f for f in derived.fields if f.init] if derived is not None else []
        if any(isinstance(a, ast.Starred) for a in call.args):
            opaque = "*" + next(ast.unparse(a.value) for a in call.args if isinstance(a, ast.Starred))
        for f, arg in zip(init_fields, call.args, strict=False):
            passed.add(f.name)
            values.append((f.name, arg))
        for kw in call.keywords:
            if kw.arg is not None:
                passed.add(kw.arg)
                values.append((kw.arg, kw.value))
                continue
            items = self._dict_items(kw.value, scope)
            if isinstance(items, str):
                opaque = opaque or items
                continue
            for k, v in items:
                passed.add(k)
                values.append((k, v))
        after: set[str] = set()
        if derived is not None:
            after, after_values = self._assigned_after(call, scope, derived)
            values += after_values
        # The source: the name whose attributes are copied under the same name most often.
        copies: dict[str, set[str]] = {}
        reads: dict[str, set[str]] = {}
        for key, value in values:
            for base, attr in _source_reads(value):
                reads.setdefault(base, set()).add(attr)
                if attr == key:
                    copies.setdefault(base, set()).add(attr)
        src_name = max(copies, key=lambda b: len(copies[b])) if copies else None
        copy_shape = src_name is not None and len(copies[src_name]) >= 2
        callee = ast.unparse(call.func)
        if derived is None:
            self._note_constructed(call.func, scope)
            if copy_shape:
                assert src_name is not None
                what = self._unresolved_callee(call.func, scope)
                if what is not None:
                    self._skip(
                        scope, call,
                        f"{callee}(...) in {scope.function} copies {len(copies[src_name])} "
                        f"field(s) from {src_name!r} but builds {what}",
                    )  # fmt: skip
            return
        if opaque is not None:
            self._skip(
                scope, call,
                f"{derived.name}(...) in {scope.function} passes {opaque}: taken as passing "
                "every field",
            )  # fmt: skip
            return
        if not copy_shape:
            return
        assert src_name is not None
        source = self._class_of_name(src_name, scope)
        how = "declared"
        if source is None and src_name in ("self", "cls"):
            return  # the enclosing class is not a known metadata class: not a copy
        if source is None:
            wanted = reads[src_name]
            cands = [c for c in self.classes.all if wanted <= {f.name for f in c.fields}]
            # Several: take the smallest field set when it is unambiguous (a base class and
            # its undecorated subclasses share one).
            smallest = min((len(c.fields) for c in cands), default=0)
            cands = [c for c in cands if len(c.fields) == smallest]
            if len({frozenset(f.name for f in c.fields) for c in cands}) == 1:
                cands = cands[:1]
            # An inferred source must be mostly copied, not merely read from.
            if len(cands) == 1 and 2 * len(copies[src_name]) < sum(f.init for f in cands[0].fields):
                cands = []
            if len(cands) != 1:
                declared = scope.types.get(src_name, [])
                where = (
                    f"; its annotation {declared[0]!r} is {self._where(declared[0], scope)}"
                    if declared and declared[0][:1].isupper()
                    else ""
                )
                self._skip(
                    scope, call,
                    f"{derived.name}(...) copies from {src_name!r} whose class is unknown "
                    f"({len(cands)} candidates{where})",
                )  # fmt: skip
                return
            source, how = cands[0], "inferred"
        self.calls += 1
        passed |= after
        derived_fields = {f.name: f for f in derived.fields}
        for f in source.fields:
            if not f.init or f.name in passed:
                continue
            target = derived_fields.get(f.name)
            if target is None or target.default is None or not target.init:
                continue
            msg = (
                f"{derived.name}(...) built from {src_name} ({source.name}, {how}) in "
                f"{scope.function} does not pass {f.name!r}: it silently takes the default "
                f"{target.default}"
            )
            self.findings.append(
                Finding(
                    path=scope.path, line=call.lineno, col=call.col_offset, rule="HM001",
                    function=scope.function, derived=derived.qualname, source=source.qualname,
                    source_expr=src_name, field=f.name, default=target.default, message=msg,
                )
            )  # fmt: skip

    def _check_replace(self, call: ast.Call, scope: _Scope, name: str) -> None:
        obj = call.args[0]
        info: ClassInfo | None = None
        if isinstance(obj, ast.Name):
            info = self._class_of_name(obj.id, scope)
        if info is None:
            self._skip(
                scope, call,
                f"{name}({ast.unparse(obj)}, ...): class of {ast.unparse(obj)!r} unknown",
            )  # fmt: skip
            return
        self.calls += 1
        for f in info.fields:
            if f.init or f.default is None:
                continue
            msg = (
                f"{name}({ast.unparse(obj)}, ...) on {info.name} in {scope.function}: field "
                f"{f.name!r} is init=False, so it is not copied but reset to its default "
                f"{f.default}"
            )
            self.findings.append(
                Finding(
                    path=scope.path, line=call.lineno, col=call.col_offset, rule="HM002",
                    function=scope.function, derived=info.qualname, source=info.qualname,
                    source_expr=ast.unparse(obj), field=f.name, default=f.default, message=msg,
                )
            )  # fmt: skip


# --------------------------------------------------------------------------- driver


def _python_files(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            out.extend(sorted(q for q in path.rglob("*.py") if q.is_file()))
        elif path.is_file():
            out.append(path)
        else:
            raise AuditError(f"hybridmeta audit: {p}: no such file or directory")
    if not out:
        raise AuditError("hybridmeta audit: no Python files in the given paths")
    return out


def audit_paths(paths: Sequence[str]) -> AuditResult:
    """Audit the Python files at ``paths`` (files or directories, searched recursively).

    A file that cannot be read or parsed (syntax of a newer Python, say) is skipped with a
    note; the others are audited.

    Raises
    ------
    AuditError
        A path that does not exist, or no given file can be read and parsed.
    """
    files = _python_files(paths)
    trees: list[tuple[str, ast.Module]] = []
    skipped: list[str] = []
    notes: list[str] = []
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    for f in files:
        try:
            trees.append((str(f), ast.parse(f.read_text(encoding="utf-8"), filename=str(f))))
        except SyntaxError as e:
            skipped.append(str(f))
            notes.append(
                f"{f}:{e.lineno}: cannot parse with Python {py} ({e.msg}); file skipped "
                "(syntax of a newer Python? run the audit with that Python)"
            )
        except (OSError, UnicodeDecodeError) as e:
            skipped.append(str(f))
            notes.append(f"{f}: cannot read ({e}); file skipped")
    if not trees:
        raise AuditError("hybridmeta audit: no file could be audited:\n" + "\n".join(notes))
    classes = _Classes()
    for path, tree in trees:
        classes.collect(tree, path)
    file_facts = {path: _file_facts(tree, path) for path, tree in trees}
    classes.imports = {
        path: {k: (m, f.originals.get(k, k)) for k, m in f.imports.items()}
        for path, f in file_facts.items()
    }
    classes.resolve()
    auditor = _Auditor(classes, file_facts)
    facts = _Module()
    for _, tree in trees:
        one = _module_facts(tree)
        facts.typevars.update(one.typevars)
        for k, v in one.returns.items():
            facts.returns.setdefault(k, v)
    for path, tree in trees:
        scopes: dict[int, dict[str, list[str]]] = {}
        for fn, cls, qual, parent in _functions(tree):
            # A nested function sees its enclosing function's names (closures), its own win.
            types = {**scopes.get(id(parent), {}), **_scope_types(fn, facts)}
            scopes[id(fn)] = types
            scope = _Scope(path, qual, cls, types, _fn_facts(fn), file_facts[path])
            for node in _own_nodes(fn):
                if isinstance(node, ast.Call):
                    auditor.check_call(node, scope)
    notes += auditor.notes
    incomplete = sorted({c.qualname for c in classes.all if not c.complete})
    if incomplete:
        where = []
        for c in classes.all:
            if c.complete:
                continue
            known = {b.name for b in c.resolved_bases}
            for base in c.bases:
                if base and base not in known and base not in ("object", "Generic", "ABC"):
                    imported = file_facts[c.path].imports.get(base)
                    if imported is not None:
                        where.append(f"{base} from {imported}: {_module_file(imported, c.path)}")
        hint = f"; pass the files defining their bases ({', '.join(sorted(set(where)))})" if where else ""
        notes.append(
            "classes with a base outside the given files (their inherited fields are not "
            f"checked): {', '.join(incomplete)}{hint}"
        )
    if not classes.all:
        used = {**auditor.constructed, **auditor.outside}
        outside = ", ".join(f"{k} ({v})" for k, v in sorted(used.items()))
        notes.append(
            "hint: no dataclass, attrs, NamedTuple or @hybridmeta.metadata class is defined "
            "in the given files, so no constructor call can be checked: pass the files that "
            "define the metadata classes together with the code that builds them"
            + (f" (used here: {outside})" if outside else "")
        )
    elif auditor.outside:
        outside = ", ".join(f"{k} ({v})" for k, v in sorted(auditor.outside.items()))
        notes.append(
            f"hint: classes built here but defined outside the given files: {outside}; pass "
            "those files too to check these calls"
        )
    findings = sorted(auditor.findings, key=lambda f: (f.path, f.line, f.col, f.field))
    return AuditResult(
        files=[p for p, _ in trees],
        classes=len(classes.all),
        calls_checked=auditor.calls,
        findings=findings,
        notes=notes,
        skipped_files=skipped,
        calls_skipped=auditor.skipped,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``hybridmeta audit``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="hybridmeta audit",
        description="Find constructor calls that build one metadata class from another and "
        "leave source fields to silently take a default (static; imports nothing).",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="Python files or directories")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # argparse exits 2 on a usage error, 0 on --help
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        result = audit_paths(args.paths)
    except AuditError as e:
        print(e, file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        for f in result.findings:
            print(f.text())
        for note in result.notes:
            print(f"note: {note}")
        skipped = (
            f", {len(result.skipped_files)} file(s) skipped" if result.skipped_files else ""
        )
        calls_skipped = f" ({result.calls_skipped} skipped)" if result.calls_skipped else ""
        print(
            f"hybridmeta audit: {len(result.findings)} finding(s); {result.calls_checked} "
            f"constructor call(s) checked{calls_skipped} in {len(result.files)} file(s)"
            f"{skipped}, {result.classes} class(es) resolved"
        )
    return 1 if result.findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
