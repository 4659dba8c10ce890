"""Hypothesis settings profiles registered by :mod:`hybridmeta.testing`.

* ``hybridmeta-ci``: quick (40 examples, 8 steps per replay run), no deadline; the default.
* ``hybridmeta-dev``: a little more, for local iteration.
* ``hybridmeta-thorough``: 400 examples, 16 steps; for a GPU run with real CUDA graphs.
* ``hybridmeta-repro``: derandomized, no example database, as the documentation's quoted
  falsifying examples are produced.

===================  ========  =====  ===========  ========  ==========
profile              examples  steps  derandomize  database  print_blob
===================  ========  =====  ===========  ========  ==========
hybridmeta-ci        40        8      no           default   yes
hybridmeta-dev       100       10     no           default   yes
hybridmeta-thorough  400       16     no           default   yes
hybridmeta-repro     100       8      yes          none      no
===================  ========  =====  ===========  ========  ==========

``examples`` is ``max_examples``; ``steps`` is ``stateful_step_count`` (steps per replay
run); ``database`` ``default`` is the example database of Hypothesis's ``default``
profile, so a failure found once is tried first in the next run; ``print_blob`` ``yes``
prints Hypothesis's ``@reproduce_failure`` line under a failure. None has a deadline,
none runs Hypothesis's "explain" phase (its report points into the harness, not into the
backend), and all suppress the ``too_slow``, ``data_too_large`` and ``filter_too_much``
health checks. Every other setting is that of Hypothesis's ``default`` profile, not of
the profile loaded when :mod:`hybridmeta.testing` is imported (a conftest's own).

The profiles are registered once, when :mod:`hybridmeta.testing` is imported: a profile
you register again under one of these names afterwards (e.g.
``settings.register_profile("hybridmeta-ci", parent=settings.get_profile("hybridmeta-ci"),
max_examples=10)``) stays as you registered it. Pick one with
``settings.load_profile(...)``, the pytest option ``--hybridmeta-profile NAME`` (with the
plugin) or the environment variable ``HYBRIDMETA_PROFILE``; the harness functions also
take an explicit ``settings``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILES", "register_profiles", "resolve_settings"]

PROFILES: tuple[str, ...] = (
    "hybridmeta-ci",
    "hybridmeta-dev",
    "hybridmeta-thorough",
    "hybridmeta-repro",
)

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
_PHASES = tuple(p for p in Phase if p is not Phase.explain)
_registered = False


def _register(name: str, *, examples: int, steps: int, repro: bool = False) -> None:
    settings.register_profile(
        name,
        # Not the loaded profile (a conftest's own): every setting not given here is
        # Hypothesis's default, whatever was loaded when hybridmeta.testing was imported.
        parent=settings.get_profile("default"),
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=_SLOW_OK,
        phases=_PHASES,
        print_blob=not repro,
        derandomize=repro,
        database=None if repro else settings.get_profile("default").database,
    )


def register_profiles() -> None:
    """Register the hybridmeta profiles with Hypothesis (idempotent)."""
    global _registered
    if _registered:
        return
    _register("hybridmeta-ci", examples=40, steps=8)
    _register("hybridmeta-dev", examples=100, steps=10)
    _register("hybridmeta-thorough", examples=400, steps=16)
    _register("hybridmeta-repro", examples=100, steps=8, repro=True)
    _registered = True


def resolve_settings(explicit: settings | None = None) -> settings:
    """``explicit``, else the profile named by ``HYBRIDMETA_PROFILE``, else ``hybridmeta-ci``."""
    register_profiles()
    if explicit is not None:
        return explicit
    return settings.get_profile(os.environ.get("HYBRIDMETA_PROFILE", "hybridmeta-ci"))
