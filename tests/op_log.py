"""A dispatch-mode recorder shared by the tests that check which ops a call issues."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the name of every dispatcher op issued while active (``ops``), in order."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
