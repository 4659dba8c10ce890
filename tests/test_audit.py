"""``hybridmeta audit``: static detection of constructors that drop fields."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from hybridmeta.audit import AuditError, audit_paths, main
from hybridmeta.cli import main as cli_main

BASE = '''
from dataclasses import dataclass, field

@dataclass(kw_only=True)
class Fwd:
    qsl: object
    slots: object
    track: object = None
    flag: bool = False
    hidden: int = field(default=0, init=False)
'''


def _write(tmp: Path, name: str, body: str) -> str:
    path = tmp / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _fields(paths: list[str]) -> list[tuple[str, str, str]]:
    return [(f.rule, f.function, f.field) for f in audit_paths(paths).findings]


def test_keyword_copy_with_a_missing_defaulted_field(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", BASE + '''
@dataclass(kw_only=True)
class Md(Fwd):
    n: int

def prepare(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track, n=1)
''')
    (f,) = audit_paths([p]).findings
    assert (f.rule, f.field, f.default, f.derived, f.source) == ("HM001", "flag", "False", "Md", "Fwd")
    assert f.line == 17 and f.function == "prepare"
    assert "does not pass 'flag': it silently takes the default False" in f.text()


def test_nested_function_checked_once_with_its_closure_types(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", BASE + '''
@dataclass(kw_only=True)
class Md(Fwd):
    n: int

def outer(fwd: Fwd) -> Md:
    def own(src: Fwd) -> Md:
        return Md(qsl=src.qsl, slots=src.slots, track=src.track, n=1)

    def closure() -> Md:
        return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track, n=2)

    return own(fwd) if fwd.flag else closure()
''')
    result = audit_paths([p])
    # One finding per call, named after the function that makes it; `fwd` is typed in the
    # enclosing function's scope.
    assert sorted(_fields([p])) == [
        ("HM001", "outer.closure", "flag"), ("HM001", "outer.own", "flag"),
    ]  # fmt: skip
    assert result.calls_checked == 2  # each constructor call once


def test_classes_resolve_across_files_and_through_inheritance(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.py", BASE)
    b = _write(tmp_path, "b.py", '''
from a import Fwd

class Mid(Fwd):
    pass

@dataclass(kw_only=True)
class Md(Mid):
    extra: int = 3

class Builder:
    @classmethod
    def make(cls, f):
        return Md(**{"qsl": f.qsl, "slots": f.slots}, flag=f.flag)
''')
    # f is unannotated: its class is the one known class with every attribute read.
    found = _fields([a, b])
    assert found == [("HM001", "Builder.make", "track")]
    assert audit_paths([b]).findings == [], "Fwd unknown without a.py: nothing to compare"


def test_cls_and_self_sources_and_namedtuples(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", '''
from typing import NamedTuple

class Plan(NamedTuple):
    a: int
    b: int = 0
    c: int = 1

    @classmethod
    def rebuild(cls, other: "Plan") -> "Plan":
        return cls(a=other.a, b=other.b)

    def copy(self) -> "Plan":
        return Plan(self.a, b=self.b, c=self.c)
''')
    assert _fields([p]) == [("HM001", "Plan.rebuild", "c")]


def test_replace_and_evolve_reset_init_false_fields(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", BASE + '''
import attrs

@attrs.define
class A:
    x: int
    cache: int = attrs.field(default=7, init=False)

def bump(fwd: Fwd, a: A):
    import dataclasses
    dataclasses.replace(fwd, flag=True)
    return attrs.evolve(a, x=1)
''')
    assert _fields([p]) == [("HM002", "bump", "hidden"), ("HM002", "bump", "cache")]


def test_opaque_mappings_and_single_reads_are_not_reported(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", BASE + '''
import dataclasses

@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0

def all_of(fwd: Fwd) -> Md:
    return Md(**dataclasses.asdict(fwd), n=1)

def one_read(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=None)
''')
    result = audit_paths([p])
    assert result.findings == []
    assert result.calls_checked == 0


def test_main_text_json_and_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path, "bad.py", BASE + '''
@dataclass(kw_only=True)
class Md(Fwd):
    n: int

def prepare(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track, n=1)
''')
    good = _write(tmp_path, "good.py", "x = 1\n")
    assert main([bad]) == 1
    out = capsys.readouterr().out
    assert f"{bad}:17:12: HM001 Md(...) built from fwd (Fwd, declared)" in out
    assert "1 finding(s); 1 constructor call(s) checked" in out
    assert main(["--json", bad]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["field"] == "flag" and data["findings"][0]["line"] == 17
    assert main([good]) == 0
    assert cli_main(["audit", good]) == 0, "the hybridmeta command dispatches to the audit"


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = _write(tmp_path, "broken.py", "def f(:\n")
    assert main([broken]) == 2
    assert "cannot parse" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.py")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main([]) == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(AuditError, match="no Python files"):
        audit_paths([str(tmp_path / "empty")])


def test_typevar_bounds_and_return_annotations_type_the_source(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", BASE + '''
from dataclasses import replace
from typing import TypeVar

M = TypeVar("M", bound="Fwd")

class Builder:
    def common(self) -> M:
        ...

    def build(self, md: M):
        fresh = self.common()
        replace(fresh, flag=True)
        return replace(md, flag=False)
''')
    result = audit_paths([p])
    assert [(f.rule, f.field, f.line) for f in result.findings] == [
        ("HM002", "hidden", 23), ("HM002", "hidden", 24)
    ]
    assert result.calls_checked == 2
