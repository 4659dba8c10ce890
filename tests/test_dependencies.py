"""pyproject.toml's promises: bounded ranges that hold the installed versions, every import
declared, one lowest Python everywhere, an extra with only what ``hybridmeta.testing``
needs, and ranges that install next to vLLM 0.33.0 and sglang 0.5.23.

The lower ends cannot be installed offline; ``make test-lowest`` checks them by hand.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PEERS: dict[str, Any] = json.loads((ROOT / "tests" / "peer_requirements.json").read_text())


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _is_self(req: Requirement) -> bool:
    return canonicalize_name(req.name) == "hybridmeta"


def _requirements() -> list[Requirement]:
    """Every requirement of pyproject.toml (an extra's ``hybridmeta[other]`` excluded)."""
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [req for r in extra if not _is_self(req := Requirement(r))]
    return reqs


def _install(extra: str) -> list[Requirement]:
    """What ``pip install hybridmeta[extra]`` asks for: the dependencies, the extra, and the
    extras it names through ``hybridmeta[...]``."""
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for r in extras[name]:
            req = Requirement(r)
            if _is_self(req):
                todo.extend(req.extras)
            else:
                reqs.append(req)
    return reqs


# The tools whose API breaks between minors are capped below the next minor, every other
# dependency below the next major; packaging (a test helper) is the one open range.
UNBOUNDED_OK = {"packaging"}


@pytest.mark.parametrize("req", _requirements(), ids=str)
def test_every_range_is_bounded_and_holds_the_installed_version(req: Requirement) -> None:
    ops = {spec.operator for spec in req.specifier}
    assert ">=" in ops, f"{req}: no lower bound"
    if req.name not in UNBOUNDED_OK:
        assert ops & {"<", "<=", "~=", "=="}, f"{req}: no upper bound"
    try:
        installed = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{req.name} is not installed here")
    # prereleases=True: a local build such as 2.13.0+cpu or a nightly still counts
    assert req.specifier.contains(installed, prereleases=True), (
        f"installed {req.name} {installed} is outside the declared range {req.specifier}"
    )


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files of src/hybridmeta that import it (stdlib and own excluded)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "src" / "hybridmeta").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "hybridmeta":
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared() -> None:
    declared = {canonicalize_name(r.name) for r in _requirements()}
    dists = importlib.metadata.packages_distributions()
    imports = _third_party_imports()
    assert {"torch", "triton", "attrs", "numpy", "safetensors", "typing_extensions"} <= set(imports)
    undeclared = {
        module: sorted(files)
        for module, files in imports.items()
        # a module of an installed distribution maps to it; else the module name is the
        # distribution name (mypy is imported by the plugin only when mypy runs)
        if not {canonicalize_name(d) for d in dists.get(module, [module])} & declared
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_one_lowest_python_everywhere() -> None:
    cfg = _pyproject()
    spec = cfg["project"]["requires-python"]
    assert spec.startswith(">="), spec
    lowest = spec.removeprefix(">=")
    assert cfg["tool"]["mypy"]["python_version"] == lowest
    assert cfg["tool"]["ruff"]["target-version"] == "py" + lowest.replace(".", "")
    assert sys.version_info >= tuple(int(x) for x in lowest.split("."))


# --------------------------------------------------------------------------- the extras

#: The suite's own tools: an engine that only uses the harness must not get them.
SUITE_TOOLS = {"mypy", "ruff", "transformers", "packaging"}


def test_the_harness_extra_holds_what_hybridmeta_testing_imports_and_nothing_more() -> None:
    base = {canonicalize_name(Requirement(r).name) for r in _pyproject()["project"]["dependencies"]}
    harness = {canonicalize_name(r.name) for r in _install("harness")} - base
    testing = {
        module
        for module, files in _third_party_imports().items()
        if any(f.startswith("src/hybridmeta/testing/") for f in files)
    }
    dists = importlib.metadata.packages_distributions()
    needed = {canonicalize_name(d) for m in testing for d in dists.get(m, [m])} - base
    assert needed == harness == {"hypothesis", "pytest"}, (needed, harness)
    assert not harness & SUITE_TOOLS


def test_the_test_extra_is_the_harness_plus_the_suite_tools() -> None:
    test = {canonicalize_name(r.name) for r in _install("test")}
    harness = {canonicalize_name(r.name) for r in _install("harness")}
    assert harness < test
    assert SUITE_TOOLS.issubset(test)


# --------------------------------------------------------------------------- next to the peers

#: Where the peers run: Linux x86-64, CPython at our lowest Python.
_ENV: dict[str, str] = {
    **{k: str(v) for k, v in default_environment().items()},
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({**_ENV, "extra": ""})


def _peer_requirements(peer: str) -> list[Requirement]:
    """The peer's requirements and those of the versions it pins of torch / transformers
    (torch pins triton)."""
    names = [peer, *PEERS["peers"][peer]]
    return [req for n in names for r in PEERS["requires"][n] if _applies(req := Requirement(r))]


def _compatible(ours: list[Requirement], theirs: list[Requirement]) -> dict[str, list[str]]:
    """Shared distribution -> the released versions both sides accept (empty: a conflict)."""
    by_name: dict[str, list[Requirement]] = {}
    for req in [*ours, *theirs]:
        if _applies(req):
            by_name.setdefault(canonicalize_name(req.name), []).append(req)
    shared = {canonicalize_name(r.name) for r in ours} & {
        canonicalize_name(r.name) for r in theirs
    }
    out: dict[str, list[str]] = {}
    for name in sorted(shared):
        released = PEERS["released"].get(name)
        assert released, f"tests/peer_requirements.json: no released versions of {name} recorded"
        out[name] = [
            v for v in released if all(r.specifier.contains(v, prereleases=False)
                                       for r in by_name[name])
        ]  # fmt: skip
    return out


@pytest.mark.parametrize("extra", ["harness", "test"])
@pytest.mark.parametrize("peer", sorted(PEERS["peers"]))
def test_every_shared_dependency_has_a_release_both_sides_accept(peer: str, extra: str) -> None:
    found = _compatible(_install(extra), _peer_requirements(peer))
    assert {"torch", "numpy"} <= found.keys()  # the check does compare something
    conflicts = {name: versions for name, versions in found.items() if not versions}
    assert not conflicts, (
        f"hybridmeta[{extra}] cannot install next to {peer}: no released version of "
        f"{sorted(conflicts)} satisfies both "
        + "; ".join(
            f"{name}: ours {[str(r.specifier) for r in _install(extra) if canonicalize_name(r.name) == name]}, "
            f"theirs {[str(r.specifier) for r in _peer_requirements(peer) if canonicalize_name(r.name) == name]}"
            for name in sorted(conflicts)
        )
    )


def test_the_peer_check_finds_a_conflict() -> None:
    # transformers>=5.24 (the range before this check) against sglang's ==5.19.0.
    ours = [Requirement("transformers>=5.24,<6"), Requirement("torch>=2.4,<3")]
    found = _compatible(ours, _peer_requirements("sglang==0.5.23"))
    assert found["transformers"] == [] and "2.14.1" in found["torch"]
    assert _compatible([Requirement("triton>=3.9,<3.10")], _peer_requirements("vllm==0.33.0")) == {
        "triton": []
    }, "torch 2.14.0 pins triton~=3.8.0"


def _online() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["harness", "test"])
@pytest.mark.parametrize("peer", sorted(PEERS["peers"]))
def test_pip_resolves_hybridmeta_next_to_the_peer(peer: str, extra: str, tmp_path: Path) -> None:
    """pip's own resolver, from the package indexes (nothing installed). It fetches the
    metadata of the peer's whole tree (the CUDA wheels' included) and takes 15 minutes or
    more on the CI machine, so it runs only when asked: HYBRIDMETA_RESOLVE_PEERS=1."""
    if os.environ.get("HYBRIDMETA_RESOLVE_PEERS") != "1":
        pytest.skip("set HYBRIDMETA_RESOLVE_PEERS=1 to run pip's resolver against the peers")
    if not _online():
        pytest.skip("no network: pip cannot reach the package index")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), peer, f"{ROOT}[{extra}]"],
        capture_output=True, text=True, timeout=1800, check=False,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    chosen: dict[str, str] = {
        str(canonicalize_name(i["metadata"]["name"])): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    assert chosen["hybridmeta"] == _pyproject()["project"]["version"]
    assert canonicalize_name(peer.split("==")[0]) in chosen
