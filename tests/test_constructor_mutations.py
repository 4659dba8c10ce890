"""No keyword of a metadata constructor call in the data path can be dropped silently.

A mutation test over the library's own metadata construction: every call in ``src/`` that
builds a metadata class (``SomeMetadata(...)`` or ``Derived.evolve_from(...)``) in the
data-path modules is found with ``ast``; for each keyword of each call, the module is
re-executed with that one keyword removed and a forward is planned that exercises it
(a mixed batch with decode rows and every track kind). Every mutant must fail at
construction with an error; a mutant that runs is a keyword whose omission would silently
take a default (the seed defect of sglang #26877).
"""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import hybridmeta
import hybridmeta.model  # a submodule the package loads on first use: the test reads it directly
from hybridmeta.core import _is_metadata_class

SRC = Path(hybridmeta.__file__).resolve().parent
#: The modules that build metadata on the data path (the CLI demo is not one).
MODULES = ("model.py", "planner.py", "graphs/buffers.py", "runtime/engine.py", "runtime/model.py")

_METADATA_NAMES = frozenset(
    name
    for mod in (hybridmeta.model,)
    for name, obj in vars(mod).items()
    if isinstance(obj, type) and _is_metadata_class(obj)
)


@attrs.frozen
class Mutant:
    module: str
    line: int
    call: str
    keyword: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} {self.call}(... {self.keyword}=...)"


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name) and f.id in _METADATA_NAMES:
        return f.id
    if isinstance(f, ast.Attribute) and f.attr == "evolve_from":
        owner = f.value
        if isinstance(owner, ast.Name) and owner.id in _METADATA_NAMES:
            return f"{owner.id}.evolve_from"
    return None


def _mutants() -> Iterator[Mutant]:
    for rel in MODULES:
        tree = ast.parse((SRC / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _call_name(node)) is not None:
                for kw in node.keywords:
                    if kw.arg is not None:  # `**engine` passes the caller's own fields
                        yield Mutant(rel, node.lineno, name, kw.arg)


MUTANTS = list(_mutants())


def _mutated_module(m: Mutant) -> types.ModuleType:
    path = SRC / m.module
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.lineno == m.line and _call_name(node) == m.call:
            node.keywords = [k for k in node.keywords if k.arg != m.keyword]
    name = "hybridmeta." + m.module.removesuffix(".py").replace("/", ".")
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    exec(compile(tree, f"<mutant {m}>", "exec"), mod.__dict__)
    return mod


def _planner_scenario(planner: Any) -> object:
    """A mixed forward with prefill rows (on-grid, off-grid and final boundaries) and a
    decode row that reaches a boundary, and a verify forward of trees with tracked rows:
    every field of every constructor is exercised."""
    mixed = planner.plan_mixed_batch(
        extend_lens=[5, 4, 3, 1],
        prefix_lens=[2, 1, 5, 7],
        slots=[0, 1, 2, 3],
        num_decodes=1,
        chunk_size=4,
        conv_kernel=4,
        track_interval=4,
        track_mask=[True, True, True, True],
        track_slots=[10, 11, 12, 13],
    )
    verify = planner.plan_verify(
        slots=[0, 1],
        draft_token_num=3,
        track_mask=[True, False],
        track_slots=[10, -1],
        retrieve_parent_token=torch.tensor([[-1, 0, 0], [-1, 0, 1]]),
    )
    return mixed, verify


def _run_mutant(m: Mutant, monkeypatch: pytest.MonkeyPatch) -> object:
    mod = _mutated_module(m)
    if m.module == "model.py":
        # the mutant's classes and constructors, used by a planner built on them
        monkeypatch.setitem(sys.modules, "hybridmeta.model", mod)
        planner = _mutated_module(Mutant("planner.py", -1, "", ""))
        out = _planner_scenario(planner)
        fwd = mod.ForwardMetadata(
            query_start_loc=torch.arange(3),
            mamba_cache_indices=torch.tensor([1, 2]),
            is_target_verify=True,
        )
        verify = mod.prepare_target_verify(fwd)
        commit = mod.prepare_commit(
            verify, accepted_index=torch.tensor([0, 0]), track_token=torch.tensor([-1, -1])
        )
        return out, mod.prepare_decode(
            mod.ForwardMetadata(query_start_loc=torch.arange(3), mamba_cache_indices=torch.arange(2))
        ), verify, commit
    if m.module == "planner.py":
        return _planner_scenario(mod)
    raise AssertionError(f"no scenario for {m.module}: add one for its constructor calls")


def test_the_data_path_constructors_are_found() -> None:
    calls = {(m.module, m.call) for m in MUTANTS}
    assert ("planner.py", "ForwardMetadata") in calls
    assert ("planner.py", "Mamba2Metadata.evolve_from") in calls
    assert ("planner.py", "ChunkPlan") in calls
    assert ("model.py", "Mamba2Metadata.evolve_from") in calls
    assert ("model.py", "SpecCommitMetadata.evolve_from") in calls
    # the mixed and the verify forward share one constructor call (planner._forward)
    assert len({m.line for m in MUTANTS if (m.module, m.call) == ("planner.py", "ForwardMetadata")}) == 1
    # the runtime builds its metadata through the planner only: no constructor call there
    assert not any(m.module.startswith("runtime/") for m in MUTANTS)
    assert not any(m.module == "graphs/buffers.py" for m in MUTANTS)


def test_the_unmutated_scenario_runs() -> None:
    _planner_scenario(hybridmeta.planner)


@pytest.mark.parametrize("mutant", MUTANTS, ids=str)
def test_dropping_any_keyword_fails_at_construction(
    mutant: Mutant, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        _run_mutant(mutant, monkeypatch)
    assert mutant.keyword in str(info.value) or "missing" in str(info.value), str(info.value)
