"""Host-to-device staging of a forward's plan: one buffer, one copy, named views.

Plans are computed on the host (no device reads); their many small index arrays travel to
the device together: packed into one host buffer (page-locked when the target is a GPU, so
the copy is truly asynchronous), copied once with ``non_blocking=True``, and handed out as
views of the device copy.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["pack_arrays", "to_device_packed"]


def to_device_packed(
    parts: Mapping[str, torch.Tensor | npt.NDArray[Any]],
    device: torch.device,
    *,
    dtype: torch.dtype = torch.int64,
    as_bool: Collection[str] = (),
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
    as_bool : collection of str
        Parts staged as ``torch.bool`` instead (nonzero is ``True``), one byte each, in the
        same buffer after the others: a mask then needs no ``!= 0`` op on the device.
        Names that are not parts are ignored.

    Returns
    -------
    dict of str to torch.Tensor
        For each name, a view of the device copy with the part's shape.
    """
    arrays = [a if type(a) is np.ndarray else _host_array(name, a) for name, a in parts.items()]
    flags = [name in as_bool for name in parts] if as_bool else None
    return dict(zip(parts, pack_arrays(arrays, device, dtype, flags), strict=True))


def pack_arrays(
    arrays: Sequence[npt.NDArray[Any]],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
    as_bool: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """:func:`to_device_packed` over a sequence of numpy arrays: the views, in order
    (``as_bool``: per array, stage it as bool)."""
    if as_bool is None or not any(as_bool):
        sizes = [a.size for a in arrays]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
        if arrays:
            # One numpy pass writes every part into the (page-locked) buffer, cast on the way.
            np.concatenate([a.reshape(-1) for a in arrays], out=host.numpy(), casting="unsafe")
        views: Sequence[torch.Tensor] = host.to(device, non_blocking=True).split_with_sizes(sizes)
    else:
        ints = [a for a, b in zip(arrays, as_bool, strict=True) if not b]
        bools = [a for a, b in zip(arrays, as_bool, strict=True) if b]
        sizes = [a.size for a in ints]
        n_int = sum(sizes)
        bool_sizes = [a.size for a in bools]
        n_bool = sum(bool_sizes)
        words = -(-n_bool // dtype.itemsize)  # whole elements of the buffer's dtype
        host = torch.empty(n_int + words, dtype=dtype, pin_memory=device.type == "cuda")
        buf = host.numpy()
        if ints:
            np.concatenate([a.reshape(-1) for a in ints], out=buf[:n_int], casting="unsafe")
        # The masks, cast to bool on the way (nonzero: True), in the bytes after the rest.
        bytes_ = buf.view(np.bool_)
        head = n_int * dtype.itemsize
        np.concatenate(
            [a.reshape(-1) for a in bools], out=bytes_[head : head + n_bool], casting="unsafe"
        )
        flat = host.to(device, non_blocking=True)
        int_views = iter(flat.split_with_sizes([*sizes, words]))
        bool_views = iter(
            flat.view(torch.bool).split_with_sizes(
                [head, *bool_sizes, words * dtype.itemsize - n_bool]
            )[1:]
        )
        views = [next(bool_views) if b else next(int_views) for b in as_bool]
    return [
        v if a.ndim == 1 else v.view(a.shape)  # split pieces are already 1-D
        for a, v in zip(arrays, views, strict=True)
    ]


def _host_array(name: str, a: torch.Tensor | npt.NDArray[Any]) -> npt.NDArray[Any]:
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise ValueError(
                f"to_device_packed: part {name!r} must be host data, got a tensor on {a.device}"
            )
        return a.detach().numpy()
    return np.asarray(a)
