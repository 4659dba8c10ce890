"""The in-kernel slot bounds of every decode / verify / commit op on the GPU.

``tests/properties/test_kernels_safety.py`` states the rule and checks it on CPU tensors
(the Triton interpreter); this file runs the same kernels' device path (the
``torch.library`` op, which does no host check) on CUDA tensors, with a fixed mix of ids of
every kind (valid, the pad id, just outside the pool, negative, past int32, past 2^40) under
both pad conventions (``-1`` ours/sglang, ``0`` vLLM's null block), and compares with the
pure-torch reference run on the CPU on the same inputs:

* nothing outside the pool changes (the pools are views of larger guard buffers), and a
  slot the reference leaves unchanged is bit-identical;
* the outputs' NaN pattern (rows with an invalid id) equals the reference's, the pad rows'
  zeros too, and every other value agrees within the dtype's tolerance;
* the error record names the same first fault as the reference's.

The ``cpu`` case runs the same comparison under the interpreter, so the test itself is
checked on machines without CUDA. Sizes on the GPU reach the launch paths the decode
step uses (a bf16 SSM state at 130 rows takes 16 rows a program).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hybridmeta.kernels import (
    causal_conv1d_update_reference,
    check_errors,
    conv_verify_update_reference,
    error_record,
    reset_errors,
    spec_commit_reference,
    ssm_state_update_reference,
    ssm_verify_update_reference,
    track_save_reference,
)
from tests.kernels._support import assert_close, bits

_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu-interpreter"),
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs CUDA")],
        id="cuda",
    ),
]
GUARD = 3
Tensors = dict[str, torch.Tensor]
Run = Callable[[Tensors, torch.Tensor, int], None]


def _ids(slots: int, bs: int, pad: int, seed: int, part: int = 0, shift: int = 0) -> list[int]:
    """``bs`` ids: distinct valid slots of the ``part``-th third of the pool (so the slots
    one field writes are never read or written through another field), the pad id and
    invalid ids of every kind, mixed: row ``b`` gets kind ``(b + shift) % 4`` (0, 1 valid,
    2 pad, 3 invalid), so fields with other shifts put an invalid or pad id on rows whose
    first field is valid."""
    g = torch.Generator().manual_seed(seed)
    third = range(part * slots // 3, (part + 1) * slots // 3)
    valid = [third[i] for i in torch.randperm(len(third), generator=g).tolist()]
    valid = [s for s in valid if s != pad]
    invalid = [slots, slots + 5, -2 if pad != -2 else -3, -(2**31) - 3, 2**31 + 5, 2**40]
    if pad != -1:
        invalid.append(-1)  # not the pad id under this convention: an invalid id
    out: list[int] = []
    n_invalid = 0
    for b in range(bs):
        kind = (b + shift) % 4
        if kind in (0, 1) and valid:
            out.append(valid.pop())
        elif kind == 2:
            out.append(pad)
        else:  # the boundary id (`slots`) first, then the others in turn
            out.append(invalid[n_invalid % len(invalid)])
            n_invalid += 1
    return out


def _guarded(shape: tuple[int, ...], slot_dim: int, slots: int, g: torch.Generator,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    full = list(shape)
    full[slot_dim] = slots + 2 * GUARD
    return torch.randn(*full, generator=g).to(dtype)


def _pool(big: torch.Tensor, slot_dim: int, slots: int) -> torch.Tensor:
    return big.narrow(slot_dim, GUARD, slots)


def _compare(
    dev: str,
    op: str,
    inputs: Tensors,
    pools: dict[str, int],
    outs: list[str],
    run_ref: Run,
    run_op: Run,
    pad: int,
    *,
    plain: tuple[str, ...] = (),
    want_fault: bool = True,
) -> None:
    """Run the reference on CPU copies and the op on ``dev`` copies; compare (see module)."""
    ref = {k: v.clone() for k, v in inputs.items()}
    got = {k: v.to(dev).clone() for k, v in inputs.items()}
    reset_errors()
    run_ref(ref, error_record("cpu"), pad)
    want = check_errors("cpu")
    run_op(got, error_record(dev), pad)
    fault = check_errors(dev)
    if want_fault:
        assert want is not None, f"{op}: the case has no invalid id (the test is broken)"
    assert (fault is None) == (want is None), f"{op}: recorded {fault}, the reference {want}"
    if want is not None and fault is not None:
        assert (fault.op, fault.row, fault.field, fault.value) == (
            want.op, want.row, want.field, want.value,
        ), f"{op}: recorded {fault}, the reference {want}"  # fmt: skip
    for name, slot_dim in pools.items():
        before, after, expect = inputs[name], got[name].cpu(), ref[name]
        guard = 0 if name in plain else GUARD
        for j in range(before.shape[slot_dim]):
            was = bits(before.select(slot_dim, j))
            inside = guard <= j < before.shape[slot_dim] - guard
            if not inside or torch.equal(bits(expect.select(slot_dim, j)), was):
                where = f"index {j - guard}" if inside else "the guard outside the pool"
                assert torch.equal(bits(after.select(slot_dim, j)), was), (
                    f"{op} on {dev}: {name} {where} changed, the reference leaves it"
                )
        assert_close(after, expect, f"{op} on {dev}: {name}")
    for name in outs:
        after, expect = got[name].cpu(), ref[name]
        nan = torch.isnan(expect)
        assert torch.equal(torch.isnan(after), nan), f"{op} on {dev}: {name} NaN rows differ"
        if want_fault:
            assert bool(nan.any()), f"{op}: no NaN row in the reference (the test is broken)"
        assert_close(after[~nan], expect[~nan], f"{op} on {dev}: {name}")


def _shapes(dev: str) -> tuple[int, int, int, int]:
    """(heads, headdim, dstate, groups): small under the interpreter."""
    return (16, 64, 64, 2) if dev == "cuda" else (2, 4, 8, 1)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("pad", [-1, 0])
@pytest.mark.parametrize(
    ("state_dtype", "bs"), [(torch.float32, 7), (torch.bfloat16, 7), (torch.bfloat16, 130),
                            (torch.float32, 130)],
)  # fmt: skip
def test_ssm_update_bounds_match_the_reference(
    dev: str, pad: int, state_dtype: torch.dtype, bs: int
) -> None:
    H, P, N, G = _shapes(dev)
    slots = 2 * bs + 4
    g = torch.Generator().manual_seed(bs + pad)
    src = torch.tensor(_ids(slots, bs, pad, seed=bs), dtype=torch.int64)
    dst = torch.tensor(_ids(slots, bs, pad, seed=bs + 1, part=1, shift=2), dtype=torch.int64)
    trk = torch.tensor(_ids(slots, bs, pad, seed=bs + 2, part=2, shift=3), dtype=torch.int64)
    inputs: Tensors = {
        "state": _guarded((slots, H, P, N), 0, slots, g, state_dtype),
        "x": torch.randn(bs, H, P, generator=g).bfloat16(),
        "z": torch.randn(bs, H, P, generator=g).bfloat16(),
        "dt": torch.randn(bs, H, generator=g).bfloat16(),
        "A": -torch.rand(H, generator=g),
        "D": torch.randn(H, generator=g),
        "dt_bias": torch.randn(H, generator=g),
        "B": torch.randn(bs, G, N, generator=g).bfloat16(),
        "C": torch.randn(bs, G, N, generator=g).bfloat16(),
        "out": torch.full((bs, H, P), 7.0).bfloat16(),
        "src": src,
        "dst": dst,
        "trk": trk,
        "mask": torch.arange(bs) % 3 == 0,
    }

    def run_ref(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        ssm_state_update_reference(
            _pool(t["state"], 0, slots), t["x"], t["dt"], t["A"], t["B"], t["C"], t["out"],
            t["src"], D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True,
            dst_indices=t["dst"], track_indices=t["trk"], track_mask=t["mask"],
            pad_slot_id=pad, errors=rec,
        )  # fmt: skip

    def run_op(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        torch.ops.hybridmeta.ssm_state_update(
            _pool(t["state"], 0, slots), t["x"], t["dt"], t["A"], t["B"], t["C"], t["out"],
            t["src"], t["D"], t["z"], t["dt_bias"], True, t["dst"], t["trk"], t["mask"],
            float("-inf"), float("inf"), pad, rec,
        )  # fmt: skip

    _compare(dev, "ssm_state_update", inputs, {"state": 0}, ["out"], run_ref, run_op, pad)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("pad", [-1, 0])
@pytest.mark.parametrize("bs", [9, 130])
def test_conv_update_bounds_match_the_reference(dev: str, pad: int, bs: int) -> None:
    D, K = (1024, 4) if dev == "cuda" else (6, 4)
    slots = 2 * bs + 4
    g = torch.Generator().manual_seed(bs)
    inputs: Tensors = {
        "x": torch.randn(bs, D, generator=g).bfloat16(),
        "cs": _guarded((slots, D, K - 1), 0, slots, g, torch.bfloat16),
        "w": torch.randn(D, K, generator=g).bfloat16(),
        "bias": torch.randn(D, generator=g).bfloat16(),
        "out": torch.full((bs, D), 7.0).bfloat16(),
        "src": torch.tensor(_ids(slots, bs, pad, seed=bs), dtype=torch.int64),
    }

    def run_ref(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        causal_conv1d_update_reference(
            t["x"], _pool(t["cs"], 0, slots), t["w"], t["bias"], t["out"], t["src"], silu=True,
            pad_slot_id=pad, errors=rec,
        )  # fmt: skip

    def run_op(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        torch.ops.hybridmeta.causal_conv1d_update(
            t["x"], _pool(t["cs"], 0, slots), t["w"], t["bias"], t["out"], t["src"], True, pad,
            rec,
        )  # fmt: skip

    _compare(dev, "causal_conv1d_update", inputs, {"cs": 0}, ["out"], run_ref, run_op, pad)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("pad", [-1, 0])
def test_track_save_bounds_match_the_reference(dev: str, pad: int) -> None:
    bs, L = 24, 3
    H, P, N, _ = _shapes(dev)
    slots = 2 * bs + 4
    g = torch.Generator().manual_seed(3)
    src = _ids(slots, bs, pad, seed=1)
    trk = _ids(slots, bs, pad, seed=2, part=1, shift=3)
    inputs: Tensors = {
        "conv": _guarded((L, slots, 64, 3), 1, slots, g, torch.bfloat16),
        "ssm": _guarded((L, slots, H, P, N), 1, slots, g),
        "src": torch.tensor(src, dtype=torch.int64),
        "trk": torch.tensor(trk, dtype=torch.int64),
        "mask": torch.arange(bs) % 5 != 4,
    }

    def run_ref(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        track_save_reference(
            _pool(t["conv"], 1, slots), _pool(t["ssm"], 1, slots), t["src"], t["trk"], t["mask"],
            pad_slot_id=pad, errors=rec,
        )  # fmt: skip

    def run_op(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        torch.ops.hybridmeta.track_save(
            _pool(t["conv"], 1, slots), _pool(t["ssm"], 1, slots), t["src"], t["trk"], t["mask"],
            pad, rec,
        )  # fmt: skip

    _compare(dev, "track_save", inputs, {"conv": 1, "ssm": 1}, [], run_ref, run_op, pad)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("pad", [-1, 0])
@pytest.mark.parametrize("which", ["ssm", "conv"])
def test_verify_bounds_match_the_reference(dev: str, pad: int, which: str) -> None:
    bs, T = 12, 4
    H, P, N, G = _shapes(dev)
    D, K = (1024, 4) if dev == "cuda" else (6, 4)
    slots = 2 * bs + 4
    g = torch.Generator().manual_seed(5)
    src = torch.tensor(_ids(slots, bs, pad, seed=7), dtype=torch.int64)
    num_draft = torch.randint(0, T + 1, (bs,), generator=g)
    num_draft[1] = T + 2  # an impossible count on a valid row
    inputs: Tensors = {"src": src, "nd": num_draft}
    if which == "ssm":
        inputs |= {
            "pool": _guarded((slots, H, P, N), 0, slots, g),
            "x": torch.randn(bs, T, H, P, generator=g).bfloat16(),
            "dt": torch.randn(bs, T, H, generator=g).bfloat16(),
            "A": -torch.rand(H, generator=g),
            "B": torch.randn(bs, T, G, N, generator=g).bfloat16(),
            "C": torch.randn(bs, T, G, N, generator=g).bfloat16(),
            "out": torch.full((bs, T, H, P), 7.0).bfloat16(),
            "inter": torch.randn(bs, T, H, P, N, generator=g),
        }
    else:
        inputs |= {
            "pool": _guarded((slots, D, K - 1), 0, slots, g, torch.bfloat16),
            "x": torch.randn(bs, T, D, generator=g).bfloat16(),
            "w": torch.randn(D, K, generator=g).bfloat16(),
            "out": torch.full((bs, T, D), 7.0).bfloat16(),
            "inter": torch.randn(bs, T, D, K - 1, generator=g).bfloat16(),
        }

    def run_ref(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        pool = _pool(t["pool"], 0, slots)
        if which == "ssm":
            ssm_verify_update_reference(
                pool, t["x"], t["dt"], t["A"], t["B"], t["C"], t["out"], t["inter"], t["src"],
                num_draft=t["nd"], pad_slot_id=pad, errors=rec,
            )  # fmt: skip
        else:
            conv_verify_update_reference(
                t["x"], pool, t["w"], None, t["out"], t["inter"], t["src"], silu=True,
                num_draft=t["nd"], pad_slot_id=pad, errors=rec,
            )  # fmt: skip

    def run_op(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        pool = _pool(t["pool"], 0, slots)
        if which == "ssm":
            torch.ops.hybridmeta.ssm_verify_update(
                pool, t["x"], t["dt"], t["A"], t["B"], t["C"], t["out"], t["inter"], t["src"],
                None, None, None, False, None, t["nd"], float("-inf"), float("inf"), pad, rec,
            )  # fmt: skip
        else:
            torch.ops.hybridmeta.conv_verify_update(
                t["x"], pool, t["w"], None, t["out"], t["inter"], t["src"], True, None, t["nd"],
                pad, rec,
            )  # fmt: skip

    op = f"{which}_verify_update"
    # `inter` is row-major too: entries the reference leaves are compared bit for bit
    _compare(
        dev, op, inputs, {"pool": 0, "inter": 0}, ["out"], run_ref, run_op, pad, plain=("inter",)
    )


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("pad", [-1, 0])
def test_spec_commit_bounds_match_the_reference(dev: str, pad: int) -> None:
    bs, T, L = 12, 4, 3
    H, P, N, _ = _shapes(dev)
    slots = 2 * bs + 4
    g = torch.Generator().manual_seed(9)
    src = _ids(slots, bs, pad, seed=11)
    trk = _ids(slots, bs, pad, seed=12, part=1, shift=3)
    acc = torch.randint(-1, T, (bs,), generator=g)
    acc[4] = T + 1  # an impossible accepted column on a valid row
    inputs: Tensors = {
        "conv": _guarded((L, slots, 64, 3), 1, slots, g, torch.bfloat16),
        "ssm": _guarded((L, slots, H, P, N), 1, slots, g),
        "i_conv": torch.randn(L, bs, T, 64, 3, generator=g).bfloat16(),
        "i_ssm": torch.randn(L, bs, T, H, P, N, generator=g),
        "src": torch.tensor(src, dtype=torch.int64),
        "acc": acc,
        "trk": torch.tensor(trk, dtype=torch.int64),
        "mask": torch.arange(bs) % 3 == 1,
        "tok": torch.randint(-1, T, (bs,), generator=g),
    }

    def run_ref(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        spec_commit_reference(
            _pool(t["conv"], 1, slots), _pool(t["ssm"], 1, slots), t["i_conv"], t["i_ssm"],
            t["src"], t["acc"], t["trk"], t["mask"], t["tok"], pad_slot_id=pad, errors=rec,
        )  # fmt: skip

    def run_op(t: Tensors, rec: torch.Tensor, pad: int) -> None:
        torch.ops.hybridmeta.spec_commit(
            _pool(t["conv"], 1, slots), _pool(t["ssm"], 1, slots), t["i_conv"], t["i_ssm"],
            t["src"], t["acc"], t["trk"], t["mask"], t["tok"], pad, rec,
        )  # fmt: skip

    _compare(dev, "spec_commit", inputs, {"conv": 1, "ssm": 1}, [], run_ref, run_op, pad)
