"""The per-launch interpreter choice (``hybridmeta._interpret``).

This suite imports triton without ``TRITON_INTERPRET``, so Triton's library functions
(``tl.sum``, ``tl.zeros``, ...) are compiled ``JITFunction`` objects here: exactly the
situation of an engine that imported triton before hybridmeta.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable, runs_interpreted, twin


@triton.jit  # type: ignore[arg-type]  # a helper returning a block; the stub types kernels
def _scaled(x: tl.tensor, s: tl.constexpr) -> tl.tensor:
    return x * s


@triton.jit
def _library_kernel(x_ptr: tl.tensor, o_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr) -> None:
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    total = tl.sum(_scaled(x, 2.0), axis=0)  # a library reduction of a helper's result
    top = tl.max(tl.where(m, x, float("-inf")), axis=0)
    low = x.sum(axis=0)  # type: ignore[attr-defined]  # a tensor method bound to tl.sum
    b = tl.zeros([BLOCK], dtype=tl.float32) + total + top * 100.0 + low * 10000.0
    tl.store(o_ptr + o, tl.sigmoid(b * 0.0) * b * 2.0, mask=m)  # sigmoid(0) * 2 == 1


# Captured at import, before any launch could have built a twin.
_DECORATED = {"_library_kernel": _library_kernel, "_scaled": _scaled}


def _expected(x: torch.Tensor) -> torch.Tensor:
    value = 2.0 * x.sum() + 100.0 * x.max() + 10000.0 * x.sum()
    return torch.full_like(x, float(value))


def _launch(x: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    launchable(_library_kernel, x.device)[(1,)](x, out, x.shape[0], BLOCK=8)
    return out


def _snapshot() -> dict[tuple[str, str], object]:
    """Every attribute of triton.language, its loaded submodules and their classes."""
    snap: dict[tuple[str, str], object] = {}
    for name, mod in list(sys.modules.items()):
        if not isinstance(mod, types.ModuleType) or not name.startswith("triton.language"):
            continue
        for key, value in vars(mod).items():
            snap[(name, key)] = value
            if isinstance(value, type) and value.__module__ == name:
                for ckey, cvalue in vars(value).items():
                    snap[(f"{name}.{key}", ckey)] = cvalue
    return snap


def test_a_kernel_on_cpu_tensors_runs_interpreted_with_triton_library_and_helpers() -> None:
    x = torch.tensor([1.0, -2.0, 3.5, 0.25, 4.0])
    torch.testing.assert_close(_launch(x), _expected(x))


def test_an_interpreted_launch_leaves_triton_language_as_it_was() -> None:
    """The interpreter's nested calls patch triton.language.core's builtins and never undo
    it; left so, a later compile in the process would emit interpreter calls."""
    _launch(torch.ones(3))  # lazy imports of a first launch happen before the snapshot
    before = _snapshot()
    _launch(torch.arange(4.0))
    after = _snapshot()
    changed = sorted(k for k in before if after.get(k, before) is not before[k])
    assert changed == []


def test_the_twin_leaves_the_kernels_module_alone() -> None:
    mod = sys.modules[__name__]
    _launch(torch.ones(2))
    for name, decorated in _DECORATED.items():
        assert vars(mod)[name] is decorated, name
    assert twin(_library_kernel) is twin(_library_kernel)  # built once


def test_the_choice_follows_the_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert runs_interpreted(_library_kernel, cpu)
    if type(_library_kernel).__name__ == "JITFunction":
        assert launchable(_library_kernel, cuda) is _library_kernel
        assert not runs_interpreted(_library_kernel, cuda)
    assert launchable(_library_kernel, cpu) is not _library_kernel


def test_twin_refuses_what_is_not_a_triton_function() -> None:
    with pytest.raises(TypeError, match=r"not a @triton\.jit function"):
        twin(_expected)


@pytest.mark.gpu
def test_an_interpreted_launch_then_a_compiled_one_in_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPU tensors (interpreted) and CUDA tensors (compiled) in one process, in both
    orders: the interpreted launch leaves nothing behind that the compile would read."""
    monkeypatch.setenv("TRITON_ALWAYS_COMPILE", "1")  # a cached binary would skip codegen
    x = torch.tensor([1.0, -2.0, 3.5, 0.25, 4.0])
    torch.testing.assert_close(_launch(x), _expected(x))
    torch.testing.assert_close(_launch(x.cuda()).cpu(), _expected(x))
    torch.testing.assert_close(_launch(x * 2), _expected(x * 2))
