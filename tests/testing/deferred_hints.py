"""A source class written the way vLLM writes many: ``from __future__ import annotations``
and a type imported only for the type checker, so its annotation is a string that does not
evaluate at run time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridmeta.core import BATCH, INDEX, Role, field, metadata, tensor_field

if TYPE_CHECKING:  # never true at run time
    from fractions import Fraction as SchedulerOutput


@dataclass(kw_only=True)
class DeferredSource:
    slots: torch.Tensor
    num_decodes: int
    scheduler_output: SchedulerOutput | None = None
    use_cascade: bool = False


@dataclass(kw_only=True)
class DeferredDerived(DeferredSource):
    num_prefills: int


def build(src: DeferredSource) -> DeferredDerived:
    return DeferredDerived(
        slots=src.slots, num_decodes=src.num_decodes, scheduler_output=src.scheduler_output,
        num_prefills=0,
    )  # fmt: skip


if TYPE_CHECKING:
    from torch import Tensor as DeviceTensor


@metadata
class DeferredMeta:
    """A metadata class with a tensor and a host field whose annotations do not evaluate."""

    slots: DeviceTensor = tensor_field(rows=BATCH, dtypes=INDEX, role=Role.WORKING_SLOT)
    scheduler_output: SchedulerOutput | None = field(default=None)
    count: int = field(default=1)
