"""Memory safety of every decode / verify / commit op for every id value, both implementations.

Each property draws slot ids of every kind (pad rows under a declared pad id, valid slots,
invalid ids: just outside the pool, far below, past int32) and runs the op's Triton
kernel (through its ``torch.library`` op, which does no host check: the device path) and
its pure-torch reference on pools that are views ``big[g:g+S]`` of a larger guard
buffer. Then:

* every byte outside the pool, and every slot no valid live row writes, is unchanged;
* pad rows have zero output, rows with an invalid id NaN output and write nothing;
* the error record names the first fault (least row, then field), as this file's own
  statement of the rule computes it; a clean call leaves it clean;
* both implementations agree on the rows that are valid;
* the public op on these CPU tensors refuses a faulty call with ``SlotIndexError`` naming
  the same fault before writing anything, and otherwise equals the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridmeta.kernels import (
    SlotIndexError,
    causal_conv1d_update,
    causal_conv1d_update_reference,
    check_errors,
    conv_verify_update,
    conv_verify_update_reference,
    error_record,
    reset_errors,
    spec_commit,
    spec_commit_reference,
    ssm_state_update,
    ssm_state_update_reference,
    ssm_verify_update,
    ssm_verify_update_reference,
    track_save,
    track_save_reference,
)
from hybridmeta.kernels._config import SsmLaunchConfig
from hybridmeta.kernels.ssm_update import launch_ssm_update
from tests.kernels._support import assert_close, bits
from tests.properties.strategies import kernels as kst

CPU = torch.device("cpu")
INT32 = (-(2**31), 2**31 - 1)
#: A fault: (row, field, value as the record holds it: saturated to int32).
Fault = tuple[int, str, int]


def _sat(v: int) -> int:
    return min(max(v, INT32[0]), INT32[1])


def _first(faults: list[tuple[int, int, str, int]]) -> Fault | None:
    """The least ``(row, field id, value)`` fault: the one the record must name."""
    if not faults:
        return None
    row, _, name, value = min((r, f, n, _sat(v)) for r, f, n, v in faults)
    return row, name, value


def _guarded(
    shape: tuple[int, ...], slot_dim: int, ids: kst.Ids, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(big, pool)``: the pool is ``big`` narrowed to ``[guard, guard + slots)`` along
    ``slot_dim``; the guard slots around it hold random values too."""
    full = list(shape)
    full[slot_dim] = ids.slots + 2 * ids.guard
    big = torch.randn(*full, generator=g).to(dtype)
    return big, big.narrow(slot_dim, ids.guard, ids.slots)


def _check_pool(
    what: str,
    before: torch.Tensor,
    after: torch.Tensor,
    slot_dim: int,
    ids: kst.Ids,
    written: set[int],
) -> None:
    """Only the ``written`` slots of the pool may differ; the guard slots never."""
    for j in range(after.shape[slot_dim]):
        slot = j - ids.guard
        if slot in written:
            continue
        same = torch.equal(bits(after.select(slot_dim, j)), bits(before.select(slot_dim, j)))
        where = "the guard buffer outside the pool" if not 0 <= slot < ids.slots else f"slot {slot}"
        assert same, f"{what}: {where} changed but no valid live row writes it"


def _check_record(what: str, op: str, want: Fault | None) -> None:
    got = check_errors(CPU)
    if want is None:
        assert got is None, f"{what}: a clean call recorded {got}"
        return
    assert got is not None, f"{what}: the fault {want} was not recorded"
    assert (got.op, got.row, got.field, got.value) == (op, want[0], want[1], want[2]), (
        f"{what}: recorded {got}, expected {op} {want}"
    )


def _check_public(
    op: str, want: Fault | None, call: Callable[[], Any], state: list[torch.Tensor]
) -> bool:
    """The public op on CPU tensors: a faulty call raises naming the fault and writes
    nothing; returns whether it ran."""
    if want is None:
        call()
        return True
    before = [bits(t) for t in state]
    with pytest.raises(SlotIndexError) as info:
        call()
    e = info.value
    assert (e.op, e.row, e.field, e.value) == (op, want[0], want[1], want[2]), str(e)
    assert f"`{want[1]}`" in str(e) and f"row {want[0]}" in str(e)
    for b, t in zip(before, state, strict=True):
        assert torch.equal(bits(t), b), f"{op}: the refused call wrote"
    assert check_errors(CPU) is None, "the host check records nothing (it raised)"
    return False


def _idx(values: tuple[int, ...], ids: kst.Ids) -> torch.Tensor:
    return torch.tensor(values, dtype=ids.dtype)


def _rows_out(
    what: str, out: torch.Tensor, pad_rows: list[int], bad_rows: list[int]
) -> None:
    for r in pad_rows:
        assert bool((out[r] == 0).all()), f"{what}: pad row {r} output is not zero"
    for r in bad_rows:
        assert bool(torch.isnan(out[r]).all()), f"{what}: invalid row {r} output is not NaN"


# --------------------------------------------------------------------------- SSM update


def _ssm_expect(c: kst.SafeSsmCase) -> tuple[Fault | None, list[int], list[int], set[int]]:
    """This file's statement of the rule: (first fault, pad rows, bad rows, written slots)."""
    ids = c.ids
    faults: list[tuple[int, int, str, int]] = []
    pads: list[int] = []
    bad: list[int] = []
    written: set[int] = set()
    for b, s in enumerate(c.src):
        if ids.kind(s) == "pad":
            pads.append(b)
            continue
        row: list[tuple[int, int, str, int]] = []
        if ids.kind(s) == "invalid":
            row.append((b, 0, "state_indices", s))
        else:
            if c.dst is not None and ids.kind(c.dst[b]) == "invalid":
                row.append((b, 1, "dst_indices", c.dst[b]))
            flagged = c.track is not None and c.mask is not None and c.mask[b]
            if flagged and c.track is not None and ids.kind(c.track[b]) == "invalid":
                row.append((b, 2, "track_indices", c.track[b]))
        if row:
            faults += row
            bad.append(b)
            continue
        d = c.dst[b] if c.dst is not None else s
        if ids.valid(d):
            written.add(d)
        if c.track is not None and c.mask is not None and c.mask[b] and ids.valid(c.track[b]):
            written.add(c.track[b])
    return _first(faults), pads, bad, written


_SSM_SHAPES = (
    ("row walk", SsmLaunchConfig(block_p=2, num_warps=1, row_walk=True, row_block=2)),
    ("1 row a program", SsmLaunchConfig(block_p=2, num_warps=1, row_walk=False, tile_rows=1)),
    ("2 rows a program", SsmLaunchConfig(block_p=2, num_warps=1, row_walk=False, tile_rows=2)),
    ("4 rows a program", SsmLaunchConfig(block_p=2, num_warps=1, row_walk=False, tile_rows=4)),
    # Late poisoning (the bf16 / fp16 tiles' default): zeros first, NaN after the stores.
    ("1 row a program, late poison",
     SsmLaunchConfig(block_p=2, num_warps=1, row_walk=False, tile_rows=1, late_poison=True)),
    ("4 rows a program, late poison",
     SsmLaunchConfig(block_p=2, num_warps=1, row_walk=False, tile_rows=4, late_poison=True)),
)


@given(case=kst.safe_ssm_cases())
def test_ssm_update_is_memory_safe_for_every_id(case: kst.SafeSsmCase) -> None:
    ids, bs = case.ids, case.bs
    H, P, N = case.nheads, case.headdim, case.dstate
    g = torch.Generator().manual_seed(case.seed)
    want, pads, bad, written = _ssm_expect(case)
    x, dt = torch.randn(bs, H, P, generator=g), torch.randn(bs, H, generator=g)
    A, B, C = -torch.rand(H, generator=g), torch.randn(bs, 1, N, generator=g), torch.randn(bs, 1, N, generator=g)
    src = _idx(case.src, ids)
    dst = None if case.dst is None else _idx(case.dst, ids)
    trk = None if case.track is None else _idx(case.track, ids)
    mask = None if case.mask is None else torch.tensor(case.mask)
    big0, _ = _guarded((ids.slots, H, P, N), 0, ids, torch.float32, g)
    results = []
    rec = error_record(CPU)
    for impl in ("triton", "reference"):
        big = big0.clone()
        state = big[ids.guard : ids.guard + ids.slots]
        out = torch.full((bs, H, P), 7.0)
        reset_errors(CPU)
        if impl == "triton":
            torch.ops.hybridmeta.ssm_state_update(
                state, x, dt, A, B, C, out, src, None, None, None, False, dst, trk, mask,
                float("-inf"), float("inf"), ids.pad, rec,
            )  # fmt: skip
        else:
            ssm_state_update_reference(
                state, x, dt, A, B, C, out, src, dst_indices=dst, track_indices=trk,
                track_mask=mask, pad_slot_id=ids.pad, errors=rec,
            )  # fmt: skip
        _check_pool(f"ssm {impl}", big0, big, 0, ids, written)
        _rows_out(f"ssm {impl}", out, pads, bad)
        _check_record(f"ssm {impl}", "ssm_state_update", want)
        results.append((out, big))
    live = [b for b in range(bs) if b not in pads and b not in bad]
    assert_close(results[0][0][live], results[1][0][live], "ssm: triton vs reference output")
    assert_close(results[0][1], results[1][1], "ssm: triton vs reference pool")
    # Every launch shape of the Triton kernel judges and reports alike: the row walk, one
    # row a program, and 2 / 4 rows a program (the block's rows judged once, its least bad
    # row reported after the row loop).
    for name, cfg in _SSM_SHAPES:
        big = big0.clone()
        state = big[ids.guard : ids.guard + ids.slots]
        out = torch.full((bs, H, P), 7.0)
        reset_errors(CPU)
        launch_ssm_update(
            state, x, dt, A, B, C, out, src, D=None, z=None, dt_bias=None, dt_softplus=False,
            dst_indices=dst, track_indices=trk, track_mask=mask, config=cfg,
            pad_slot_id=ids.pad, errors=rec,
        )  # fmt: skip
        _check_pool(f"ssm {name}", big0, big, 0, ids, written)
        _rows_out(f"ssm {name}", out, pads, bad)
        _check_record(f"ssm {name}", "ssm_state_update", want)
        assert_close(out[live], results[1][0][live], f"ssm {name} vs reference output")
        assert_close(big, results[1][1], f"ssm {name} vs reference pool")

    big = big0.clone()
    state = big[ids.guard : ids.guard + ids.slots]
    ran = _check_public(
        "ssm_state_update", want,
        lambda: ssm_state_update(
            state, x, dt, A, B, C, state_indices=src, dst_indices=dst, track_indices=trk,
            track_mask=mask, pad_slot_id=ids.pad, impl="reference",
        ), [big],
    )  # fmt: skip
    if ran:
        assert torch.equal(bits(big), bits(results[1][1]))


# --------------------------------------------------------------------------- conv update


@given(case=kst.safe_rows_cases(with_track=False), channels_contiguous=st.booleans())
def test_conv_update_is_memory_safe_for_every_id(
    case: kst.SafeRowsCase, channels_contiguous: bool
) -> None:
    """Both pool layouts: ``[slots, conv_dim, k-1]`` (one row a program) and ``[slots, k-1,
    conv_dim]`` storage (four rows a program: the least bad row of a block is reported)."""
    ids, bs = case.ids, case.bs
    g = torch.Generator().manual_seed(case.seed)
    D, K = 5, 3
    faults = [(b, 0, "cache_indices", s) for b, s in enumerate(case.src) if ids.kind(s) == "invalid"]
    want = _first(faults)
    pads = [b for b, s in enumerate(case.src) if ids.kind(s) == "pad"]
    bad = [b for b, s in enumerate(case.src) if ids.kind(s) == "invalid"]
    written = {s for s in case.src if ids.valid(s)}
    x, w = torch.randn(bs, D, generator=g), torch.randn(D, K, generator=g)
    src = _idx(case.src, ids)
    shape = (ids.slots, K - 1, D) if channels_contiguous else (ids.slots, D, K - 1)
    big0, _ = _guarded(shape, 0, ids, torch.float32, g)

    def pool(big: torch.Tensor) -> torch.Tensor:
        cs = big[ids.guard : ids.guard + ids.slots]
        return cs.transpose(1, 2) if channels_contiguous else cs

    rec = error_record(CPU)
    results = []
    for impl in ("triton", "reference"):
        big = big0.clone()
        cs = pool(big)
        out = torch.full((bs, D), 7.0)
        reset_errors(CPU)
        if impl == "triton":
            torch.ops.hybridmeta.causal_conv1d_update(x, cs, w, None, out, src, True, ids.pad, rec)
        else:
            causal_conv1d_update_reference(
                x, cs, w, None, out, src, silu=True, pad_slot_id=ids.pad, errors=rec
            )
        _check_pool(f"conv {impl}", big0, big, 0, ids, written)
        _rows_out(f"conv {impl}", out, pads, bad)
        _check_record(f"conv {impl}", "causal_conv1d_update", want)
        results.append((out, big))
    live = [b for b in range(bs) if b not in pads and b not in bad]
    assert_close(results[0][0][live], results[1][0][live], "conv: triton vs reference output")
    assert_close(results[0][1], results[1][1], "conv: triton vs reference pool")

    big = big0.clone()
    cs = pool(big)
    ran = _check_public(
        "causal_conv1d_update", want,
        lambda: causal_conv1d_update(
            x, cs, w, cache_indices=src, pad_slot_id=ids.pad, impl="reference"
        ), [big],
    )  # fmt: skip
    if ran:
        assert torch.equal(bits(big), bits(results[1][1]))


# --------------------------------------------------------------------------- track-save


@given(case=kst.safe_rows_cases(with_track=True))
def test_track_save_is_memory_safe_for_every_id(case: kst.SafeRowsCase) -> None:
    ids = case.ids
    assert case.track is not None and case.mask is not None
    g = torch.Generator().manual_seed(case.seed)
    faults: list[tuple[int, int, str, int]] = []
    written: set[int] = set()
    for b, (s, t, m) in enumerate(zip(case.src, case.track, case.mask, strict=True)):
        if not m:
            continue
        if ids.kind(s) == "invalid":
            faults.append((b, 0, "src_indices", s))
        elif ids.valid(s) and ids.kind(t) == "invalid":
            faults.append((b, 1, "track_indices", t))
        elif ids.valid(s) and ids.valid(t):
            written.add(t)
    want = _first(faults)
    src, trk, mask = _idx(case.src, ids), _idx(case.track, ids), torch.tensor(case.mask)
    L = 2
    ssm0, _ = _guarded((L, ids.slots, 1, 2, 3), 1, ids, torch.float32, g)
    conv0, _ = _guarded((L, ids.slots, 4, 2), 1, ids, torch.bfloat16, g)
    rec = error_record(CPU)
    results = []
    for impl in ("triton", "reference"):
        ssm_big, conv_big = ssm0.clone(), conv0.clone()
        ssm = ssm_big[:, ids.guard : ids.guard + ids.slots]
        conv = conv_big[:, ids.guard : ids.guard + ids.slots]
        reset_errors(CPU)
        if impl == "triton":
            torch.ops.hybridmeta.track_save(conv, ssm, src, trk, mask, ids.pad, rec)
        else:
            track_save_reference(conv, ssm, src, trk, mask, pad_slot_id=ids.pad, errors=rec)
        _check_pool(f"track_save {impl} ssm", ssm0, ssm_big, 1, ids, written)
        _check_pool(f"track_save {impl} conv", conv0, conv_big, 1, ids, written)
        _check_record(f"track_save {impl}", "track_save", want)
        results.append((ssm_big, conv_big))
    for a, b in zip(*results, strict=True):
        assert torch.equal(bits(a), bits(b)), "track_save: triton and reference copies differ"

    ssm_big, conv_big = ssm0.clone(), conv0.clone()
    ssm = ssm_big[:, ids.guard : ids.guard + ids.slots]
    conv = conv_big[:, ids.guard : ids.guard + ids.slots]
    ran = _check_public(
        "track_save", want,
        lambda: track_save(
            conv, ssm, src_indices=src, track_indices=trk, track_mask=mask, pad_slot_id=ids.pad,
            impl="reference",
        ), [ssm_big, conv_big],
    )  # fmt: skip
    if ran:
        assert torch.equal(bits(ssm_big), bits(results[1][0]))


# --------------------------------------------------------------------------- verify


def _verify_expect(
    c: kst.SafeVerifyCase, slot_field: str
) -> tuple[Fault | None, list[int], list[int], dict[int, int]]:
    """(first fault, pad rows, bad rows, live columns of each live row)."""
    ids = c.ids
    faults: list[tuple[int, int, str, int]] = []
    pads, bad = [], []
    live: dict[int, int] = {}
    for b, s in enumerate(c.src):
        if ids.kind(s) == "pad":
            pads.append(b)
            continue
        if ids.kind(s) == "invalid":
            faults.append((b, 0, slot_field, s))
            bad.append(b)
            continue
        n = c.num_draft[b] if c.num_draft is not None else c.T
        if not 0 <= n <= c.T:
            faults.append((b, 1, "num_draft", n))
            bad.append(b)
            continue
        if c.parent is not None:
            wrong = [p for t, p in enumerate(c.parent[b][:n]) if not -1 <= p < t]
            if wrong:
                faults.append((b, 2, "parent", wrong[0]))
                bad.append(b)
                continue
        live[b] = n
    return _first(faults), pads, bad, live


@pytest.mark.parametrize("which", ["ssm", "conv"])
@given(case=kst.safe_verify_cases())
def test_verify_is_memory_safe_for_every_id(which: str, case: kst.SafeVerifyCase) -> None:
    ids, bs, T = case.ids, case.bs, case.T
    g = torch.Generator().manual_seed(case.seed)
    want, pads, bad, live = _verify_expect(
        case, "state_indices" if which == "ssm" else "cache_indices"
    )
    src = _idx(case.src, ids)
    nd = None if case.num_draft is None else _idx(case.num_draft, ids)
    par = None if case.parent is None else torch.tensor(case.parent, dtype=ids.dtype)
    H, P, N, D, K = 1, 2, 3, 4, 3
    if which == "ssm":
        big0, _ = _guarded((ids.slots, H, P, N), 0, ids, torch.float32, g)
        x, dt = torch.randn(bs, T, H, P, generator=g), torch.randn(bs, T, H, generator=g)
        A = -torch.rand(H, generator=g)
        B, C = torch.randn(bs, T, 1, N, generator=g), torch.randn(bs, T, 1, N, generator=g)
        inter0 = torch.randn(bs, T, H, P, N, generator=g)
        out_shape: tuple[int, ...] = (bs, T, H, P)
    else:
        big0, _ = _guarded((ids.slots, D, K - 1), 0, ids, torch.float32, g)
        x, w = torch.randn(bs, T, D, generator=g), torch.randn(D, K, generator=g)
        inter0 = torch.randn(bs, T, D, K - 1, generator=g)
        out_shape = (bs, T, D)
    op = "ssm_verify_update" if which == "ssm" else "conv_verify_update"
    rec = error_record(CPU)
    results = []
    for impl in ("triton", "reference"):
        big, inter = big0.clone(), inter0.clone()
        pool = big[ids.guard : ids.guard + ids.slots]
        out = torch.full(out_shape, 7.0)
        reset_errors(CPU)
        if which == "ssm" and impl == "triton":
            torch.ops.hybridmeta.ssm_verify_update(
                pool, x, dt, A, B, C, out, inter, src, None, None, None, False, par, nd,
                float("-inf"), float("inf"), ids.pad, rec,
            )  # fmt: skip
        elif which == "ssm":
            ssm_verify_update_reference(
                pool, x, dt, A, B, C, out, inter, src, parent=par, num_draft=nd,
                pad_slot_id=ids.pad, errors=rec,
            )  # fmt: skip
        elif impl == "triton":
            torch.ops.hybridmeta.conv_verify_update(
                x, pool, w, None, out, inter, src, True, par, nd, ids.pad, rec
            )
        else:
            conv_verify_update_reference(
                x, pool, w, None, out, inter, src, silu=True, parent=par, num_draft=nd,
                pad_slot_id=ids.pad, errors=rec,
            )  # fmt: skip
        assert torch.equal(bits(big), bits(big0)), f"{op} {impl}: the pool (or its guard) changed"
        for b in range(bs):
            for t in range(T):
                kept = b in live and t < live[b]
                if not kept:
                    assert torch.equal(bits(inter[b, t]), bits(inter0[b, t])), (
                        f"{op} {impl}: inter[{b}, {t}] written, but not a live column"
                    )
                    if b not in bad:
                        assert bool((out[b, t] == 0).all()), f"{op} {impl}: out[{b}, {t}] not 0"
        _rows_out(f"{op} {impl}", out, pads, bad)
        _check_record(f"{op} {impl}", op, want)
        results.append((out, inter))
    rows = sorted(live)
    assert_close(results[0][0][rows], results[1][0][rows], f"{op}: triton vs reference output")
    assert_close(results[0][1][rows], results[1][1][rows], f"{op}: triton vs reference inter")

    inter = inter0.clone()
    pool = big0.clone()[ids.guard : ids.guard + ids.slots]
    if which == "ssm":
        _check_public(
            op, want,
            lambda: ssm_verify_update(
                pool, x, dt, A, B, C, state_indices=src, inter=inter, parent=par, num_draft=nd,
                pad_slot_id=ids.pad, impl="reference",
            ), [inter],
        )  # fmt: skip
    else:
        _check_public(
            op, want,
            lambda: conv_verify_update(
                x, pool, w, cache_indices=src, inter=inter, parent=par, num_draft=nd,
                pad_slot_id=ids.pad, impl="reference",
            ), [inter],
        )  # fmt: skip


# --------------------------------------------------------------------------- commit


@given(case=kst.safe_commit_cases())
def test_spec_commit_is_memory_safe_for_every_id(case: kst.SafeCommitCase) -> None:
    ids, bs, T = case.ids, case.bs, case.T
    g = torch.Generator().manual_seed(case.seed)
    faults: list[tuple[int, int, str, int]] = []
    written: set[int] = set()
    for b, s in enumerate(case.src):
        if ids.kind(s) == "pad":
            continue
        if ids.kind(s) == "invalid":
            faults.append((b, 0, "state_indices", s))
            continue
        row: list[tuple[int, int, str, int]] = []
        a = case.acc[b]
        if not -1 <= a < T:
            row.append((b, 1, "accepted_index", a))
        tracked = case.track is not None and case.mask is not None and case.mask[b]
        if tracked:
            assert case.track is not None and case.token is not None
            t, k = case.track[b], case.token[b]
            if ids.kind(t) == "invalid":
                row.append((b, 2, "track_indices", t))
            elif ids.valid(t) and not -1 <= k < T:
                row.append((b, 3, "track_token", k))
        if row:
            faults += row
            continue
        if a >= 0:
            written.add(s)
        if tracked and ids.valid(case.track[b]) and case.token[b] >= 0:  # type: ignore[index]
            written.add(case.track[b])  # type: ignore[index]
    want = _first(faults)
    L = 2
    ssm0, _ = _guarded((L, ids.slots, 1, 2, 3), 1, ids, torch.float32, g)
    conv0, _ = _guarded((L, ids.slots, 4, 2), 1, ids, torch.float32, g)
    i_ssm = torch.randn(L, bs, T, 1, 2, 3, generator=g)
    i_conv = torch.randn(L, bs, T, 4, 2, generator=g)
    src, acc = _idx(case.src, ids), _idx(case.acc, ids)
    trk = None if case.track is None else _idx(case.track, ids)
    mask = None if case.mask is None else torch.tensor(case.mask)
    tok = None if case.token is None else _idx(case.token, ids)
    rec = error_record(CPU)
    results = []
    for impl in ("triton", "reference"):
        ssm_big, conv_big = ssm0.clone(), conv0.clone()
        ssm = ssm_big[:, ids.guard : ids.guard + ids.slots]
        conv = conv_big[:, ids.guard : ids.guard + ids.slots]
        reset_errors(CPU)
        if impl == "triton":
            torch.ops.hybridmeta.spec_commit(
                conv, ssm, i_conv, i_ssm, src, acc, trk, mask, tok, ids.pad, rec
            )
        else:
            spec_commit_reference(
                conv, ssm, i_conv, i_ssm, src, acc, trk, mask, tok, pad_slot_id=ids.pad,
                errors=rec,
            )  # fmt: skip
        _check_pool(f"commit {impl} ssm", ssm0, ssm_big, 1, ids, written)
        _check_pool(f"commit {impl} conv", conv0, conv_big, 1, ids, written)
        _check_record(f"commit {impl}", "spec_commit", want)
        results.append((ssm_big, conv_big))
    for a, b in zip(*results, strict=True):
        assert torch.equal(bits(a), bits(b)), "spec_commit: triton and reference copies differ"

    ssm_big, conv_big = ssm0.clone(), conv0.clone()
    ssm = ssm_big[:, ids.guard : ids.guard + ids.slots]
    conv = conv_big[:, ids.guard : ids.guard + ids.slots]
    ran = _check_public(
        "spec_commit", want,
        lambda: spec_commit(
            conv, ssm, i_conv, i_ssm, state_indices=src, accepted_index=acc, track_indices=trk,
            track_mask=mask, track_token=tok, pad_slot_id=ids.pad, impl="reference",
        ), [ssm_big, conv_big],
    )  # fmt: skip
    if ran:
        assert torch.equal(bits(ssm_big), bits(results[1][0]))
