"""Property-based tests for an engine's own Mamba2 decode path and metadata code.

Point hybridmeta's Hypothesis machinery at an existing backend, unchanged:

* :func:`check_replay` drives a :class:`GraphedDecodeBackend` (a few methods wrapping the
  engine's static buffers, refresh, captured forward and eager path) through captures and
  replays of random batches while every static buffer's stale tail is poisoned, and
  shrinks any disagreement with the eager reference to a minimal batch that names the
  rows and buffers involved. Real CUDA graphs on a GPU, the CPU emulation elsewhere.
* :func:`check_field_flow` / :func:`assert_field_flow` find the fields of a source
  metadata object that a hand-written constructor drops (and the ones that silently took
  a default), for dataclasses, attrs classes, ``NamedTuple`` and hybridmeta classes.
* :mod:`hybridmeta.testing.strategies`: batches, stale-tail fillers, draft trees and
  instances of any ``@hybridmeta.metadata`` class.
* :mod:`hybridmeta.testing.pytest_plugin`: fixtures and the ``--hybridmeta-profile``
  option; :mod:`hybridmeta.testing.profiles`: the registered Hypothesis profiles.

See ``docs/testing.md`` for a ten-minute walk-through.
"""

from hybridmeta.testing.backend import GraphedDecodeBackend, Reference
from hybridmeta.testing.flow import (
    FieldFlowError,
    FieldFlowUsageError,
    FlowFailure,
    FlowReport,
    assert_field_flow,
    check_field_flow,
    sentinel_instances,
)
from hybridmeta.testing.profiles import PROFILES, register_profiles, resolve_settings
from hybridmeta.testing.replay import ReplayFailure, check_replay, replay_machine
from hybridmeta.testing.strategies import (
    Batch,
    DraftTree,
    TailFill,
    batches,
    draft_trees,
    fill_tail,
    metadata_instances,
    tail_fills,
)

register_profiles()

__all__ = [
    "PROFILES",
    "Batch",
    "DraftTree",
    "FieldFlowError",
    "FieldFlowUsageError",
    "FlowFailure",
    "FlowReport",
    "GraphedDecodeBackend",
    "Reference",
    "ReplayFailure",
    "TailFill",
    "assert_field_flow",
    "batches",
    "check_field_flow",
    "check_replay",
    "draft_trees",
    "fill_tail",
    "metadata_instances",
    "register_profiles",
    "replay_machine",
    "resolve_settings",
    "sentinel_instances",
    "tail_fills",
]
