"""pytest plugin for scripts/mutation.sh (loaded in the throw-away copy only).

mutmut 3 runs each mutant in a child forked from a process that has already imported
hybridmeta and the test modules, with the original code active. Everything that runs at
import (each ``@metadata`` class body runs ``core._build``, ``_make_validator``,
``_host_annotations``, ...; module-level classes in the tests; registries) would then keep
the original behaviour, and a mutant there could only be caught by classes a test builds
in its own body. In a child that tests a mutant, this plugin drops every module loaded
from the copy (hybridmeta, the tests, their conftest) before pytest loads the conftest
files, so the child imports them again with the mutant active (a fraction of a second:
torch and the other third-party modules stay loaded).

The package's modules the parent had loaded are imported again right away: a mutant that
breaks one of those imports (a class of the package refused at definition) is caught there
and the child exits with status 1 ("killed"); left to pytest, a conftest's failed import
is a usage error that mutmut does not expect from a mutant.
A mutant that breaks the import of a test module makes pytest stop at collection (exit
status 2, which mutmut reads as "interrupted"): also reported as a test failure.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest


def _testing_a_mutant() -> bool:
    return "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", "")


def _hide_stats_from_children() -> None:
    """In mutmut's stats run, keep the stats mode out of the environment that subprocesses
    inherit. A test that runs pytest in a subprocess from a temporary folder (the plugin's
    own tests do) would otherwise record trampoline hits there, where mutmut finds no
    configuration, and fail the stats run. The trampolines of this process read the mode
    from mutmut's process-local copy; the children run the original code."""
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    from mutmut.mutation import trampoline

    trampoline._mutant_under_test = "stats"
    del os.environ["MUTANT_UNDER_TEST"]


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    _hide_stats_from_children()
    if not _testing_a_mutant():
        return
    here = os.getcwd() + os.sep
    package = []  # the package's modules (under src/), as the parent process had them
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(here) and name != __name__:
            del sys.modules[name]
            if path.startswith(here + "src" + os.sep):
                package.append(name)
    try:
        for name in sorted(package):
            importlib.import_module(name)
    except Exception:
        os._exit(1)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "MUTANT_UNDER_TEST" not in os.environ:
        from mutmut.mutation import trampoline

        if trampoline._mutant_under_test == "stats":  # put back what mutmut set
            os.environ["MUTANT_UNDER_TEST"] = "stats"
    if _testing_a_mutant() and exitstatus == pytest.ExitCode.INTERRUPTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
