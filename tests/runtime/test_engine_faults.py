"""The reference runtime reads the kernels' error record at its existing sync points (the
step's token transfer) and raises the fault there."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.kernels import (
    SlotIndexError,
    check_errors,
    reset_errors,
    track_save_reference,
)
from hybridmeta.runtime.engine import Runtime, RuntimeOptions
from hybridmeta.runtime.model import NemotronH


def _fault() -> None:
    """A fault on the device path (a captured step would record it the same way)."""
    pool = torch.zeros(1, 2, 1, 1, 1)
    track_save_reference(
        torch.zeros(1, 2, 1, 1), pool, torch.tensor([0]), torch.tensor([7]), torch.tensor([True])
    )


def _opts(**kw: object) -> RuntimeOptions:
    base: dict[str, object] = {
        "num_working": 2, "num_track": 4, "max_len": 64, "track_interval": 16,
        "max_prefill_tokens": 32, "use_graphs": True,
    }  # fmt: skip
    base.update(kw)
    return RuntimeOptions(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_a_recorded_fault_raises_at_the_steps_sync_point(
    tiny_model: NemotronH, overlap: bool
) -> None:
    rt = Runtime(tiny_model, _opts(overlap_decode=overlap))
    rt.submit(list(range(1, 9)), 6)
    reset_errors()
    rt.step()  # the prefill and its first token: clean
    _fault()

    def steps(n: int) -> None:
        for _ in range(n):  # the next token transfer (overlapped: when it lands)
            rt.step()

    with pytest.raises(SlotIndexError, match=r"track_save: `track_indices` .* row 0 holds 7"):
        steps(3)
    assert check_errors() is None, "raising reset the record"


def test_a_clean_run_reads_a_clean_record(tiny_model: NemotronH) -> None:
    reset_errors()
    rt = Runtime(tiny_model, _opts())
    rt.submit(list(range(1, 9)), 4)
    rt.run()
    assert check_errors() is None
