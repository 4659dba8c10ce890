"""GPU-only kernel tests: Nemotron-Nano-9B-v2 shapes, recompilation, CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.kernels import causal_conv1d_update, ssm_state_update, track_save
from hybridmeta.kernels._config import SsmLaunchConfig
from hybridmeta.kernels.conv_update import _conv_update_kernel
from hybridmeta.kernels.ssm_update import (
    _ssm_update_kernel,
    _ssm_update_tile_kernel,
    launch_ssm_update,
)
from hybridmeta.kernels.track_save import _track_save_kernel
from tests.kernels._support import (
    assert_close,
    assert_slots_bitwise,
    bits,
    causal_conv1d_update_ref,
    compiled_count,
    ssm_state_update_ref,
    track_save_ref,
)

pytestmark = pytest.mark.gpu

# Nemotron-Nano-9B-v2 Mamba layer (tensor parallel 1).
H, P, N, G, CONV_DIM, K = 128, 80, 128, 8, 12288, 4
CUDA = torch.device("cuda")


def _ssm_inputs(bs: int, seed: int, act: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(CUDA)

    return {
        "x": rnd(bs, H, P).to(act),
        "dt": rnd(bs, H, scale=0.5).to(act),
        "A": -torch.rand(H, generator=g).to(CUDA) * 2.0,
        "B": rnd(bs, G, N).to(act),
        "C": rnd(bs, G, N).to(act),
        "D": rnd(H),
        "z": rnd(bs, H, P).to(act),
        "dt_bias": rnd(H, scale=0.5),
    }


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssm_nano_shapes_match_reference(state_dtype: torch.dtype) -> None:
    slots = 24
    src = torch.tensor([5, -1, 17, 2, -1, 9], device=CUDA)  # pads shuffled among live rows
    trk = torch.tensor([20, 3, -1, 11, 0, 21], device=CUDA)
    mask = torch.tensor([True, True, False, True, True, False], device=CUDA)
    a = _ssm_inputs(src.shape[0], 0)
    state0 = torch.randn(slots, H, P, N, device=CUDA).to(state_dtype)
    ref_state, ref_out = ssm_state_update_ref(
        state0, a["x"], a["dt"], a["A"], a["B"], a["C"], src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, track_indices=trk, track_mask=mask,
    )  # fmt: skip
    state = state0.clone()
    out = torch.full_like(a["x"], float("nan"))
    ssm_state_update(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, track_indices=trk, track_mask=mask, out=out,
    )  # fmt: skip
    assert bool((out[[1, 4]] == 0).all())
    assert_close(out, ref_out, "out")
    written = [5, 17, 2, 9, 20, 11]
    untouched = torch.tensor([s for s in range(slots) if s not in written], device=CUDA)
    assert_slots_bitwise(state, state0, untouched, "state")
    w = torch.tensor(written, device=CUDA)
    assert_close(state[w], ref_state[w], "written slots")


def test_conv_and_track_save_nano_shapes_match_reference() -> None:
    slots = 12
    src = torch.tensor([3, -1, 7, 0], device=CUDA)
    x = torch.randn(4, CONV_DIM, device=CUDA).to(torch.bfloat16)
    w = (torch.randn(CONV_DIM, K, device=CUDA) * 0.5).to(torch.bfloat16)
    b = torch.randn(CONV_DIM, device=CUDA).to(torch.bfloat16)
    cs0 = torch.randn(slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    ref_cs, ref_out = causal_conv1d_update_ref(x, cs0, w, b, src, silu=True)
    cs = cs0.clone()
    out = torch.full_like(x, float("nan"))
    causal_conv1d_update(x, cs, w, b, cache_indices=src, out=out)
    assert_close(out, ref_out, "conv out")
    # On the GPU every cast rounds to nearest like torch: the new state is bit-exact.
    assert torch.equal(bits(cs), bits(ref_cs))

    layers = 27
    conv_pool = torch.randn(layers, slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    ssm_pool = torch.randn(layers, slots, H, P, N, device=CUDA)
    trk = torch.tensor([9, 10, 11, 8], device=CUDA)
    mask = torch.tensor([True, True, False, True], device=CUDA)
    ref_conv, ref_ssm = track_save_ref(conv_pool, ssm_pool, src, trk, mask)
    track_save(conv_pool, ssm_pool, src_indices=src, track_indices=trk, track_mask=mask)
    assert torch.equal(bits(conv_pool), bits(ref_conv))
    assert torch.equal(bits(ssm_pool), bits(ref_ssm))


def test_new_batch_size_never_recompiles() -> None:
    slots = 160
    state = torch.randn(slots, H, P, N, device=CUDA)
    cs = torch.randn(slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    w = torch.randn(CONV_DIM, K, device=CUDA).to(torch.bfloat16)
    conv_pool = torch.randn(2, slots, 8, K - 1, device=CUDA).to(torch.bfloat16)
    ssm_pool = torch.randn(2, slots, 2, 4, 8, device=CUDA)
    counts: list[tuple[int, int, int, int]] = []
    # 1 and 40 rows first: an fp32 state runs one tile a program up to 32 rows and the row
    # walk above, so each of the two SSM kernels compiles once; after that no size compiles.
    for i, bs in enumerate((1, 40, 2, 3, 7, 16, 32, 33, 64)):
        a = _ssm_inputs(bs, i)
        perm = torch.randperm(slots, device=CUDA)
        # Fresh (16-byte aligned) index tensors, as static buffers are: pointer alignment is
        # a specialisation of its own, batch size must not be.
        src, trk = perm[:bs].clone(), perm[bs : 2 * bs].clone()
        mask = torch.rand(bs, device=CUDA) < 0.5
        ssm_state_update(
            state, a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=src, D=a["D"],
            z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True, track_indices=trk, track_mask=mask,
        )  # fmt: skip
        causal_conv1d_update(
            torch.randn(bs, CONV_DIM, device=CUDA).to(torch.bfloat16), cs, w, cache_indices=src
        )
        track_save(conv_pool, ssm_pool, src_indices=src, track_indices=trk, track_mask=mask)
        torch.cuda.synchronize()
        counts.append(
            (
                compiled_count(_ssm_update_kernel),
                compiled_count(_ssm_update_tile_kernel),
                compiled_count(_conv_update_kernel),
                compiled_count(_track_save_kernel),
            )
        )
    assert all(c == counts[1] for c in counts[1:]), f"compiled variants per bs: {counts}"


def test_cuda_graph_replay_ignores_garbage_past_bs() -> None:
    """Capture at bs=5 on [:5] views of 8-row static buffers; replay with fresh inputs and a
    garbage tail (other rows' live slots, out-of-range ids, NaN, True flags) each time."""
    max_bs, bs, slots, layers = 8, 5, 32, 3
    state = torch.randn(slots, H, P, N, device=CUDA)
    cs = torch.randn(slots, CONV_DIM, K - 1, device=CUDA).to(torch.bfloat16)
    w = torch.randn(CONV_DIM, K, device=CUDA).to(torch.bfloat16)
    conv_pool = torch.randn(layers, slots, 64, K - 1, device=CUDA).to(torch.bfloat16)
    ssm_pool = torch.randn(layers, slots, 4, 8, 16, device=CUDA)
    a0 = _ssm_inputs(max_bs, 0)
    static = {k: v.clone() for k, v in a0.items()}
    static_x_conv = torch.randn(max_bs, CONV_DIM, device=CUDA).to(torch.bfloat16)
    static_src = torch.full((max_bs,), -1, dtype=torch.int64, device=CUDA)
    static_trk = torch.full((max_bs,), -1, dtype=torch.int64, device=CUDA)
    static_mask = torch.zeros(max_bs, dtype=torch.bool, device=CUDA)
    out = torch.full((max_bs, H, P), float("nan"), device=CUDA).to(torch.bfloat16)
    conv_out = torch.full((max_bs, CONV_DIM), float("nan"), device=CUDA).to(torch.bfloat16)

    def step() -> None:
        v = {k: t[:bs] if t.shape[0] == max_bs else t for k, t in static.items()}
        ssm_state_update(
            state, v["x"], v["dt"], v["A"], v["B"], v["C"], state_indices=static_src[:bs],
            D=v["D"], z=v["z"], dt_bias=v["dt_bias"], dt_softplus=True,
            track_indices=static_trk[:bs], track_mask=static_mask[:bs], out=out[:bs],
        )  # fmt: skip
        causal_conv1d_update(
            static_x_conv[:bs], cs, w, cache_indices=static_src[:bs], out=conv_out[:bs]
        )
        track_save(
            conv_pool, ssm_pool, src_indices=static_src[:bs], track_indices=static_trk[:bs],
            track_mask=static_mask[:bs],
        )  # fmt: skip

    # Warm up (compiles) on a side stream, then capture.
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(slots, generator=g).to(CUDA)
        src = perm[:bs].clone()
        src[seed] = -1  # a pad row among live rows
        trk = perm[bs : 2 * bs]
        mask = torch.tensor([True, False, True, True, False], device=CUDA)
        fresh = _ssm_inputs(bs, 10 + seed)
        xc = torch.randn(bs, CONV_DIM, generator=g).to(CUDA, torch.bfloat16)
        # In-place refresh of the live prefix; garbage in the tail.
        for k in ("x", "dt", "B", "C", "z"):
            static[k][:bs] = fresh[k]
            static[k][bs:] = float("nan")
        static_x_conv[:bs] = xc
        static_x_conv[bs:] = float("nan")
        static_src[:bs] = src
        static_src[bs:] = torch.tensor([int(src[0]), slots + 3, 2**30], device=CUDA)
        static_trk[:bs] = trk
        static_trk[bs:] = torch.tensor([int(src[2]), int(trk[0]), slots], device=CUDA)
        static_mask[:bs] = mask
        static_mask[bs:] = True
        out[bs:] = float("nan")
        conv_out[bs:] = float("nan")

        s0, c0, cp0, sp0 = state.clone(), cs.clone(), conv_pool.clone(), ssm_pool.clone()
        ref_state, ref_out = ssm_state_update_ref(
            s0, fresh["x"], fresh["dt"], static["A"], fresh["B"], fresh["C"], src, D=static["D"],
            z=fresh["z"], dt_bias=static["dt_bias"], dt_softplus=True, track_indices=trk,
            track_mask=mask,
        )  # fmt: skip
        ref_cs, ref_co = causal_conv1d_update_ref(xc, c0, w, None, src, silu=True)
        ref_cp, ref_sp = track_save_ref(cp0, sp0, src, trk, mask)

        graph.replay()
        torch.cuda.synchronize()
        assert_close(out[:bs], ref_out, "replayed ssm out")
        assert_close(state, ref_state, "replayed ssm state")
        assert_close(conv_out[:bs], ref_co, "replayed conv out")
        assert torch.equal(bits(cs), bits(ref_cs))
        assert torch.equal(bits(conv_pool), bits(ref_cp))
        assert torch.equal(bits(ssm_pool), bits(ref_sp))
        assert bool(torch.isnan(out[bs:]).all())
        assert bool(torch.isnan(conv_out[bs:]).all())


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block_p", "num_warps"), [(4, 1), (8, 1), (16, 1), (8, 2), (16, 2)])
def test_ssm_tile_shapes_match_reference(
    state_dtype: torch.dtype, block_p: int, num_warps: int
) -> None:
    """Every candidate tile shape of the SSM update is right at Nano shapes."""
    slots = 12
    src = torch.tensor([5, -1, 9, 2], device=CUDA)
    a = _ssm_inputs(src.shape[0], 3)
    state0 = torch.randn(slots, H, P, N, device=CUDA).to(state_dtype)
    ref_state, ref_out = ssm_state_update_ref(
        state0, a["x"], a["dt"], a["A"], a["B"], a["C"], src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True,
    )  # fmt: skip
    state = state0.clone()
    out = torch.full_like(a["x"], float("nan"))
    launch_ssm_update(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], out, src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, dst_indices=None, track_indices=None,
        track_mask=None, config=SsmLaunchConfig(block_p=block_p, num_warps=num_warps),
    )  # fmt: skip
    assert_close(out, ref_out, "out")
    assert_close(state, ref_state, "state")


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "max_regs"), [(2, None), (8, None), (8, 64), (32, None)])
def test_ssm_tile_rows_nano_shapes_match_reference(
    state_dtype: torch.dtype, rows: int, max_regs: int | None
) -> None:
    """Rows a program of the one-tile kernel at Nano shapes (compiled, so the outlined row
    body runs): 37 rows of 40-row buffers, live rows among pads, whole pad blocks, a short
    last block; pad rows and the tail hold NaN inputs and live-looking slots. Pad rows zero,
    the tail untouched, written slots equal the reference, other slots bit-identical."""
    bs, n, slots = 37, 40, 96
    live = [0, 3, 4, 5, 17, 30, 36]
    g = torch.Generator().manual_seed(rows)
    perm = torch.randperm(slots, generator=g).tolist()
    src_l = [perm[b] if b in live or b >= bs else -1 for b in range(n)]
    trk_l = [perm[n + b] for b in range(n)]
    mask_l = [b not in live or live.index(b) % 2 == 0 for b in range(n)]
    src = torch.tensor(src_l, device=CUDA)
    trk = torch.tensor(trk_l, device=CUDA)
    mask = torch.tensor(mask_l, device=CUDA)
    a = _ssm_inputs(n, 20 + rows)
    for k in ("x", "dt", "B", "C", "z"):
        a[k][[b for b in range(n) if b not in live]] = float("nan")
    v = {k: a[k][:bs] for k in ("x", "dt", "B", "C", "z")}
    state0 = torch.randn(slots, H, P, N, device=CUDA).to(state_dtype)
    ref_state, ref_out = ssm_state_update_ref(
        state0, v["x"], v["dt"], a["A"], v["B"], v["C"], src[:bs], D=a["D"], z=v["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, track_indices=trk[:bs], track_mask=mask[:bs],
    )  # fmt: skip
    state = state0.clone()
    out = torch.full_like(a["x"], float("nan"))
    block_p = 16 if state_dtype == torch.bfloat16 else 8
    cfg = SsmLaunchConfig(
        block_p=block_p, num_warps=2, row_walk=False, tile_rows=rows, max_regs=max_regs
    )
    launch_ssm_update(
        state, v["x"], v["dt"], a["A"], v["B"], v["C"], out[:bs], src[:bs], D=a["D"],
        z=v["z"], dt_bias=a["dt_bias"], dt_softplus=True, dst_indices=None,
        track_indices=trk[:bs], track_mask=mask[:bs], config=cfg,
    )  # fmt: skip
    torch.cuda.synchronize()
    pad = [b for b in range(bs) if b not in live]
    assert bool((out[pad] == 0).all())
    assert bool(out[bs:].isnan().all())
    assert_close(out[:bs], ref_out, "out")
    written = sorted({src_l[b] for b in live} | {trk_l[b] for b in live if mask_l[b]})
    untouched = torch.tensor([s for s in range(slots) if s not in written], device=CUDA)
    assert_slots_bitwise(state, state0, untouched, "state")
    w = torch.tensor(written, device=CUDA)
    assert_close(state[w], ref_state[w], "written slots")


def test_tile_rows_new_batch_size_never_recompiles() -> None:
    """Rows a program keeps the batch size a runtime value: one compiled variant of the
    one-tile kernel serves every batch size at a given `tile_rows`."""
    slots = 160
    state = torch.randn(slots, H, P, N, device=CUDA).to(torch.bfloat16)
    cfg = SsmLaunchConfig(block_p=16, num_warps=2, row_walk=False, tile_rows=8)
    counts = []
    for i, bs in enumerate((1, 5, 8, 9, 40, 64, 129)):
        a = _ssm_inputs(bs, 40 + i)
        src = torch.randperm(slots, device=CUDA)[:bs].clone()
        out = torch.empty_like(a["x"])
        launch_ssm_update(
            state, a["x"], a["dt"], a["A"], a["B"], a["C"], out, src, D=a["D"], z=a["z"],
            dt_bias=a["dt_bias"], dt_softplus=True, dst_indices=None, track_indices=None,
            track_mask=None, config=cfg,
        )  # fmt: skip
        torch.cuda.synchronize()
        counts.append(compiled_count(_ssm_update_tile_kernel))
    assert all(c == counts[0] for c in counts), f"compiled variants per bs: {counts}"


# --------------------------------------------------------------------------- int64 indexing
# A kernel addresses slot `s` of a pool at element `s * slot_stride + offset_in_slot`. With a
# Nano-9B-v2 SSM state (128 x 80 x 128 = 1,310,720 elements per slot) that passes 2**31 at
# slot 1639: from there int32 arithmetic wraps (1639 * 1,310,720 = 2,148,270,080 becomes
# -2,146,697,216) and the kernel reads and writes about 8 GiB *before* the pool. The launch
# then either faults (illegal address) or touches other memory, while slot 1639 keeps its
# old state and the row's output is garbage: the checks below fail either way. The index
# tensors are int32 on purpose: a slot loaded as int64 would widen the product by itself
# and hide a kernel that forgot to.
INT32_LIMIT = 2**31


def _first_slot_past_int32(per_slot: int) -> int:
    """The first slot whose first element lies at or beyond element 2**31."""
    return -(-INT32_LIMIT // per_slot)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The pool's bits as integers, without a copy (pools are contiguous)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _compact(slots: list[int], *index_lists: list[int]) -> tuple[list[int], ...]:
    """Remap slot ids to positions in ``slots`` (``-1`` stays ``-1``)."""
    pos = {s: i for i, s in enumerate(slots)}
    return tuple([pos[s] if s >= 0 else -1 for s in idx] for idx in index_lists)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssm_update_reaches_slots_past_int32_offsets(state_dtype: torch.dtype) -> None:
    per_slot = H * P * N
    high = _first_slot_past_int32(per_slot)  # 1639
    assert high * per_slot >= INT32_LIMIT > (high - 1) * per_slot
    slots = high + 2  # 8.6 GB in fp32, 4.3 GB in bf16
    state = torch.randn(slots, H, P, N, device=CUDA, dtype=state_dtype)
    state0 = state.clone()
    # row 0 reads and writes past 2**31; row 1 tracks into a slot past it; row 2 is a pad
    # row (its set mask must write nothing); row 3's slot starts below 2**31 and ends past it
    src_l, trk_l = [high, 5, -1, high - 1], [-1, high + 1, 0, 2]
    src = torch.tensor(src_l, dtype=torch.int32, device=CUDA)
    trk = torch.tensor(trk_l, dtype=torch.int32, device=CUDA)
    mask = torch.tensor([False, True, True, True], device=CUDA)
    a = _ssm_inputs(4, 11)
    out = torch.full_like(a["x"], float("nan"))
    ssm_state_update(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=src, D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True, track_indices=trk, track_mask=mask, out=out,
    )  # fmt: skip
    torch.cuda.synchronize()

    # the reference on a compact pool of the slots involved
    used = sorted({s for s in src_l + trk_l if s >= 0})
    c_src, c_trk = _compact(used, src_l, trk_l)
    used_t = torch.tensor(used, device=CUDA)
    ref_small, ref_out = ssm_state_update_ref(
        state0[used_t], a["x"], a["dt"], a["A"], a["B"], a["C"],
        torch.tensor(c_src, dtype=torch.int32, device=CUDA), D=a["D"], z=a["z"],
        dt_bias=a["dt_bias"], dt_softplus=True,
        track_indices=torch.tensor(c_trk, dtype=torch.int32, device=CUDA), track_mask=mask,
    )  # fmt: skip
    assert_close(out, ref_out, "out")
    written = [high, 5, high + 1, high - 1, 2]
    for s in written:
        assert_close(state[s], ref_small[used.index(s)], f"slot {s}")
    # every other slot bit-identical (slot 0, the pad row's track slot, among them)
    state[used_t] = state0[used_t]
    assert torch.equal(_raw(state), _raw(state0))


def test_conv_update_reaches_slots_past_int32_offsets() -> None:
    per_slot = CONV_DIM * (K - 1)  # 36,864 elements
    high = _first_slot_past_int32(per_slot)  # 58,255
    slots = high + 1  # 4.3 GB of bf16
    cs = torch.randn(slots, CONV_DIM, K - 1, device=CUDA, dtype=torch.bfloat16)
    cs0 = cs.clone()
    src_l = [high, 7, -1, high - 1]
    x = torch.randn(4, CONV_DIM, device=CUDA).to(torch.bfloat16)
    w = (torch.randn(CONV_DIM, K, device=CUDA) * 0.5).to(torch.bfloat16)
    b = torch.randn(CONV_DIM, device=CUDA).to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    src = torch.tensor(src_l, dtype=torch.int32, device=CUDA)
    causal_conv1d_update(x, cs, w, b, cache_indices=src, out=out)
    torch.cuda.synchronize()

    used = sorted(s for s in src_l if s >= 0)
    (c_src,) = _compact(used, src_l)
    used_t = torch.tensor(used, device=CUDA)
    ref_small, ref_out = causal_conv1d_update_ref(
        x, cs0[used_t], w, b, torch.tensor(c_src, dtype=torch.int32, device=CUDA), silu=True
    )
    assert_close(out, ref_out, "conv out")
    assert torch.equal(_raw(cs[used_t]), _raw(ref_small))  # a shifted copy: bit-exact
    cs[used_t] = cs0[used_t]
    assert torch.equal(_raw(cs), _raw(cs0))


@pytest.mark.parametrize("big", ["ssm", "conv"])
def test_track_save_reaches_slots_past_int32_offsets(big: str) -> None:
    """Two layers: the second layer's rows start half way, so the layer offset plus the
    slot offset passes 2**31 (the kernel must widen both). The pool named ``big`` has the
    real per-slot size; the other is tiny (both share the slot count)."""
    layers = 2
    conv_shape, ssm_shape = ((CONV_DIM, K - 1), (1, 1, 8)) if big == "conv" else ((8, 3), (H, P, N))
    per_slot = CONV_DIM * (K - 1) if big == "conv" else H * P * N
    # element of (layer 1, slot s) = (slots + s) * per_slot: past 2**31 for s >= high - slots
    high = _first_slot_past_int32(per_slot)
    slots = high // 2 + 3
    s_hi = high - slots  # the first slot of layer 1 past 2**31
    assert (slots + s_hi) * per_slot >= INT32_LIMIT > (slots + s_hi - 1) * per_slot
    assert s_hi + 2 < slots
    conv_pool = torch.randn(layers, slots, *conv_shape, device=CUDA).to(torch.bfloat16)
    ssm_pool = torch.randn(layers, slots, *ssm_shape, device=CUDA)
    conv0, ssm0 = conv_pool.clone(), ssm_pool.clone()
    # row 0 copies a slot past 2**31 down to slot 3; row 1 copies slot 5 up past it
    src_l, trk_l = [s_hi + 1, 5, -1], [3, s_hi + 2, 1]
    mask = torch.tensor([True, True, True], device=CUDA)
    track_save(
        conv_pool,
        ssm_pool,
        src_indices=torch.tensor(src_l, dtype=torch.int32, device=CUDA),
        track_indices=torch.tensor(trk_l, dtype=torch.int32, device=CUDA),
        track_mask=mask,
    )
    torch.cuda.synchronize()

    used = sorted({s for s in src_l + trk_l if s >= 0})
    c_src, c_trk = _compact(used, src_l, trk_l)
    used_t = torch.tensor(used, device=CUDA)
    ref_conv, ref_ssm = track_save_ref(
        conv0[:, used_t],
        ssm0[:, used_t],
        torch.tensor(c_src, dtype=torch.int32, device=CUDA),
        torch.tensor(c_trk, dtype=torch.int32, device=CUDA),
        mask,
    )
    assert torch.equal(_raw(conv_pool[:, used_t]), _raw(ref_conv))
    assert torch.equal(_raw(ssm_pool[:, used_t]), _raw(ref_ssm))
    assert torch.equal(_raw(ssm_pool[:, 3]), _raw(ssm0[:, s_hi + 1]))  # the copy happened
    conv_pool[:, used_t] = conv0[:, used_t]
    ssm_pool[:, used_t] = ssm0[:, used_t]
    assert torch.equal(_raw(conv_pool), _raw(conv0))
    assert torch.equal(_raw(ssm_pool), _raw(ssm0))
