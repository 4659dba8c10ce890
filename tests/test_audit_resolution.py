"""``hybridmeta audit``: how classes, imports, annotations and assignments are resolved.

Each test writes a few small source files and checks what :func:`audit_paths` (or
``main``) reports for them: the findings, the notes of skipped calls and the JSON report.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from hybridmeta.audit import AuditResult, audit_paths, main

FWD = """\
from dataclasses import dataclass, field

@dataclass(kw_only=True)
class Fwd:
    qsl: object
    slots: object
    track: object = None
    flag: bool = False
    hidden: int = field(default=0, init=False)
"""

MD = """
@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0
"""

# Fwd of another engine: the same name, another field set.
SPARE_FWD = """\
from dataclasses import dataclass

@dataclass(kw_only=True)
class Fwd:
    qsl: object
    slots: object
    spare: object = None
"""


def _tree(tmp: Path, files: dict[str, str]) -> dict[str, str]:
    """Write ``files`` (relative path -> source) under ``tmp``; their paths as given."""
    out: dict[str, str] = {}
    for name, body in files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        out[name] = str(path)
    return out


def _audit(tmp: Path, files: dict[str, str]) -> AuditResult:
    _tree(tmp, files)
    return audit_paths([str(tmp)])


def _found(result: AuditResult) -> list[tuple[str, str]]:
    return sorted((f.function, f.field) for f in result.findings)


def _line_of(source: str, text: str) -> int:
    (line,) = [i for i, s in enumerate(source.splitlines(), 1) if text in s]
    return line


# --------------------------------------------------------------------------- reports


def test_json_report_has_every_key_and_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = (
        FWD
        + MD
        + """
def prepare(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)

def opaque(fwd: Fwd, extra: dict[str, object]) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, **extra)
"""
    )
    p = _tree(tmp_path, {"m.py": src})["m.py"]
    line = _line_of(src, "track=fwd.track)")
    skipped_line = _line_of(src, "**extra")
    assert main(["--json", p]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data == {
        "version": 1,
        "files": [p],
        "skipped_files": [],
        "classes": 2,
        "calls_checked": 1,
        "calls_skipped": 1,
        "findings": [
            {
                "path": p, "line": line, "col": 11, "rule": "HM001", "function": "prepare",
                "derived": "Md", "source": "Fwd", "source_expr": "fwd", "field": "flag",
                "default": "False",
                "message": "Md(...) built from fwd (Fwd, declared) in prepare does not pass "
                "'flag': it silently takes the default False",
            }
        ],
        "notes": [
            f"{p}:{skipped_line}: Md(...) in opaque passes **extra (keys unknown): "
            "taken as passing every field; skipped"
        ],
    }  # fmt: skip


def test_no_python_files_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err == "hybridmeta audit: no Python files in the given paths\n"


# --------------------------------------------------------------------------- annotations


@pytest.mark.parametrize(
    ("annotation", "how"),
    [
        ("Fwd", "declared"),
        ("'Fwd'", "declared"),
        ("mod.Fwd", "declared"),
        ("Fwd | None", "declared"),
        ("None | Fwd", "declared"),
        ("Optional[Fwd]", "declared"),
        ("typing.Optional[Fwd]", "declared"),
        ("'Optional[Fwd]'", "declared"),
        ("Union[None, Fwd]", "declared"),
        ("typing.Union[Fwd, int]", "declared"),
        ("Annotated[Fwd, 'per step']", "declared"),
        ("typing.Annotated[Optional[Fwd], 'per step']", "declared"),
        # Annotated's metadata is not the type: the class is inferred from the reads.
        ("Annotated[object, 'Fwd']", "inferred"),
        ("list[Fwd]", "inferred"),
    ],
)
def test_parameter_annotations_name_the_source_class(
    tmp_path: Path, annotation: str, how: str
) -> None:
    src = (
        FWD
        + MD
        + f"""
import typing
from typing import Annotated, Optional, Union
import mod

def prepare(src: {annotation}) -> Md:
    return Md(qsl=src.qsl, slots=src.slots, track=src.track)
"""
    )
    (f,) = _audit(tmp_path, {"m.py": src}).findings
    assert (f.field, f.source) == ("flag", "Fwd")
    assert f.message.startswith(f"Md(...) built from src (Fwd, {how}) in prepare")


def test_local_names_are_typed_by_assignments_typevars_and_closures(tmp_path: Path) -> None:
    src = (
        FWD
        + MD
        + """
import typing
from typing import Final

T = typing.TypeVar("T", bound=Fwd)

def load() -> Fwd: ...

class Runner:
    def current(self) -> Fwd: ...

def by_typevar(src: T) -> Md:
    return Md(qsl=src.qsl, slots=src.slots, track=src.track)

def by_local_annotation(raw: object) -> Md:
    src: Fwd = raw
    return Md(qsl=src.qsl, slots=src.slots, track=src.track)

def by_final(raw: object) -> Md:
    src: Final[Fwd] = raw
    return Md(qsl=src.qsl, slots=src.slots, track=src.track)

def by_function_result() -> Md:
    src = load()
    return Md(qsl=src.qsl, slots=src.slots, track=src.track)

def by_method_result(runners: list[Runner]) -> Md:
    src = runners[-1].current()
    return Md(qsl=src.qsl, slots=src.slots, track=src.track)

def by_constructor(q: object) -> Md:
    src = Fwd(qsl=q, slots=q)
    return Md(qsl=src.qsl, slots=src.slots, track=src.track)

def outer(src: Fwd) -> Md:
    def inner() -> Md:
        return Md(qsl=src.qsl, slots=src.slots, track=src.track)
    return inner()
"""
    )
    result = _audit(tmp_path, {"m.py": src})
    got = sorted((f.function, f.field, f.message.split(" in ")[0]) for f in result.findings)
    declared = "Md(...) built from src (Fwd, declared)"
    assert got == [
        (fn, "flag", declared)
        for fn in sorted([
            "by_constructor", "by_final", "by_function_result", "by_local_annotation",
            "by_method_result", "by_typevar", "outer.inner",
        ])
    ]  # fmt: skip


# --------------------------------------------------------------------------- declarations


@pytest.mark.parametrize(
    ("src", "expected"),
    [
        pytest.param(
            """\
from dataclasses import dataclass, field

@dataclass
class Md:
    qsl: object
    slots: object
    need: object = field(metadata={"doc": "required"})
    track: list[int] = field(default_factory=list)
    flag: bool = field(default=False, repr=False)
    step: int = field(default=0, init=True)

def copy(src: Md) -> Md:
    return Md(qsl=src.qsl, slots=src.slots)
""",
            [("HM001", "flag", "False"), ("HM001", "step", "0"), ("HM001", "track", "list()")],
            id="field-options",
        ),
        pytest.param(
            """\
import attrs

@attrs.define
class Md:
    qsl: object
    slots: object
    cache: dict[str, int] = attrs.field(factory=dict)

def copy(src: Md) -> Md:
    return Md(qsl=src.qsl, slots=src.slots)
""",
            [("HM001", "cache", "dict()")],
            id="attrs-factory",
        ),
        pytest.param(
            """\
import typing
from dataclasses import dataclass
from typing import ClassVar

@dataclass
class Md:
    registry: ClassVar[dict[str, int]] = {}
    qsl: object
    slots: object
    kind: typing.ClassVar[str] = "md"
    version: "ClassVar[int]" = 1
    flag: "bool" = False

def copy(src: Md) -> Md:
    return Md(qsl=src.qsl, slots=src.slots)
""",
            [("HM001", "flag", "False")],
            id="classvars-are-not-fields",
        ),
        pytest.param(
            """\
from dataclasses import KW_ONLY, dataclass

@dataclass
class Md:
    qsl: object
    _: KW_ONLY
    slots: object
    track: object = None
    flag: bool = False

def copy(src):
    return Md(qsl=src.qsl, slots=src.slots)
""",
            # The source is inferred: 2 of its 4 init fields copied is enough.
            [("HM001", "flag", "False"), ("HM001", "track", "None")],
            id="kw-only-marker-is-not-a-field",
        ),
        pytest.param(
            """\
import typing

class Plan(typing.NamedTuple):
    qsl: object
    slots: object
    rows: int = 1

def copy(src: Plan) -> Plan:
    return Plan(src.qsl, src.slots)
""",
            [("HM001", "rows", "1")],
            id="typing-namedtuple",
        ),
        pytest.param(
            '''\
import attr

@attr.s
class Md:
    """Metadata of one step."""

    LIMIT = 4
    qsl = attr.ib()
    slots = attr.ib()
    flag = attr.ib(default=False)
    cache = attr.ib(factory=dict, init=False)

    def describe(self) -> str:
        return "md"

def copy(src: Md) -> Md:
    return Md(qsl=src.qsl, slots=src.slots)

def bump(src: Md) -> Md:
    return attr.evolve(src, flag=True)
''',
            [("HM001", "flag", "False"), ("HM002", "cache", "dict()")],
            id="attr-s-assignments",
        ),
    ],
)
def test_field_declarations_and_their_defaults(
    tmp_path: Path, src: str, expected: list[tuple[str, str, str]]
) -> None:
    result = _audit(tmp_path, {"m.py": src})
    assert sorted((f.rule, f.field, f.default) for f in result.findings) == expected
    assert result.notes == []
    assert result.calls_skipped == 0


def test_replace_finding_and_unknown_object(tmp_path: Path) -> None:
    src = (
        FWD
        + """
import dataclasses

class Holder:
    def __init__(self, fwd: Fwd) -> None:
        self.fwd = fwd

    def bump(self) -> Fwd:
        return dataclasses.replace(self.fwd, flag=True)

def reset(fwd: Fwd) -> Fwd:
    return dataclasses.replace(fwd, flag=False)
"""
    )
    p = _tree(tmp_path, {"m.py": src})["m.py"]
    result = audit_paths([p])
    line = _line_of(src, "replace(fwd, flag=False)")
    (f,) = result.findings
    message = (
        "dataclasses.replace(fwd, ...) on Fwd in reset: field 'hidden' is init=False, so it "
        "is not copied but reset to its default 0"
    )
    assert asdict(f) == {
        "path": p, "line": line, "col": 11, "rule": "HM002", "function": "reset",
        "derived": "Fwd", "source": "Fwd", "source_expr": "fwd", "field": "hidden",
        "default": "0", "message": message,
    }  # fmt: skip
    assert f.text() == f"{p}:{line}:12: HM002 {message}"
    bump = _line_of(src, "replace(self.fwd")
    assert result.notes == [
        f"{p}:{bump}: dataclasses.replace(self.fwd, ...): class of 'self.fwd' unknown; skipped"
    ]
    assert (result.calls_checked, result.calls_skipped) == (1, 1)


# --------------------------------------------------------------------------- hierarchies

INCOMPLETE = "classes with a base outside the given files"


@pytest.mark.parametrize(
    ("files", "expected", "incomplete", "classes"),
    [
        pytest.param(
            {
                "m.py": FWD
                + """
from abc import ABC
from typing import Generic, TypeVar

T = TypeVar("T")

@dataclass(kw_only=True)
class A(Fwd, ABC):
    a: int = 0

@dataclass(kw_only=True)
class B(Generic[T], Fwd):
    b: int = 0

@dataclass(kw_only=True)
class C(object):
    qsl: object
    slots: object
    c: int = 0

def to_a(f: Fwd) -> A:
    return A(qsl=f.qsl, slots=f.slots, track=f.track)

def to_b(f: Fwd) -> B:
    return B(qsl=f.qsl, slots=f.slots, track=f.track)

def to_c(c: C) -> C:
    return C(qsl=c.qsl, slots=c.slots)
"""
            },
            [("to_a", "flag", "A"), ("to_b", "flag", "B"), ("to_c", "c", "C")],
            [],
            4,
            id="object-abc-generic-bases",
        ),
        pytest.param(
            {
                "m.py": FWD
                + """
from mixins import Printable

@dataclass(kw_only=True)
class Md(Printable, Fwd):
    n: int = 0

@dataclass(kw_only=True)
class Sub(Md):
    m: int = 0

def to_md(f: Fwd) -> Md:
    return Md(qsl=f.qsl, slots=f.slots, track=f.track)
"""
            },
            [("to_md", "flag", "Md")],
            [
                f"{INCOMPLETE} (their inherited fields are not checked): Md, Sub; pass the files "
                "defining their bases (Printable from mixins: mixins.py)"
            ],
            3,
            id="outside-mixin-first",
        ),
        pytest.param(
            {
                "m.py": FWD
                + """
class Helper:
    def run(self) -> None: ...

class Plain(Fwd):
    note: str = ""

def copy(p: Plain) -> Plain:
    return Plain(qsl=p.qsl, slots=p.slots, track=p.track, flag=p.flag)
"""
            },
            # Plain is not decorated: its annotation is no field; Helper is no metadata.
            [],
            [],
            2,
            id="undecorated-classes",
        ),
        pytest.param(
            {
                "base.py": FWD,
                "user.py": """\
import base
from dataclasses import dataclass

@dataclass(kw_only=True)
class Md(base.Fwd):
    n: int = 0

def to_md(f: base.Fwd) -> Md:
    return Md(qsl=f.qsl, slots=f.slots, track=f.track)
""",
            },
            [("to_md", "flag", "Md")],
            [],
            2,
            id="dotted-base",
        ),
        pytest.param(
            {
                "a_md.py": """\
from dataclasses import dataclass
from z_base import Fwd, Mid

@dataclass(kw_only=True)
class Md(Mid):
    n: int = 0

def to_md(f: Fwd) -> Md:
    return Md(qsl=f.qsl, slots=f.slots, track=f.track)
""",
                "z_base.py": FWD
                + """
@dataclass(kw_only=True)
class Mid(Fwd):
    m: int = 0
""",
            },
            [("to_md", "flag", "Md")],
            [],
            3,
            id="subclass-in-an-earlier-file",
        ),
        pytest.param(
            {
                "a.py": SPARE_FWD,
                "b.py": FWD
                + MD
                + """
def to_md(f: Fwd) -> Md:
    return Md(qsl=f.qsl, slots=f.slots, track=f.track)
""",
            },
            [("to_md", "flag", "Md")],
            [],
            3,
            id="same-file-base-wins",
        ),
        pytest.param(
            {
                "a.py": """\
from dataclasses import dataclass

@dataclass(kw_only=True)
class Root:
    qsl: object
    slots: object
    flag: bool = False

    def finish(self, flag: bool) -> None:
        self.flag = flag

@dataclass(kw_only=True)
class Md(Root):
    track: object = None
""",
                "b.py": """\
from dataclasses import dataclass
from a import Md, Root

@dataclass(kw_only=True)
class Md(Md):
    n: int = 0

def build(r: Root) -> Md:
    md = Md(qsl=r.qsl, slots=r.slots)
    md.finish(r.flag)
    md.validate()  # defined nowhere: looked up through the bases, not forever
    return md
""",
            },
            # b.Md extends a.Md (the name it imports), whose base Root sets flag.
            [],
            [],
            3,
            id="extends-imported-class-of-the-same-name",
        ),
        pytest.param(
            {
                "m.py": FWD
                + """
from mixins import Base

@dataclass(kw_only=True)
class Mid(Base):
    qsl: object
    slots: object

@dataclass(kw_only=True)
class Md(Mid):
    n: int = 0
"""
            },
            [],
            [
                f"{INCOMPLETE} (their inherited fields are not checked): Md, Mid; pass the files "
                "defining their bases (Base from mixins: mixins.py)"
            ],
            3,
            id="incomplete-base-makes-subclass-incomplete",
        ),
        pytest.param(
            {
                "m.py": FWD
                + """
class Outer:
    @dataclass(kw_only=True)
    class Inner(Fwd):
        n: int = 0

def to_inner(f: Fwd) -> "Outer.Inner":
    return Outer.Inner(qsl=f.qsl, slots=f.slots, track=f.track)
"""
            },
            [("to_inner", "flag", "Outer.Inner")],
            [],
            2,
            id="nested-class",
        ),
    ],
)
def test_class_hierarchies_across_files(
    tmp_path: Path,
    files: dict[str, str],
    expected: list[tuple[str, str, str]],
    incomplete: list[str],
    classes: int,
) -> None:
    result = _audit(tmp_path, files)
    assert sorted((f.function, f.field, f.derived) for f in result.findings) == expected
    assert [n for n in result.notes if n.startswith(INCOMPLETE)] == incomplete
    assert result.classes == classes


USER = """\
from dataclasses import dataclass
{import_line}

@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0

def prepare(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots)
"""


@pytest.mark.parametrize(
    ("user", "import_line", "extra"),
    [
        ("eng2/backend.py", "from .meta import Fwd", {}),
        ("eng2/sub/backend.py", "from ..meta import Fwd", {"eng2/sub/__init__.py": ""}),
        ("user.py", "from eng2.meta import Fwd", {}),
        ("user.py", "from eng3 import Fwd", {"eng3/__init__.py": FWD}),
        ("eng3/backend.py", "from . import Fwd", {"eng3/__init__.py": FWD}),
        ("eng3/backend.py", "from .models import Fwd",
         {"eng3/__init__.py": "", "eng3/models/__init__.py": FWD}),
        ("user.py", "from eng3.models.meta import Fwd",
         {"eng3/__init__.py": "", "eng3/models/__init__.py": "", "eng3/models/meta.py": FWD,
          "eng3/meta.py": SPARE_FWD}),
    ],
)  # fmt: skip
def test_imports_find_the_module_of_the_class(
    tmp_path: Path, user: str, import_line: str, extra: dict[str, str]
) -> None:
    # eng1/meta.py (found first) has another Fwd: the import must pick eng2's (or eng3's).
    files = {
        "eng1/__init__.py": "", "eng1/meta.py": SPARE_FWD,
        "eng2/__init__.py": "", "eng2/meta.py": FWD,
        **extra, user: USER.format(import_line=import_line),
    }  # fmt: skip
    result = _audit(tmp_path, files)
    assert _found(result) == [("prepare", "flag"), ("prepare", "track")]
    assert result.notes == []


def test_re_exports_are_followed(tmp_path: Path) -> None:
    files = {
        "base.py": FWD,
        "pkg/__init__.py": "from base import Fwd\n",
        "user.py": USER.format(import_line="from pkg import Fwd"),
        "rel/__init__.py": "from .meta import Fwd\n",
        "rel/meta.py": FWD,
        "rel_user.py": USER.format(import_line="from rel import Fwd"),
        # A circle of re-exports (broken code) means a class outside the given files, and
        # so does a base that is no class statement (Base = declarative_base()).
        "x.py": "from y import Meta\n",
        "y.py": "from x import Meta\n",
        "models.py": "from sqlalchemy.orm import declarative_base\n\nBase = declarative_base()\n",
        "z.py": """\
from dataclasses import dataclass
from models import Base
from x import Meta

@dataclass
class Looped(Meta):
    qsl: object

@dataclass
class Row(Base):
    qsl: object

def build(fwd: "Fwd"):
    return Meta(qsl=fwd.qsl, slots=fwd.slots)
""",
    }
    paths = _tree(tmp_path, files)
    result = audit_paths([str(tmp_path)])
    assert sorted((f.path, f.function, f.field) for f in result.findings) == [
        (paths[user], "prepare", field)
        for user in ("rel_user.py", "user.py")
        for field in ("flag", "track")
    ]
    (note,) = [n for n in result.notes if "; skipped" in n]
    assert "builds class 'Meta', which is not defined in the given files (imported from x" in note
    assert [n for n in result.notes if n.startswith(INCOMPLETE)] == [
        f"{INCOMPLETE} (their inherited fields are not checked): Looped, Row; pass the files "
        "defining their bases (Base from models: models.py, Meta from x: x.py)"
    ]


def test_a_module_attribute_names_a_class_of_the_given_files(tmp_path: Path) -> None:
    files = {
        "base.py": FWD + MD,
        "user.py": """\
import base

def prepare(fwd: base.Fwd) -> base.Md:
    return base.Md(qsl=fwd.qsl, slots=fwd.slots)
""",
    }
    result = _audit(tmp_path, files)
    assert _found(result) == [("prepare", "flag"), ("prepare", "track")]
    assert [f.message.split(" in ")[0] for f in result.findings] == [
        "Md(...) built from fwd (Fwd, declared)"
    ] * 2


def test_same_class_names_in_two_files_resolve_in_their_own_file(tmp_path: Path) -> None:
    files = {
        "a.py": """\
from dataclasses import dataclass

@dataclass(kw_only=True)
class Md:
    qsl: object
    slots: object
    spare: int = 0

class Builder:
    NAMES = ("qsl",)

    def build(self, md: Md) -> Md:
        return Md(**{k: getattr(md, k) for k in self.NAMES}, slots=md.slots)
""",
        "b.py": """\
from dataclasses import dataclass, fields

@dataclass(kw_only=True)
class Md:
    qsl: object
    slots: object
    track: object = None
    flag: bool = False

    def clone(self) -> "Md":
        return Md(qsl=self.qsl, slots=self.slots)

    @classmethod
    def rebuild(cls, other: "Md") -> "Md":
        return cls(qsl=other.qsl, slots=other.slots)

    def declared(self, other: "Md") -> "Md":
        return Md(**{f.name: getattr(other, f.name) for f in fields(Md)})

class Builder:
    NAMES = ("qsl", "slots", "track")

    def build(self, md: Md) -> Md:
        return Md(**{k: getattr(md, k) for k in self.NAMES})
""",
    }
    paths = _tree(tmp_path, files)
    result = audit_paths([str(tmp_path)])
    assert sorted((f.path, f.function, f.field) for f in result.findings) == [
        (paths["a.py"], "Builder.build", "spare"),
        (paths["b.py"], "Builder.build", "flag"),
        (paths["b.py"], "Md.clone", "flag"), (paths["b.py"], "Md.clone", "track"),
        (paths["b.py"], "Md.rebuild", "flag"), (paths["b.py"], "Md.rebuild", "track"),
    ]  # fmt: skip
    assert result.calls_checked == 5


# --------------------------------------------------------------------------- callees


def test_self_class_callees_and_self_sources(tmp_path: Path) -> None:
    src = (
        FWD
        + MD
        + """
    def clone(self) -> "Md":
        return self.__class__(qsl=self.qsl, slots=self.slots, track=self.track)

    def again(self) -> "Md":
        return type(self)(qsl=self.qsl, slots=self.slots, track=self.track)

    def to_fwd(self) -> Fwd:
        return Fwd(qsl=self.qsl, slots=self.slots, track=self.track)

    def deferred(self) -> "Md":
        def build() -> "Md":
            return Md(qsl=self.qsl, slots=self.slots, track=self.track)
        return build()
"""
    )
    result = _audit(tmp_path, {"m.py": src})
    assert sorted((f.function, f.field, f.derived, f.source) for f in result.findings) == [
        ("Md.again", "flag", "Md", "Md"), ("Md.again", "n", "Md", "Md"),
        ("Md.clone", "flag", "Md", "Md"), ("Md.clone", "n", "Md", "Md"),
        ("Md.deferred.build", "flag", "Md", "Md"), ("Md.deferred.build", "n", "Md", "Md"),
        ("Md.to_fwd", "flag", "Fwd", "Md"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("import_line", "callee", "what"),
    [
        ("from .meta import Elsewhere", "Elsewhere",
         "class 'Elsewhere', which is not defined in the given files (imported from .meta: "
         "pass {pkg}/meta.py)"),
        ("from ..meta import Elsewhere", "Elsewhere",
         "class 'Elsewhere', which is not defined in the given files (imported from ..meta: "
         "pass {root}/meta.py)"),
        ("from . import Elsewhere", "Elsewhere",
         "class 'Elsewhere', which is not defined in the given files (imported from .: "
         "pass {pkg}/__init__.py)"),
        ("from .. import Elsewhere", "Elsewhere",
         "class 'Elsewhere', which is not defined in the given files (imported from ..: "
         "pass {root}/__init__.py)"),
        ("from .types import Elsewhere", "Elsewhere",
         "class 'Elsewhere', which is not defined in the given files (imported from .types: "
         "pass {pkg}/types.py)"),
        ("from ..sub.meta import Elsewhere", "Elsewhere",
         "class 'Elsewhere', which is not defined in the given files (imported from "
         "..sub.meta: pass {root}/sub/meta.py)"),
        ("", "Elsewhere", "class 'Elsewhere', which is not defined in the given files"),
        ("import engine.meta as meta", "meta.Elsewhere",
         "class 'Elsewhere', which is not defined in the given files"),
        ("", "type(fwd)", "a class chosen at run time (type(fwd))"),
        ("", "backends[0].metadata_cls", "a class chosen at run time (backends[0].metadata_cls)"),
        ("from types import SimpleNamespace", "SimpleNamespace", None),
        ("from unittest.mock import Mock", "Mock", None),
        ("from helpers import md_factory", "md_factory", None),
        # a method or a function registry of a computed object: plain functions, no note
        ("", "backends[0].build", None),
        ("", "backends[0]", None),
    ],
)  # fmt: skip
def test_calls_that_copy_into_unknown_classes(
    tmp_path: Path, import_line: str, callee: str, what: str | None
) -> None:
    src = (
        FWD
        + import_line
        + """

def build(fwd: Fwd, backends: list[object]) -> object:
    return CALLEE(qsl=fwd.qsl, slots=fwd.slots)
""".replace("CALLEE", callee)
    )
    files = {
        # a function of another given file (found before this one) is not a class
        "pkg/a_helpers.py": "def md_factory(**kw: object) -> object:\n    return kw\n",
        "pkg/backend.py": src,
    }
    paths = _tree(tmp_path, files)
    result = audit_paths([str(tmp_path)])
    skipped = [n for n in result.notes if n.endswith("; skipped")]
    if what is None:
        assert skipped == [] and result.calls_skipped == 0
        return
    what = what.format(pkg=tmp_path / "pkg", root=tmp_path)
    line = _line_of(src, "return ")
    assert skipped == [
        f"{paths['pkg/backend.py']}:{line}: {callee}(...) in build copies 2 field(s) from "
        f"'fwd' but builds {what}; skipped"
    ]


def test_hint_lists_the_imported_classes_when_none_is_defined(tmp_path: Path) -> None:
    files = {
        "pkg/backend.py": """\
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from engine.builders import make_md
from .meta import Md
from .types import Plan
from ..shared import Cfg

def prepare(fwd):
    if fwd is None:
        raise ValueError("no batch")
    pool = ThreadPoolExecutor()
    table = OrderedDict()
    return Md(plan=Plan(), cfg=Cfg(), md=make_md(), pool=pool, table=table)
"""
    }
    result = _audit(tmp_path, files)
    (hint,) = [n for n in result.notes if n.startswith("hint:")]
    pkg = tmp_path / "pkg"
    assert hint.endswith(
        f"(used here: Cfg ({tmp_path}/shared.py), Md ({pkg}/meta.py), Plan ({pkg}/types.py))"
    )


# --------------------------------------------------------------------------- name lists


def test_field_lists_from_constants_and_declared_fields(tmp_path: Path) -> None:
    files = {
        "a_consts.py": 'SHARED = ("qsl", "slots", "track")\n',
        "base.py": FWD,
        "z_user.py": """\
import dataclasses
import settings
from dataclasses import dataclass, fields

import base
from a_consts import SHARED
from base import Fwd
from elsewhere import Mixin, Outside
from hybridmeta import fields_of

COPIED: tuple[str, ...] = ("qsl", "slots", "track", "flag")
FWD_FIELDS = dataclasses.fields(Fwd)

@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0

@dataclass(kw_only=True)
class Part(Mixin):
    qsl: object
    slots: object

def annotated_constant(fwd: Fwd) -> Fwd:
    return Fwd(**{k: getattr(fwd, k) for k in COPIED})

def imported_constant(fwd: Fwd) -> Fwd:
    return Fwd(**{k: getattr(fwd, k) for k in SHARED})

def by_fields(fwd: Fwd) -> Md:
    return Md(**{f.name: getattr(fwd, f.name) for f in fields(Fwd)})

def by_fields_of(fwd: Fwd) -> Md:
    return Md(**{f.name: getattr(fwd, f.name) for f in fields_of(Fwd)})

def by_dotted_class(fwd: Fwd) -> Md:
    return Md(**{f.name: getattr(fwd, f.name) for f in dataclasses.fields(base.Fwd)})

def module_attribute(fwd: Fwd) -> Fwd:
    return Fwd(**{k: getattr(fwd, k) for k in settings.FIELDS})

def fields_constant(fwd: Fwd) -> Md:
    return Md(**{f.name: getattr(fwd, f.name) for f in FWD_FIELDS})

def outside_class(fwd: Fwd) -> Md:
    return Md(**{f.name: getattr(fwd, f.name) for f in fields(Outside)})

def incomplete_class(fwd: Fwd) -> Md:
    return Md(**{f.name: getattr(fwd, f.name) for f in fields(Part)})
""",
    }
    result = _audit(tmp_path, files)
    assert _found(result) == [("imported_constant", "flag")]
    assert result.calls_checked == 5
    # Unknown name lists and classes that are not (completely) known: keys unknown.
    skipped = sorted(
        fn
        for n in result.notes
        for fn in re.findall(r"\(\.\.\.\) in (\w+) passes .*keys unknown", n)
    )
    assert skipped == ["fields_constant", "incomplete_class", "module_attribute", "outside_class"]


# --------------------------------------------------------------------------- construct, assign

ASSIGN = (
    FWD
    + """
def record(obj: object, what: str) -> None: ...

def convert(obj: object, name: str) -> object: ...

FIELDS = ("slots", "track")

@dataclass(kw_only=True)
class Other(Fwd):
    def set_track(self, fwd: Fwd) -> None:
        self.flag = fwd.flag

@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0

    def set_track(self, fwd: Fwd) -> None:
        self.track = fwd.track
        self._set_flag(fwd)

    def _set_flag(self, fwd: Fwd) -> None:
        self.flag = fwd.flag

    def fill(self, fwd: Fwd, depth: int) -> None:
        self.track = fwd.track
        if depth:
            self.fill(fwd, depth - 1)

    @staticmethod
    def check() -> None: ...

def other_by_method(fwd: Fwd) -> Other:
    o = Other(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
    o.set_track(fwd)
    return o

def by_method_chain(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    md.set_track(fwd)
    return md

def by_flag_method(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
    md._set_flag(fwd)
    return md

def by_recursive_method(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots, flag=fwd.flag)
    md.fill(fwd, 2)
    return md

def by_missing_method(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
    md.validate()
    return md

def assigned_and_by_method(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    md.track = fwd.track
    md.check()
    return md

def by_setattr(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl)
    setattr(md, "slots", fwd.slots)
    return md

def by_object_setattr(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl)
    object.__setattr__(md, "slots", fwd.slots)
    return md

def by_attribute(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl)
    md.slots = fwd.slots
    return md

def by_tuple(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    md.track, md.flag = fwd.track, fwd.flag
    return md

def not_an_assignment(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
    record(md, "flag")
    return md

def by_loop(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl)
    for name in FIELDS:
        setattr(md, name, getattr(fwd, name))
    return md

def by_loop_reset(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    for name in ("track",):
        setattr(md, name, None)
    return md

def by_loop_converted(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl)
    for name in FIELDS:
        setattr(md, name, convert(fwd, name))
    return md

def direct_then_loop(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    md.flag = fwd.flag
    for name in ("track",):
        setattr(md, name, getattr(fwd, name))
    return md

def by_pairs(fwd: Fwd, updates: dict[str, object]) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    for name, value in updates.items():
        setattr(md, name, value)
    return md
"""
)


def test_fields_assigned_after_construction(tmp_path: Path) -> None:
    result = _audit(tmp_path, {"m.py": ASSIGN})
    assert _found(result) == [
        ("assigned_and_by_method", "flag"),
        ("by_attribute", "flag"), ("by_attribute", "track"),
        ("by_loop", "flag"),
        ("by_loop_reset", "flag"),
        ("by_missing_method", "flag"),
        ("by_object_setattr", "flag"), ("by_object_setattr", "track"),
        # names set in a loop over unknown pairs are not known
        ("by_pairs", "flag"), ("by_pairs", "track"),
        ("by_setattr", "flag"), ("by_setattr", "track"),
        ("not_an_assignment", "flag"),
    ]  # fmt: skip
    # The source of every copy is fwd, named by its annotation (loops of setattr included).
    assert {f.message.split(" in ")[0] for f in result.findings} == {
        "Md(...) built from fwd (Fwd, declared)"
    }
    # by_loop_converted copies one field only (the rest is converted): not a copy.
    assert result.calls_checked == 15 and result.calls_skipped == 0
