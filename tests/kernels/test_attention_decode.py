"""Decode attention over the KV caches: the KV write and the attention, against references."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hybridmeta.kernels._dispatch as dispatch
from hybridmeta import debug_mode
from hybridmeta.debug import is_debug
from hybridmeta.graphs import default_backend
from hybridmeta.kernels import (
    Impl,
    decode_attention,
    decode_attention_reference,
    kv_cache_write,
    kv_cache_write_reference,
)
from hybridmeta.kernels.attention_decode import attention_splits, launch_decode_attention
from tests.kernels._support import DEVICE, assert_close, bits, nan_empty
from tests.op_log import OpLog

pytestmark = pytest.mark.interpreter if DEVICE.type == "cpu" else pytest.mark.gpu

S, M, KVH = 3, 80, 2  # working slots (+ the scratch row), keys per slot, KV heads
SLOTS = [2, 0, -1, 1]  # row 2 is a pad row
FIRST = [0, 61, 7, 77]  # position of each row's first token (T=3 ends at 63 and 79)


def _rnd(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


def _positions(T: int, first: list[int] | None = None) -> torch.Tensor:
    """``[4, T]`` consecutive positions per row from ``first`` (a verify row's pending token
    and drafts). Default: ``FIRST``, or for ``T = 1`` positions 0, 64 (the first key of the
    second 64-key tile), 7 and 79 (the last key)."""
    if first is None:
        first = FIRST if T > 1 else [0, 64, 7, 79]
    start = torch.tensor(first, dtype=torch.int64)
    return (start[:, None] + torch.arange(T)).to(DEVICE)


class Pool:
    """KV caches ``[S + 1, M, KVH, hd]`` (row S: scratch) inside a NaN buffer with one guard
    row on each side, so that a write through slot -1 or past the scratch row shows."""

    def __init__(self, hd: int, dtype: torch.dtype, *, fill: float = float("nan")) -> None:
        self.kbuf = torch.full((S + 3, M, KVH, hd), fill, dtype=dtype, device=DEVICE)
        self.vbuf = self.kbuf.clone()
        self.k, self.v = self.kbuf[1 : S + 2], self.vbuf[1 : S + 2]

    def prefix(self, slots: list[int], lengths: list[int], seed: int) -> None:
        """Finite keys and values at positions ``0 .. length - 1`` of each live row's slot;
        every other cell keeps its fill (NaN: stale garbage)."""
        for i, (slot, n) in enumerate(zip(slots, lengths, strict=True)):
            if slot >= 0 and n > 0:
                shape = (n, KVH, self.k.shape[-1])
                self.k[slot, :n] = _rnd(*shape, dtype=self.k.dtype, seed=seed + 2 * i)
                self.v[slot, :n] = _rnd(*shape, dtype=self.v.dtype, seed=seed + 2 * i + 1)

    def clone(self) -> Pool:
        other = Pool.__new__(Pool)
        other.kbuf, other.vbuf = self.kbuf.clone(), self.vbuf.clone()
        other.k, other.v = other.kbuf[1 : S + 2], other.vbuf[1 : S + 2]
        return other


def _written(pos: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """``[S + 3, M]`` bool buffer rows: the cells the live tokens write."""
    cells = torch.zeros(S + 3, M, dtype=torch.bool)
    for b, slot in enumerate(slots):
        if slot >= 0:
            cells[slot + 1, pos[b].cpu()] = True
    return cells


def _assert_only_written(after: torch.Tensor, before: torch.Tensor, cells: torch.Tensor) -> None:
    """Buffer cells outside ``cells`` (guards, scratch row, other slots, stale cells) kept
    their bits."""
    keep = ~cells.to(after.device)
    assert torch.equal(bits(after[keep]), bits(before[keep])), "a cell no live token writes changed"


def _runtime_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slot: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The runtime's torch decode attention (``Attention._rows`` / ``_attend``), verbatim."""
    B, T, Hq, hd = q.shape
    kvh = kc.shape[2]
    token_slot = slot[:, None].expand(B, T)
    kc.index_put_((token_slot, pos), k.view(B, T, kvh, hd).to(kc.dtype))
    vc.index_put_((token_slot, pos), v.view(B, T, kvh, hd).to(vc.dtype))
    keys = torch.arange(kc.shape[1], device=q.device)
    mask = keys[None, None, :] <= pos[:, :, None]
    kk, vv = kc[slot], vc[slot]
    r, lq = q.shape[:2]
    qg = q.reshape(r, lq, kvh, Hq // kvh, hd)
    scores = torch.einsum("rlgqd,rmgd->rgqlm", qg, kk).float() * scale
    scores = scores.masked_fill(~mask[:, None, None], -torch.inf)
    probs = torch.softmax(scores, dim=-1).to(vv.dtype)
    out = torch.einsum("rgqlm,rmgd->rlgqd", probs, vv)
    return out.reshape(r, lq, Hq * hd)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_runtime_torch_code(dtype: torch.dtype, T: int) -> None:
    """Live rows: the references' caches and outputs are the runtime's, bit for bit; a pad
    row writes nothing (the runtime wrote it into the scratch row) and outputs zeros."""
    G, hd = 5, 16
    pool = Pool(hd, dtype, fill=0.0)
    for buf, seed in ((pool.kbuf, 1), (pool.vbuf, 2)):  # finite stale values everywhere
        buf.copy_(_rnd(*buf.shape, dtype=dtype, seed=seed))
    slots = torch.tensor(SLOTS, device=DEVICE)
    pos = _positions(T)
    q = _rnd(4, T, KVH * G, hd, dtype=dtype, seed=3)
    k = _rnd(4, T, KVH, hd, dtype=dtype, seed=4)
    v = _rnd(4, T, KVH, hd, dtype=dtype, seed=5)
    scale = hd**-0.5
    runtime = pool.clone()
    want = _runtime_step(q, k, v, runtime.k, runtime.v, slots, pos, scale)
    before = pool.clone()
    kv_cache_write(k, v, pool.k, pool.v, slots, pos, impl="reference")
    got = decode_attention(q, pool.k, pool.v, slots, pos, scale, impl="reference")
    live = [b for b, s in enumerate(SLOTS) if s >= 0]
    assert torch.equal(bits(got[live]), bits(want[live]))
    assert bool((got[2] == 0).all())
    # The caches: the runtime's except its pad-row write into the scratch row (S).
    for mine, theirs, old in ((pool.k, runtime.k, before.k), (pool.v, runtime.v, before.v)):
        assert torch.equal(bits(mine[:S]), bits(theirs[:S]))
        assert torch.equal(bits(mine[S]), bits(old[S]))
        assert not torch.equal(bits(theirs[S]), bits(old[S]))
    assert torch.equal(bits(pool.kbuf[0]), bits(before.kbuf[0]))
    # The reference functions themselves (the public op adds only checks).
    kc, vc = before.k.clone(), before.v.clone()
    kv_cache_write_reference(k, v, kc, vc, slots, pos)
    assert torch.equal(bits(kc), bits(pool.k)) and torch.equal(bits(vc), bits(pool.v))
    direct = decode_attention_reference(q, kc, vc, slots, pos, scale)
    assert torch.equal(bits(direct), bits(got))


@pytest.mark.parametrize(("G", "hd"), [(2, 32), (5, 24)])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(dtype: torch.dtype, T: int, G: int, hd: int) -> None:
    """Per-row positions (0, a tile boundary, the last key), T tokens per row, a pad row
    and NaN in every cell past each row's tokens: same caches, outputs within tolerance."""
    pool = Pool(hd, dtype)
    pos = _positions(T)
    pool.prefix(SLOTS, [int(p) for p in pos[:, 0]], seed=10)
    ref = pool.clone()
    slots = torch.tensor(SLOTS, device=DEVICE)
    k = _rnd(4, T, KVH, hd, dtype=dtype, seed=20)
    v = _rnd(4, T, KVH, hd, dtype=dtype, seed=21)
    kv_cache_write(k, v, pool.k, pool.v, slots, pos)
    kv_cache_write(k, v, ref.k, ref.v, slots, pos, impl="reference")
    assert torch.equal(bits(pool.kbuf), bits(ref.kbuf)) and torch.equal(
        bits(pool.vbuf), bits(ref.vbuf)
    )
    q = _rnd(4, T, KVH * G, hd, dtype=dtype, seed=22)
    scale = 0.7 * hd**-0.5
    out = nan_empty(4, T, KVH * G * hd, dtype=dtype)
    got = decode_attention(q, pool.k, pool.v, slots, pos, scale, out=out)
    want = decode_attention(q, ref.k, ref.v, slots, pos, scale, impl="reference")
    assert got.data_ptr() == out.data_ptr()
    assert not bool(torch.isnan(want).any()), "the reference read a stale cell"
    assert torch.equal(bits(got[2]), bits(torch.zeros_like(got[2]))), "pad row output"
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_close(got, want, "bf16 attention")
    assert torch.equal(bits(pool.kbuf), bits(ref.kbuf)), "attention wrote a cache"


def test_position_includes_its_own_key() -> None:
    """Equal keys give uniform weights: a token at position p averages v[0..p], its own key
    included and the next one excluded (an off-by-one in the mask moves the mean by 1/2)."""
    hd, G, T = 16, 3, 3
    first = [0, 20, 5, 40]
    impls: tuple[Impl, ...] = ("triton", "reference")
    for impl in impls:
        pool = Pool(hd, torch.float32)
        for b, slot in enumerate(SLOTS):
            if slot >= 0:
                n = first[b] + T
                pool.k[slot, :n] = 0.25
                pool.v[slot, :n] = (torch.arange(n, dtype=torch.float32) + 1.0).view(n, 1, 1)
        pos = _positions(T, first)
        slots = torch.tensor(SLOTS, device=DEVICE)
        q = _rnd(4, T, KVH * G, hd, dtype=torch.float32, seed=30)
        got = decode_attention(q, pool.k, pool.v, slots, pos, 1.0, impl=impl)
        want = (pos.float() + 2.0) / 2.0  # mean of 1 .. p + 1
        want = torch.where(slots[:, None] >= 0, want, 0.0)
        torch.testing.assert_close(
            got, want[:, :, None].expand_as(got).contiguous(), rtol=1e-6, atol=1e-6
        )


def test_key_tiles_are_walked_to_the_position() -> None:
    """Tiles of 16 keys: positions end in the first, second (partial) and third tile."""
    hd, G, T, m = 32, 4, 3, 40
    pool = Pool(hd, torch.float32)
    first = [13, 37, 3, 0]  # ends 15, 39, pad, 2
    pool.prefix(SLOTS, [f + T for f in first], seed=40)
    slots = torch.tensor(SLOTS, device=DEVICE)
    pos = _positions(T, first)
    q = _rnd(4, T, KVH * G, hd, dtype=torch.float32, seed=41)
    kc, vc = pool.k[:, :m], pool.v[:, :m]  # a max_len of 40 (strided slots)
    out = nan_empty(4, T, KVH * G * hd, dtype=torch.float32)
    launch_decode_attention(q, kc, vc, slots, pos, 0.3, out, block_n=16)
    want = decode_attention_reference(q, kc, vc, slots, pos, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [(3, 16), (2, 32), (5, 16)])
def test_split_keys_and_combine_equal_the_reference(splits: tuple[int, int]) -> None:
    """Flash-decoding: the keys axis in splits of 16 or 32 keys (tiles of 16), partials
    merged by the combine kernel; tokens ending in the first, a middle and the last split,
    a token at position 0 (one key: every later split empty) and a pad row (all empty)."""
    hd, G, T, m = 32, 4, 3, 40
    pool = Pool(hd, torch.float32)
    first = [13, 37, 3, 0]  # ends 15, 39, pad, 2
    pool.prefix(SLOTS, [f + T for f in first], seed=40)
    slots = torch.tensor(SLOTS, device=DEVICE)
    pos = _positions(T, first)
    pos[3, 0] = 0
    q = _rnd(4, T, KVH * G, hd, dtype=torch.float32, seed=42)
    kc, vc = pool.k[:, :m], pool.v[:, :m]
    out = nan_empty(4, T, KVH * G * hd, dtype=torch.float32)
    launch_decode_attention(q, kc, vc, slots, pos, 0.3, out, block_n=16, splits=splits)
    want = decode_attention_reference(q, kc, vc, slots, pos, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert bool((out[2] == 0).all()), "a pad row gets zeros"


def test_split_rule_fills_the_gpu_from_shapes_only() -> None:
    # one row of 8 KV heads and 2,080 keys: splits of >= 128 keys, <= 512 programs
    n, keys = attention_splits(1, 8, 2080, 64)
    assert n * keys >= 2080 and keys % 64 == 0 and keys >= 128 and 8 * n <= 512 and n > 1
    assert (n - 1) * keys < 2080, "no split lies wholly past max_len"
    # 64 rows already give 512 programs: one pass; short caches: one pass
    assert attention_splits(64, 8, 2080, 64)[0] == 1
    assert attention_splits(1, 8, 100, 64)[0] == 1


def _odd_layout(t: torch.Tensor) -> torch.Tensor:
    """The values of a ``[S + 1, M, KVH, hd]`` cache in head-major storage with every
    element at an even offset (strides ``[.., 2 hd, 2 M hd, 2]``)."""
    wide = torch.stack([t.transpose(1, 2), t.transpose(1, 2)], dim=-1)  # [S+1, KVH, M, hd, 2]
    return wide[..., 0].transpose(1, 2)


def test_strided_tensors_and_int32_indices() -> None:
    """Views with odd strides everywhere (caches head-major and every other element, q a
    column slice, out every other column, positions every other column) and int32 slots
    and positions."""
    hd, G, T = 16, 2, 3
    dtype = torch.float32
    pool = Pool(hd, dtype)
    pos64 = _positions(T)
    pool.prefix(SLOTS, [int(p) for p in pos64[:, 0]], seed=50)
    kc, vc = _odd_layout(pool.k), _odd_layout(pool.v)
    assert kc.stride(-1) == 2 and kc.stride(2) == 2 * M * hd
    kd, vd = pool.k.clone(), pool.v.clone()
    wide = _rnd(4, T, KVH * G + 3, hd, dtype=dtype, seed=51)
    q = wide[:, :, 3:]
    kv = _rnd(4, T, 2 * KVH, hd, dtype=dtype, seed=52)
    k, v = kv[:, :, :KVH], kv[:, :, KVH:]
    pos = torch.stack([pos64, pos64], dim=2).flatten(1).to(torch.int32)[:, ::2]
    assert pos.stride() == (2 * T, 2)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    kv_cache_write(k, v, kc, vc, slots, pos)
    kv_cache_write(k.contiguous(), v.contiguous(), kd, vd, slots, pos64, impl="reference")
    assert torch.equal(bits(kc), bits(kd)) and torch.equal(bits(vc), bits(vd))
    big = nan_empty(4, T, 2 * KVH * G * hd, dtype=dtype)
    out = big[:, :, ::2]
    decode_attention(q, kc, vc, slots, pos, 0.25, out=out)
    want = decode_attention_reference(q.contiguous(), kd, vd, slots, pos64, 0.25)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert bool(torch.isnan(big[:, :, 1::2]).all()), "wrote outside out"


def test_pad_rows_read_and_write_nothing() -> None:
    """A pad row with a live-looking position writes no cell (not the scratch row, not
    through slot -1 into the row before the caches); its output is zeros whatever its
    position (garbage included) and its q (NaN included)."""
    hd, G, T = 16, 2, 3
    impls: tuple[Impl, ...] = ("triton", "reference")
    for impl in impls:
        pool = Pool(hd, torch.float32)
        slots_l = [-1, 1, -1, -1]
        pos = _positions(T, [0, 5, 0, 50])
        pool.prefix(slots_l, [0, 5, 0, 0], seed=60)
        before = pool.clone()
        slots = torch.tensor(slots_l, device=DEVICE)
        k = _rnd(4, T, KVH, hd, dtype=torch.float32, seed=61)
        v = _rnd(4, T, KVH, hd, dtype=torch.float32, seed=62)
        kv_cache_write(k, v, pool.k, pool.v, slots, pos, impl=impl)
        cells = _written(pos, slots_l)
        _assert_only_written(pool.kbuf, before.kbuf, cells)
        _assert_only_written(pool.vbuf, before.vbuf, cells)
        assert torch.equal(pool.k[1, 5:8], k[1]) and torch.equal(pool.v[1, 5:8], v[1])
        # An all-pad batch changes nothing at all.
        snap = pool.clone()
        none = torch.full((4,), -1, device=DEVICE)
        kv_cache_write(k, v, pool.k, pool.v, none, pos, impl=impl)
        assert torch.equal(bits(pool.kbuf), bits(snap.kbuf))
        assert torch.equal(bits(pool.vbuf), bits(snap.vbuf))
        q = _rnd(4, T, KVH * G, hd, dtype=torch.float32, seed=63)
        q[0] = float("nan")
        bad_pos = pos.clone()
        bad_pos[0] = torch.tensor([10**9, -5, M])  # never read: the row is a pad row
        got = decode_attention(q, pool.k, pool.v, slots, bad_pos, 0.5, impl=impl)
        pad = [0, 2, 3]
        assert torch.equal(bits(got[pad]), bits(torch.zeros_like(got[pad])))
        assert not bool(torch.isnan(got).any())


def test_cast_on_store() -> None:
    """fp32 K/V into bf16 caches: each stored value is the cast (rounded on the GPU; the
    interpreter truncates, within one bf16 step)."""
    hd, T = 16, 1
    pool = Pool(hd, torch.bfloat16)
    ref = pool.clone()
    slots = torch.tensor(SLOTS, device=DEVICE)
    pos = _positions(T)
    k = _rnd(4, T, KVH, hd, dtype=torch.float32, seed=70)
    v = _rnd(4, T, KVH, hd, dtype=torch.float32, seed=71)
    kv_cache_write(k, v, pool.k, pool.v, slots, pos)
    kv_cache_write(k, v, ref.k, ref.v, slots, pos, impl="reference")
    cells = _written(pos, SLOTS)
    _assert_only_written(pool.kbuf, ref.kbuf, cells)
    _assert_only_written(pool.vbuf, ref.vbuf, cells)
    dev_cells = cells.to(DEVICE)
    assert_close(pool.kbuf[dev_cells], ref.kbuf[dev_cells], "k cast on store")
    assert_close(pool.vbuf[dev_cells], ref.vbuf[dev_cells], "v cast on store")
    if DEVICE.type == "cuda":
        assert torch.equal(bits(pool.kbuf), bits(ref.kbuf))


def _args(hd: int = 16, G: int = 2, T: int = 1) -> dict[str, torch.Tensor]:
    pool = Pool(hd, torch.float32, fill=0.0)
    return {
        "q": _rnd(4, T, KVH * G, hd, dtype=torch.float32, seed=80),
        "k": _rnd(4, T, KVH, hd, dtype=torch.float32, seed=81),
        "v": _rnd(4, T, KVH, hd, dtype=torch.float32, seed=82),
        "k_cache": pool.k,
        "v_cache": pool.v,
        "slots": torch.tensor(SLOTS, device=DEVICE),
        "positions": _positions(T),
    }


def _write(a: dict[str, torch.Tensor], **over: Any) -> None:
    b: dict[str, Any] = {**a, **over}
    kv_cache_write(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slots"], b["positions"])


def _attend(a: dict[str, torch.Tensor], **over: Any) -> None:
    b: dict[str, Any] = {"scale": 0.5, "out": None, **a, **over}
    decode_attention(
        b["q"], b["k_cache"], b["v_cache"], b["slots"], b["positions"], b["scale"], out=b["out"]
    )


_WRITE_ERRORS = [
    ({"k_cache": torch.zeros(4, 8, 2)}, ValueError, r"kv_cache_write: `k_cache` must have shape"),
    ({"k_cache": torch.zeros(4, 8, 2, 16, dtype=torch.int32)}, TypeError, r"`k_cache` must have dtype"),
    ({"v_cache": torch.zeros(S + 1, M, KVH, 8)}, ValueError, r"`v_cache` must have shape"),
    ({"v_cache": torch.zeros(S + 1, M, KVH, 16, dtype=torch.bfloat16)}, TypeError, r"`v_cache` must have dtype float32"),
    ({"k": torch.zeros(4, 1, KVH + 1, 16)}, ValueError, r"`k` must have shape \[batch, tokens, kv_heads, head_dim\]"),
    ({"v": torch.zeros(4, 2, KVH, 16)}, ValueError, r"`v` must have shape"),
    ({"slots": torch.zeros(4)}, TypeError, r"`slots` must have dtype int32/int64"),
    ({"slots": torch.zeros(8, dtype=torch.int64)[::2]}, ValueError, r"`slots` must be contiguous"),
    ({"positions": torch.zeros(4, dtype=torch.int64)}, ValueError, r"`positions` must have shape \[batch, tokens\]"),
    ({"k": torch.zeros(4, 1, KVH, 16, device="meta")}, ValueError, r"`k` must be on the state's device"),
]  # fmt: skip

_ATTN_ERRORS = [
    ({"q": torch.zeros(4, 1, 5, 16)}, ValueError, r"decode_attention: `q` heads=5 must be a positive multiple of the caches' kv_heads=2"),
    ({"q": torch.zeros(4, 1, 4, 8)}, ValueError, r"`q` must have shape \[batch, tokens, heads, head_dim\]"),
    ({"q": torch.zeros(4, 1, 4, 16, dtype=torch.bfloat16)}, TypeError, r"`q` must have dtype float32"),
    ({"q": torch.zeros(4, 1, 4, 16, device="meta")}, ValueError, r"`q` must be on the state's device"),
    ({"v_cache": torch.zeros(S + 1, M + 1, KVH, 16)}, ValueError, r"`v_cache` must have shape"),
    ({"positions": torch.zeros(4, 2, dtype=torch.int64)}, ValueError, r"`positions` must have shape"),
    ({"slots": torch.zeros(3, dtype=torch.int64)}, ValueError, r"`slots` must have shape \[batch\]"),
    ({"out": torch.zeros(4, 1, 60)}, ValueError, r"`out` must have shape \[batch, tokens, heads \* head_dim\]"),
    ({"out": torch.zeros(4, 1, 64, dtype=torch.int64)}, TypeError, r"`out` must have dtype"),
    ({"scale": "0.5"}, TypeError, r"`scale` must be a real number"),
]  # fmt: skip


def _on_device(over: dict[str, Any]) -> dict[str, Any]:
    """The bad values on the test device, keeping their strides (``.to`` would make a
    strided tensor contiguous on another device)."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.device == DEVICE:
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=DEVICE).copy_(t)

    return {n: move(t) for n, t in over.items()}


@pytest.mark.parametrize(("over", "exc", "match"), _WRITE_ERRORS)
def test_kv_cache_write_refuses_bad_arguments(
    over: dict[str, Any], exc: type[Exception], match: str
) -> None:
    a = _args()
    before = (a["k_cache"].clone(), a["v_cache"].clone())
    with pytest.raises(exc, match=match):
        _write(a, **_on_device(over))
    assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])


@pytest.mark.parametrize(("over", "exc", "match"), _ATTN_ERRORS)
def test_decode_attention_refuses_bad_arguments(
    over: dict[str, Any], exc: type[Exception], match: str
) -> None:
    a = _args()
    with pytest.raises(exc, match=match):
        _attend(a, **_on_device(over))


@contextlib.contextmanager
def _values_checked() -> Iterator[None]:
    """CPU tensors: the value rules are always checked; CUDA tensors: in debug mode."""
    if DEVICE.type == "cpu":
        assert not is_debug()
        yield
    else:
        with debug_mode():
            yield


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_out_of_range_values_are_refused(impl: Impl) -> None:
    a = _args(T=3)
    a["positions"] = _positions(3)
    before = (a["k_cache"].clone(), a["v_cache"].clone())
    bad: list[tuple[str, torch.Tensor, str]] = [
        ("slots", torch.tensor([2, S, -1, 1]), r"`slots` values must be -1 \(pad\) or in \[0, 3\); row 1 holds 3"),
        ("slots", torch.tensor([2, 0, -2, 1]), r"`slots` values must be -1 \(pad\) or in \[0, 3\); row 2 holds -2"),
        ("positions", torch.tensor([[0, 1, 2], [M - 1, M, 3], [0, 0, 0], [5, 6, 7]]), rf"`positions` of a live row must be in \[0, {M}\).*row 1 token 1 holds {M}"),
        ("positions", torch.tensor([[0, 1, 2], [3, 4, 5], [0, 0, 0], [-1, 6, 7]]), r"`positions` of a live row must be in \[0, 80\).*row 3 token 0 holds -1"),
    ]  # fmt: skip
    for name, value, match in bad:
        b = {**a, name: value.to(DEVICE)}
        with _values_checked():
            with pytest.raises(ValueError, match="kv_cache_write: " + match):
                kv_cache_write(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slots"],
                               b["positions"], impl=impl)  # fmt: skip
            with pytest.raises(ValueError, match="decode_attention: " + match):
                decode_attention(b["q"], b["k_cache"], b["v_cache"], b["slots"], b["positions"],
                                 0.5, impl=impl)  # fmt: skip
    assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])


def test_each_launch_is_one_dispatched_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observed (a dispatch mode, or ALWAYS_DISPATCH) each call is one hybridmeta op, with
    the same result as the direct launch."""
    results = []
    for forced in (False, True):
        monkeypatch.setattr(dispatch, "ALWAYS_DISPATCH", forced)
        a = _args(G=2, T=3)
        _write(a)
        out = torch.empty(4, 3, KVH * 2 * 16, device=DEVICE)
        _attend(a, out=out)
        results.append((a["k_cache"], a["v_cache"], out))
    for direct, dispatched in zip(*results, strict=True):
        assert torch.equal(bits(direct), bits(dispatched))
    monkeypatch.setattr(dispatch, "ALWAYS_DISPATCH", False)
    a = _args()
    with OpLog() as rec:
        _write(a)
        _attend(a)
    mine = [s for s in rec.ops if s.startswith("hybridmeta.")]
    assert mine == ["hybridmeta.kv_cache_write.default", "hybridmeta.decode_attention.default"]


def test_both_ops_run_under_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = OpLog()
    with FakeTensorMode(), seen:
        a = _args()
        _write(a)
        _attend(a)
    assert [op for op in seen.ops if op.startswith("hybridmeta.")] == [
        "hybridmeta.kv_cache_write.default",
        "hybridmeta.decode_attention.default",
    ]


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_captured_step_replays_new_rows(impl: Impl) -> None:
    """Captured with pad rows only (as the graph runner does), replayed over live rows:
    no host read while capturing, and the replay computes what an eager call does."""
    hd, G, T = 16, 2, 3
    pool = Pool(hd, torch.float32, fill=0.0)
    slots = torch.full((4,), -1, device=DEVICE)
    pos = torch.zeros(4, T, dtype=torch.int64, device=DEVICE)
    q = torch.zeros(4, T, KVH * G, hd, device=DEVICE)
    k, v = torch.zeros(4, T, KVH, hd, device=DEVICE), torch.zeros(4, T, KVH, hd, device=DEVICE)

    def step() -> torch.Tensor:
        kv_cache_write(k, v, pool.k, pool.v, slots, pos, impl=impl)
        return decode_attention(q, pool.k, pool.v, slots, pos, 0.5, impl=impl)

    graph = default_backend(DEVICE).capture(step)
    eager = pool.clone()
    slots.copy_(torch.tensor(SLOTS))
    pos.copy_(_positions(T))
    pool.prefix(SLOTS, [int(p) for p in pos[:, 0]], seed=90)
    eager.prefix(SLOTS, [int(p) for p in pos[:, 0]], seed=90)
    q.copy_(_rnd(*q.shape, dtype=torch.float32, seed=91))
    k.copy_(_rnd(*k.shape, dtype=torch.float32, seed=92))
    v.copy_(_rnd(*v.shape, dtype=torch.float32, seed=93))
    graph.replay()
    kv_cache_write(k, v, eager.k, eager.v, slots, pos, impl=impl)
    want = decode_attention(q, eager.k, eager.v, slots, pos, 0.5, impl=impl)
    assert torch.equal(bits(graph.outputs), bits(want))
    assert torch.equal(bits(pool.kbuf), bits(eager.kbuf))
    assert bool(want[0].abs().sum() > 0)


def test_empty_batch_is_a_no_op() -> None:
    pool = Pool(16, torch.float32)
    before = pool.clone()
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    z = torch.zeros(0, 1, KVH, 16, device=DEVICE)
    kv_cache_write(z, z, pool.k, pool.v, none, none.view(0, 1))
    out = decode_attention(torch.zeros(0, 1, 4, 16, device=DEVICE), pool.k, pool.v, none,
                           none.view(0, 1), 0.5)  # fmt: skip
    assert out.shape == (0, 1, 64)
    assert torch.equal(bits(pool.kbuf), bits(before.kbuf))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16, 64])
def test_nano_shapes_match_reference(B: int) -> None:
    """Nemotron-H attention: head_dim 128, 40 query heads on 8 KV heads, bf16, long rows;
    1 and 16 rows split the keys (16 and 4 splits), 64 rows take one pass."""
    hd, kvh, heads, m = 128, 8, 40, 2048
    assert (attention_splits(B, kvh, m, 64)[0] > 1) == (B < 64)
    g = torch.Generator().manual_seed(100)
    kc = torch.randn(B + 1, m, kvh, hd, generator=g).to(DEVICE, torch.bfloat16)
    vc = torch.randn(B + 1, m, kvh, hd, generator=g).to(DEVICE, torch.bfloat16)
    slots = torch.randperm(B, generator=g).to(DEVICE)
    if B > 3:
        slots[3] = -1
    pos = torch.randint(0, m, (B, 1), generator=g).to(DEVICE)
    pos[0, 0] = m - 1 if B == 1 else 0
    if B > 1:
        pos[1, 0] = m - 1
    q = torch.randn(B, 1, heads, hd, generator=g).to(DEVICE, torch.bfloat16)
    got = decode_attention(q, kc, vc, slots, pos, hd**-0.5)
    want = decode_attention_reference(q, kc, vc, slots, pos, hd**-0.5)
    assert_close(got, want, "nano decode attention")
    assert math.isfinite(float(got.float().abs().max()))
