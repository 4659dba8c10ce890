"""The Hypothesis profiles of hybridmeta.testing are the ones its documentation describes.

Each test registers the profiles into a registry that holds none of them (as in a process
that has not imported hybridmeta.testing yet), so what it reads is what
``register_profiles`` registers, not what an earlier import left there; the registry, the
module's registered flag and ``HYBRIDMETA_PROFILE`` are put back afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings

from hybridmeta.testing import PROFILES, profiles, resolve_settings

_YES_NO = {"yes": True, "no": False}


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hypothesis's registry without hybridmeta's profiles, which are not yet registered, and
    a user's own profile loaded (as a conftest may load one before importing the plugin):
    with a deadline, no example database, no blob, quiet and one bug a run, none of which
    the hybridmeta profiles may take from it."""
    registry = settings._profiles  # Hypothesis's registry (private)
    assert isinstance(registry, dict) and "default" in registry
    kept = {name: got for name, got in registry.items() if name not in PROFILES}
    monkeypatch.setattr(settings, "_profiles", kept)
    monkeypatch.setattr(profiles, "_registered", False)
    monkeypatch.delenv("HYBRIDMETA_PROFILE", raising=False)
    loaded = settings._current_profile
    assert loaded in kept
    settings.register_profile(
        "user-loaded", deadline=1000, database=None, print_blob=False, max_examples=7,
        verbosity=Verbosity.quiet, report_multiple_bugs=False,
    )  # fmt: skip
    settings.load_profile("user-loaded")
    yield
    settings.load_profile(loaded)  # before monkeypatch puts the registry back


def documented_table() -> dict[str, dict[str, str]]:
    """The profile table of the module docstring: profile name -> column -> cell."""
    doc = profiles.__doc__ or ""
    lines = [line for line in doc.splitlines() if line.strip()]
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line)]
    assert len(rules) == 3, "the docstring's profile table (three ==== rules) is missing"
    header = lines[rules[0] + 1].split()
    rows = [line.split() for line in lines[rules[1] + 1 : rules[2]]]
    assert header[0] == "profile" and all(len(row) == len(header) for row in rows)
    return {row[0]: dict(zip(header[1:], row[1:], strict=True)) for row in rows}


@pytest.mark.usefixtures("fresh_registry")
def test_registered_profiles_match_the_documented_table() -> None:
    table = documented_table()
    assert tuple(table) == PROFILES  # every profile documented, and nothing else
    profiles.register_profiles()
    default_db = settings.get_profile("default").database
    assert default_db is not None
    for name, row in table.items():
        got = settings.get_profile(name)
        assert got.max_examples == int(row["examples"]), name
        assert got.stateful_step_count == int(row["steps"]), name
        assert got.derandomize is _YES_NO[row["derandomize"]], name
        assert got.print_blob is _YES_NO[row["print_blob"]], name
        if row["database"] == "none":
            assert got.database is None, name
        else:
            assert row["database"] == "default"
            assert got.database == default_db, name
    ci, dev = table["hybridmeta-ci"], table["hybridmeta-dev"]
    assert int(dev["examples"]) > int(ci["examples"])  # "dev: a little more"
    assert resolve_settings() is settings.get_profile("hybridmeta-ci")  # "ci: the default"


@pytest.mark.usefixtures("fresh_registry")
def test_every_profile_has_no_deadline_no_explain_and_tolerates_slow_runs() -> None:
    profiles.register_profiles()
    for name in PROFILES:
        got = settings.get_profile(name)
        assert got.deadline is None, name
        assert set(got.phases) == set(Phase) - {Phase.explain}, name
        slow = {HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much}
        assert slow <= set(got.suppress_health_check), name


@pytest.mark.usefixtures("fresh_registry")
def test_every_other_setting_is_hypothesis_default_not_the_loaded_profile() -> None:
    profiles.register_profiles()
    default = settings.get_profile("default")
    for name in PROFILES:
        got = settings.get_profile(name)
        assert got.verbosity == default.verbosity, name
        assert got.report_multiple_bugs == default.report_multiple_bugs, name


@pytest.mark.usefixtures("fresh_registry")
def test_a_profile_registered_again_after_import_is_kept() -> None:
    profiles.register_profiles()  # what importing hybridmeta.testing does
    mine = settings.get_profile("hybridmeta-ci")
    settings.register_profile("hybridmeta-ci", parent=mine, max_examples=3)
    assert resolve_settings().max_examples == 3  # not registered over again
    profiles.register_profiles()
    assert settings.get_profile("hybridmeta-ci").max_examples == 3
