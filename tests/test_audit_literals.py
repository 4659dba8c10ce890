"""``hybridmeta audit``: name lists, built ``**`` mappings, construct-then-assign, the choice
of source and class, and the driver's notes and output (small files in ``tmp_path``)."""

from __future__ import annotations

import ast
import json
import sys
import textwrap
from pathlib import Path

import pytest

from hybridmeta.audit import AuditError, AuditResult, audit_paths, main
from tests.test_audit import _write

HEAD = """
from dataclasses import dataclass, field

@dataclass(kw_only=True)
class Fwd:
    qsl: object
    slots: object
    track: object = None
    flag: bool = False

@dataclass(kw_only=True)
class Md(Fwd):
    n: int = 0
"""

#: The three names most cases below resolve to: ``Md`` built from them drops only ``flag``.
ALL = '("qsl", "slots", "track")'


def _audit(tmp: Path, body: str, **others: str) -> tuple[str, AuditResult]:
    """Audit ``HEAD + body`` as m.py, with the other files named by the keywords."""
    p = _write(tmp, "m.py", HEAD + textwrap.dedent(body))
    paths = [p] + [_write(tmp, f"{name}.py", text) for name, text in others.items()]
    return p, audit_paths(paths)


def _line_of(path: str, text: str) -> int:
    """The line of ``path`` where ``text`` first occurs."""
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if text in line)


def _dropped(result: AuditResult) -> list[str]:
    return [f.field for f in result.findings]


def _skip_note(result: AuditResult) -> str:
    """The one note of the one skipped call."""
    assert result.findings == [] and result.calls_skipped == 1 and result.calls_checked == 0
    (note,) = [n for n in result.notes if n.endswith("; skipped")]
    return note


def _comprehension(names: str, prelude: str = "", cls_body: str = "") -> str:
    """A method that builds ``Md`` from ``fwd`` over the name list ``names``."""
    return f"""
{prelude}

class Builder:
    {cls_body or "pass"}

    def build(self, fwd: Fwd) -> Md:
        return Md(**{{k: getattr(fwd, k) for k in {names}}})
"""


# --------------------------------------------------------------------------- name lists

LISTS = "BASE = ('qsl', 'slots')\nEXTRA = ('track',)\nALL = " + ALL


@pytest.mark.parametrize(
    ("body", "others"),
    [
        pytest.param(_comprehension('(*BASE, "track")', LISTS), {}, id="starred"),
        pytest.param(_comprehension("BASE + EXTRA", LISTS), {}, id="concatenated-names"),
        pytest.param(_comprehension('{"qsl", "slots"} | {"track"}'), {}, id="set-union"),
        *[
            pytest.param(_comprehension(f"{fn}(ALL)", LISTS), {}, id=f"{fn}-call")
            for fn in ("tuple", "list", "set", "frozenset", "sorted")
        ],
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                names = ("qsl", "slots", "track")
                return Md(**{k: getattr(fwd, k) for k in names})
            """,
            {},
            id="local-literal",
        ),
        pytest.param(
            LISTS + "\ndef build(fwd: Fwd) -> Md:\n    names = ALL\n"
            "    return Md(**{k: getattr(fwd, k) for k in names})\n",
            {},
            id="local-alias-of-a-module-list",
        ),
        pytest.param(_comprehension("NAMES", LISTS, "NAMES = ALL"), {}, id="class-constant"),
        pytest.param(_comprehension("self.NAMES", LISTS, "NAMES = ALL"), {}, id="self-constant"),
        pytest.param(
            LISTS
            + "\nclass Base:\n    NAMES = ALL\n"
            + _comprehension("self.NAMES").replace("class Builder:", "class Builder(Base):"),
            {},
            id="inherited-constant",
        ),
        pytest.param(
            LISTS + "\nclass Lists:\n    NAMES = ALL\n" + _comprehension("Lists.NAMES"),
            {},
            id="other-class-constant",
        ),
        pytest.param(
            LISTS + "\nclass Builder:\n    NAMES = ALL\n\n    @classmethod\n"
            "    def build(cls, fwd: Fwd) -> Md:\n"
            "        return Md(**{k: getattr(fwd, k) for k in cls.NAMES})\n",
            {},
            id="cls-constant",
        ),
        pytest.param(_comprehension("NAMES", LISTS + "\nNAMES = ALL"), {}, id="module-alias"),
        pytest.param(
            _comprehension("SHARED", "from lists import SHARED"),
            {"lists": f"SHARED = ALL\nALL = {ALL}\n"},
            id="imported-from-a-given-file",
        ),
    ],
)
def test_name_lists_written_in_any_supported_form_are_followed(
    tmp_path: Path, body: str, others: dict[str, str]
) -> None:
    _, result = _audit(tmp_path, body, **others)
    assert _dropped(result) == ["flag"], result.notes
    assert result.calls_checked == 1 and result.calls_skipped == 0


def test_same_named_classes_in_two_files_keep_their_own_lists(tmp_path: Path) -> None:
    # Both files define Builder with a NAMES of their own: each call reads its file's.
    other = """
from m import Fwd, Md

class Builder:
    NAMES = ("qsl", "slots", "track", "flag")

    def bare(self, fwd: Fwd) -> Md:
        return Md(**{k: getattr(fwd, k) for k in NAMES})

    def by_self(self, fwd: Fwd) -> Md:
        return Md(**{k: getattr(fwd, k) for k in self.NAMES})
"""
    body = f"""
class Builder:
    NAMES = {ALL}

    def bare(self, fwd: Fwd) -> Md:
        return Md(**{{k: getattr(fwd, k) for k in NAMES}})

    def by_self(self, fwd: Fwd) -> Md:
        return Md(**{{k: getattr(fwd, k) for k in self.NAMES}})
"""
    p, result = _audit(tmp_path, body, other=other)
    assert [(f.path, f.function, f.field) for f in result.findings] == [
        (p, "Builder.bare", "flag"), (p, "Builder.by_self", "flag"),
    ]  # fmt: skip
    assert result.calls_checked == 4


@pytest.mark.parametrize(
    ("body", "others"),
    [
        pytest.param(_comprehension('("qsl", "slots", "track", None)'), {}, id="not-a-string"),
        pytest.param(_comprehension("BASE + names()", LISTS), {}, id="concatenated-call"),
        pytest.param(_comprehension("names()"), {}, id="a-call"),
        pytest.param(
            """
            def build(fwd: Fwd, names: tuple[str, ...]) -> Md:
                return Md(**{k: getattr(fwd, k) for k in names})
            """,
            {},
            id="a-parameter",
        ),
        pytest.param(_comprehension('(*names(), "track")'), {}, id="starred-call"),
        pytest.param(_comprehension("sorted(ALL, key=len)", LISTS), {}, id="sorted-with-a-key"),
        pytest.param(_comprehension("constants.FIELDS", "import constants"), {}, id="module-attr"),
        pytest.param(
            _comprehension("SHARED", "from lists import SHARED"),
            {"lists": "SHARED = ('qsl',)\n", "more": "SHARED = ('slots',)\n"},
            id="two-given-files-define-it",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, long: bool) -> Md:
                names = ("qsl", "slots")
                if long:
                    names = ("qsl", "slots", "track")
                return Md(**{k: getattr(fwd, k) for k in names})
            """,
            {},
            id="reassigned",
        ),
        pytest.param(
            # A regression: the list was taken as its first assignment only, and `track`
            # and `flag` reported as dropped.
            """
            def build(fwd: Fwd) -> Md:
                names = ["qsl", "slots"]
                names += ["track", "flag"]
                return Md(**{k: getattr(fwd, k) for k in names})
            """,
            {},
            id="extended-in-place",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, names: list[str]) -> Md:
                names += ["track"]
                return Md(**{k: getattr(fwd, k) for k in names})
            """,
            {},
            id="parameter-extended-in-place",
        ),
        # Lists defined through themselves end (unknown) instead of recursing forever.
        pytest.param(_comprehension("CYC", 'CYC = (*CYC, "track")'), {}, id="cycle-starred"),
        pytest.param(_comprehension("CYC", 'CYC = CYC + ("track",)'), {}, id="cycle-left"),
        pytest.param(_comprehension("CYC", 'CYC = ("track",) + CYC'), {}, id="cycle-right"),
        pytest.param(_comprehension("CYC", "CYC = tuple(CYC)"), {}, id="cycle-call"),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                names = (*names, "track")
                return Md(**{k: getattr(fwd, k) for k in names})
            """,
            {},
            id="cycle-local",
        ),
        pytest.param(_comprehension("CYC", "", "CYC = (*CYC,)"), {}, id="cycle-class"),
        pytest.param(
            _comprehension("Lists.CYC", "class Lists:\n    CYC = Lists.CYC\n"), {}, id="cycle-attr"
        ),
        pytest.param(
            _comprehension("CYC", "from lists import CYC"),
            {"lists": "CYC = (*CYC, 'track')\n"},
            id="cycle-imported",
        ),
    ],
)
def test_name_lists_that_cannot_be_resolved_skip_the_call(
    tmp_path: Path, body: str, others: dict[str, str]
) -> None:
    p, result = _audit(tmp_path, body, **others)
    note = _skip_note(result)
    assert note.startswith(f"{p}:")
    assert "(keys unknown): taken as passing every field; skipped" in note


def test_a_method_of_a_class_defined_in_a_function_reads_no_class_constants(
    tmp_path: Path,
) -> None:
    # The class is not collected (it is local): its bare names are the module's.
    _, result = _audit(tmp_path, f"""
NAMES = {ALL}

def factory():
    class Local:
        def build(self, fwd: Fwd) -> Md:
            return Md(**{{k: getattr(fwd, k) for k in NAMES}})

    return Local
""")  # fmt: skip
    assert _dropped(result) == ["flag"]


def test_a_function_outside_a_class_with_a_self_parameter(tmp_path: Path) -> None:
    _, result = _audit(tmp_path, """
def build(self, fwd: Fwd) -> Md:
    return Md(**{k: getattr(fwd, k) for k in self.NAMES})
""")  # fmt: skip
    assert "keys unknown" in _skip_note(result)


def _list_chain(levels: int) -> tuple[str, dict[str, str]]:
    """Two name lists ``levels`` deep: one through a local, a call, a class constant, a
    starred element, module constants and both sides of ``+``; one through ``self.`` and
    a chain of imported constants."""
    assert levels in (8, 9)
    last = ('("qsl",) + ("slots",)' if levels == 8
            else 'LAST + ("slots",)\nLAST = ("qsl",)')  # fmt: skip
    mixed = f"""
FILE1 = FILE2 + ("track",)
FILE2 = {last}

class Builder:
    CLS_NAMES = (*FILE1,)

    def build(self, fwd: Fwd) -> Md:
        names = tuple(CLS_NAMES)
        return Md(**{{k: getattr(fwd, k) for k in names}})
"""
    hops = levels - 1
    chain = "".join(f"S{i} = S{i + 1}\n" for i in range(1, hops)) + f"S{hops} = {ALL}\n"
    by_import = """
from lists import S1

class Other:
    NAMES = S1

    def build(self, fwd: Fwd) -> Md:
        return Md(**{k: getattr(fwd, k) for k in self.NAMES})
"""
    return mixed + by_import, {"lists": chain}


@pytest.mark.parametrize(("levels", "resolved"), [(8, True), (9, False)])
def test_name_lists_nested_eight_deep_are_followed_and_nine_are_not(
    tmp_path: Path, levels: int, resolved: bool
) -> None:
    body, others = _list_chain(levels)
    _, result = _audit(tmp_path, body, **others)
    if resolved:
        assert _dropped(result) == ["flag", "flag"] and result.calls_skipped == 0
    else:
        assert result.findings == [] and result.calls_skipped == 2
        assert all("keys unknown" in n for n in result.notes)


# --------------------------------------------------------------------------- ** mappings


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots, "track": fwd.track}
                return Md(**kw)
            """,
            id="literal",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                base = {"qsl": fwd.qsl, "slots": fwd.slots}
                return Md(**{**base, "track": fwd.track})
            """,
            id="merged-literal",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                base = {"qsl": fwd.qsl, "slots": fwd.slots}
                return Md(**dict(base, track=fwd.track))
            """,
            id="dict-of-a-mapping",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                base = {"qsl": fwd.qsl, "slots": fwd.slots}
                return Md(**dict(**base, track=fwd.track))
            """,
            id="dict-of-unpacked",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                kw = {"qsl": fwd.qsl}
                kw["slots"] = fwd.slots
                kw["track"] = fwd.track
                return Md(**kw)
            """,
            id="items-assigned",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots}
                kw |= {"track": fwd.track}
                return Md(**kw)
            """,
            id="merged-in-place",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots}
                kw.update(track=fwd.track)
                return Md(**kw)
            """,
            id="updated-by-keyword",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                kw = {"qsl": fwd.qsl}
                kw.setdefault("slots", fwd.slots)
                kw.setdefault("track", fwd.track)
                return Md(**kw)
            """,
            id="setdefault",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots, "track": fwd.track}
                kw.setdefault("n")
                return Md(**kw)
            """,
            id="setdefault-without-a-value",
        ),
    ],
)
def test_built_mappings_pass_their_keys_and_copy_their_values(tmp_path: Path, body: str) -> None:
    _, result = _audit(tmp_path, body)
    assert _dropped(result) == ["flag"], result.notes
    assert result.calls_checked == 1


@pytest.mark.parametrize(
    ("body", "why"),
    [
        pytest.param(
            """
            def build(fwd: Fwd, **kw: object) -> Md:
                return Md(qsl=fwd.qsl, slots=fwd.slots, **kw)
            """,
            "**kw (the function's own **kw: keys unknown)",
            id="own-kwargs",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, extra: list[str]) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots}
                for name in extra:
                    kw[name] = getattr(fwd, name)
                return Md(**kw)
            """,
            "**kw (kw[name] = ... with a computed key: keys unknown)",
            id="computed-item",
        ),
        pytest.param(
            # A regression: the computed keys were ignored, and `track` and `flag`
            # reported as dropped.
            """
            def build(fwd: Fwd, extra: list[str]) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots}
                for k in extra:
                    kw.setdefault(k, getattr(fwd, k))
                return Md(**kw)
            """,
            "**kw (kw.setdefault(k, ...) with a computed key: keys unknown)",
            id="computed-setdefault",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots, "track": fwd.track}
                del kw["track"]
                return Md(**kw)
            """,
            "**kw (del kw['track']: keys unknown)",
            id="deleted-item",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, extra: dict[str, object]) -> Md:
                kw = {"qsl": fwd.qsl, "slots": fwd.slots}
                kw.update(**extra)
                return Md(**kw)
            """,
            "**kw (kw.update(**...): keys unknown)",
            id="updated-by-unpacking",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, key: str) -> Md:
                return Md(**{key: fwd.qsl, "slots": fwd.slots, "track": fwd.track})
            """,
            "**{key: fwd.qsl, 'slots': fwd.slots, 'track': fwd.track} (keys unknown)",
            id="computed-literal-key",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, pairs: list[tuple[str, object]]) -> Md:
                return Md(qsl=fwd.qsl, slots=fwd.slots, **{k: v for k, v in pairs})
            """,
            "**{k: v for k, v in pairs} (keys unknown)",
            id="comprehension-over-pairs",
        ),
        pytest.param(
            f"""
            def build(fwd: Fwd) -> Md:
                return Md(**{{k: getattr(fwd, k) for k in {ALL} if k != "track"}})
            """,
            "(keys unknown)",
            id="filtered-comprehension",
        ),
        pytest.param(
            f"""
            def build(fwd: Fwd) -> Md:
                return Md(qsl=fwd.qsl, slots=fwd.slots, **{{k.upper(): 0 for k in {ALL}}})
            """,
            "(keys unknown)",
            id="computed-comprehension-key",
        ),
        # Mappings rebuilt from themselves end (unknown) instead of recursing forever.
        pytest.param(
            """
            def build(fwd: Fwd, kw: dict[str, object]) -> Md:
                kw = {**kw, "qsl": fwd.qsl, "slots": fwd.slots}
                return Md(**kw)
            """,
            "**kw (built from {**kw, 'qsl': fwd.qsl, 'slots': fwd.slots}: keys unknown)",
            id="cycle-merged",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, kw: dict[str, object]) -> Md:
                kw = dict(kw, qsl=fwd.qsl, slots=fwd.slots)
                return Md(**kw)
            """,
            "**kw (built from dict(kw, qsl=fwd.qsl, slots=fwd.slots): keys unknown)",
            id="cycle-dict-of-a-mapping",
        ),
        pytest.param(
            """
            def build(fwd: Fwd, kw: dict[str, object]) -> Md:
                kw = dict(**kw, qsl=fwd.qsl, slots=fwd.slots)
                return Md(**kw)
            """,
            "**kw (built from dict(**kw, qsl=fwd.qsl, slots=fwd.slots): keys unknown)",
            id="cycle-dict-of-unpacked",
        ),
    ],
)
def test_mappings_with_unknown_keys_skip_the_call_and_say_why(
    tmp_path: Path, body: str, why: str
) -> None:
    p, result = _audit(tmp_path, body)
    note = _skip_note(result)
    assert note.startswith(f"{p}:") and "Md(...) in build passes " in note
    assert f"{why}: taken as passing every field; skipped" in note


def _dict_chain(levels: int) -> str:
    """``**kw`` ``levels`` deep through every way a mapping is built from another."""
    assert levels in (8, 9)
    inner = ('dict({"qsl": fwd.qsl, "slots": fwd.slots, "track": fwd.track})' if levels == 8
             else 'dict(k4)\n    k4 = {"qsl": fwd.qsl, "slots": fwd.slots, "track": fwd.track}')  # fmt: skip
    return f"""
def build(fwd: Fwd) -> Md:
    kw = {{**k1, "n": 1}}
    k1 = dict(k2)
    k2 = dict(**k3)
    k3 = {inner}
    return Md(**kw)
"""


@pytest.mark.parametrize(("levels", "resolved"), [(8, True), (9, False)])
def test_mappings_nested_eight_deep_are_followed_and_nine_are_not(
    tmp_path: Path, levels: int, resolved: bool
) -> None:
    _, result = _audit(tmp_path, _dict_chain(levels))
    if resolved:
        assert _dropped(result) == ["flag"] and result.calls_skipped == 0
    else:
        assert "keys unknown" in _skip_note(result)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("None", id="constant"),
        pytest.param('getattr(fwd, "old_" + k)', id="another-attribute"),
        pytest.param("defaults[k]", id="a-lookup"),
    ],
)
def test_a_comprehension_that_does_not_copy_by_name_is_not_a_copy(
    tmp_path: Path, value: str
) -> None:
    _, result = _audit(tmp_path, f"""
def build(fwd: Fwd, defaults: dict[str, object]) -> Md:
    return Md(**{{k: {value} for k in {ALL}}})
""")  # fmt: skip
    assert result.findings == [] and result.notes == []
    assert result.calls_checked == 0 and result.calls_skipped == 0


# --------------------------------------------------------------------------- construct, then assign


@pytest.mark.parametrize(
    ("body", "dropped"),
    [
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                md = Md(qsl=fwd.qsl, slots=fwd.slots)
                md.track, md.flag = fwd.track, fwd.flag
                return md
            """,
            [],
            id="unpacked-onto-the-result",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                md = Md(qsl=fwd.qsl, slots=fwd.slots)
                md.track, *md.flag = fwd.track, fwd.flag
                return md
            """,
            [],
            id="starred-onto-the-result",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                md: Md = Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
                md.flag = fwd.flag
                return md
            """,
            [],
            id="annotated-result",
        ),
        pytest.param(
            # Values assigned afterwards are copies too: three of them make the shape.
            """
            def build(fwd: Fwd) -> Md:
                md = Md(qsl=fwd.qsl)
                md.slots = fwd.slots
                md.track = fwd.track
                return md
            """,
            ["flag"],
            id="copies-assigned-afterwards",
        ),
        pytest.param(
            """
            class Holder:
                def build(self, fwd: Fwd) -> None:
                    self.md = Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
            """,
            ["flag"],
            id="stored-on-an-attribute",
        ),
        pytest.param(
            """
            def build(fwd: Fwd) -> Md:
                tmp = fwd.flag
                del tmp
                return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
            """,
            ["flag"],
            id="a-deleted-local",
        ),
    ],
)
def test_fields_assigned_after_the_call_are_passed(
    tmp_path: Path, body: str, dropped: list[str]
) -> None:
    _, result = _audit(tmp_path, body)
    assert _dropped(result) == dropped and result.calls_checked == 1, result.notes


# --------------------------------------------------------------------------- one call

PLAIN = """
from dataclasses import dataclass, field

@dataclass
class Src:
    qsl: object
    slots: object
    track: object = None
    flag: bool = False

@dataclass
class Dst(Src):
    n: int = 0
"""


@pytest.mark.parametrize(
    ("call", "dropped"),
    [
        pytest.param("Dst(s.qsl, s.slots, s.track)", ["flag"], id="three-positional"),
        pytest.param("Dst(s.qsl, s.slots, s.track, s.flag)", [], id="all-positional"),
        pytest.param("Dst(s.qsl, s.slots, flag=s.flag)", ["track"], id="mixed"),
    ],
)
def test_positional_arguments_pass_fields_in_order(
    tmp_path: Path, call: str, dropped: list[str]
) -> None:
    p = _write(tmp_path, "m.py", PLAIN + f"\ndef build(s: Src) -> Dst:\n    return {call}\n")
    result = audit_paths([p])
    assert _dropped(result) == dropped and result.calls_checked == 1


def test_starred_arguments_are_taken_as_passing_everything(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", PLAIN + """
def build(s: Src, head: list[object]) -> Dst:
    return Dst(*head, slots=s.slots, track=s.track)
""")  # fmt: skip
    note = _skip_note(audit_paths([p]))
    assert note == (
        f"{p}:{_line_of(p, 'return Dst(')}: Dst(...) in build passes *head: taken as passing every field; skipped"
    )


def test_the_source_is_the_name_copied_most(tmp_path: Path) -> None:
    _, result = _audit(tmp_path, """
def build(a: Fwd, z: Fwd) -> Md:
    return Md(qsl=a.qsl, slots=a.slots, track=z.track)
""")  # fmt: skip
    (f,) = result.findings
    assert (f.field, f.source_expr, f.source) == ("flag", "a", "Fwd")
    assert "Md(...) built from a (Fwd, declared) in build does not pass 'flag'" in f.message


def test_self_is_a_source_only_in_a_known_class(tmp_path: Path) -> None:
    _, result = _audit(tmp_path, """
@dataclass(kw_only=True)
class Plan:
    qsl: object
    slots: object
    track: object = None
    flag: bool = False

    def to_md(self) -> Md:
        return Md(qsl=self.qsl, slots=self.slots, track=self.track)

class Holder:
    qsl = slots = None

    def build(self) -> Md:
        return Md(qsl=self.qsl, slots=self.slots)

    @classmethod
    def make(cls) -> Md:
        return Md(qsl=cls.qsl, slots=cls.slots)
""")  # fmt: skip
    assert [(f.function, f.field, f.source_expr, f.source) for f in result.findings] == [
        ("Plan.to_md", "flag", "self", "Plan"),
    ]
    assert result.calls_checked == 1 and result.notes == []


INFERRED = """
from dataclasses import dataclass, field

@dataclass(kw_only=True)
class Small:
    qsl: object
    slots: object
    track: object = None

@dataclass(kw_only=True)
class Big(Small):
    n: int = 0

@dataclass(kw_only=True)
class Quad:
    a: int
    b: int
    c: int = 0
    d: int = 0

@dataclass(kw_only=True)
class Wide:
    v: int
    w: int
    x: int = 0
    y: int = 0
    z: int = 0
"""


def test_an_inferred_source_is_the_smallest_class_with_every_read_and_mostly_copied(
    tmp_path: Path,
) -> None:
    p = _write(tmp_path, "m.py", INFERRED + """
def exact(f) -> Big:
    # reads every field of Small (and some of Big's): Small, whose track is not passed
    return Big(qsl=f.qsl, slots=f.slots, n=len(f.track))

def half(f) -> Quad:
    return Quad(a=f.a, b=f.b)  # 2 of Quad's 4 fields: enough

def less_than_half(f) -> Wide:
    return Wide(v=f.v, w=f.w)  # 2 of 5: Wide is not taken
""")  # fmt: skip
    result = audit_paths([p])
    assert [(f.function, f.field, f.source) for f in result.findings] == [
        ("exact", "track", "Small"), ("half", "c", "Quad"), ("half", "d", "Quad"),
    ]  # fmt: skip
    assert "Quad(...) built from f (Quad, inferred) in half does not pass 'c'" in (
        result.findings[1].message
    )
    assert result.calls_checked == 2 and result.calls_skipped == 1
    assert result.notes == [
        f"{p}:{_line_of(p, 'return Wide(')}: Wide(...) copies from 'f' whose class is unknown (0 candidates); skipped"
    ]


def test_an_unknown_annotation_of_the_source_is_named_in_the_note(tmp_path: Path) -> None:
    p = _write(tmp_path, "m.py", INFERRED + """
from engine.meta import Outside

def build(src: Outside) -> Wide:
    return Wide(v=src.v, w=src.w)
""")  # fmt: skip
    result = audit_paths([p])
    assert result.notes == [
        f"{p}:{_line_of(p, 'return Wide(')}: Wide(...) copies from 'src' whose class is unknown (0 candidates; its "
        "annotation 'Outside' is not defined in the given files (imported from engine.meta: "
        "pass engine/meta.py)); skipped",
        "hint: classes built here but defined outside the given files: Outside "
        "(engine/meta.py); pass those files too to check these calls",
    ]


def test_only_init_fields_with_a_default_of_the_derived_class_are_reported(
    tmp_path: Path,
) -> None:
    p = _write(tmp_path, "m.py", """
from dataclasses import dataclass, field

@dataclass(kw_only=True)
class S3:
    a: int
    b: int
    cache: int = 0
    extra: int = 0
    flag: bool = False

@dataclass(kw_only=True)
class D3:
    a: int
    b: int
    cache: int = field(default=0, init=False)  # cannot be passed
    flag: bool = False  # extra: not a field of D3

def build(s: S3) -> D3:
    return D3(a=s.a, b=s.b)
""")  # fmt: skip
    assert _dropped(audit_paths([p])) == ["flag"]


def test_replace_findings_name_the_call(tmp_path: Path) -> None:
    _, result = _audit(tmp_path, """
from dataclasses import replace

@dataclass(kw_only=True)
class Cached:
    a: int
    hidden: int = field(default=0, init=False)

def bump(c: Cached) -> Cached:
    return replace(c, a=1)
""")  # fmt: skip
    (f,) = result.findings
    assert f.message == (
        "replace(c, ...) on Cached in bump: field 'hidden' is init=False, so it is not "
        "copied but reset to its default 0"
    )


def test_an_outside_class_copying_after_an_unknown_mapping_is_noted(tmp_path: Path) -> None:
    _, result = _audit(tmp_path, """
from engine.other import Elsewhere

def build(fwd: Fwd, opts: dict[str, object]):
    return Elsewhere(**opts, qsl=fwd.qsl, slots=fwd.slots)
""")  # fmt: skip
    note = _skip_note(result)
    assert note.endswith(
        "Elsewhere(...) in build copies 2 field(s) from 'fwd' but builds class 'Elsewhere', "
        "which is not defined in the given files (imported from engine.other: pass "
        "engine/other.py); skipped"
    )


# --------------------------------------------------------------------------- driver


def test_files_that_cannot_be_read_or_parsed_are_skipped_with_a_note(tmp_path: Path) -> None:
    good = _write(tmp_path, "a_good.py", HEAD)
    latin = tmp_path / "b_latin.py"
    latin.write_bytes(b"name = '\xe9t\xe9'\n")
    broken = _write(tmp_path, "c_broken.py", "def f(:\n")
    try:
        ast.parse("def f(:\n")
    except SyntaxError as e:
        msg = e.msg
    result = audit_paths([str(tmp_path)])
    assert result.files == [good] and result.skipped_files == [str(latin), broken]
    read, parse = result.notes[:2]
    assert read.startswith(f"{latin}: cannot read (") and read.endswith("); file skipped")
    assert "codec can't decode" in read
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert parse == (
        f"{broken}:1: cannot parse with Python {py} ({msg}); file skipped (syntax of a newer "
        "Python? run the audit with that Python)"
    )
    with pytest.raises(AuditError) as err:
        audit_paths([str(latin), broken])
    assert str(err.value) == f"hybridmeta audit: no file could be audited:\n{read}\n{parse}"


def test_a_closure_sees_the_annotations_of_its_enclosing_function(tmp_path: Path) -> None:
    # Fwd and Other both have qsl, slots and track: only the annotation tells them apart.
    _, result = _audit(tmp_path, """
@dataclass(kw_only=True)
class Other:
    qsl: object
    slots: object
    track: object = None
    spare: object = None

def outer(fwd: Fwd) -> Md:
    def inner() -> Md:
        def innermost() -> Md:
            return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
        return innermost()
    return inner()

def unannotated(fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track)
""")  # fmt: skip
    assert [(f.function, f.field) for f in result.findings] == [
        ("outer.inner.innermost", "flag"),
    ]
    assert "'fwd' whose class is unknown (2 candidates)" in _only_skip(result)


def _only_skip(result: AuditResult) -> str:
    (note,) = [n for n in result.notes if n.endswith("; skipped")]
    return note


def test_classes_with_bases_outside_the_given_files_are_named_with_where_to_find_them(
    tmp_path: Path,
) -> None:
    known = _write(tmp_path, "known.py", """
from dataclasses import dataclass

@dataclass
class Known:
    k: int = 0
""")  # fmt: skip
    p = _write(tmp_path, "m.py", """
from abc import ABC
from dataclasses import dataclass
from engine.base import Base
from known import Known
from .mixins import Mixin

@dataclass
class Complete:
    a: int = 0

@dataclass
class A(Known, Base, ABC):
    x: int = 0

@dataclass
class B(Mixin, Undefined):
    y: int = 0
""")  # fmt: skip
    (note,) = audit_paths([p, known]).notes
    assert note == (
        "classes with a base outside the given files (their inherited fields are not "
        "checked): A, B; pass the files defining their bases (Base from engine.base: "
        f"engine/base.py, Mixin from .mixins: {tmp_path / 'mixins.py'})"
    )
    only = _write(tmp_path, "only.py", """
from dataclasses import dataclass

@dataclass
class C(Undefined):
    y: int = 0
""")  # fmt: skip
    assert audit_paths([only]).notes == [
        "classes with a base outside the given files (their inherited fields are not checked): C"
    ]


def test_hints_name_the_classes_used_but_not_given(tmp_path: Path) -> None:
    bare = _write(tmp_path, "bare.py", "def f() -> int:\n    return 1\n")
    assert audit_paths([bare]).notes == [
        "hint: no dataclass, attrs, NamedTuple or @hybridmeta.metadata class is defined in "
        "the given files, so no constructor call can be checked: pass the files that define "
        "the metadata classes together with the code that builds them"
    ]
    _, result = _audit(tmp_path, """
from engine.other import Elsewhere
from far.away import Far

def one(fwd: Fwd):
    return Elsewhere(qsl=fwd.qsl, slots=fwd.slots)

def two(fwd: Fwd):
    return Far(qsl=fwd.qsl, slots=fwd.slots)
""")  # fmt: skip
    assert result.notes[-1] == (
        "hint: classes built here but defined outside the given files: Elsewhere "
        "(engine/other.py), Far (far/away.py); pass those files too to check these calls"
    )


CLEAN = (
    HEAD
    + """
def build(fwd: Fwd) -> Md:
    return Md(qsl=fwd.qsl, slots=fwd.slots, track=fwd.track, flag=fwd.flag)
"""
)


def test_main_help_describes_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: hybridmeta audit [-h] [--json] PATH [PATH ...] ")
    assert (
        "Find constructor calls that build one metadata class from another and leave source "
        "fields to silently take a default (static; imports nothing)." in out
    )
    assert "PATH Python files or directories" in out
    assert "--json print the findings as JSON" in out


def test_main_reads_sys_argv_and_prints_indented_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _write(tmp_path, "m.py", CLEAN)
    monkeypatch.setattr(sys, "argv", ["hybridmeta-audit", "--json", p])
    assert main() == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:3] == ["{", '  "version": 1,', '  "files": ['], out
    assert json.loads(out)["files"] == [p]
    monkeypatch.setattr(sys, "argv", ["hybridmeta-audit", p])
    assert main() == 0
    assert capsys.readouterr().out == (
        "hybridmeta audit: 0 finding(s); 1 constructor call(s) checked in 1 file(s), "
        "2 class(es) resolved\n"
    )
