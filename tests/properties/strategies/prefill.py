"""Hypothesis strategies for prefill: mixed batches with the edge cases that broke peers.

A batch is drawn row by row, so a row can be steered to put its track boundary exactly on
the *global* chunk grid (``g % chunk_size == 0``), just past it, at the row's end, or
nowhere, knowing where the earlier rows put its first token. Prefill rows come first,
decode rows (1 token, prefix >= 1) last.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch
from hypothesis import strategies as st

from hybridmeta import (
    Conventions,
    ForwardMetadata,
    Mamba2Metadata,
    RowOrder,
    metadata,
    plan_mixed_batch,
)
from hybridmeta.kernels import (
    ConvPrefillOutput,
    Impl,
    SSDScanOutput,
    SSMParams,
    causal_conv1d_prefill,
    extend_track_save,
    split_xbc,
    ssd_chunked_scan,
    track_save_from_metadata,
)
from tests.kernels._support import TOLERANCES
from tests.oracle import OracleRow, oracle_layer, oracle_ssm_row

__all__ = [
    "BF16",
    "FP32",
    "ROW_ORDER_FORWARDS",
    "WRONG_ARGUMENT_KINDS",
    "BatchSpec",
    "LayerData",
    "batch_specs",
    "close",
    "decodes_first",
    "make_layer",
    "plan_kwargs",
    "plan_of",
    "run_oracle",
    "run_pipeline",
    "run_ssm_oracle",
    "split_of",
    "wrong_plan_arguments",
]

_MODES = ("random", "on_grid", "past_grid", "end", "short", "single")


@attrs.frozen(kw_only=True)
class BatchSpec:
    """Host description of one mixed batch plus the layer shape."""

    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    conv_kernel: int
    chunk_size: int
    track_interval: int
    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    slots: tuple[int, ...]
    track_mask: tuple[bool, ...]
    track_slots: tuple[int, ...]
    num_decodes: int
    pool_size: int
    seed: int

    @property
    def num_prefills(self) -> int:
        return len(self.extend_lens) - self.num_decodes

    @property
    def conv_dim(self) -> int:
        return self.nheads * self.headdim + 2 * self.ngroups * self.dstate

    @property
    def prefill_tokens(self) -> int:
        return sum(self.extend_lens[: self.num_prefills])


@st.composite
def _prefill_row(draw: st.DrawFn, qs: int, L: int, interval: int) -> tuple[int, int]:
    """(extend, prefix) of one prefill row whose first token sits at flattened ``qs``."""
    mode = draw(st.sampled_from(_MODES))
    if mode in ("on_grid", "past_grid"):
        # boundary after k new tokens with (qs + k) % L == 0 (or == 1 just past the edge)
        want = 0 if mode == "on_grid" else 1
        k = (want - qs) % L
        k = k if k > 0 else L
        k += L * draw(st.integers(0, 1))
        extend = k + draw(st.integers(1, L + 1))  # the boundary is mid-row
        j = draw(st.integers(-(-k // interval), -(-k // interval) + 1))
        return extend, interval * j - k
    if mode == "end":
        extend = draw(st.integers(1, 3 * L))
        j = draw(st.integers(-(-extend // interval), -(-extend // interval) + 1))
        return extend, interval * j - extend
    if mode == "short":
        return draw(st.integers(1, max(1, L - 1))), draw(st.integers(0, 2 * interval))
    if mode == "single":
        return 1, draw(st.integers(0, 2 * interval))
    extend = draw(st.sampled_from([1, L - 1, L, L + 1, 2 * L, 2 * L + 1]) | st.integers(1, 3 * L))
    prefix = draw(st.just(0) | st.integers(0, 3 * interval))
    return max(extend, 1), prefix


@st.composite
def batch_specs(
    draw: st.DrawFn,
    *,
    min_prefills: int = 1,
    max_prefills: int = 4,
    max_decodes: int = 2,
) -> BatchSpec:
    """A mixed batch: shapes, chunk size, track interval, rows, slots and track mask."""
    ngroups = draw(st.sampled_from([1, 2]))
    nheads = ngroups * draw(st.integers(1, 2))
    headdim = draw(st.integers(1, 3))
    dstate = draw(st.integers(1, 4))
    conv_kernel = draw(st.integers(2, 4))
    L = draw(st.sampled_from([2, 4, 8]))
    interval = L * draw(st.integers(1, 2))
    n_pre = draw(st.integers(min_prefills, max_prefills))
    n_dec = draw(st.integers(0, max_decodes))
    extend: list[int] = []
    prefix: list[int] = []
    qs = 0
    for _ in range(n_pre):
        e, p = draw(_prefill_row(qs, L, interval))
        extend.append(e)
        prefix.append(max(p, 0))
        qs += e
    for _ in range(n_dec):
        extend.append(1)
        on = draw(st.booleans())
        # on: (prefix + 1) % interval == 0, so the decode step ends on a boundary
        prefix.append(
            interval * draw(st.integers(1, 2)) - 1 if on else draw(st.integers(1, 3 * interval))
        )
    n = n_pre + n_dec
    pool_size = 2 * n + 2
    perm = draw(st.permutations(list(range(pool_size))))
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return BatchSpec(
        nheads=nheads,
        headdim=headdim,
        ngroups=ngroups,
        dstate=dstate,
        conv_kernel=conv_kernel,
        chunk_size=L,
        track_interval=interval,
        extend_lens=tuple(extend),
        prefix_lens=tuple(prefix),
        slots=tuple(perm[:n]),
        track_mask=tuple(mask),
        track_slots=tuple(perm[n : 2 * n]),
        num_decodes=n_dec,
        pool_size=pool_size,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@attrs.frozen(kw_only=True)
class LayerData:
    """Random layer weights, prefill inputs and state pools for a :class:`BatchSpec`."""

    xbc: torch.Tensor  # [T, conv_dim]
    dt: torch.Tensor  # [T, H]
    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor  # [conv_dim]
    params: SSMParams
    conv_pool: torch.Tensor  # [pool, conv_dim, K-1]
    ssm_pool: torch.Tensor  # [pool, H, P, N]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> LayerData:
        """Copy to ``device``; ``dtype`` casts the activations and the conv pool."""

        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype or t.dtype)

        return LayerData(
            xbc=mv(self.xbc),
            dt=self.dt.to(device),
            conv_weight=self.conv_weight.to(device),
            conv_bias=self.conv_bias.to(device),
            params=SSMParams(
                A=self.params.A.to(device),
                D=self.params.D.to(device),
                dt_bias=self.params.dt_bias.to(device),
            ),
            conv_pool=mv(self.conv_pool),
            ssm_pool=self.ssm_pool.to(device),
        )


def make_layer(spec: BatchSpec, *, tokens: int | None = None) -> LayerData:
    """Deterministic random data (``spec.seed``) for the prefill rows of ``spec``."""
    g = torch.Generator().manual_seed(spec.seed)
    T = spec.prefill_tokens if tokens is None else tokens
    H, K = spec.nheads, spec.conv_kernel

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    return LayerData(
        xbc=rnd(T, spec.conv_dim),
        dt=rnd(T, H, scale=0.5),
        conv_weight=rnd(spec.conv_dim, K, scale=0.5),
        conv_bias=rnd(spec.conv_dim, scale=0.1),
        params=SSMParams(
            A=-(torch.rand(H, generator=g) + 0.2),
            D=rnd(H),
            dt_bias=rnd(H, scale=0.2),
        ),
        conv_pool=rnd(spec.pool_size, spec.conv_dim, K - 1),
        ssm_pool=rnd(spec.pool_size, H, spec.headdim, spec.dstate),
    )


def plan_kwargs(spec: BatchSpec) -> dict[str, Any]:
    """The planner's arguments for ``spec`` (tracking on)."""
    return {
        "extend_lens": spec.extend_lens,
        "prefix_lens": spec.prefix_lens,
        "slots": spec.slots,
        "num_decodes": spec.num_decodes,
        "chunk_size": spec.chunk_size,
        "conv_kernel": spec.conv_kernel,
        "track_interval": spec.track_interval,
        "track_mask": spec.track_mask,
        "track_slots": spec.track_slots,
    }


@metadata(extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST))
class DecodesFirstForward(ForwardMetadata):
    """An engine's forward metadata with decode rows first (pad slot -1)."""


@metadata(
    extension=True, conventions=Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0)
)
class VllmStyleForward(ForwardMetadata):
    """vLLM's conventions: decode rows first, null slot 0 (``NULL_BLOCK_ID``, a slot every
    pool reserves, never a live row's)."""


#: Source classes declaring decode rows first, with the null slot -1 and 0.
ROW_ORDER_FORWARDS: tuple[type[ForwardMetadata], ...] = (DecodesFirstForward, VllmStyleForward)


def decodes_first(spec: BatchSpec) -> tuple[dict[str, Any], list[int]]:
    """``spec``'s planner arguments with its decode rows first (each part in its order),
    and the permutation: row ``i`` of that batch is row ``perm[i]`` of ``spec``."""
    n, n_pre = len(spec.extend_lens), spec.num_prefills
    perm = [*range(n_pre, n), *range(n_pre)]
    kw = plan_kwargs(spec)
    for name in ("extend_lens", "prefix_lens", "slots", "track_mask", "track_slots"):
        kw[name] = tuple(kw[name][r] for r in perm)
    return kw, perm


def plan_of(spec: BatchSpec, device: torch.device | str = "cpu") -> Mamba2Metadata:
    """Plan ``spec`` (tracking on): the forward's metadata."""
    return plan_mixed_batch(**plan_kwargs(spec), device=device)


_I64_MAX = (1 << 63) - 1
_COUNTS = ("num_decodes", "chunk_size", "conv_kernel", "track_interval")
_ROWS = ("extend_lens", "prefix_lens", "slots", "track_slots")


#: The kinds of :func:`wrong_plan_arguments`.
WRONG_ARGUMENT_KINDS = ("count", "shape", "dtype", "past_int64", "overflow")


@st.composite
def wrong_plan_arguments(draw: st.DrawFn, spec: BatchSpec, kind: str) -> tuple[str, object, str]:
    """One planner argument of ``spec`` replaced by a wrong value of ``kind`` (one of
    :data:`WRONG_ARGUMENT_KINDS`): a count of the wrong type, a per-row argument of the
    wrong shape or dtype, a value past int64, a row whose end position overflows int64.
    Returns ``(argument, value, rule)``, ``rule`` a phrase the refusal states. The
    planner must refuse it with a message naming the argument, before it computes
    anything. ``spec`` has rows."""
    kw = plan_kwargs(spec)
    if kind == "count":
        name = draw(st.sampled_from(_COUNTS))
        value = kw[name]
        how = draw(st.sampled_from(["float", "bool", "numpy", "str", "tensor"]))
        wrong: object = {
            "float": float(value),
            "bool": bool(value),
            "numpy": np.int64(value),
            "str": str(value),
            "tensor": torch.tensor(value),
        }[how]
        return name, wrong, f"{name} must be an int, got "
    if kind == "dtype":
        name = draw(st.sampled_from((*_ROWS, "track_mask")))
        rule = "must be bool" if name == "track_mask" else "must hold integers"
        return name, [float(v) + 0.5 for v in kw[name]], rule
    if kind == "shape":
        name = draw(st.sampled_from((*_ROWS, "track_mask")))
        value = kw[name]
        how = draw(st.sampled_from(["nested", "scalar", "str", "2-d", "none"]))
        if how == "nested":
            return name, [[v] for v in value], "must be 1-D (one entry per row)"
        if how == "2-d":
            return name, torch.tensor(value).reshape(1, -1), "must be 1-D (one entry per row)"
        wrong = {"scalar": value[0], "str": "".join(str(int(v)) for v in value), "none": None}
        if how == "none" and name in ("track_mask", "track_slots"):
            # None is "not given": the other track argument alone is refused
            return name, None, "given without"
        return name, wrong[how], "must be a 1-D sequence of"
    name = draw(st.sampled_from(_ROWS if kind == "past_int64" else _ROWS[:2]))
    value = kw[name]
    r = draw(st.integers(0, len(value) - 1))
    if kind == "past_int64":
        big = _I64_MAX + 1 + draw(st.integers(0, 2**63 - 1))
        if draw(st.booleans()):  # a list of Python ints
            return name, [*value[:r], big, *value[r + 1 :]], "does not fit int64"
        arr = np.array(value, dtype=np.uint64)  # an unsigned array
        arr[r] = np.uint64(big)
        return name, arr, "does not fit int64"
    # overflow: a row whose end position (prefix + extend) passes int64 (or, the value
    # itself past int64, does not fit; or a decode row's extend is not 1)
    other = kw["prefix_lens" if name == "extend_lens" else "extend_lens"][r]
    big = _I64_MAX - other + 1 + draw(st.integers(0, 3))
    if big > _I64_MAX:
        rule = "does not fit int64"
    elif name == "extend_lens" and r >= spec.num_prefills:
        rule = "is a decode row"
    else:
        rule = "overflow int64"
    return name, [*value[:r], big, *value[r + 1 :]], rule


def run_oracle(spec: BatchSpec, data: LayerData) -> list[OracleRow]:
    """The oracle over the prefill rows, initial states read from ``data``'s pools."""
    n_pre = spec.num_prefills
    has = [spec.prefix_lens[r] > 0 for r in range(n_pre)]
    conv_pool = data.conv_pool.float().cpu()
    ssm_pool = data.ssm_pool.float().cpu()
    return oracle_layer(
        data.xbc.float().cpu(),
        data.dt.float().cpu(),
        spec.extend_lens[:n_pre],
        [conv_pool[spec.slots[r]] if has[r] else None for r in range(n_pre)],
        [ssm_pool[spec.slots[r]] if has[r] else None for r in range(n_pre)],
        conv_weight=data.conv_weight.float().cpu(),
        conv_bias=data.conv_bias.float().cpu(),
        params=SSMParams(
            A=data.params.A.cpu(), D=data.params.D.cpu(), dt_bias=data.params.dt_bias.cpu()
        ),
        nheads=spec.nheads,
        headdim=spec.headdim,
        ngroups=spec.ngroups,
        dstate=spec.dstate,
    )


def run_ssm_oracle(
    spec: BatchSpec, data: LayerData, conv_out: torch.Tensor
) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The SSM oracle fed with the conv output the pipeline actually produced.

    With bf16 activations the conv output is rounded to bf16 before the scan; comparing
    the scan with this oracle measures the scan's own error, not that rounding amplified
    over a long row. Initial states are read from ``data``'s pools (call it before the
    pipeline writes them). Returns ``(y [L, H, P], states)`` per prefill row.
    """
    x, B, C = split_of(spec, conv_out.float().cpu())
    dt = data.dt.float().cpu()
    ssm_pool = data.ssm_pool.float().cpu()
    params = SSMParams(
        A=data.params.A.cpu(), D=data.params.D.cpu(), dt_bias=data.params.dt_bias.cpu()
    )
    out = []
    start = 0
    for r in range(spec.num_prefills):
        n = spec.extend_lens[r]
        init = ssm_pool[spec.slots[r]] if spec.prefix_lens[r] > 0 else None
        sl = slice(start, start + n)
        out.append(oracle_ssm_row(x[sl], dt[sl], B[sl], C[sl], params, init))
        start += n
    return out


def split_of(spec: BatchSpec, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a conv output of ``spec``'s layer into ``x, B, C``."""
    return split_xbc(u, spec.nheads, spec.headdim, spec.ngroups, spec.dstate)


def run_pipeline(
    spec: BatchSpec,
    data: LayerData,
    md: Mamba2Metadata,
    *,
    track: bool = True,
    impl: Impl = "reference",
) -> tuple[ConvPrefillOutput, SSDScanOutput]:
    """Conv, scan (``impl``) and (optionally) the track saves of the prefill rows: the
    extend track-save of mid-row boundaries, then the forward's track-save of the rows
    flagged in ``mamba_track_mask`` (boundaries that end a row). Pools updated in place."""
    conv = causal_conv1d_prefill(
        data.xbc, data.conv_weight, data.conv_bias, md=md, conv_state=data.conv_pool
    )
    x, B, C = split_of(spec, conv.out)
    scan = ssd_chunked_scan(
        x,
        data.dt,
        B,
        C,
        params=data.params,
        md=md,
        ssm_state=data.ssm_pool,
        return_chunk_states=True,
        impl=impl,
    )
    if track:
        extend_track_save(
            md,
            xbc=data.xbc,
            conv=conv,
            scan=scan,
            conv_state=data.conv_pool,
            ssm_state=data.ssm_pool,
        )
        # one layer: the layer-major pools of the track-save are these pools, unsqueezed
        track_save_from_metadata(md, data.conv_pool[None], data.ssm_pool[None], impl=impl)
    return conv, scan


#: (rtol, atol) per activation dtype: the rows of the one tolerance table. fp32: the
#: chunked scan and the token-by-token oracle associate the same sums differently
#: (chunk-local cumulative decays, inter-chunk state passing): a few ulps per step over
#: <= ~100 steps of values up to ~10, i.e. ~1e-4 worst case, inside 1e-3 + 3e-4 |ref|.
#: bf16: activations rounded to 8 bits of mantissa (2**-8 relative) at the scan's input
#: and output.
FP32: tuple[float, float] = TOLERANCES[torch.float32]
BF16: tuple[float, float] = TOLERANCES[torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float] = FP32) -> None:
    """``assert_close`` in fp32 with a per-dtype tolerance (on the CPU)."""
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), rtol=tol[0], atol=tol[1]
    )
