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

Calls that pass ``**mapping`` of unknown keys (``**vars(src)``, ``**asdict(src)``) are
taken as passing everything. Exit status: 1 with findings, 0 without, 2 on a usage error
or a file that does not parse.
"""

from __future__ import annotations

import argparse
import ast
import json
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

    def to_json(self) -> dict[str, object]:
        return {
            "version": 1,
            "files": self.files,
            "classes": self.classes,
            "calls_checked": self.calls_checked,
            "findings": [asdict(f) for f in self.findings],
            "notes": self.notes,
        }


class AuditError(Exception):
    """A usage error or a file that cannot be read or parsed (exit status 2)."""


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
                    )
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
                pick = (same_file or cands)[:1]
                if not pick:
                    complete = False
                    continue
                bf, bcomplete = fields_of(pick[0], (*stack, id(info)))
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

    def lookup(self, name: str, path: str) -> ClassInfo | None:
        cands = self.by_name.get(name.split(".")[-1], [])
        same = [c for c in cands if c.path == path]
        pick = same or cands
        return pick[0] if pick else None


# --------------------------------------------------------------------------- calls


@dataclass
class _Scope:
    path: str
    function: str
    enclosing_class: str | None
    types: dict[str, list[str]]  # local name -> candidate class names


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


class _Auditor:
    def __init__(self, classes: _Classes) -> None:
        self.classes = classes
        self.findings: list[Finding] = []
        self.calls = 0
        self.notes: list[str] = []

    def _class_of_name(self, name: str, scope: _Scope) -> ClassInfo | None:
        if name in ("self", "cls") and scope.enclosing_class:
            return self.classes.lookup(scope.enclosing_class, scope.path)
        for cand in scope.types.get(name, []):
            info = self.classes.lookup(cand, scope.path)
            if info is not None:
                return info
        return None

    def _callee(self, func: ast.expr, scope: _Scope) -> ClassInfo | None:
        if isinstance(func, ast.Name) and func.id == "cls" and scope.enclosing_class:
            return self.classes.lookup(scope.enclosing_class, scope.path)
        name = _dotted(func)
        if name is None:
            return None
        last = name.split(".")[-1]
        if not last[:1].isupper():
            return None
        return self.classes.lookup(last, scope.path)

    def check_call(self, call: ast.Call, scope: _Scope) -> None:
        name = _dotted(call.func)
        if name in _REPLACE and call.args:
            self._check_replace(call, scope, name)
            return
        derived = self._callee(call.func, scope)
        if derived is None:
            return
        passed: set[str] = set()
        values: list[tuple[str, ast.expr]] = []
        init_fields = [f for f in derived.fields if f.init]
        for f, arg in zip(init_fields, call.args, strict=False):
            passed.add(f.name)
            values.append((f.name, arg))
        if any(isinstance(a, ast.Starred) for a in call.args):
            return
        for kw in call.keywords:
            if kw.arg is not None:
                passed.add(kw.arg)
                values.append((kw.arg, kw.value))
            elif isinstance(kw.value, ast.Dict) and all(
                isinstance(k, ast.Constant) and isinstance(k.value, str) for k in kw.value.keys
            ):
                for k, v in zip(kw.value.keys, kw.value.values, strict=True):
                    assert isinstance(k, ast.Constant)
                    passed.add(str(k.value))
                    values.append((str(k.value), v))
            elif isinstance(kw.value, ast.Call) and _dotted(kw.value.func) == "dict" and not kw.value.args:
                for k2 in kw.value.keywords:
                    if k2.arg is None:
                        return
                    passed.add(k2.arg)
                    values.append((k2.arg, k2.value))
            else:
                return  # **mapping of unknown keys: may pass anything
        # The source: the name whose attributes are copied under the same name most often.
        copies: dict[str, set[str]] = {}
        reads: dict[str, set[str]] = {}
        for key, value in values:
            for base, attr in _source_reads(value):
                reads.setdefault(base, set()).add(attr)
                if attr == key:
                    copies.setdefault(base, set()).add(attr)
        if not copies:
            return
        src_name = max(copies, key=lambda b: len(copies[b]))
        if len(copies[src_name]) < 2:
            return
        self.calls += 1
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
                self.notes.append(
                    f"{scope.path}:{call.lineno}: {derived.name}(...) copies from "
                    f"{src_name!r} whose class is unknown ({len(cands)} candidates); skipped"
                )
                return
            source, how = cands[0], "inferred"
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
            self.notes.append(
                f"{scope.path}:{call.lineno}: {name}({ast.unparse(obj)}, ...): class of "
                f"{ast.unparse(obj)!r} unknown; skipped"
            )
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

    Raises
    ------
    AuditError
        A path that does not exist, or a file that cannot be read or parsed.
    """
    files = _python_files(paths)
    trees: list[tuple[str, ast.Module]] = []
    errors: list[str] = []
    for f in files:
        try:
            trees.append((str(f), ast.parse(f.read_text(encoding="utf-8"), filename=str(f))))
        except SyntaxError as e:
            errors.append(f"{f}:{e.lineno}: cannot parse: {e.msg}")
        except (OSError, UnicodeDecodeError) as e:
            errors.append(f"{f}: cannot read: {e}")
    if errors:
        raise AuditError("hybridmeta audit: " + "\n".join(errors))
    classes = _Classes()
    for path, tree in trees:
        classes.collect(tree, path)
    classes.resolve()
    auditor = _Auditor(classes)
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
            scope = _Scope(path, qual, cls, types)
            for node in _own_nodes(fn):
                if isinstance(node, ast.Call):
                    auditor.check_call(node, scope)
    incomplete = [c.qualname for c in classes.all if not c.complete]
    notes = list(auditor.notes)
    if incomplete:
        notes.append(
            "classes with a base outside the given files (their inherited fields are not "
            f"checked): {', '.join(sorted(set(incomplete)))}"
        )
    findings = sorted(auditor.findings, key=lambda f: (f.path, f.line, f.col, f.field))
    return AuditResult(
        files=[str(f) for f in files],
        classes=len(classes.all),
        calls_checked=auditor.calls,
        findings=findings,
        notes=notes,
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
        print(
            f"hybridmeta audit: {len(result.findings)} finding(s); {result.calls_checked} "
            f"constructor call(s) checked in {len(result.files)} file(s), "
            f"{result.classes} class(es) resolved"
        )
    return 1 if result.findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
