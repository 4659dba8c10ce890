"""The kernels' device-side error record (``hybridmeta.kernels._errors``): which fault it
keeps, how it is read without an extra sync, and that a captured step records into it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta.graphs import EmulatedGraphBackend
from hybridmeta.kernels import (
    KernelFault,
    SlotIndexError,
    causal_conv1d_update_reference,
    check_errors,
    error_record,
    raise_if_faulted,
    reset_errors,
    ssm_state_update,
    ssm_state_update_reference,
)
from hybridmeta.kernels._errors import NO_FAULT, OPS, TAG

CPU = torch.device("cpu")
S, H, P, N, D, K = 6, 1, 2, 4, 3, 3


@pytest.fixture(autouse=True)
def _clean_record() -> None:
    reset_errors()


def _ssm(idx: list[int], impl: str = "reference", **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    bs = len(idx)
    state = torch.randn(S, H, P, N)
    out = torch.empty(bs, H, P)
    args = (state, torch.randn(bs, H, P), torch.randn(bs, H), -torch.rand(H),
            torch.randn(bs, 1, N), torch.randn(bs, 1, N), out, torch.tensor(idx))  # fmt: skip
    if impl == "reference":
        ssm_state_update_reference(*args, **kw)
    else:
        torch.ops.hybridmeta.ssm_state_update(
            *args, None, None, None, False, None, None, None, float("-inf"), float("inf"),
            kw.get("pad_slot_id", -1), error_record(CPU),
        )  # fmt: skip
    return state, out


def _conv(idx: list[int]) -> None:
    bs = len(idx)
    causal_conv1d_update_reference(
        torch.randn(bs, D), torch.randn(S, D, K - 1), torch.randn(D, K), None,
        torch.empty(bs, D), torch.tensor(idx), silu=False,
    )  # fmt: skip


def test_a_clean_record_reads_none_and_costs_one_read() -> None:
    rec = error_record(CPU)
    assert rec.dtype == torch.int64 and rec.tolist() == [0, NO_FAULT, 0, 0]
    _ssm([0, -1, 3])
    assert check_errors(CPU) is None
    raise_if_faulted(CPU)  # nothing to raise
    assert error_record("cpu") is rec, "one record per device"


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_the_least_row_then_field_wins_within_an_op(impl: str) -> None:
    _ssm([0, 9, -4, 2], impl)  # rows 1 and 2 fault
    _ssm([S, 1], impl)  # a later launch of the same op: row 0 is less
    fault = check_errors(CPU)
    assert fault == KernelFault(
        op="ssm_state_update", field="state_indices", row=0, value=S, pad=-1, bound=S,
        kind="slot",
    )  # fmt: skip
    assert check_errors(CPU) is None, "reading resets the record"


def test_the_first_faulting_op_owns_the_record() -> None:
    _conv([0, S + 2])
    _ssm([S])  # row 0 of another op: dropped, the conv faulted first
    fault = check_errors(CPU)
    assert fault is not None and (fault.op, fault.field, fault.row, fault.value) == (
        "causal_conv1d_update", "cache_indices", 1, S + 2,
    )  # fmt: skip


def test_values_outside_int32_are_reported_saturated() -> None:
    state = torch.zeros(S, H, P, N)
    ssm_state_update_reference(
        state, torch.randn(1, H, P), torch.randn(1, H), -torch.rand(H), torch.randn(1, 1, N),
        torch.randn(1, 1, N), torch.empty(1, H, P), torch.tensor([2**40]),
    )  # fmt: skip
    fault = check_errors(CPU)
    assert fault is not None and fault.saturated and fault.value == 2**31 - 1
    assert "row 0 holds >= 2147483647" in fault.message()


def test_raise_if_faulted_names_op_field_row_and_value() -> None:
    _ssm([0, 1], pad_slot_id=0)  # vLLM's pad 0: row 1 is live, row 0 a pad row
    raise_if_faulted(CPU)
    _ssm([0, -1], pad_slot_id=0)  # with pad 0, -1 is not a pad id: invalid
    with pytest.raises(SlotIndexError) as info:
        raise_if_faulted(CPU)
    e = info.value
    assert isinstance(e, IndexError) and isinstance(e, ValueError)
    assert (e.op, e.field, e.row, e.value) == ("ssm_state_update", "state_indices", 1, -1)
    assert str(e).startswith(
        "ssm_state_update: `state_indices` values must be 0 (pad) or in [0, 6); row 1 holds -1"
    )
    assert "found on the device" in str(e)
    assert check_errors(CPU) is None, "raising resets the record"


def test_values_read_by_the_caller_decode_without_a_device_read() -> None:
    _ssm([1, S + 1])
    copied = error_record(CPU).tolist()  # what an engine copies with its own transfer
    fault = check_errors(CPU, values=copied)
    assert fault is not None and (fault.row, fault.value) == (1, S + 1)
    assert error_record(CPU).tolist() == [0, NO_FAULT, 0, 0], "a fault resets the device record"
    assert check_errors(CPU, values=[0, NO_FAULT, 0, 0]) is None
    with pytest.raises(ValueError, match="`values` needs the `device`"):
        check_errors(values=copied)


def test_every_op_has_a_distinct_tag_and_named_fields() -> None:
    assert sorted(TAG.values()) == list(range(1, len(OPS) + 1))
    for name, fields in OPS:
        assert len(fields) <= 16 and len({f for f, _ in fields}) == len(fields), name


def test_a_captured_step_records_a_fault_at_replay_and_writes_nothing() -> None:
    """Under graph replay no host check runs (the ids are read on the device): the invalid
    row writes nothing, its output is NaN, and the record names it at the next read."""
    big = torch.randn(S + 2, H, P, N)
    state = big[:S]
    bs = 2
    x, dt = torch.randn(bs, H, P), torch.randn(bs, H)
    A, B, C = -torch.rand(H), torch.randn(bs, 1, N), torch.randn(bs, 1, N)
    idx = torch.full((bs,), -1)  # captured on pad rows: nothing written
    out = torch.empty(bs, H, P)
    graph = EmulatedGraphBackend("cpu").capture(
        lambda: ssm_state_update(
            state, x, dt, A, B, C, state_indices=idx, out=out, impl="reference"
        ),
    )  # fmt: skip
    assert check_errors(CPU) is None
    before = big.clone()
    idx.copy_(torch.tensor([2, S]))  # the next step's ids land in the static buffer
    graph.replay()
    assert torch.equal(big[S:], before[S:]), "wrote past the pool"
    assert torch.equal(big[:2], before[:2]) and torch.equal(big[3:S], before[3:S])
    assert not torch.equal(big[2], before[2]), "the valid row still ran"
    assert bool(torch.isnan(out[1]).all()) and not bool(torch.isnan(out[0]).any())
    fault = check_errors(CPU)
    assert fault is not None and (fault.op, fault.row, fault.value) == ("ssm_state_update", 1, S)
