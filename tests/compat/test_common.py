"""The shared pieces of hybridmeta.compat: the slots the compositions' own writes may touch
(the peer's pad id passed through, never translated), sync-free row writes, varlen padding,
sglang's tree parents."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.compat._common import (
    activation_name,
    per_head,
    sibling_parents,
    valid_slots,
    varlen_pad,
    varlen_unpad_,
    write_rows_,
)


def test_valid_slots_skip_the_peers_pad_id_and_ids_outside_the_pool() -> None:
    ids = torch.tensor([0, 3, -1, 0, 5], dtype=torch.int32)
    assert valid_slots(ids, 0, 5).tolist() == [False, True, False, False, False]
    assert valid_slots(ids, -1, 5).tolist() == [True, True, False, True, False]
    assert valid_slots(torch.tensor([7, 2]), 7, 8).tolist() == [False, True]


@pytest.mark.parametrize("write", [[True, False, True], [False, False, False], [False, True, False]])
def test_write_rows_writes_exactly_the_flagged_rows(write: list[bool]) -> None:
    pool = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)
    orig = pool.clone()
    idx = torch.tensor([3, 0, 1])
    vals = torch.tensor([[10.0, 11.0], [20.0, 21.0], [30.0, 31.0]])
    write_rows_(pool, (idx,), vals, torch.tensor(write))
    expect = orig.clone()
    for r, w in enumerate(write):
        if w:
            expect[int(idx[r])] = vals[r]
    assert torch.equal(pool, expect)


def test_write_rows_two_indices_on_a_strided_view() -> None:
    base = torch.zeros(3, 4, 2)
    view = base[:, 1:]  # [3, 3, 2], strided
    write_rows_(view, (torch.tensor([2, 0]), torch.tensor([1, 2])), torch.ones(2, 2),
                torch.tensor([True, False]))  # fmt: skip
    assert base.sum() == 2 and bool((base[2, 2] == 1).all())


def test_varlen_pad_and_unpad_round_trip() -> None:
    x = torch.arange(7.0)[:, None].expand(7, 3).contiguous()
    cu = torch.tensor([0, 3, 3, 7])
    xp = varlen_pad(x, cu[:-1], 4)
    assert xp.shape == (3, 4, 3) and xp[2, 3, 0] == 6 and xp[0, 2, 0] == 2
    out = torch.full((8, 3), -5.0)  # one token past cu[-1] keeps its value
    varlen_unpad_(out, xp * 10, cu)
    assert out[:, 0].tolist() == [0, 10, 20, 30, 40, 50, 60, -5]


def test_sibling_parents_follows_next_and_sibling_links() -> None:
    # 0 -> {1, 3}, 1 -> {2}; 3 -> {4}
    nxt = torch.tensor([[1, 2, -1, 4, -1]])
    sib = torch.tensor([[-1, 3, -1, -1, -1]])
    assert sibling_parents(nxt, sib, 5).tolist() == [[0, 0, 1, 0, 3]]


def test_per_head_and_activation_rules() -> None:
    A = torch.tensor([1.0, 2.0])[:, None, None].expand(2, 3, 4)
    assert per_head("op", "A", A, (1, 2)).tolist() == [1.0, 2.0]
    with pytest.raises(NotImplementedError, match="`A` varies along dim 2"):
        per_head("op", "A", torch.randn(2, 1, 4), (1, 2))
    assert activation_name("op", True) == "silu" and activation_name("op", "swish") == "silu"
    assert activation_name("op", False) is None and activation_name("op", None) is None
    with pytest.raises(ValueError, match="`activation`"):
        activation_name("op", "gelu")
