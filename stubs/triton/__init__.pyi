# Minimal hand-written stubs for the parts of Triton that hybridmeta uses.
# Triton ships no py.typed; these let mypy --strict check our kernels and launchers.
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

from . import language as language
from . import testing as testing
from .runtime.jit import JITFunction as JITFunction

__version__: str

@overload
def jit(fn: Callable[..., None], /) -> JITFunction: ...
@overload
def jit(
    *,
    do_not_specialize: Sequence[str | int] | None = ...,
    do_not_specialize_on_alignment: Sequence[str | int] | None = ...,
    debug: bool | None = ...,
    noinline: bool | None = ...,
    repr: Callable[..., str] | None = ...,
    launch_metadata: Callable[..., Any] | None = ...,
) -> Callable[[Callable[..., None]], JITFunction]: ...
def heuristics(
    values: Mapping[str, Callable[[dict[str, Any]], Any]],
) -> Callable[[JITFunction], JITFunction]: ...
def cdiv(x: int, y: int) -> int: ...
def next_power_of_2(n: int) -> int: ...
