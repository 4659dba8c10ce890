"""How an op call picks its implementation and how a Triton launch is issued.

The implementation (the Triton kernel or the op's pure-torch reference) is a property of
the op call: the ``impl`` keyword of every public op, defaulting to the innermost
:func:`implementation` context, else ``"auto"``: Triton on a CUDA device, the reference
elsewhere (on the CPU Triton would only run interpreted). Nothing else in the library
(scheduler, prefix cache, runtime) knows or branches on it.

A Triton launch goes through its ``torch.library`` custom op whenever the dispatcher is
observed (:func:`observed`), so a ``TorchDispatchMode`` (the CPU CUDA-graph emulation,
fake tensors) sees each launch as one op with its mutated arguments declared; otherwise
the launcher is called directly (the custom op only adds host time).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Literal

import torch
from torch._C import _len_torch_dispatch_stack

__all__ = [
    "ALWAYS_DISPATCH",
    "Impl",
    "implementation",
    "no_output_fake",
    "observed",
    "on_device",
    "resolve",
]

#: ``"auto"``: Triton on CUDA, the reference elsewhere.
Impl = Literal["auto", "triton", "reference"]
_DEFAULT: contextvars.ContextVar[Impl] = contextvars.ContextVar("hybridmeta_impl", default="auto")
# The same default, per thread, for code torch.compile traces: Dynamo cannot read a
# context variable (a graph break) but reads and guards a thread-local attribute, so a
# compiled function recompiles when the block around it names another implementation.
_TRACED = threading.local()

#: Force every Triton launch through the torch dispatcher (tests compare the two paths).
ALWAYS_DISPATCH = False


@contextlib.contextmanager
def implementation(impl: Impl) -> Iterator[None]:
    """Make ``impl`` the default of every op call inside the block (thread- and task-local;
    in code that ``torch.compile`` traces, thread-local, and a change recompiles).

    Example: run the runtime's decode through the Triton kernels on the CPU interpreter::

        with hybridmeta.kernels.implementation("triton"):
            ...
    """
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(
            f"implementation: impl must be 'auto', 'triton' or 'reference', got {impl!r}"
        )
    token = _DEFAULT.set(impl)
    outer = getattr(_TRACED, "impl", "auto")
    _TRACED.impl = impl
    try:
        yield
    finally:
        _TRACED.impl = outer
        _DEFAULT.reset(token)


def resolve(op: str, impl: Impl | None, device: torch.device) -> Literal["triton", "reference"]:
    """The implementation an op call runs on tensors of ``device``."""
    if impl is not None:
        choice = impl
    elif torch.compiler.is_compiling():
        choice = getattr(_TRACED, "impl", "auto")
    else:
        choice = _DEFAULT.get()
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if choice == "triton":
        # On a device other than CUDA the launch runs in the Triton interpreter
        # (hybridmeta._interpret), decided per launch.
        return "triton"
    if choice == "reference":
        return "reference"
    raise ValueError(f"{op}: impl must be 'auto', 'triton' or 'reference', got {choice!r}")


def observed(t: torch.Tensor) -> bool:
    """Whether a launch must go through its ``torch.library`` op.

    It must whenever something could watch or transform it: ``torch.compile`` tracing, an
    active ``TorchDispatchMode`` (graph recording, fake tensors), or a tensor subclass.
    With none of those the op would only add dispatcher overhead (tens of microseconds of
    host time per call), so the kernel is launched directly; the launch is the same either
    way.

    ``torch.compiler.is_compiling()`` comes first: Dynamo folds it to ``True`` and traces
    nothing after it (the dispatch-mode stack is not something it can put in a graph: it
    would break the graph there).
    """
    return (
        torch.compiler.is_compiling()
        or ALWAYS_DISPATCH
        or type(t) is not torch.Tensor
        or _len_torch_dispatch_stack() > 0
    )


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' device."""
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def no_output_fake(*args: object, **kwargs: object) -> None:
    """The fake (meta) implementation of every hybridmeta op: each writes its declared
    mutated arguments in place and returns nothing, so under fake tensors there is
    nothing to compute."""
    return None
