"""The comparison that decides whether a replay is faithful, on hand-made tensors.

``check_replay`` passes a backend exactly when ``_compare`` finds no problem: a row
compared too loosely, a slot left out of the untouched-slot check or a NaN taken for a
difference would pass a broken backend or fail a correct one. These tests give
``_compare`` and its row predicates (``_row_same``, ``_row_close``), the rows rule of the
static buffers and the perturbation the diagnosis uses one case each.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridmeta.testing import Batch, Reference
from hybridmeta.testing.replay import (
    _maxdiff,
    _perturb,
    _ReplayBase,
    _row_close,
    _row_same,
    _rows,
    replay_machine,
    rows_rule,
)
from tests.testing.test_replay import Tiny

NAN = math.nan


# --------------------------------------------------------------------------- rows


@pytest.mark.parametrize(
    ("rows", "max_bs", "rule"),
    [
        (5, 4, (1, 1)),  # offsets: max_bs + 1
        (4, 4, (1, 0)),
        (8, 4, (2, 0)),  # two rows a request
        (12, 4, (3, 0)),
        (2, 1, (1, 1)),  # max_bs + 1 wins over 2 * max_bs
        (1, 1, (1, 0)),
        (6, 4, None),  # neither
        (3, 4, None),  # fewer rows than requests
        (0, 4, None),
    ],
)
def test_rows_rule(rows: int, max_bs: int, rule: tuple[int, int] | None) -> None:
    assert rows_rule(torch.zeros(rows, 2), max_bs) == rule
    if rule is not None:
        assert _rows(rule, max_bs) == rows
        assert _rows(rule, 2) == 2 * rule[0] + rule[1]


def test_a_scalar_buffer_has_no_rows() -> None:
    assert rows_rule(torch.tensor(3.0), 1) is None


# --------------------------------------------------------------------------- predicates


def test_row_same_is_bitwise_and_nan_equals_nan() -> None:
    a = torch.tensor([[1.0, NAN], [2.0, 3.0], [NAN, NAN], [0.0, 1.0]])
    b = torch.tensor([[1.0, NAN], [2.0, 3.0000002], [NAN, 1.0], [-0.0, 1.0]])
    assert _row_same(a, b).tolist() == [True, False, False, True]
    assert _row_same(torch.tensor([1, 2, 3]), torch.tensor([1, 5, 3])).tolist() == [
        True,
        False,
        True,
    ]
    # Rows of any rank reduce to one verdict a row.
    c = torch.zeros(2, 2, 3)
    d = c.clone()
    d[1, 1, 2] = 1.0
    assert _row_same(c, d).tolist() == [True, False]


def test_row_close_zero_tolerance_is_bitwise() -> None:
    a = torch.tensor([[1.0], [2.0]])
    b = torch.tensor([[1.0], [2.0 + 2.0**-22]])
    assert _row_close(a, b, (0.0, 0.0)).tolist() == [True, False]
    assert _row_close(a, b, (1e-5, 0.0)).tolist() == [True, True]


def test_row_close_uses_rtol_and_atol_and_equal_nan() -> None:
    a = torch.tensor([[100.0, 0.0], [100.0, 0.0], [NAN, 1.0], [1.0, 1.0]])
    b = torch.tensor([[100.5, 0.0], [100.0, 0.05], [NAN, 1.0], [NAN, 1.0]])
    # rtol 1e-2 covers 0.5 at 100; atol 0.1 covers 0.05 at 0; NaN only equals NaN.
    assert _row_close(a, b, (1e-2, 0.1)).tolist() == [True, True, True, False]
    assert _row_close(a, b, (1e-3, 0.1)).tolist() == [False, True, True, False]
    assert _row_close(a, b, (1e-2, 0.01)).tolist() == [True, False, True, False]
    # 1-D: one verdict an element.
    assert _row_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]), (0.1, 0.0)).tolist() == [
        True,
        False,
    ]


def test_row_close_with_a_tolerance_of_one_side_only() -> None:
    a = torch.tensor([[2.0], [2.0]])
    b = torch.tensor([[2.5], [-2.0]])
    assert _row_close(a, b, (0.0, 1.0)).tolist() == [True, False]  # atol alone
    assert _row_close(a, b, (1.0, 0.0)).tolist() == [True, False]  # rtol alone: |d| <= |b|


def test_row_close_never_rounds_integers() -> None:
    a, b = torch.tensor([[3], [4]]), torch.tensor([[3], [5]])
    assert _row_close(a, b, (1.0, 1.0)).tolist() == [True, False]


def test_maxdiff() -> None:
    assert _maxdiff(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 4.25])) == "2.25"
    assert _maxdiff(torch.tensor([1.0, NAN]), torch.tensor([1.0, 1.0])) == "nan"
    assert _maxdiff(torch.tensor([3]), torch.tensor([1])) == "2"


# --------------------------------------------------------------------------- perturb


@pytest.mark.parametrize("num_slots", [1, 2, 5])
def test_perturb_changes_every_element_to_a_legal_value(num_slots: int) -> None:
    ints = torch.tensor([-2, -1, 0, 1, num_slots - 1])
    before = ints.clone()
    _perturb(ints, num_slots)
    assert bool((ints != before).all())
    assert int(ints.min()) >= 0 and int(ints.max()) < max(num_slots, 2)
    assert ints.tolist() == [(max(v, -1) + 1) % max(num_slots, 2) for v in before.tolist()]

    floats = torch.tensor([0.0, -3.5, NAN, float("inf")])
    _perturb(floats, num_slots)
    assert floats.tolist() == [1.0, -2.5, 1.0, float("-inf")]

    # Values + 1 leaves as they are (TailFill.HUGE's fill among them) change sign.
    top = torch.finfo(torch.float32).max
    big = torch.tensor([top, 2.0**24, -(2.0**25)])
    _perturb(big, num_slots)
    assert big.tolist() == [-top, -(2.0**24), 2.0**25]
    half = torch.tensor([300.0, 3.0], dtype=torch.bfloat16)
    _perturb(half, num_slots)
    assert half.tolist() == [-300.0, 4.0]

    flags = torch.tensor([True, False])
    _perturb(flags, num_slots)
    assert flags.tolist() == [False, True]

    one = torch.tensor([2.0])
    _perturb(one, num_slots)
    assert one.tolist() == [3.0]

    empty = torch.zeros(0)
    _perturb(empty, num_slots)
    assert empty.numel() == 0


# --------------------------------------------------------------------------- _compare


def _machine(tolerance: tuple[float, float] = (0.0, 0.0)) -> _ReplayBase:
    m = replay_machine(Tiny)()
    assert isinstance(m, _ReplayBase)
    backend = Tiny()
    backend.tolerance = tolerance
    m._backend = backend  # num_slots 10, max_bs 4
    return m


def _batch(slots: tuple[int, ...], track: tuple[int, ...] | None = None,
           mask: tuple[bool, ...] | None = None) -> Batch:  # fmt: skip
    n = len(slots)
    return Batch(slots=slots, track_slots=track or (-1,) * n,
                 track_mask=mask or (False,) * n, extend_lens=(1,) * n)  # fmt: skip


def _pools() -> dict[str, torch.Tensor]:
    return {"pool": torch.arange(11, dtype=torch.float32)[:, None]}


def test_a_faithful_step_has_no_problem() -> None:
    m, before = _machine(), _pools()
    after = before["pool"].clone()
    after[2] += 1.0
    after[10] = 99.0  # the trash row past num_slots is not checked
    ref = Reference(pools={"pool": after.clone()}, outputs={"y": torch.tensor([[3.0]])})
    outs = {"y": torch.tensor([[3.0], [123.0], [NAN], [0.0]])}  # rows past bs: not compared
    assert m._compare(_batch((2,)), before, {"pool": after}, outs, ref) == []


def test_an_output_row_off_by_an_ulp_is_named() -> None:
    m, before = _machine(), _pools()
    want = torch.tensor([[1.0], [2.0], [3.0]])
    got = want.clone()
    got[1] = torch.nextafter(got[1], torch.tensor(10.0))
    ref = Reference(pools={"pool": before["pool"].clone()}, outputs={"y": want})
    problems = m._compare(_batch((-1, -1, -1)), before, before, {"y": got}, ref)
    assert problems == ["output 'y': row 1 differs from the eager reference (max |diff| 2.38e-07)"]
    # Within the backend's tolerance: accepted.
    assert (
        _machine((1e-6, 0.0))._compare(_batch((-1, -1, -1)), before, before, {"y": got}, ref) == []
    )


def test_missing_and_misshapen_outputs() -> None:
    m, before = _machine(), _pools()
    ref = Reference(pools={}, outputs={"z": torch.zeros(2), "y": torch.zeros(2, 3)})
    problems = m._compare(_batch((-1, -1)), before, before, {"y": torch.zeros(4, 2)}, ref)
    assert problems == [
        "output 'z': the captured forward did not return it",
        "output 'y': live rows have shape (2, 2), the reference (2, 3)",
    ]


def test_rows_of_several_entries_a_request_are_named_by_request() -> None:
    m, before = _machine(), _pools()
    want = torch.zeros(6, 1)  # 3 requests, 2 rows each
    got = want.clone()
    got[3] = 1.0  # request 1
    got[4] = NAN  # request 2
    ref = Reference(pools={}, outputs={"y": want})
    problems = m._compare(_batch((-1, -1, -1)), before, before, {"y": got}, ref)
    assert problems == [
        "output 'y': row 1 differs from the eager reference (max |diff| 1)",
        "output 'y': row 2 differs from the eager reference (max |diff| nan)",
    ]


def test_one_request_of_two_rows_is_request_0() -> None:
    m, before = _machine(), _pools()
    want = torch.zeros(2, 1)
    got = want.clone()
    got[1] = 1.0
    ref = Reference(pools={}, outputs={"y": want})
    assert m._compare(_batch((-1,)), before, before, {"y": got}, ref) == [
        "output 'y': row 0 differs from the eager reference (max |diff| 1)"
    ]


def test_the_reference_is_compared_in_the_replays_dtype() -> None:
    # An fp32 reference against a bf16 graph: equal once rounded to bf16.
    m = _machine()
    before = {"pool": torch.arange(11, dtype=torch.bfloat16)[:, None]}
    ref_pool = before["pool"].float()
    ref_pool[3] += 1e-3  # rounds back to the bf16 value: the reference did not write slot 3
    ref_pool[2] = 7.001  # slot 2, addressed: 7 in bf16
    after = before["pool"].clone()
    after[2] = 7.0
    ref = Reference(pools={"pool": ref_pool}, outputs={"y": torch.tensor([[1.0001]])})
    outs = {"y": torch.tensor([[1.0]], dtype=torch.bfloat16)}
    assert m._compare(_batch((2,)), before, {"pool": after}, outs, ref) == []
    # Slot 3 unchanged in bf16 is not "written by the reference": changing it is caught.
    after[3] = 30.0
    assert m._compare(_batch((2,)), before, {"pool": after}, outs, ref) == [
        "pool 'pool': slot 3 changed, but no live row addresses it"
    ]


def test_at_most_four_rows_are_listed() -> None:
    m, before = _machine(), _pools()
    want = torch.zeros(6, 1)
    ref = Reference(pools={}, outputs={"y": want})
    bs6 = _batch((-1,) * 6)
    problems = m._compare(bs6, before, before, {"y": want + 1.0}, ref)
    assert [p.split(" differs")[0] for p in problems] == [f"output 'y': row {r}" for r in range(4)]


def test_an_addressed_slot_must_hold_the_reference() -> None:
    m, before = _machine(), _pools()
    ref_pool = before["pool"].clone()
    ref_pool[3] += 1.0
    ref_pool[7] = 5.0
    after = before["pool"].clone()  # the replay wrote nothing
    batch = _batch((3, 1), track=(7, 8), mask=(True, False))
    ref = Reference(pools={"pool": ref_pool}, outputs={})
    problems = m._compare(batch, before, {"pool": after}, {}, ref)
    assert problems == [
        "pool 'pool': slot 3 (working slot of row 0) does not hold the eager reference's value",
        "pool 'pool': slot 7 (track slot of row 0) does not hold the eager reference's value",
    ]


def test_a_slot_the_reference_writes_is_checked_even_unaddressed() -> None:
    m, before = _machine(), _pools()
    ref_pool = before["pool"].clone()
    ref_pool[5] = -1.0  # the backend's own write pattern
    ref = Reference(pools={"pool": ref_pool}, outputs={})
    wrong = before["pool"].clone()
    wrong[5] = -2.0
    problems = m._compare(_batch((-1,)), before, {"pool": wrong}, {}, ref)
    assert problems == [
        "pool 'pool': slot 5 (written by the eager reference) does not hold the eager "
        "reference's value"
    ]
    assert m._compare(_batch((-1,)), before, {"pool": ref_pool.clone()}, {}, ref) == []


def test_an_unaddressed_slot_must_keep_its_bits_whatever_the_tolerance() -> None:
    before = _pools()
    before["pool"][4] = NAN  # NaN kept is unchanged
    ref = Reference(pools={"pool": before["pool"].clone()}, outputs={})
    after = before["pool"].clone()
    after[6] = torch.nextafter(after[6], torch.tensor(100.0))
    # An unflagged row's track slot is not addressed either.
    batch = _batch((2,), track=(6,), mask=(False,))
    for tol in [(0.0, 0.0), (1e-3, 1e-3)]:
        problems = _machine(tol)._compare(batch, before, {"pool": after}, {}, ref)
        assert problems == ["pool 'pool': slot 6 changed, but no live row addresses it"]
    assert _machine()._compare(batch, before, {"pool": before["pool"].clone()}, {}, ref) == []
