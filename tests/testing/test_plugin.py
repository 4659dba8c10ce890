"""The pytest plugin, used the way docs/testing.md tells an engine developer to use it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from hybridmeta.testing import PROFILES, pytest_plugin, resolve_settings

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = 'pytest_plugins = ["hybridmeta.testing.pytest_plugin"]\n'
USER_TESTS = """
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
"""


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


def test_resolve_settings_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMETA_PROFILE", "hybridmeta-thorough")
    assert resolve_settings().max_examples == 400
    explicit = settings(max_examples=3)
    assert resolve_settings(explicit) is explicit


# The plugin's hooks in this process (the test above runs them in a child pytest only).


def plugin_config(*args: str) -> pytest.Config:
    """A pytest Config with only the plugin's option, parsed from ``args`` as pytest does."""
    config = pytest.Config(pytest.PytestPluginManager())
    pytest_plugin.pytest_addoption(config._parser)
    config._parser.parse(list(args), namespace=config.option)
    return config


def test_profile_option_takes_each_profile_and_refuses_other_names() -> None:
    for name in PROFILES:
        assert plugin_config("--hybridmeta-profile", name).getoption("--hybridmeta-profile") == name
    assert plugin_config().getoption("--hybridmeta-profile") is None
    with pytest.raises(pytest.UsageError, match="invalid choice: 'hybridmeta-fast'"):
        plugin_config("--hybridmeta-profile", "hybridmeta-fast")


def test_profile_option_help_tells_the_truth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # no line wrapping in the help
    monkeypatch.delenv("HYBRIDMETA_PROFILE", raising=False)
    lines = [line for line in plugin_config()._parser.optparser.format_help().splitlines() if line]
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("--hybridmeta-profile"))
    package = pytest_plugin.__name__.partition(".")[0]
    assert lines[at - 1] == f"{package}:"  # listed under the package's own section
    help_text = " ".join(lines[at:])
    default = re.search(r"\(default: ([\w-]+)", help_text)
    assert default, help_text
    assert resolve_settings() is settings.get_profile(default[1])  # the default it names
    variable = re.search(r"\$(\w+)", help_text)
    assert variable, help_text
    monkeypatch.setenv(variable[1], "hybridmeta-thorough")  # the variable it names
    assert resolve_settings() is settings.get_profile("hybridmeta-thorough")


def test_configure_hands_the_chosen_profile_to_the_fixtures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRIDMETA_PROFILE", "hybridmeta-dev")
    pytest_plugin.pytest_configure(plugin_config("--hybridmeta-profile", "hybridmeta-thorough"))
    assert resolve_settings() is settings.get_profile("hybridmeta-thorough")  # option wins
    monkeypatch.setenv("HYBRIDMETA_PROFILE", "hybridmeta-dev")
    pytest_plugin.pytest_configure(plugin_config())  # no option: the variable stands
    assert os.environ["HYBRIDMETA_PROFILE"] == "hybridmeta-dev"
    monkeypatch.delenv("HYBRIDMETA_PROFILE")
    pytest_plugin.pytest_configure(plugin_config())
    assert "HYBRIDMETA_PROFILE" not in os.environ
