"""The SSM update's row walk: row splits, pad blocks, and the direct launch path."""

from __future__ import annotations

import pytest
import torch

from hybridmeta.kernels import ssm_state_update
from hybridmeta.kernels import ssm_update as su
from hybridmeta.kernels._config import SsmLaunchConfig, ssm_launch_config
from hybridmeta.kernels.ssm_update import launch_ssm_update, ssm_state_update_reference
from tests.kernels._support import (
    DEVICE,
    assert_close,
    assert_slots_bitwise,
    bits,
    nan_empty,
    ssm_state_update_ref,
)

H, P, N, G = 2, 4, 8, 1
# Kernel tests that run on the CPU interpreter and, on a CUDA machine, in the GPU suite.
ANY_DEVICE = pytest.mark.interpreter if DEVICE.type == "cpu" else pytest.mark.gpu


def _inputs(bs: int, slots: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    return {
        "state": rnd(slots, H, P, N),
        "x": rnd(bs, H, P),
        "dt": rnd(bs, H, scale=0.5),
        "A": -torch.rand(H, generator=g).to(DEVICE),
        "B": rnd(bs, G, N),
        "C": rnd(bs, G, N),
        "D": rnd(H),
        "z": rnd(bs, H, P),
    }


def _plan(bs: int, live_rows: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct source slots for live rows, -1 elsewhere; a track slot for every other live row."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(2 * bs + 1, generator=g).tolist()
    src = [-1] * bs
    trk = [-1] * bs
    for i, b in enumerate(live_rows):
        src[b] = perm[i]
        if i % 2 == 0:
            trk[b] = perm[bs + i]
    mask = [t >= 0 for t in trk]
    dev = DEVICE
    return (
        torch.tensor(src, device=dev),
        torch.tensor(trk, device=dev),
        torch.tensor(mask, device=dev),
    )


def _check_launch(
    bs: int, live: list[int], *, plan_seed: int, input_seed: int, config: SsmLaunchConfig | None
) -> None:
    """Launch over ``bs`` rows (``live`` of them live, tracked every other one) and check it
    against the reference: pad rows zero, written slots equal, other slots bit-identical."""
    src, trk, mask = _plan(bs, live, seed=plan_seed)
    a = _inputs(bs, 2 * bs + 1, seed=input_seed)
    ref_state, ref_out = ssm_state_update_ref(
        a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], src, D=a["D"], z=a["z"],
        dt_softplus=True, track_indices=trk, track_mask=mask,
    )  # fmt: skip
    state = a["state"].clone()
    out = nan_empty(bs, H, P, dtype=torch.float32)
    launch_ssm_update(
        state, a["x"], a["dt"], a["A"], a["B"], a["C"], out, src, D=a["D"], z=a["z"],
        dt_bias=None, dt_softplus=True, dst_indices=None, track_indices=trk, track_mask=mask,
        config=config,
    )  # fmt: skip
    pad = src < 0
    assert bool((out[pad] == 0).all()), "pad rows get zero output"
    assert_close(out, ref_out, "out")
    written = sorted({*src[~pad].tolist(), *trk[mask].tolist()})
    untouched = torch.tensor([s for s in range(state.shape[0]) if s not in written], device=DEVICE)
    assert_slots_bitwise(state, a["state"], untouched, "state")
    w = torch.tensor(written, device=DEVICE)
    assert_close(state[w], ref_state[w], "written slots")


@ANY_DEVICE
@pytest.mark.parametrize(("splits", "row_block"), [(1, 64), (3, 64), (130, 64), (1, 16)])
@pytest.mark.parametrize("layout", ["graph_tail", "shuffled"])
def test_every_row_split_matches_reference(splits: int, row_block: int, layout: str) -> None:
    """One program walking all 130 rows (three row blocks of 64, or nine of 16; pad-only
    blocks skipped), three programs, or one row each: the same result, pad rows zero, other
    slots untouched."""
    bs = 130
    live = [0, 1] if layout == "graph_tail" else [3, 17, 18, 63, 64, 100, 129]
    cfg = SsmLaunchConfig(block_p=4, num_warps=1, row_splits=splits, row_block=row_block)
    _check_launch(bs, live, plan_seed=splits, input_seed=len(live), config=cfg)


@ANY_DEVICE
@pytest.mark.parametrize("bs", [32, 33])
def test_default_launch_on_both_sides_of_the_tile_to_walk_switch(bs: int) -> None:
    """fp32 launches of up to 32 rows run one tile a program, from 33 the row walk (the
    default rule): both match the reference, pad rows zero, other slots untouched."""
    cfg = ssm_launch_config(torch.float32, P, N)
    assert cfg.walks_rows(bs) == (bs > 32)
    _check_launch(bs, [0, 5, bs - 2], plan_seed=bs, input_seed=bs, config=None)


def test_the_default_rule_picks_the_kernel_by_dtype_and_rows() -> None:
    f32 = ssm_launch_config(torch.float32, 80, 128)
    assert [f32.walks_rows(bs) for bs in (1, 16, 32, 33, 256)] == [False] * 3 + [True] * 2
    bf16 = ssm_launch_config(torch.bfloat16, 80, 128)
    assert not any(bf16.walks_rows(bs) for bs in (1, 33, 512)) and bf16.num_warps == 2
    # an explicit configuration keeps its kernel at every size
    assert SsmLaunchConfig(block_p=8, num_warps=1).walks_rows(1)


@ANY_DEVICE
@pytest.mark.parametrize("bs", [3, 40])
def test_dt_limit_equals_clamping_dt_beforehand(bs: int) -> None:
    """``dt_limit`` clamps the discretised dt inside the kernel (the tile kernel at 3 fp32
    rows, the row walk at 40): the same as handing it ``clamp(softplus(dt + dt_bias))``
    computed in torch, as the runtime did before; the clamp binds on both sides here."""
    assert ssm_launch_config(torch.float32, P, N).walks_rows(bs) == (bs > 32)
    a = _inputs(bs, bs + 2, seed=7)
    src = torch.arange(bs, device=DEVICE)
    src[1] = -1
    dt = torch.linspace(-4.0, 3.0, bs * H, device=DEVICE).view(bs, H)
    bias = torch.tensor([0.3, -0.2], device=DEVICE)
    lim = (0.2, 1.5)
    pre = torch.nn.functional.softplus(dt + bias).clamp(*lim)
    assert bool((pre == lim[0]).any()) and bool((pre == lim[1]).any()), "the clamp binds"

    def run(
        dt_: torch.Tensor, limit: tuple[float, float] | None = None, softplus: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        state = a["state"].clone()
        out = ssm_state_update(
            state, a["x"], dt_, a["A"], a["B"], a["C"], state_indices=src, D=a["D"],
            dt_bias=bias if softplus else None, dt_softplus=softplus, dt_limit=limit,
        )  # fmt: skip
        return out, state

    got = run(dt, lim)
    want = run(pre, softplus=False)
    for g, w, what in zip(got, want, ("out", "state"), strict=True):
        assert_close(g, w, what)
    assert not torch.allclose(run(dt)[0], got[0], atol=1e-3)
    ref_state, ref_out = ssm_state_update_ref(
        a["state"], a["x"], dt, a["A"], a["B"], a["C"], src, D=a["D"], dt_bias=bias,
        dt_softplus=True, dt_limit=lim,
    )  # fmt: skip
    assert_close(got[0], ref_out, "out vs reference")
    assert_close(got[1], ref_state, "state vs reference")


@pytest.mark.parametrize(
    "lim", [(1.0, 0.5), (float("nan"), 1.0), (0.5,), "0.1", (True, 2.0)], ids=str
)
def test_bad_dt_limit_is_refused_and_writes_nothing(lim: object) -> None:
    a = _inputs(2, 4, seed=0)
    state = a["state"].clone()
    with pytest.raises(ValueError, match=r"ssm_state_update: `dt_limit` must"):
        ssm_state_update(
            state, a["x"], a["dt"], a["A"], a["B"], a["C"],
            state_indices=torch.tensor([0, 1], device=DEVICE), dt_limit=lim,  # type: ignore[arg-type]
        )  # fmt: skip
    assert torch.equal(bits(state), bits(a["state"]))


@ANY_DEVICE
def test_strided_index_tensor_is_refused() -> None:
    a = _inputs(3, 8, seed=0)
    idx = torch.tensor([1, 0, 2, 0, 5, 0], device=DEVICE)[::2]
    with pytest.raises(ValueError, match=r"`state_indices` must be contiguous"):
        ssm_state_update(
            a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=idx
        )


@pytest.mark.gpu
def test_direct_launch_equals_first_launch() -> None:
    """The first call goes through Triton's launch and caches the variant; the next, with
    the same layout, goes to the compiled launcher directly: bit-identical results."""
    bs, slots = 5, 12
    a = _inputs(bs, slots, seed=1)
    src = torch.tensor([3, -1, 7, 0, 9], device=DEVICE)
    # fp32 at 5 rows: one tile a program (the default rule), so the tile kernel's launcher
    launcher = su._LAUNCHER if ssm_launch_config(torch.float32, P, N).walks_rows(bs) else su._TILE_LAUNCHER
    launcher.clear()
    results = []
    for _ in range(3):
        state = a["state"].clone()
        out = ssm_state_update(
            state, a["x"], a["dt"], a["A"], a["B"], a["C"], state_indices=src, D=a["D"],
            z=a["z"], dt_softplus=True,
        )  # fmt: skip
        results.append((bits(out), bits(state)))
    assert len(launcher._variants) == 1
    for r in results[1:]:
        assert torch.equal(r[0], results[0][0]) and torch.equal(r[1], results[0][1])


# --------------------------------------------------------------------------- rows a program

# The one-tile kernel with `tile_rows` rows a program: headdim 4 in two p-tiles.
ROW_LAYOUTS: dict[str, tuple[int, list[int]]] = {
    "all_pad": (6, []),  # every block of rows is pad: skipped, zero output only
    "graph_tail": (9, [0]),  # one live row, then pad blocks; bs not a multiple of the rows
    "partial": (11, [1, 2, 7, 10]),  # live and pad rows in a block; live last row, short block
    "interior_pad": (8, [0, 3, 4, 7]),  # pad rows between a block's first and last live row
    "all_live": (7, list(range(7))),
}
TAIL = 3  # rows past bs in every buffer: garbage the kernel must not read or write


def _rows_cfg(rows: int, late: bool = False) -> SsmLaunchConfig:
    return SsmLaunchConfig(
        block_p=2, num_warps=1, row_walk=False, tile_rows=rows, late_poison=late
    )


def _check_rows_launch(
    bs: int, live: list[int], rows: int, *, with_dst: bool, seed: int, late: bool = False
) -> None:
    """Launch on the first ``bs`` rows of ``bs + TAIL``-row buffers and compare with the
    reference. Pad rows carry NaN inputs, a valid destination and a flagged valid track
    slot; the tail rows carry live-looking slots, NaN inputs and set flags. Checks: outputs
    equal, pad rows exactly zero, the tail of ``out`` untouched, written slots equal, every
    other slot (pad rows' and tail rows' slots, sources overwritten elsewhere) bit-identical.
    """
    n = bs + TAIL
    slots = 3 * n + 1
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(slots, generator=g).tolist()
    is_live = [b in live for b in range(n)]
    src = [perm[b] if b >= bs or is_live[b] else -1 for b in range(n)]
    dst = [perm[n + b] for b in range(n)]
    if with_dst and live:
        dst[live[-1]] = -1  # a live row that writes nothing back
    trk = [perm[2 * n + b] for b in range(n)]
    # every other live row tracked; pad rows and the tail flagged too (they must not write)
    mask = [not is_live[b] or live.index(b) % 2 == 0 for b in range(n)]
    a = _inputs(n, slots, seed=seed)
    for k in ("x", "dt", "B", "C", "z"):
        a[k][[b for b in range(n) if not is_live[b]]] = float("nan")

    def idx(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, device=DEVICE)

    src_t, dst_t, trk_t = idx(src), idx(dst), idx(trk)
    mask_t = torch.tensor(mask, device=DEVICE)
    v = {k: a[k][:bs] for k in ("x", "dt", "B", "C", "z")}
    ref_state, ref_out = ssm_state_update_ref(
        a["state"], v["x"], v["dt"], a["A"], v["B"], v["C"], src_t[:bs], D=a["D"], z=v["z"],
        dt_softplus=True, dst_indices=dst_t[:bs] if with_dst else None,
        track_indices=trk_t[:bs], track_mask=mask_t[:bs],
    )  # fmt: skip
    state = a["state"].clone()
    out = nan_empty(n, H, P, dtype=torch.float32)
    launch_ssm_update(
        state, v["x"], v["dt"], a["A"], v["B"], v["C"], out[:bs], src_t[:bs], D=a["D"],
        z=v["z"], dt_bias=None, dt_softplus=True,
        dst_indices=dst_t[:bs] if with_dst else None, track_indices=trk_t[:bs],
        track_mask=mask_t[:bs], config=_rows_cfg(rows, late),
    )  # fmt: skip
    pad = [b for b in range(bs) if not is_live[b]]
    assert bool((out[pad] == 0).all()), "pad rows get exactly zero output"
    assert bool(out[bs:].isnan().all()), "rows past bs: output untouched"
    assert_close(out[:bs], ref_out, "out")
    written = {(dst if with_dst else src)[b] for b in live} | {trk[b] for b in live if mask[b]}
    written.discard(-1)
    untouched = torch.tensor([s for s in range(slots) if s not in written], device=DEVICE)
    assert_slots_bitwise(state, a["state"], untouched, "state")
    if written:
        w = torch.tensor(sorted(written), device=DEVICE)
        assert_close(state[w], ref_state[w], "written slots")


@ANY_DEVICE
@pytest.mark.parametrize("late", [False, True], ids=["select", "late_poison"])
@pytest.mark.parametrize("with_dst", [False, True], ids=["in_place", "dst"])
@pytest.mark.parametrize("layout", list(ROW_LAYOUTS))
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_rows_a_program_match_reference(rows: int, layout: str, with_dst: bool, late: bool) -> None:
    """`tile_rows` 1, 2 and 4: blocks all pad, partly pad, pad rows inside a block, a short
    last block (bs not a multiple of the rows), all live; in place or into destination
    slots, tracked rows; bad rows poisoned at the output or late: the reference's result,
    pad rows zero, nothing past bs read or written."""
    bs, live = ROW_LAYOUTS[layout]
    _check_rows_launch(bs, live, rows, with_dst=with_dst, seed=rows + bs, late=late)


def test_tile_rows_must_be_a_power_of_two() -> None:
    assert SsmLaunchConfig(block_p=8, num_warps=1, tile_rows=16).tile_rows == 16
    for bad in (0, 3, 6, -2):
        with pytest.raises(ValueError, match="tile_rows must be a power of two"):
            SsmLaunchConfig(block_p=8, num_warps=1, tile_rows=bad)


@ANY_DEVICE
def test_rows_a_program_grid_and_variant_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid has ceil(bs / rows) programs along the rows; the launcher's variant key (what
    one compiled kernel serves) is the same for every batch size at one `tile_rows` and
    differs between `tile_rows` values; the default is one row a program (grid p x bs x h)."""
    calls: list[tuple[tuple[int, int, int], object]] = []
    launch = su._TILE_LAUNCHER.launch

    def spy(var: object, grid: tuple[int, int, int], key: object, *rest: object) -> None:
        calls.append((grid, key))
        launch(var, grid, key, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(su._TILE_LAUNCHER, "launch", spy)
    sizes = (1, 3, 4, 9)
    for rows in (1, 2, 4):
        for bs in sizes:
            a = _inputs(bs, bs + 1, seed=bs)
            out = torch.empty(bs, H, P, device=DEVICE)
            launch_ssm_update(
                a["state"], a["x"], a["dt"], a["A"], a["B"], a["C"], out,
                torch.arange(bs, device=DEVICE), D=a["D"], z=a["z"], dt_bias=None,
                dt_softplus=True, dst_indices=None, track_indices=None, track_mask=None,
                config=_rows_cfg(rows),
            )  # fmt: skip
    grids = [c[0] for c in calls]
    assert grids == [(2, -(-bs // r), H) for r in (1, 2, 4) for bs in sizes]
    keys = [c[1] for c in calls]
    per_rows = [keys[i : i + len(sizes)] for i in range(0, len(keys), len(sizes))]
    assert all(len(set(map(repr, ks))) == 1 for ks in per_rows), "one variant per rows value"
    assert len({repr(ks[0]) for ks in per_rows}) == 3, "rows values have their own variants"
    assert ssm_launch_config(torch.bfloat16, 80, 128).tile_rows == 1
    assert ssm_launch_config(torch.float32, 80, 128).tile_rows == 1


@ANY_DEVICE
def test_rows_a_program_follow_the_batch_size_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tile_rows_from``: a launch takes the rows of the last step its batch size reaches
    (grid and result); the default gives bf16 states 16 rows a program from 128 rows and
    32 from 256, one below, and fp32 states none (their large launches walk rows)."""
    bf16 = ssm_launch_config(torch.bfloat16, 80, 128)
    steps = [bf16.rows_per_program(b) for b in (1, 127, 128, 255, 256, 512)]
    assert steps == [1, 1, 16, 16, 32, 32]
    assert ssm_launch_config(torch.float32, 80, 128).rows_per_program(512) == 1
    with pytest.raises(ValueError, match="tile_rows_from rows must be powers of two"):
        SsmLaunchConfig(block_p=8, num_warps=1, tile_rows_from=((4, 3),))
    with pytest.raises(ValueError, match="tile_rows_from must ascend"):
        SsmLaunchConfig(block_p=8, num_warps=1, tile_rows_from=((8, 2), (4, 4)))
    grids: list[tuple[int, int, int]] = []
    launch = su._TILE_LAUNCHER.launch

    def spy(var: object, grid: tuple[int, int, int], *rest: object) -> None:
        grids.append(grid)
        launch(var, grid, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(su._TILE_LAUNCHER, "launch", spy)
    cfg = SsmLaunchConfig(block_p=2, num_warps=1, row_walk=False, tile_rows_from=((3, 2), (6, 4)))
    for bs in (2, 5, 7):
        a = _inputs(bs, bs + 1, seed=40 + bs)
        src = torch.arange(bs, device=DEVICE)
        src[1] = -1  # a pad row inside the first block
        out = torch.full((bs, H, P), float("nan"), device=DEVICE)
        state = a["state"].clone()
        launch_ssm_update(
            state, a["x"], a["dt"], a["A"], a["B"], a["C"], out, src, D=a["D"], z=a["z"],
            dt_bias=None, dt_softplus=True, dst_indices=None, track_indices=None,
            track_mask=None, config=cfg,
        )  # fmt: skip
        ref_state = a["state"].clone()
        ref_out = torch.empty_like(out)
        ssm_state_update_reference(
            ref_state, a["x"], a["dt"], a["A"], a["B"], a["C"], ref_out, src, D=a["D"],
            z=a["z"], dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(state, ref_state)
    assert grids == [(2, 2, H), (2, 3, H), (2, 2, H)]
