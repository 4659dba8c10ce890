"""Conv verify update: worked examples against the reference, validation, debug checks, dispatch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import debug_mode
from hybridmeta.kernels import causal_conv1d_update, conv_verify_update
from tests.kernels._support import assert_close, bits, conv_verify_update_ref, strided
from tests.kernels.test_ops import _hybridmeta_ops

DIM, K, SLOTS, BS, T = 24, 4, 8, 3, 4
PARENTS = [[-1, 0, 0, 1], [5, 9, -7, 3], [-1, 0, -1, 2]]


def _args(state_dtype: torch.dtype = torch.float32, *, inner: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    if inner:  # conv_dim the contiguous axis of the pool (vLLM's layout)
        cs = torch.randn(SLOTS, K - 1, DIM, generator=g).transpose(1, 2)
    else:
        cs = torch.randn(SLOTS, DIM, K - 1, generator=g)
    return {
        "x": torch.randn(BS, T, DIM, generator=g),
        "conv_state": cs.to(state_dtype),
        "weight": torch.randn(DIM, K, generator=g),
        "bias": torch.randn(DIM, generator=g),
        "cache_indices": torch.tensor([1, -1, 4]),
        "inter": torch.full((BS, T, DIM, K - 1), float("nan")).to(state_dtype),
    }


def _call(a: dict[str, Any]) -> torch.Tensor:
    rest = {k: v for k, v in a.items() if k not in ("x", "conv_state", "weight")}
    return conv_verify_update(a["x"], a["conv_state"], a["weight"], **rest)


@pytest.mark.interpreter
@pytest.mark.parametrize("inner", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["chain", "tree", "ragged tree"])
def test_matches_reference(state_dtype: torch.dtype, shape: str, inner: bool) -> None:
    a = _args(state_dtype, inner=inner)
    if shape != "chain":
        a["parent"] = torch.tensor(PARENTS)
    if shape == "ragged tree":
        a["num_draft"] = torch.tensor([2, 99, 1])
    cs0 = a["conv_state"].clone()
    ref_inter, ref_out = conv_verify_update_ref(
        a["x"], a["conv_state"], a["weight"], a["bias"], a["inter"], a["cache_indices"],
        silu=True, parent=a.get("parent"), num_draft=a.get("num_draft"),
    )  # fmt: skip
    out = torch.full((BS, T, DIM), float("nan"))
    _call({**a, "out": out})
    # bf16 pool: ancestors' inputs pass through bf16 (the interpreter truncates, torch rounds).
    tol = (1e-2, 5e-2) if state_dtype == torch.bfloat16 else (3e-4, 1e-3)
    torch.testing.assert_close(out, ref_out, rtol=tol[0], atol=tol[1])
    n = {"chain": [T, 0, T], "tree": [T, 0, T], "ragged tree": [2, 0, 1]}[shape]
    for b in range(BS):
        if n[b]:
            assert_close(a["inter"][b, : n[b]], ref_inter[b, : n[b]], f"inter row {b}")
        assert bool(torch.isnan(a["inter"][b, n[b] :].float()).all())
        assert bool((out[b, n[b] :] == 0).all())
    assert torch.equal(bits(a["conv_state"]), bits(cs0)), "the pool is only read"


@pytest.mark.interpreter
def test_window_of_a_tree_token_holds_its_ancestors_inputs() -> None:
    """Row 0: token 3's parent is 1, whose parent is 0: its window is [x0, x1, x3] (k = 4),
    not the chain's [x1, x2, x3]; token 2 (parent 0) keeps the last working column."""
    a = _args()
    a["parent"] = torch.tensor(PARENTS)
    _call(a)
    x = a["x"][0]
    assert torch.equal(a["inter"][0, 3], torch.stack([x[0], x[1], x[3]], dim=1))
    w0 = a["conv_state"][1]
    assert torch.equal(a["inter"][0, 2], torch.stack([w0[:, 2], x[0], x[2]], dim=1))
    # Row 2, column 2 is a second root: the working window shifted once.
    w2, x2 = a["conv_state"][4], a["x"][2]
    assert torch.equal(a["inter"][2, 2], torch.stack([w2[:, 1], w2[:, 2], x2[2]], dim=1))


@pytest.mark.interpreter
def test_chain_equals_sequential_single_token_updates_bitwise() -> None:
    a = _args(torch.bfloat16)
    out = _call(a)
    pool = a["conv_state"].clone()
    for t in range(T):
        out_t = causal_conv1d_update(
            a["x"][:, t], pool, a["weight"], a["bias"], cache_indices=a["cache_indices"]
        )
        assert torch.equal(bits(a["inter"][0, t]), bits(pool[1]))
        assert torch.equal(bits(a["inter"][2, t]), bits(pool[4]))
        assert_close(out[[0, 2], t], out_t[[0, 2]], f"out column {t}")


@pytest.mark.interpreter
def test_each_launch_is_one_dispatched_op() -> None:
    a = _args()
    assert _hybridmeta_ops(lambda: _call(a)) == ["hybridmeta.conv_verify_update.default"]
    schema = torch.ops.hybridmeta.conv_verify_update.default._schema
    mutated = {
        arg.name
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    }
    assert mutated == {"out", "inter", "errors"}


BAD: list[tuple[str, str, Any, type[Exception], str]] = [
    ("x 2d", "x", torch.zeros(BS, DIM), ValueError, r"`x` must have shape \[bs, T, conv_dim\]"),
    ("x no columns", "x", torch.zeros(BS, 0, DIM), ValueError, r"at least one draft column"),
    ("weight k", "weight", torch.zeros(DIM, K + 1), ValueError, r"`weight` must have shape"),
    ("bias", "bias", torch.zeros(DIM + 1), ValueError, r"`bias` must have shape \[conv_dim\]"),
    (
        "idx rows",
        "cache_indices",
        torch.zeros(BS - 1, dtype=torch.long),
        ValueError,
        r"`cache_indices` must have shape \[bs\]",
    ),
    (
        "inter k",
        "inter",
        torch.zeros(BS, T, DIM, K),
        ValueError,
        r"`inter` must have shape \[bs, T, conv_dim, k - 1\]",
    ),
    (
        "inter dtype",
        "inter",
        torch.zeros(BS, T, DIM, K - 1, dtype=torch.float16),
        TypeError,
        r"`inter` must have dtype float32",
    ),
    ("parent", "parent", torch.zeros(BS, T + 2, dtype=torch.long), ValueError, r"`parent`"),
    ("num_draft", "num_draft", torch.zeros(BS, dtype=torch.bool), TypeError, r"`num_draft`"),
    ("activation", "activation", "relu", ValueError, r"`activation` must be None, 'silu'"),
    ("out", "out", torch.zeros(BS, T, DIM, dtype=torch.bfloat16), TypeError, r"`out` must have"),
]


@pytest.mark.parametrize(("case", "name", "value", "exc", "match"), BAD, ids=[c[0] for c in BAD])
def test_rejects_bad_argument_and_writes_nothing(
    case: str, name: str, value: Any, exc: type[Exception], match: str
) -> None:
    a = _args()
    a[name] = value
    if name != "out":
        a["out"] = torch.full((BS, T, DIM), float("nan"))
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=match):
        _call(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"cache_indices": torch.tensor([1, -3, 4])}, r"`cache_indices` values must be -1"),
        ({"parent": torch.tensor([[-1, 1, 0, 1], PARENTS[1], PARENTS[2]])}, r"row 0 column 1"),
        ({"num_draft": torch.tensor([1, 0, T + 1])}, r"`num_draft` values must be in"),
    ],
)
def test_debug_mode_refuses_bad_indices(change: dict[str, torch.Tensor], match: str) -> None:
    a = {**_args(), **change}
    out = torch.full((BS, T, DIM), float("nan"))
    with debug_mode(), pytest.raises(ValueError, match=match):
        _call({**a, "out": out})
    assert bool(torch.isnan(a["inter"]).all())
    assert bool(torch.isnan(out).all())


@pytest.mark.parametrize("name", ['cache_indices', 'bias'])
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
