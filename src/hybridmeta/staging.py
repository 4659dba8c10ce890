"""Host-to-device staging of a forward's plan: one buffer, one copy, named views.

Plans are computed on the host (no device reads); their many small index arrays travel to
the device together: packed into one host buffer (page-locked when the target is a GPU, so
the copy is truly asynchronous), copied once with ``non_blocking=True``, and handed out as
views of the device copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy.typing as npt
import torch

__all__ = ["to_device_packed"]


def to_device_packed(
    parts: Mapping[str, torch.Tensor | npt.NDArray[Any]],
    device: torch.device,
    *,
    dtype: torch.dtype = torch.int64,
) -> dict[str, torch.Tensor]:
    """Copy host arrays to ``device`` in one non-blocking copy.

    Parameters
    ----------
    parts : mapping of str to CPU tensor or numpy array
        The arrays, any shapes; each is cast to ``dtype``.
    device : torch.device
        Target device (a CPU target gets views of the packed host buffer).
    dtype : torch.dtype
        dtype of the packed buffer and of every returned view.

    Returns
    -------
    dict of str to torch.Tensor
        For each name, a view of the device copy with the part's shape.
    """
    tensors = {name: torch.as_tensor(a) for name, a in parts.items()}
    sizes = [t.numel() for t in tensors.values()]
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
    if sizes:
        torch.cat([t.reshape(-1).to(dtype) for t in tensors.values()], out=host)
    flat = host.to(device, non_blocking=True)
    return {
        name: v.view(t.shape)
        for (name, t), v in zip(tensors.items(), torch.split(flat, sizes), strict=True)
    }
