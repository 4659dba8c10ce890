"""Host-to-device staging of a forward's plan: one buffer, one copy, named views.

Plans are computed on the host (no device reads); their many small index arrays travel to
the device together: packed into one host buffer (page-locked when the target is a GPU, so
the copy is truly asynchronous), copied once with ``non_blocking=True``, and handed out as
views of the device copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
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
    arrays = [a if type(a) is np.ndarray else _host_array(name, a) for name, a in parts.items()]
    sizes = [a.size for a in arrays]
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
    if arrays:
        # One numpy pass writes every part into the (page-locked) buffer, cast on the way.
        np.concatenate([a.reshape(-1) for a in arrays], out=host.numpy(), casting="unsafe")
    flat = host.to(device, non_blocking=True)
    return {
        name: v if a.ndim == 1 else v.view(a.shape)  # split pieces are already 1-D
        for name, a, v in zip(parts, arrays, torch.split(flat, sizes), strict=True)
    }


def _host_array(name: str, a: torch.Tensor | npt.NDArray[Any]) -> npt.NDArray[Any]:
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise ValueError(
                f"to_device_packed: part {name!r} must be host data, got a tensor on {a.device}"
            )
        return a.detach().numpy()
    return np.asarray(a)
