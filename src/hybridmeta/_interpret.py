"""Where a Triton launch runs: compiled on CUDA tensors, interpreted on any other device.

The choice is made per launch, from the tensors' device, and changes nothing in the
process: ``import hybridmeta`` leaves ``os.environ`` alone, so an engine's own Triton
kernels keep compiling whatever the import order, and a kernel of hybridmeta launched on
CPU tensors still runs (in the Triton interpreter) after triton, vLLM or ``torch._dynamo``
was imported first.

How Triton decides. ``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a
function: unset, it makes a ``JITFunction`` (compiled for the active GPU); set, an
``InterpretedFunction`` (run by numpy on the host). Triton's own library functions
(``tl.sum``, ``tl.max``, ``tl.zeros``, ``tl.sigmoid``, ...) are decorated the same way at
``import triton``. An interpreted kernel may only call interpreted functions (a
``JITFunction`` called from Python raises "Cannot call @triton.jit'd outside of the scope of
a kernel"), which is why the environment variable had to be set before triton was imported.

What hybridmeta does instead (Triton 3.2 to 3.9: only ``InterpretedFunction(fn)``,
``fn[grid](...)`` and the public ``JITFunction`` type are used):

* every kernel stays what ``@triton.jit`` made it; a launch on CUDA tensors is the kernel's
  own, untouched (no lookup beyond one device check);
* the first launch of a kernel on CPU tensors builds its *interpreted twin*: an
  ``InterpretedFunction`` of a copy of the kernel's Python function whose globals are a
  snapshot of its module's, with every ``JITFunction`` in them (the kernel's helpers)
  replaced by that function's own twin, recursively. The module's globals are never
  changed, so a compiled launch in another thread sees the compiled kernel;
* for the duration of an interpreted launch, the ``JITFunction`` attributes of
  ``triton.language`` and its submodules (and the tensor methods such as ``x.sum()``) are
  their twins, exactly what ``TRITON_INTERPRET=1`` at import would have made them, and
  afterwards every attribute the launch changed in ``triton.language`` is put back (the
  interpreter's nested calls leave some of their own patches behind, which would break a
  later compile in the same process). Triton's interpreter patches ``triton.language``
  for every launch itself, so these launches are serialised by one lock, and a compile of
  a GPU kernel in another thread must not overlap one (as with Triton's interpreter
  alone).

``TRITON_INTERPRET=1`` set by the user keeps its meaning: the kernels are then
``InterpretedFunction`` already and every launch, on any device, is interpreted.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

__all__ = ["launchable", "runs_interpreted"]

K = TypeVar("K")

_LOCK = threading.RLock()
#: id(JITFunction) -> (the function, its interpreted twin); the function is held so that
#: its id is never reused.
_TWINS: dict[int, tuple[object, Any]] = {}


def _jit_types() -> tuple[type, type]:
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError as err:  # pragma: no cover - triton's interpreter needs numpy
        raise RuntimeError(
            "hybridmeta: Triton kernels on CPU tensors run in the Triton interpreter, which "
            f"could not be imported ({err}); install numpy or use impl='reference'"
        ) from err
    return JITFunction, InterpretedFunction


def _is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated as an ``InterpretedFunction`` (``TRITON_INTERPRET=1``)."""
    mod = sys.modules.get("triton.runtime.interpreter")
    return mod is not None and isinstance(kernel, mod.InterpretedFunction)


def runs_interpreted(kernel: object, device: torch.device) -> bool:
    """Whether a launch of ``kernel`` on tensors of ``device`` runs in the interpreter."""
    return device.type != "cuda" or _is_interpreted(kernel)


def launchable(kernel: K, device: torch.device) -> K:
    """``kernel`` as it launches on tensors of ``device``: itself on CUDA, else its twin.

    Use it where a kernel is launched: ``launchable(_my_kernel, x.device)[grid](...)``.
    """
    if device.type == "cuda" and not _is_interpreted(kernel):
        return kernel
    return _Interpreted(kernel)  # type: ignore[return-value]  # same [grid](...) protocol


class _Interpreted:
    """``kernel[grid](...)`` run by the interpreter, with Triton's library interpreted."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def run(*args: object, **kwargs: object) -> None:
            with _interpreted_library():
                twin(self.kernel)[grid](*args, **kwargs)

        return run


def twin(fn: object) -> Any:
    """The interpreted twin of a ``@triton.jit`` function (itself if already interpreted)."""
    jit_type, interp_type = _jit_types()
    if isinstance(fn, interp_type):
        return fn
    if not isinstance(fn, jit_type):
        raise TypeError(f"hybridmeta: {fn!r} is not a @triton.jit function")
    with _LOCK:
        return _twin(fn, jit_type, interp_type)


def _twin(fn: Any, jit_type: type, interp_type: type) -> Any:
    got = _TWINS.get(id(fn))
    if got is not None:
        return got[1]
    raw = fn.fn
    scope = dict(raw.__globals__)
    clone = types.FunctionType(raw.__code__, scope, raw.__name__, raw.__defaults__, raw.__closure__)
    clone.__kwdefaults__ = raw.__kwdefaults__
    clone.__annotations__ = dict(raw.__annotations__)
    clone.__qualname__ = raw.__qualname__
    clone.__module__ = raw.__module__
    clone.__doc__ = raw.__doc__
    clone.__dict__.update(raw.__dict__)
    result = interp_type(clone)
    _TWINS[id(fn)] = (fn, result)  # before the helpers: recursion ends at cycles
    for name, value in scope.items():
        if isinstance(value, jit_type) and not isinstance(value, interp_type):
            scope[name] = _twin(value, jit_type, interp_type)
    return result


def _library() -> list[type | types.ModuleType]:
    """``triton.language``, its loaded submodules and the classes they define."""
    owners: list[type | types.ModuleType] = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        owners.append(mod)
        for value in vars(mod).values():
            if isinstance(value, type) and value.__module__ == name:
                owners.append(value)
    return owners


@contextmanager
def _interpreted_library() -> Iterator[None]:
    """Inside: Triton's library functions are interpreted twins. After: ``triton.language``
    is as it was before (every changed attribute restored)."""
    jit_type, interp_type = _jit_types()
    import triton.language as tl

    with _LOCK:
        _import_lazy_modules()
        owners = _library()
        saved = [(owner, dict(vars(owner))) for owner in owners]
        try:
            for owner, attrs in saved:
                for name, value in attrs.items():
                    if not isinstance(value, jit_type) or isinstance(value, interp_type):
                        continue
                    t = _twin(value, jit_type, interp_type)
                    if owner is tl.tensor:
                        # A method, as ``TRITON_INTERPRET=1`` makes it (an interpreted
                        # function is not a descriptor): ``x.sum(axis=0)``.
                        setattr(owner, name, _method(t))
                    else:
                        setattr(owner, name, t)
            yield
        finally:
            for owner, attrs in saved:
                now = vars(owner)
                for name, value in attrs.items():
                    if now.get(name, _GONE) is not value:
                        setattr(owner, name, value)


_GONE = object()
#: Modules a launch may import lazily that read ``triton.language`` as they import (Triton
#: 3.9's Gluon asserts that ``tl.cdiv`` is a ``JITFunction``): imported before the library
#: is swapped for its twins.
_LAZY = ("triton.experimental.gluon",)
_lazy_done = False


def _import_lazy_modules() -> None:
    global _lazy_done
    if _lazy_done:
        return
    for name in _LAZY:
        with contextlib.suppress(ImportError):  # an older Triton without it
            importlib.import_module(name)
    _lazy_done = True


def _method(fn: Any) -> Callable[..., Any]:
    def method(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    method.__name__ = getattr(fn, "__name__", "method")
    return method
