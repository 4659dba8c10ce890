from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

@overload
def do_bench(
    fn: Callable[[], Any],
    warmup: float = ...,
    rep: float = ...,
    grad_to_none: Sequence[Any] | None = ...,
    quantiles: None = ...,
    return_mode: Literal["min", "max", "mean", "median", "all"] = ...,
) -> float: ...
@overload
def do_bench(
    fn: Callable[[], Any],
    warmup: float = ...,
    rep: float = ...,
    grad_to_none: Sequence[Any] | None = ...,
    *,
    quantiles: Sequence[float],
    return_mode: Literal["min", "max", "mean", "median", "all"] = ...,
) -> list[float]: ...
def do_bench_cudagraph(
    fn: Callable[[], Any],
    rep: int = ...,
    grad_to_none: Sequence[Any] | None = ...,
    quantiles: Sequence[float] | None = ...,
    return_mode: Literal["min", "max", "mean", "median", "all"] = ...,
) -> float: ...
