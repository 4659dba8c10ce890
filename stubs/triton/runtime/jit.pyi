from collections.abc import Callable
from typing import Any

_Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]

class JITFunction:
    fn: Callable[..., None]
    # Per-device compilation caches: device -> (kernel cache dict, ...).
    device_caches: dict[Any, Any]
    def __getitem__(self, grid: _Grid) -> Callable[..., Any]: ...
    # Calling a jit function from inside another jit function.
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
