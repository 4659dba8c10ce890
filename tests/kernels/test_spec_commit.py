"""Spec commit and the track-boundary helper: worked examples, validation, debug checks, dispatch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import debug_mode
from hybridmeta.kernels import spec_commit, spec_track_token
from tests.kernels._support import bits, spec_commit_ref, strided
from tests.kernels.test_ops import _hybridmeta_ops

L, SLOTS, BS, T = 2, 10, 4, 3


def _args() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "conv_pool": torch.randn(L, SLOTS, 6, 3, generator=g).to(torch.bfloat16),
        "ssm_pool": torch.randn(L, SLOTS, 2, 3, 4, generator=g),
        "inter_conv": torch.randn(L, BS, T, 6, 3, generator=g).to(torch.bfloat16),
        "inter_ssm": torch.randn(L, BS, T, 2, 3, 4, generator=g),
        # Row 1 is a pad row; row 3 accepted nothing.
        "state_indices": torch.tensor([2, -1, 5, 7]),
        "accepted_index": torch.tensor([1, 2, 2, -1]),
        "track_indices": torch.tensor([8, 9, 0, 1]),
        "track_mask": torch.tensor([True, True, False, True]),
        "track_token": torch.tensor([0, 0, 1, 2]),
    }


def _call(a: dict[str, Any]) -> None:
    rest = {k: v for k, v in a.items() if k not in ("conv_pool", "ssm_pool", "inter_conv",
                                                      "inter_ssm")}  # fmt: skip
    spec_commit(a["conv_pool"], a["ssm_pool"], a["inter_conv"], a["inter_ssm"], **rest)


@pytest.mark.interpreter
def test_worked_example() -> None:
    a = _args()
    conv0, ssm0 = a["conv_pool"].clone(), a["ssm_pool"].clone()
    ref_conv, ref_ssm = spec_commit_ref(
        conv0, ssm0, a["inter_conv"], a["inter_ssm"], a["state_indices"], a["accepted_index"],
        a["track_indices"], a["track_mask"], a["track_token"],
    )  # fmt: skip
    _call(a)
    assert torch.equal(bits(a["ssm_pool"]), bits(ref_ssm))
    assert torch.equal(bits(a["conv_pool"]), bits(ref_conv))
    # By hand: row 0 commits column 1 into slot 2 and tracks column 0 into slot 8; row 2
    # commits column 2 into slot 5 (unflagged: slot 0 untouched); row 3 commits nothing but
    # is told to track column 2 into slot 1 (the kernel copies what the caller asks).
    assert torch.equal(a["ssm_pool"][:, 2], a["inter_ssm"][:, 0, 1])
    assert torch.equal(a["conv_pool"][:, 2], a["inter_conv"][:, 0, 1])
    assert torch.equal(a["ssm_pool"][:, 8], a["inter_ssm"][:, 0, 0])
    assert torch.equal(a["ssm_pool"][:, 5], a["inter_ssm"][:, 2, 2])
    assert torch.equal(a["ssm_pool"][:, 1], a["inter_ssm"][:, 3, 2])
    for slot in (0, 3, 4, 6, 7, 9):  # pad row's track 9, unflagged track 0, row 3's slot 7
        assert torch.equal(bits(a["ssm_pool"][:, slot]), bits(ssm0[:, slot])), slot
        assert torch.equal(bits(a["conv_pool"][:, slot]), bits(conv0[:, slot])), slot


@pytest.mark.interpreter
def test_without_track_and_per_layer_views() -> None:
    """No track arguments: only working slots; one layer of the pools is a [1, ...] view."""
    a = _args()
    for k in ("track_indices", "track_mask", "track_token"):
        del a[k]
    ssm0 = a["ssm_pool"].clone()
    layer = {k: (v[1:2] if k in ("conv_pool", "ssm_pool", "inter_conv", "inter_ssm") else v)
             for k, v in a.items()}  # fmt: skip
    _call(layer)
    assert torch.equal(a["ssm_pool"][1, 2], a["inter_ssm"][1, 0, 1])
    assert torch.equal(bits(a["ssm_pool"][0]), bits(ssm0[0])), "layer 0 not addressed"
    assert torch.equal(bits(a["ssm_pool"][1, 8]), bits(ssm0[1, 8])), "no track copy"


@pytest.mark.interpreter
def test_each_launch_is_one_dispatched_op() -> None:
    a = _args()
    assert _hybridmeta_ops(lambda: _call(a)) == ["hybridmeta.spec_commit.default"]
    schema = torch.ops.hybridmeta.spec_commit.default._schema
    mutated = {
        arg.name
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    }
    assert mutated == {"conv_pool", "ssm_pool", "errors"}


BAD: list[tuple[str, str, Any, type[Exception], str]] = [
    (
        "inter_ssm rows",
        "inter_ssm",
        torch.zeros(L, BS + 1, T, 2, 3, 4),
        ValueError,
        r"`inter_ssm` must have shape \[layers, bs, T, nheads, headdim, dstate\]",
    ),
    (
        "inter_ssm dtype",
        "inter_ssm",
        torch.zeros(L, BS, T, 2, 3, 4, dtype=torch.bfloat16),
        TypeError,
        r"`inter_ssm` must have dtype float32",
    ),
    (
        "inter_conv T",
        "inter_conv",
        torch.zeros(L, BS, T + 1, 6, 3, dtype=torch.bfloat16),
        ValueError,
        r"`inter_conv` must have shape \[layers, bs, T, conv_dim, k - 1\]",
    ),
    (
        "inter_conv layout",
        "inter_conv",
        torch.zeros(L, BS, T, 3, 6, dtype=torch.bfloat16).transpose(3, 4),
        ValueError,
        r"`inter_conv` must be contiguous within each slot",
    ),
    (
        "conv_pool layers",
        "conv_pool",
        torch.zeros(L + 1, SLOTS, 6, 3, dtype=torch.bfloat16),
        ValueError,
        r"`conv_pool` must have shape \[layers, slots",
    ),
    (
        "accepted rows",
        "accepted_index",
        torch.zeros(BS + 1, dtype=torch.long),
        ValueError,
        r"`accepted_index` must have shape \[bs\]",
    ),
    (
        "accepted float",
        "accepted_index",
        torch.zeros(BS),
        TypeError,
        r"`accepted_index` must have dtype",
    ),
    ("track alone", "track_mask", None, ValueError, r"must be given together or not at all"),
    (
        "track_mask int",
        "track_mask",
        torch.zeros(BS, dtype=torch.long),
        TypeError,
        r"`track_mask` must have dtype bool",
    ),
    (
        "track_token rows",
        "track_token",
        torch.zeros(BS - 1, dtype=torch.long),
        ValueError,
        r"`track_token` must have shape \[bs\]",
    ),
]


@pytest.mark.parametrize(("case", "name", "value", "exc", "match"), BAD, ids=[c[0] for c in BAD])
def test_rejects_bad_argument_and_writes_nothing(
    case: str, name: str, value: Any, exc: type[Exception], match: str
) -> None:
    a = _args()
    a[name] = value
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=match):
        _call(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"state_indices": torch.tensor([2, -1, SLOTS, 7])}, r"`state_indices` values must be"),
        ({"accepted_index": torch.tensor([1, 2, T, -1])}, r"`accepted_index` values .* row 2"),
        ({"accepted_index": torch.tensor([-2, 2, 2, -1])}, r"row 0 holds -2"),
        ({"track_token": torch.tensor([0, 0, 1, T])}, r"`track_token` values .* row 3"),
        ({"track_indices": torch.tensor([8, 9, 0, 5])}, r"slot 5 is written twice"),
        ({"track_indices": torch.tensor([8, 9, 0, 8])}, r"slot 8 is written twice"),
    ],
)
def test_debug_mode_refuses_bad_indices(change: dict[str, torch.Tensor], match: str) -> None:
    a = {**_args(), **change}
    before = {k: bits(a[k]) for k in ("conv_pool", "ssm_pool")}
    with debug_mode(), pytest.raises(ValueError, match=match):
        _call(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


@pytest.mark.interpreter
def test_debug_mode_accepts_pad_rows_and_unflagged_garbage() -> None:
    a = _args()
    a["accepted_index"] = torch.tensor([1, 77, 2, -1])  # pad row 1: garbage
    a["track_token"] = torch.tensor([0, 0, 99, 2])  # row 2 unflagged: garbage
    a["track_indices"] = torch.tensor([8, 2, 5, 1])  # pad / unflagged rows point at live slots
    ref_conv, ref_ssm = spec_commit_ref(
        a["conv_pool"], a["ssm_pool"], a["inter_conv"], a["inter_ssm"], a["state_indices"],
        a["accepted_index"], a["track_indices"], a["track_mask"], a["track_token"],
    )  # fmt: skip
    with debug_mode():
        _call(a)
    assert torch.equal(bits(a["ssm_pool"]), bits(ref_ssm))
    assert torch.equal(bits(a["conv_pool"]), bits(ref_conv))


@pytest.mark.parametrize(
    ("seq_len", "accepted", "interval", "expect"),
    [
        (254, 3, 256, 1),  # 255 -> 256 -> 257: the state after 256 tokens is column 1
        (255, 1, 256, 0),  # exactly one token lands on the boundary
        (255, 0, 256, -1),  # nothing accepted
        (256, 4, 256, -1),  # the boundary was the previous step's
        (250, 2, 256, -1),  # short of it
        (0, 4, 2, 3),  # two boundaries crossed (2 and 4): the last
        (3, 4, 2, 2),  # 4 and 6 crossed: 6 -> column 2
    ],
)
def test_spec_track_token_chain(seq_len: int, accepted: int, interval: int, expect: int) -> None:
    tok = spec_track_token(torch.tensor([seq_len]), torch.tensor([accepted]), interval)
    assert tok.tolist() == [expect]
    if expect >= 0:  # the definition: seq_len + column + 1 tokens are in that state
        assert (seq_len + expect + 1) % interval == 0


def test_spec_track_token_maps_path_positions_to_tree_columns() -> None:
    path = torch.tensor([[0, 2, 3, 0], [0, 1, 0, 0]])
    tok = spec_track_token(torch.tensor([5, 7]), torch.tensor([3, 2]), 8, path=path)
    # Row 0: boundary 8 after 3 tokens (path position 2 -> column 3); row 1: position 0 -> 0.
    assert tok.tolist() == [3, 0]
    with pytest.raises(ValueError, match=r"`interval` must be > 0"):
        spec_track_token(torch.tensor([1]), torch.tensor([1]), 0)


@pytest.mark.parametrize("name", ['state_indices', 'accepted_index', 'track_indices', 'track_mask', 'track_token'])
def test_strided_1d_argument_is_refused_and_writes_nothing(name: str) -> None:
    """The kernels read entry ``i`` of a 1-D argument at offset ``i``: a strided view would
    hand them other rows' values (and other slots to write)."""
    a = _args()
    a[name] = strided(a[name])
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError, match=rf"`{name}` must be contiguous"):
        _call(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k
