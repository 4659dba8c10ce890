"""The Makefile's install stamp: a change of the torch settings re-creates the venv.

Runs ``make`` in dry-run (``-n``) and question (``-q``) modes on a copy of the Makefile:
nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _install_as_make_would(project: Path, *args: str, target: str = "setup") -> None:
    """Create the stamp the recipe would touch, as if the install had run."""
    plan = _make(project, "-n", target, *args).stdout.splitlines()
    stamp = next(line.split()[1] for line in plan if line.startswith("touch "))
    (project / stamp).parent.mkdir(parents=True, exist_ok=True)
    (project / stamp).touch()


def test_the_stamp_tracks_every_torch_setting(project: Path) -> None:
    assert _make(project, "-q", "setup").returncode == 1  # fresh clone: install needed
    _install_as_make_would(project)
    assert _make(project, "-q", "setup").returncode == 0  # up to date
    for change in (
        "TORCH_SPEC=torch==2.11.0",
        "TORCH_SPEC=",
        "TORCH_INDEX=https://download.pytorch.org/whl/cpu",
        "USE_SYSTEM_TORCH=1",
    ):
        assert _make(project, "-q", "setup", change).returncode == 1, change
    _install_as_make_would(project, "USE_SYSTEM_TORCH=1")
    assert _make(project, "-q", "setup", "USE_SYSTEM_TORCH=1").returncode == 0
    # A newer pyproject.toml re-installs too. Its mtime is set past the stamp's
    # explicitly: a plain touch can land in the same tick of the file system's
    # clock as the stamp's, and make reads equal times as up to date.
    stamp = max((project / ".venv").glob(".installed-*"), key=lambda p: p.stat().st_mtime_ns)
    newer = stamp.stat().st_mtime_ns + 2_000_000_000
    os.utime(project / "pyproject.toml", ns=(newer, newer))
    assert _make(project, "-q", "setup", "USE_SYSTEM_TORCH=1").returncode == 1


def test_install_commands(project: Path) -> None:
    default = _make(project, "-n", "setup").stdout
    assert 'pip install -q  "torch==2.13.0"' in default
    assert "--system-site-packages" not in default
    assert "--clear" in default  # a changed setting never mixes with the old venv
    index = _make(project, "-n", "setup", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    assert '--index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"' in index.stdout
    system = _make(project, "-n", "setup", "USE_SYSTEM_TORCH=1").stdout
    assert "venv --clear --system-site-packages" in system
    # the system's torch is reused: the only pip step is the package itself
    assert _pip_lines(system) == [".venv/bin/python -m pip install -q -e '.[test]'"]
    unpinned = _make(project, "-n", "setup", "TORCH_SPEC=").stdout
    assert _pip_lines(unpinned) == [".venv/bin/python -m pip install -q -e '.[test]'"]


def _pip_lines(plan: str) -> list[str]:
    return [line for line in plan.splitlines() if "pip install" in line]


def test_test_runs_the_suite_then_mypy_then_ruff(project: Path) -> None:
    _install_as_make_would(project)
    _install_as_make_would(project, target="setup-vllm")
    plan = _make(project, "-n", "test").stdout.splitlines()
    assert plan == [
        ".venv/bin/python -m pytest -q",
        ".venv/bin/python -m mypy --strict",
        ".venv/bin/python -m ruff check .",
        # then the vLLM plugin's tests, in their own venv (docs/vllm.md)
        ".venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/integrations/vllm",
    ]
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("make test")
