"""The pytest plugin, used the way docs/testing.md tells an engine developer to use it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from hybridmeta.testing import PROFILES, register_profiles, resolve_settings

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = 'pytest_plugins = ["hybridmeta.testing.pytest_plugin"]\n'
USER_TESTS = '''
from examples.legacy_engine.harness import stale_tail_backend
from examples.legacy_engine.metadata import ForwardMetadata, prepare_decode_dropping
from hybridmeta.testing import TailFill


def test_stale(replay_check):
    replay_check(stale_tail_backend, fills=[TailFill.ZEROS])


def test_flow(field_flow_check):
    field_flow_check(ForwardMetadata, prepare_decode_dropping,
                     fields=("has_mamba_track_mask", "draft_token_num"))


def test_profile(hybridmeta_settings, hybridmeta_device):
    assert hybridmeta_settings.max_examples == 40  # the option beat $HYBRIDMETA_PROFILE
    assert hybridmeta_device.type in ("cpu", "cuda")
'''


def test_plugin_fixtures_and_profile_option(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_engine.py").write_text(USER_TESTS)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["HYBRIDMETA_PROFILE"] = "hybridmeta-thorough"  # the command-line option wins
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--hybridmeta-profile", "hybridmeta-ci", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "2 failed, 1 passed" in out, out
    assert "FAILED test_engine.py::test_stale" in out
    assert "FAILED test_engine.py::test_flow" in out
    assert "has_mamba_track_mask does not reach Mamba2Metadata" in out


def test_profiles_are_registered() -> None:
    register_profiles()
    for name in PROFILES:
        assert settings.get_profile(name).deadline is None
    assert settings.get_profile("hybridmeta-repro").derandomize
    assert resolve_settings().max_examples in (40, 100, 400)


def test_resolve_settings_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMETA_PROFILE", "hybridmeta-thorough")
    assert resolve_settings().max_examples == 400
    explicit = settings(max_examples=3)
    assert resolve_settings(explicit) is explicit
