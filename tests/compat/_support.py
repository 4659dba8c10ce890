"""Shared helpers of the compat tests: signature comparison, tolerances, pool checks."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any

import torch

from tests.compat.peer_signatures import SIGNATURES
from tests.kernels._support import TOLERANCES, bits


def recorded(name: str) -> list[tuple[str, object]]:
    """(name, default or ``inspect.Parameter.empty``) of a recorded peer signature."""
    fn = ast.parse(f"def f({SIGNATURES[name]}): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args
    assert not args.kwonlyargs and args.vararg is None and args.kwarg is None
    names = [a.arg for a in args.args]
    defaults: list[object] = [inspect.Parameter.empty] * (len(names) - len(args.defaults))
    for d in args.defaults:
        defaults.append(eval(compile(ast.Expression(d), "<sig>", "eval"), {"float": float}))
    return list(zip(names, defaults, strict=True))


def assert_signature(fn: Callable[..., Any], name: str) -> None:
    """``fn``'s parameters equal the recorded peer signature: names, order, kinds, defaults."""
    params = list(inspect.signature(fn).parameters.values())
    got = [(p.name, p.default) for p in params]
    assert got == recorded(name), f"{name}: {got} != {recorded(name)}"
    kinds = {p.kind for p in params}
    assert kinds == {inspect.Parameter.POSITIONAL_OR_KEYWORD}, f"{name}: kinds {kinds}"


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within the peers' tolerance for ``actual``'s dtype (vLLM's / mamba_ssm's tests:
    fp32 ``rtol 3e-4, atol 1e-3``, bf16 ``1e-2, 5e-2``); NaN never passes."""
    assert not bool(torch.isnan(actual).any()), f"{what}: NaN"
    rtol, atol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.equal(bits(actual), bits(expected)), f"{what}: changed"
