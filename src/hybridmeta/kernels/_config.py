"""Launch configurations, picked by rule rather than autotuned.

Autotuning an in-place kernel would run it several times on live state, so each kernel
gets a fixed configuration derived from dtype and shape. The benchmark sweeps the
alternatives and records why the defaults below were chosen (see ``docs/kernels.md``).
"""

from __future__ import annotations

import functools
import itertools

import attrs
import torch
import triton.language as tl

#: The Triton dtype of a torch float dtype (a kernel's constexpr cast target).
TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@attrs.frozen
class SsmLaunchConfig:
    """Tile of the SSM update: ``block_p`` headdim rows by the whole ``dstate``.

    ``row_walk``: the row-walking kernel (fp32 state), else one tile a program.
    ``row_splits``: programs per tile position along the rows (``None``: about 2.5 full
    waves of resident programs; each program walks ``ceil(bs / row_splits)`` rows).
    ``row_block``: rows whose slots a program reads at once to skip pad rows.
    ``tile_max_bs``: with ``row_walk``, launches of at most this many rows take the
    one-tile-a-program kernel instead (same tile and warps): at a handful of rows the walk's
    loop costs more than its row skipping saves.
    ``tile_rows``: rows a program of the one-tile kernel owns (a power of two; 1: one row a
    program). A program reads the source slots of its rows at once, writes the zero output
    of their pad rows in one store and runs the row body from its first to its last live
    row, so a padded bucket launches ``tile_rows`` times fewer programs.
    ``tile_rows_from``: ``(min_bs, rows)`` steps, ascending: a launch of at least ``min_bs``
    rows takes ``rows`` rows a program instead of ``tile_rows`` (the last step that applies
    wins), so a large bucket's pad rows cost few programs while small launches keep one
    row a program. Each distinct value compiles once; the batch size never does.
    ``max_regs``: register cap per thread of the one-tile kernel (ptxas ``maxnreg``; ``None``:
    the compiler's choice).
    ``late_poison``: where the one-tile kernel gives a row with an invalid id its NaN
    output. ``True``: the row stores zeros like a pad row, then NaN over them in a branch
    after the row's stores (and, with several rows a program, after the row loop), so
    nothing about the fault is live through the row's arithmetic; ``False``: a select at
    the output store. The outputs are the same; what differs is the code ptxas makes
    (docs/perf_notes.md, "Round 3, fourth GPU session").
    """

    block_p: int
    num_warps: int
    row_splits: int | None = None
    row_block: int = 64
    row_walk: bool = True
    tile_max_bs: int = 0
    tile_rows: int = attrs.field(default=1)
    tile_rows_from: tuple[tuple[int, int], ...] = attrs.field(default=())
    max_regs: int | None = None
    late_poison: bool = False

    @tile_rows.validator
    def _check_tile_rows(self, _: object, value: int) -> None:
        if value < 1 or value & (value - 1):
            raise ValueError(f"SsmLaunchConfig: tile_rows must be a power of two, got {value}")

    @tile_rows_from.validator
    def _check_tile_rows_from(self, _: object, value: tuple[tuple[int, int], ...]) -> None:
        for _, rows in value:
            if rows < 1 or rows & (rows - 1):
                raise ValueError(
                    f"SsmLaunchConfig: tile_rows_from rows must be powers of two, got {rows}"
                )
        if any(a[0] >= b[0] for a, b in itertools.pairwise(value)):
            raise ValueError(f"SsmLaunchConfig: tile_rows_from must ascend in min_bs, got {value}")

    def rows_per_program(self, bs: int) -> int:
        """Rows a program of the one-tile kernel owns in a launch of ``bs`` rows."""
        rows = self.tile_rows
        for min_bs, step_rows in self.tile_rows_from:
            if bs >= min_bs:
                rows = step_rows
        return rows

    def walks_rows(self, bs: int) -> bool:
        """Whether a launch of ``bs`` rows runs the row-walking kernel."""
        return self.row_walk and bs > self.tile_max_bs


@attrs.frozen
class ConvLaunchConfig:
    """Tile of the conv update: ``block_c`` channels of ``rows`` rows (a power of two)."""

    block_c: int
    num_warps: int
    rows: int = 1


@attrs.frozen
class CopyLaunchConfig:
    """Track-save copy: elements per loop step and programs per launch."""

    block: int
    num_warps: int
    max_programs: int


@functools.cache
def ssm_launch_config(state_dtype: torch.dtype, headdim: int, dstate: int) -> SsmLaunchConfig:
    """Pick the SSM update kernel and tile for a state dtype and head shape.

    A tile carries 4 KiB of state whatever its dtype. An fp32 state (one warp, 128 bytes
    of state per thread) takes the row-walking kernel from 33 rows up: 92.8 / 94.0 / 93.7%
    of the copy ceiling at bs 128 / 256 / 512 on the H200, against 90-92% for one tile a
    program, and a padded bucket costs little (docs/perf_notes.md, run 3); up to 32 rows
    it takes one tile a program, 6-11% faster there (bs 4 / 8 / 16 under graph replay:
    13.8 / 24.7 / 46.5 us against 15.5 / 26.9 / 49.4 us; `kernels_h200_tile_sweep.json`).
    bf16 / fp16 tiles poison bad rows late (``late_poison``): the select at the output
    took ptxas (Triton 3.6, sm_90a) from 64 to 72 registers a thread at one row a program
    and from 72 to 80 at 16 / 32 (16 -> 14 and 14 -> 12 resident programs an SM), 4-6.5%
    slower at 8-32 and 128-256 rows on the H200; late, they take the unchecked kernel's
    counts and times. The fp32 tile keeps the select: late it measured 1.05-1.13x at 1-8
    rows.
    A bf16 / fp16 state takes one tile a program on two warps: the row walk's extra live
    registers held its 16-row bf16 tile to 78-82%, against 87-90% for one tile a program
    (two warps 0.3-5% faster than one at every bs of the tile sweep). mamba_ssm's 4-row
    tiles (2 KiB fp32, 1 KiB bf16, 4 warps) make the kernel bound by program scheduling.
    From 128 rows a bf16 / fp16 program owns 16 rows, from 256 rows 32 (``tile_rows_from``):
    a bucket-256 graph replayed with one live row then costs 6.8 us, 1.8x a bucket-1 graph,
    against 232 us (60x) at one row a program, for 0.2-1.2% of a full launch's time at
    128 / 256 / 512 rows (`sweep_ssm_rows_h200.json`; below 128 rows more rows a program
    cost 3-40%).
    """
    rows = max(1, (4096 // state_dtype.itemsize) // max(dstate, 1))
    block_p = max(min(_pow2_floor(rows), pow2_ceil(headdim)), 1)
    if state_dtype.itemsize >= 4:
        return SsmLaunchConfig(block_p=block_p, num_warps=1, row_walk=True, tile_max_bs=32)
    return SsmLaunchConfig(
        block_p=block_p, num_warps=2, row_walk=False, tile_rows_from=((128, 16), (256, 32)),
        late_poison=True,
    )


@functools.cache
def conv_launch_config(dim: int, *, channels_contiguous: bool = False) -> ConvLaunchConfig:
    """Pick the conv update tile: 128 channels a program (fewer for tiny ``conv_dim``).

    With ``conv_dim`` the contiguous axis of the pool (``[slots, k-1, conv_dim]`` storage),
    a program takes 4 rows: one row's channels hold too few bytes to keep memory busy and
    each row would re-read the weights (H200 sweep: 67% of copy against 26% for one row).
    With the ``[slots, conv_dim, k-1]`` contiguous layout more rows did not help (36% at
    best, one row): its 6-byte channel runs force 2-byte accesses whatever the tile.
    """
    block_c = min(128, pow2_ceil(dim))
    return ConvLaunchConfig(block_c=block_c, num_warps=2, rows=4 if channels_contiguous else 1)


def copy_launch_config(device: torch.device, element_size: int) -> CopyLaunchConfig:
    """Pick the track-save copy shape: 32 KiB a step, 16 programs per SM on a GPU.

    The H200 sweep found every shape from 8 to 32 KiB and 4 to 16 programs per SM within
    2% of each other at 4 tracked rows; this one was on top.
    """
    block = 32768 // element_size
    if device.type == "cuda":
        programs = 16 * _sm_count(device.index if device.index is not None else 0)
    else:
        # The CPU interpreter runs programs one after another: few is fastest.
        programs = 2
    return CopyLaunchConfig(block=block, num_warps=8, max_programs=programs)


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def pow2_ceil(n: int) -> int:
    """The least power of two ``>= n`` (1 for ``n <= 1``).

    Host code uses this and :func:`cdiv`, not ``triton.next_power_of_2`` / ``triton.cdiv``:
    in Triton 3.6 those are ``constexpr_function`` objects whose wrapper costs a few
    microseconds a call, which a launch path calling them two or three times pays per op.
    """
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0``."""
    return -(-a // b)


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)
