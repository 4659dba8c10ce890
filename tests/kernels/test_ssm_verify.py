"""SSM verify update: a worked example against the reference, validation, debug checks, dispatch.

Kernel runs use CPU tensors (the Triton interpreter); ``test_spec_gpu.py`` runs the kernel
compiled at Nemotron-Nano-9B-v2 shapes. Validation tests raise before any launch and run
anywhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridmeta import debug_mode
from hybridmeta.kernels import ssm_state_update, ssm_verify_update
from hybridmeta.kernels.ssm_verify import ssm_verify_launch_config
from tests.kernels._support import assert_close, bits, ssm_verify_update_ref, strided
from tests.kernels.test_ops import _hybridmeta_ops

H, P, N, G, SLOTS, BS, T = 4, 8, 16, 2, 8, 3, 4
CPU = torch.device("cpu")
# Row 0: a tree (two children of the root, a grandchild); row 1: a pad row carrying a
# garbage tree; row 2: a forest (column 2 is a second root).
PARENTS = [[-1, 0, 0, 1], [5, 9, -7, 3], [-1, 0, -1, 2]]


def _args(state_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "state": torch.randn(SLOTS, H, P, N, generator=g).to(state_dtype),
        "x": torch.randn(BS, T, H, P, generator=g),
        "dt": torch.rand(BS, T, H, generator=g),
        "A": -torch.rand(H, generator=g),
        "B": torch.randn(BS, T, G, N, generator=g),
        "C": torch.randn(BS, T, G, N, generator=g),
        "state_indices": torch.tensor([2, -1, 5]),
        "inter": torch.full((BS, T, H, P, N), float("nan")).to(state_dtype),
        "D": torch.randn(H, generator=g),
        "z": torch.randn(BS, T, H, P, generator=g),
        "dt_bias": torch.randn(H, generator=g),
        "dt_softplus": True,
    }


def _call(a: dict[str, Any]) -> torch.Tensor:
    a = dict(a)
    return ssm_verify_update(
        a.pop("state"), a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"), **a
    )


def _reference(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return ssm_verify_update_ref(
        a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], a["inter"], a["state_indices"],
        D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True, parent=a.get("parent"),
        num_draft=a.get("num_draft"),
    )  # fmt: skip


@pytest.mark.interpreter
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["chain", "tree", "ragged tree"])
def test_matches_reference(state_dtype: torch.dtype, shape: str) -> None:
    a = _args(state_dtype)
    if shape != "chain":
        a["parent"] = torch.tensor(PARENTS)
    if shape == "ragged tree":
        a["num_draft"] = torch.tensor([3, 99, 0])  # row 2 live but with no draft column
    state0 = a["state"].clone()
    ref_inter, ref_out = _reference(a)
    out = torch.full((BS, T, H, P), float("nan"))
    _call({**a, "out": out})
    # bf16 state: the interpreter truncates where torch rounds, once per token.
    rtol, atol = (1e-2 * T, 5e-2 * T) if state_dtype == torch.bfloat16 else (3e-4, 1e-3)
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)
    n = [T, 0, T] if shape != "ragged tree" else [3, 0, 0]
    for b in range(BS):
        # Written blocks match; dead blocks (pad row, columns past the count) stay NaN and
        # their output is zero.
        if n[b]:
            torch.testing.assert_close(
                a["inter"][b, : n[b]].float(), ref_inter[b, : n[b]].float(), rtol=rtol, atol=atol
            )
        assert bool(torch.isnan(a["inter"][b, n[b] :].float()).all())
        assert bool((out[b, n[b] :] == 0).all())
    assert torch.equal(bits(a["state"]), bits(state0)), "the pool is only read"


@pytest.mark.interpreter
def test_root_reload_and_parent_reload_differ_from_a_chain() -> None:
    """The worked example is not degenerate: the tree's results differ from the chain's."""
    a = _args()
    chain = _call({**a, "inter": a["inter"].clone()})
    tree = _call({**a, "inter": a["inter"].clone(), "parent": torch.tensor(PARENTS)})
    assert torch.equal(chain[:, :2], tree[:, :2])  # columns 0 and 1 follow the chain in both
    assert not torch.allclose(chain[0, 2], tree[0, 2])  # parent 0, not 1
    assert not torch.allclose(chain[2, 2], tree[2, 2])  # a second root


@pytest.mark.interpreter
def test_chain_equals_sequential_single_token_updates_bitwise() -> None:
    """Same arithmetic, same rounding per token: on the interpreter even the bits agree."""
    a = _args(torch.bfloat16)
    out = _call(a)
    pool = a["state"].clone()
    for t in range(T):
        out_t = ssm_state_update(
            pool, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t],
            state_indices=a["state_indices"], D=a["D"], z=a["z"][:, t], dt_bias=a["dt_bias"],
            dt_softplus=True,
        )  # fmt: skip
        assert torch.equal(bits(a["inter"][0, t]), bits(pool[2]))
        assert torch.equal(bits(a["inter"][2, t]), bits(pool[5]))
        assert torch.equal(bits(out_t[[0, 2]]), bits(out[[0, 2], t]))


@pytest.mark.interpreter
def test_each_launch_is_one_dispatched_op() -> None:
    a = _args()
    ops = _hybridmeta_ops(lambda: _call(a))
    assert ops == ["hybridmeta.ssm_verify_update.default"]
    schema = torch.ops.hybridmeta.ssm_verify_update.default._schema
    mutated = {
        arg.name
        for arg in schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    }
    assert mutated == {"out", "inter", "errors"}, "the pool is not a mutated argument"


@pytest.mark.interpreter
def test_direct_and_dispatched_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridmeta.kernels._dispatch as ops

    results = []
    for forced in (False, True):
        monkeypatch.setattr(ops, "ALWAYS_DISPATCH", forced)
        a = _args()
        a["parent"] = torch.tensor(PARENTS)
        results.append((_call(a), a["inter"]))
    for direct, dispatched in zip(results[0], results[1], strict=True):
        assert torch.equal(bits(direct), bits(dispatched))


@pytest.mark.interpreter
def test_dt_limit_equals_clamping_dt_beforehand() -> None:
    """``dt_limit`` clamps the discretised dt inside the kernel: the same as handing the
    kernel ``clamp(softplus(dt + dt_bias))`` computed in torch (the runtime's old path),
    and the clamp binds on both sides here (a planted no-op clamp differs)."""
    a = _args()
    a["dt"] = torch.linspace(-4.0, 3.0, BS * T * H).view(BS, T, H)
    lim = (0.2, 1.5)
    got = _call({**a, "dt_limit": lim, "inter": a["inter"].clone()})
    pre = torch.nn.functional.softplus(a["dt"] + a["dt_bias"]).clamp(*lim)
    assert bool((pre == lim[0]).any()) and bool((pre == lim[1]).any()), "the clamp binds"
    plain = {**a, "dt": pre, "dt_bias": None, "dt_softplus": False, "inter": a["inter"].clone()}
    torch.testing.assert_close(got, _call(plain), rtol=1e-5, atol=1e-5)
    unclamped = _call({**a, "inter": a["inter"].clone()})
    assert not torch.allclose(got, unclamped, rtol=1e-3, atol=1e-3)
    ref = torch.empty_like(got)
    from hybridmeta.kernels import ssm_verify_update_reference

    ssm_verify_update_reference(
        a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], ref, a["inter"].clone(),
        a["state_indices"], D=a["D"], z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True,
        dt_limit=lim,
    )  # fmt: skip
    torch.testing.assert_close(got, ref, rtol=3e-4, atol=1e-3)


def test_bs_zero_is_a_no_op() -> None:
    a = _args()
    for k in ("x", "dt", "B", "C", "z", "state_indices", "inter"):
        a[k] = a[k][:0]
    out = _call(a)
    assert out.shape == (0, T, H, P)


BAD: list[tuple[str, str, Any, type[Exception], str]] = [
    ("x 3d", "x", torch.zeros(BS, H, P), ValueError, r"`x` must have shape \[bs, T, nheads"),
    ("x no columns", "x", torch.zeros(BS, 0, H, P), ValueError, r"at least one draft column"),
    ("dt no T", "dt", torch.zeros(BS, H), ValueError, r"`dt` must have shape \[bs, T, nheads\]"),
    ("dt T", "dt", torch.zeros(BS, T + 1, H), ValueError, r"`dt` must have shape"),
    ("B T", "B", torch.zeros(BS, T - 1, G, N), ValueError, r"`B` must have shape"),
    ("B groups", "B", torch.zeros(BS, T, 3, N), ValueError, r"ngroups=3 must divide nheads=4"),
    ("C groups", "C", torch.zeros(BS, T, 1, N), ValueError, r"`C` must have shape"),
    ("z T", "z", torch.zeros(BS, 1, H, P), ValueError, r"`z` must have shape"),
    ("A", "A", torch.zeros(H, P), ValueError, r"`A` must have shape \[nheads\]"),
    (
        "idx rows",
        "state_indices",
        torch.zeros(BS + 1, dtype=torch.long),
        ValueError,
        r"`state_indices` must have shape \[bs\]",
    ),
    ("idx float", "state_indices", torch.zeros(BS), TypeError, r"`state_indices` must have dtype"),
    (
        "inter T",
        "inter",
        torch.zeros(BS, T + 1, H, P, N),
        ValueError,
        r"`inter` must have shape \[bs, T, nheads, headdim, dstate\]",
    ),
    (
        "inter dtype",
        "inter",
        torch.zeros(BS, T, H, P, N, dtype=torch.bfloat16),
        TypeError,
        r"`inter` must have dtype float32",
    ),
    (
        "inter layout",
        "inter",
        torch.zeros(BS, T, H, N, P).transpose(3, 4),
        ValueError,
        r"`inter` must be contiguous within each slot",
    ),
    (
        "parent shape",
        "parent",
        torch.zeros(BS, T + 1, dtype=torch.long),
        ValueError,
        r"`parent` must have shape \[bs, T\]",
    ),
    ("parent dtype", "parent", torch.zeros(BS, T), TypeError, r"`parent` must have dtype"),
    (
        "num_draft shape",
        "num_draft",
        torch.zeros(BS, T, dtype=torch.long),
        ValueError,
        r"`num_draft` must have shape \[bs\]",
    ),
    (
        "out T",
        "out",
        torch.zeros(BS, T - 1, H, P),
        ValueError,
        r"`out` must have shape \[bs, T, nheads, headdim\]",
    ),
    ("state int", "state", torch.zeros(SLOTS, H, P, N, dtype=torch.int32), TypeError, r"`state`"),
    ("dt_limit order", "dt_limit", (1.0, 0.5), ValueError, r"`dt_limit` must have lo <= hi"),
    ("dt_limit nan", "dt_limit", (float("nan"), 1.0), ValueError, r"`dt_limit` must have a finite lo"),
    ("dt_limit one", "dt_limit", (0.5,), ValueError, r"`dt_limit` must be None or a pair"),
    ("inter list", "inter", [0.0], TypeError, r"`inter` must be a torch.Tensor"),
]


@pytest.mark.parametrize(("case", "name", "value", "exc", "match"), BAD, ids=[c[0] for c in BAD])
def test_rejects_bad_argument_and_writes_nothing(
    case: str, name: str, value: Any, exc: type[Exception], match: str
) -> None:
    a = _args()
    a[name] = value
    if name != "out":
        a["out"] = torch.full((BS, T, H, P), float("nan"))
    before = {k: bits(v) for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=match):
        _call(a)
    for k, v in before.items():
        assert torch.equal(bits(a[k]), v), k


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"state_indices": torch.tensor([2, -1, SLOTS])}, r"`state_indices` values must be -1"),
        ({"parent": torch.tensor([[-1, 0, 2, 1], PARENTS[1], PARENTS[2]])}, r"row 0 column 2 holds 2"),
        ({"parent": torch.tensor([[-1, 0, 0, 1], PARENTS[1], [-2, 0, 1, 2]])}, r"row 2 column 0"),
        ({"parent": torch.tensor([[-1, 0, 0, 4], PARENTS[1], PARENTS[2]])}, r"row 0 column 3"),
        ({"num_draft": torch.tensor([T + 1, 0, 1])}, r"`num_draft` values must be in \[0, T=4\]; row 0"),
        ({"num_draft": torch.tensor([1, 0, -1])}, r"row 2 holds -1"),
    ],
)
def test_debug_mode_refuses_bad_indices(change: dict[str, torch.Tensor], match: str) -> None:
    a = {**_args(), **change}
    out = torch.full((BS, T, H, P), float("nan"))
    with debug_mode(), pytest.raises(ValueError, match=match):
        _call({**a, "out": out})
    assert bool(torch.isnan(a["inter"]).all())
    assert bool(torch.isnan(out).all())


@pytest.mark.interpreter
def test_debug_mode_ignores_pad_rows_garbage() -> None:
    """A pad row's tree and count are never read: debug mode must not refuse them."""
    a = _args()
    a["parent"] = torch.tensor(PARENTS)  # row 1 (pad) holds an invalid tree
    a["num_draft"] = torch.tensor([T, T + 9, T])
    _, ref_out = _reference(a)
    with debug_mode():
        out = _call(a)
    assert_close(out, ref_out, "out")


def test_verify_tile_holds_32_state_elements_per_thread() -> None:
    cfg = ssm_verify_launch_config(80, 128)  # Nemotron-Nano-9B-v2
    assert (cfg.block_p, cfg.num_warps) == (8, 1)
    assert cfg.block_p * 128 // (32 * cfg.num_warps) == 32
    assert ssm_verify_launch_config(3, 128).block_p == 4  # never above headdim's pow2
    assert ssm_verify_launch_config(64, 16).block_p == 64


@pytest.mark.parametrize("name", ['state_indices', 'A', 'D', 'dt_bias'])
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
