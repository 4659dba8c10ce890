"""Typing tests: mypy (with hybridmeta's plugin) must report exactly the expected errors.

Each file in ``cases/`` marks the lines that must fail with ``# E: <text>``; every other line
must type-check. The project's own mypy configuration (``pyproject.toml``) is used, so the
plugin is loaded the way an engine would load it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# mypy is a test dependency (the project's own type gate); a machine without it (the GPU
# image) skips these cases.
api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[2]
CASES = sorted((Path(__file__).parent / "cases").glob("*.py"))
_MARK = re.compile(r"#\s*E:\s*(?P<text>.+?)\s*$")
_REPORT = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): (?P<kind>error|note): (?P<msg>.*)$")


def _expected(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _MARK.search(line)
        if m:
            out[lineno] = m.group("text")
    return out


@pytest.fixture(scope="module")
def mypy_reports() -> dict[tuple[str, int], list[str]]:
    stdout, stderr, _ = api.run(
        ["--config-file", str(ROOT / "pyproject.toml"), "--no-error-summary", *map(str, CASES)]
    )
    assert not stderr, stderr
    reports: dict[tuple[str, int], list[str]] = {}
    for line in stdout.splitlines():
        m = _REPORT.match(line)
        if m is None:
            continue
        if m.group("kind") == "note" and not m.group("msg").startswith("Revealed type"):
            continue  # context notes ("... defined in ...") accompany an error already counted
        key = (Path(m.group("file")).name, int(m.group("line")))
        reports.setdefault(key, []).append(m.group("msg"))
    return reports


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_mypy_reports_exactly_the_marked_errors(
    case: Path, mypy_reports: dict[tuple[str, int], list[str]]
) -> None:
    expected = _expected(case)
    assert expected, f"{case.name} marks no expected error"
    got = {line: msgs for (name, line), msgs in mypy_reports.items() if name == case.name}
    for line, text in expected.items():
        msgs = got.get(line, [])
        assert len(msgs) == 1 and text in msgs[0], (
            f"{case.name}:{line}: expected {text!r}, got {msgs}"
        )
    unexpected = {line: msgs for line, msgs in got.items() if line not in expected}
    assert not unexpected, f"{case.name}: unexpected mypy reports {unexpected}"
