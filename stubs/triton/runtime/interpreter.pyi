from collections.abc import Callable
from typing import Any

from .jit import _Grid

class InterpretedFunction:
    fn: Callable[..., None]
    def __init__(self, fn: Callable[..., None], **kwargs: Any) -> None: ...
    def __getitem__(self, grid: _Grid) -> Callable[..., Any]: ...
    # Calling an interpreted function from inside an interpreted kernel.
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
