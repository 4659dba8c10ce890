"""Operations a step might issue during graph capture, and whether CUDA refuses them.

Each case is a function of one float tensor ``t`` (4 elements, on the capture's device).
``scripts/cuda_capture_refusals.py`` runs every case under real CUDA stream capture on a
GPU (one subprocess a case: a refused capture poisons the CUDA context) and writes
``cuda_capture_refusals.json`` beside this file; the CPU emulation must refuse exactly the
cases CUDA refuses (``tests/graphs/test_capture.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("cuda_capture_refusals.json")


def _bool_mask_assign(t: torch.Tensor) -> None:
    t[t > 0] = 0.0


CASES: dict[str, Callable[[torch.Tensor], object]] = {
    # reads a device value on the host
    "item": lambda t: t[0].item(),
    "bool": lambda t: bool(t[0]),
    "int": lambda t: int(t[0]),
    "float": lambda t: float(t[0]),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "to-cpu-nonblocking": lambda t: t.to("cpu", non_blocking=True),
    "any-bool": lambda t: bool((t > 0).any()),
    "equal": lambda t: torch.equal(t, t),  # identical tensors: answered from metadata
    "equal-copy": lambda t: torch.equal(t, t + 0),
    "allclose": lambda t: torch.allclose(t, t),
    # output size depends on device values
    "nonzero": lambda t: t.nonzero(),
    "argwhere": lambda t: torch.argwhere(t),
    "where-1arg": lambda t: torch.where(t > 0),
    "mask-index": lambda t: t[t > 0],
    "mask-assign": _bool_mask_assign,  # one value: a masked fill
    "mask-assign-values": lambda t: t.__setitem__(t > 0, t[2:] * 2),  # t > 0 holds 2 rows
    "masked_select": lambda t: torch.masked_select(t, t > 0),
    "unique": lambda t: torch.unique(t),
    "unique_consecutive": lambda t: torch.unique_consecutive(t),
    "repeat_interleave-tensor": lambda t: torch.repeat_interleave(
        t, torch.ones(4, dtype=torch.long, device=t.device)
    ),
    "bincount": lambda t: torch.bincount(t.long().abs()),
    # fixed shapes, no host read: capturable
    "sum": lambda t: t.sum(),
    "any": lambda t: (t > 0).any(),
    "masked_fill": lambda t: t.masked_fill(t > 0, 0.0),
    "where-3arg": lambda t: torch.where(t > 0, t, 0.0),
    "index_select": lambda t: t.index_select(0, torch.zeros(2, dtype=torch.long, device=t.device)),
    "index_copy_": lambda t: t.index_copy_(
        0, torch.zeros(1, dtype=torch.long, device=t.device), t[1:2] * 2
    ),
    "scatter_reduce_": lambda t: torch.full_like(t, -1.0).scatter_reduce_(
        0, torch.zeros(4, dtype=torch.long, device=t.device), t, reduce="amax"
    ),
    "cumsum": lambda t: torch.cumsum(t, 0),
    "sort": lambda t: torch.sort(t),
    "topk": lambda t: torch.topk(t, 2),
    "searchsorted": lambda t: torch.searchsorted(torch.sort(t).values, t),
    "repeat_interleave-int": lambda t: torch.repeat_interleave(t, 2),
    "clone": lambda t: t.clone(),
    "cat": lambda t: torch.cat([t, t]),
    "arange": lambda t: torch.arange(4, device=t.device),
    "zeros_like": lambda t: torch.zeros_like(t),
    "promote_types": lambda t: torch.empty(1, dtype=torch.promote_types(t.dtype, torch.bfloat16)),
}


def load_results() -> dict[str, bool]:
    """``{case: refused by CUDA capture}`` as measured on a GPU."""
    data = json.loads(RESULTS.read_text())
    refused: dict[str, bool] = data["refused"]
    return refused
