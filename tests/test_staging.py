"""One-copy host-to-device staging of plan arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from hybridmeta.staging import to_device_packed


def _round_trip(device: torch.device) -> None:
    parts: dict[str, torch.Tensor | npt.NDArray[Any]] = {
        "a": torch.tensor([3, 1, 4]),
        "b": np.array([[1, 5], [9, 2]], dtype=np.int32),
        "empty": torch.zeros(0, dtype=torch.int64),
        "mask": np.array([True, False, True]),
    }
    out = to_device_packed(parts, device, dtype=torch.int32)
    assert list(out) == list(parts)
    for name, v in out.items():
        ref = torch.as_tensor(parts[name]).to(torch.int32)
        assert v.device.type == device.type
        assert v.dtype == torch.int32
        assert v.shape == ref.shape
        assert torch.equal(v.cpu(), ref), name
    # Views of one buffer: one copy, not one per part.
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()


def test_round_trip_cpu() -> None:
    _round_trip(torch.device("cpu"))


def test_no_parts() -> None:
    assert to_device_packed({}, torch.device("cpu")) == {}


@pytest.mark.gpu
def test_round_trip_cuda_pinned() -> None:
    _round_trip(torch.device("cuda", torch.cuda.current_device()))


def test_a_device_tensor_part_is_refused_by_name() -> None:
    parts: dict[str, torch.Tensor | npt.NDArray[Any]] = {
        "ok": np.arange(3),
        "elsewhere": torch.empty(3, dtype=torch.int64, device="meta"),
    }
    with pytest.raises(ValueError, match="part 'elsewhere' must be host data"):
        to_device_packed(parts, torch.device("cpu"))


def _as_bool_round_trip(device: torch.device) -> None:
    parts: dict[str, torch.Tensor | npt.NDArray[Any]] = {
        "a": np.array([3, 1, 4]),
        "mask": np.array([0, 2, 0, 1]),
        "b": torch.tensor([[1, 5], [9, 2]]),
        "flag": np.array([True]),
        "empty": np.zeros(0, dtype=np.int64),
    }
    for dtype in (torch.int64, torch.int32):
        out = to_device_packed(parts, device, dtype=dtype, as_bool={"mask", "flag", "absent"})
        assert list(out) == list(parts)
        assert out["mask"].dtype == torch.bool and out["flag"].dtype == torch.bool
        assert out["mask"].cpu().tolist() == [False, True, False, True]
        assert out["flag"].cpu().tolist() == [True]
        assert out["a"].dtype == dtype and out["a"].cpu().tolist() == [3, 1, 4]
        assert out["b"].dtype == dtype and out["b"].cpu().tolist() == [[1, 5], [9, 2]]
        assert out["empty"].shape == (0,)
        # the masks too are views of the one staged buffer
        base = out["a"].untyped_storage().data_ptr()
        assert {v.untyped_storage().data_ptr() for v in out.values()} == {base}


def test_as_bool_parts_cpu() -> None:
    _as_bool_round_trip(torch.device("cpu"))


@pytest.mark.gpu
def test_as_bool_parts_cuda_pinned() -> None:
    _as_bool_round_trip(torch.device("cuda", torch.cuda.current_device()))
