"""pyproject.toml's promises: bounded ranges that hold the installed versions, every import
declared, one lowest Python everywhere.

The lower ends cannot be installed offline; ``make test-lowest`` checks them by hand.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _requirements() -> list[Requirement]:
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in extra]
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
