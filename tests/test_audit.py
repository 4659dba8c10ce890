"""``hybridmeta audit``: static detection of constructors that drop fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hybridmeta.audit
from hybridmeta.audit import AuditError, audit_paths, main
from hybridmeta.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
#: The hybridmeta under test (a subprocess must import the same one).
SRC = Path(hybridmeta.audit.__file__).resolve().parents[1]

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
    path.parent.mkdir(parents=True, exist_ok=True)
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


# --------------------------------------------------------------------------- real code

MD = BASE + '''
@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0

    def finish(self, fwd: Fwd) -> None:
        self._more(fwd)

    def _more(self, fwd: Fwd) -> None:
        self.flag = fwd.flag
'''


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(
            "type Slots = list[int]\n\ndef first[T](xs: list[T]) -> T:\n    return xs[0]\n",
            marks=pytest.mark.skipif(sys.version_info >= (3, 12), reason="parses on 3.12+"),
            id="pep695",
        ),
        pytest.param("def f(:\n", id="broken"),
    ],
)
def test_an_unparseable_file_is_skipped_with_a_note(
    tmp_path: Path, code: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _write(tmp_path, "m.py", MD + '''
def prepare(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
''')
    bad = _write(tmp_path, "newer.py", code)
    result = audit_paths([str(tmp_path)])
    assert [(f.function, f.field) for f in result.findings] == [("prepare", "flag")]
    assert result.skipped_files == [bad] and result.files == [good]
    (note,) = [n for n in result.notes if bad in n]
    assert "cannot parse with Python" in note and "file skipped" in note
    assert main([str(tmp_path)]) == 1, "the other files are still audited"
    out = capsys.readouterr().out
    assert f"note: {bad}:" in out and "1 file(s) skipped" in out
    assert main(["--json", str(tmp_path)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["skipped_files"] == [bad] and data["files"] == [good]
    assert main([bad]) == 2, "nothing left to audit"
    assert "no file could be audited" in capsys.readouterr().err


def test_construct_then_assign_is_not_a_dropped_field(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", MD + '''
FIELDS = ("qsl", "slots")

def direct(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    md.track = fwd.track
    if fwd.flag:
        setattr(md, "flag", fwd.flag)
    return md

def by_method(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
    md.finish(fwd)  # Md.finish -> Md._more sets self.flag
    return md

def in_a_loop(fwd: Fwd) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots)
    for name in ("track", "flag"):
        object.__setattr__(md, name, getattr(fwd, name))
    return md

def on_another_object(fwd: Fwd, other: Md) -> Md:
    md = Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
    other.flag = fwd.flag
    return md
''')
    result = audit_paths([p])
    assert [(f.function, f.field) for f in result.findings] == [("on_another_object", "flag")]
    assert result.calls_checked == 4


def test_hand_listed_field_names_and_built_kwargs_are_resolved(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", MD + '''
import dataclasses

COPIED = ("qsl", "slots", "track")

class Builder:
    _SHARED = ["qsl", "slots"]

    def by_module_list(self, fwd: Fwd) -> Md:
        return Md(**{k: getattr(fwd, k) for k in COPIED}, n=1)

    def by_class_list(self, fwd: Fwd) -> Md:
        return Md(**{name: getattr(fwd, name) for name in self._SHARED + ["track"]})

    def by_kwargs(self, fwd: Fwd) -> Md:
        kw = dict(qsl=fwd.qsl, slots=fwd.slots)
        kw["track"] = fwd.track
        kw.update(n=1)
        return Md(**kw)

    def by_kwargs_complete(self, fwd: Fwd) -> Md:
        kw = {k: getattr(fwd, k) for k in COPIED}
        kw.setdefault("flag", fwd.flag)
        return Md(**kw)

    def by_declared_fields(self, fwd: Fwd) -> Md:
        return Md(**{f.name: getattr(fwd, f.name) for f in dataclasses.fields(Fwd)})

    def by_a_smaller_class(self, fwd: Fwd) -> Md:
        return Md(**{f.name: getattr(fwd, f.name) for f in dataclasses.fields(Pair)})

@dataclass
class Pair:
    qsl: object
    slots: object
''')
    # Another file's COPIED (a different list of the same name) is its own.
    other = _write(tmp_path, "other.py", '''
from m import Fwd, Md

COPIED = ["qsl", "slots", "track", "flag"]

def complete(fwd: Fwd) -> Md:
    return Md(**{k: getattr(fwd, k) for k in COPIED})
''')
    result = audit_paths([p, other])
    assert sorted((f.function, f.field) for f in result.findings) == [
        ("Builder.by_a_smaller_class", "flag"), ("Builder.by_a_smaller_class", "track"),
        ("Builder.by_class_list", "flag"), ("Builder.by_kwargs", "flag"),
        ("Builder.by_module_list", "flag"),
    ]  # fmt: skip
    assert result.calls_checked == 7 and result.calls_skipped == 0


def test_every_skipped_call_gets_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, "m.py", MD + '''
from engine.other import Elsewhere

class Backend:
    metadata_cls = Md

    def run_time_class(self, fwd: Fwd):
        return self.metadata_cls(qsl=fwd.qsl, slots=fwd.slots)

    def outside(self, fwd: Fwd):
        return Elsewhere(qsl=fwd.qsl, slots=fwd.slots)

    def opaque(self, fwd: Fwd, extra: dict) -> Md:
        kw = dict(qsl=fwd.qsl, slots=fwd.slots)
        kw.update(extra)
        return Md(**kw)

    def removed(self, fwd: Fwd) -> Md:
        kw = dict(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
        kw.pop("track")
        return Md(**kw)

def helper(a: object, b: object) -> None: ...

def not_a_class(fwd: Fwd) -> None:
    helper(qsl=fwd.qsl, slots=fwd.slots)  # a function of the given files: no note
''')
    result = audit_paths([p])
    assert result.findings == [] and result.calls_skipped == 4
    notes = "\n".join(result.notes)
    assert f"{p}:28: self.metadata_cls(...) in Backend.run_time_class copies 2 field(s) " \
        "from 'fwd' but builds a class chosen at run time (self.metadata_cls); skipped" in notes
    assert "Elsewhere(...) in Backend.outside copies 2 field(s) from 'fwd' but builds class " \
        "'Elsewhere', which is not defined in the given files (imported from engine.other: " \
        "pass engine/other.py); skipped" in notes
    assert "Md(...) in Backend.opaque passes **kw (built from extra: keys unknown): taken as " \
        "passing every field; skipped" in notes
    assert "Md(...) in Backend.removed passes **kw (kw.pop(...): keys unknown)" in notes
    assert "helper" not in notes
    assert "hint: classes built here but defined outside the given files: Elsewhere " \
        "(engine/other.py)" in notes
    main([p])
    out = capsys.readouterr().out
    assert out.count("; skipped") == 4 and "(4 skipped)" in out


def test_classes_defined_elsewhere_get_a_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, "backend.py", '''
from engine.metadata import ForwardMetadata, Mamba2Metadata
from engine.plans import Plan

def prepare(fwd: ForwardMetadata) -> Mamba2Metadata:
    return Mamba2Metadata(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track, plan=Plan(rows=3))
''')
    assert main([p]) == 0
    out = capsys.readouterr().out
    assert "0 class(es) resolved" in out
    assert "hint: no dataclass, attrs, NamedTuple or @hybridmeta.metadata class is defined in " \
        "the given files" in out
    assert "pass the files that define the metadata classes" in out
    assert "(used here: Mamba2Metadata (engine/metadata.py), Plan (engine/plans.py))" in out


def test_the_audit_command_does_not_import_torch(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", MD)
    code = (
        "import sys\n"
        "from hybridmeta.cli import main\n"
        f"rc = main(['audit', {p!r}])\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'numpy', 'hypothesis') if m in sys.modules)\n"
        "print('rc', rc, 'heavy', heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("rc 0 heavy []"), done.stdout


def test_the_package_loads_its_names_on_first_use() -> None:
    code = (
        "import sys, hybridmeta\n"
        "before = 'torch' in sys.modules\n"
        "md = hybridmeta.Mamba2Metadata\n"
        "print(before, 'torch' in sys.modules, md.__module__, 'plan_mixed_batch' in dir(hybridmeta))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "hybridmeta.model", "True"]
    import hybridmeta

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = hybridmeta.nope  # type: ignore[attr-defined]


def test_imports_decide_which_class_of_a_name_is_meant(tmp_path: Path) -> None:
    # Two engines' ForwardMetadata in the given files, and one from a package not given.
    (tmp_path / "eng").mkdir()
    (tmp_path / "eng" / "__init__.py").write_text("")
    _write(tmp_path, "eng/meta.py", BASE)
    _write(tmp_path, "a_other.py", '''
from dataclasses import dataclass

@dataclass(kw_only=True)
class Fwd:
    qsl: object
    slots: object
    spare: object = None
''')
    user = _write(tmp_path, "eng/backend.py", '''
from dataclasses import dataclass
from .meta import Fwd

@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0

def prepare(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
''')
    elsewhere = _write(tmp_path, "third.py", '''
from pkg.missing import Fwd
from a_other import Fwd as Spare

def copy(f: Spare) -> Fwd:
    return Fwd(qsl=f.qsl, slots=f.slots)

def renamed(f: Spare) -> Spare:
    return Spare(qsl=f.qsl, slots=f.slots)
''')
    result = audit_paths([str(tmp_path)])
    # eng/meta.py's Fwd (track, flag, hidden), not a_other.py's (spare, found first);
    # Spare is a_other.Fwd.
    assert sorted((f.path, f.function, f.field) for f in result.findings) == [
        (user, "prepare", "flag"), (elsewhere, "renamed", "spare"),
    ]  # fmt: skip
    (note,) = [n for n in result.notes if n.startswith(elsewhere)]
    assert "class 'Fwd', which is not defined in the given files (imported from pkg.missing: " \
        "pass pkg/missing.py)" in note
