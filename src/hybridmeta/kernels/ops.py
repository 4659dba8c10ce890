"""Public decode-kernel ops: validation, allocation, and one ``torch.library`` op per launch.

Each public function checks shapes, dtypes and devices (cheap, no device reads), checks
index ranges and slot collisions only in debug mode (:func:`hybridmeta.debug.is_debug`),
allocates the output if none is given, and then launches exactly one kernel: through a
``torch.library`` custom op whenever the dispatcher is observed (see :func:`_observed`),
directly otherwise. A ``TorchDispatchMode`` (for instance the CPU CUDA-graph emulation in
:mod:`hybridmeta.graphs`) therefore sees each kernel launch as one ``hybridmeta::*`` op
with its mutated arguments declared. Nothing is written before every check has passed.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hybridmeta.debug import is_debug
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MASK_DTYPES,
    STATE_DTYPES,
    check_disjoint_writes,
    check_index_range,
    check_optional,
    check_pool,
    check_slot_contiguous,
    check_tensor,
)
from hybridmeta.kernels.conv_update import launch_conv_update
from hybridmeta.kernels.ssm_update import launch_ssm_update, ssm_args_ok
from hybridmeta.kernels.track_save import launch_track_save

__all__ = [
    "DecodeIndices",
    "causal_conv1d_update",
    "causal_conv1d_update_from_metadata",
    "ssm_state_update",
    "ssm_state_update_from_metadata",
    "track_save",
    "track_save_from_metadata",
]


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    # Triton launches on the current CUDA device: make it the tensors' device.
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# Force every call through the torch dispatcher (benchmarks and tests compare the paths).
ALWAYS_DISPATCH = False


def _observed(pool: torch.Tensor) -> bool:
    """Whether a launch must go through the ``torch.library`` op.

    It must whenever something could watch or transform it: an active ``TorchDispatchMode``
    (graph recording, fake tensors), ``torch.compile`` tracing, or a tensor subclass. With
    none of those the op would only add dispatcher overhead (tens of microseconds of host
    time per call), so the kernel is launched directly; the launch is the same either way.
    """
    return (
        ALWAYS_DISPATCH
        or type(pool) is not torch.Tensor
        or _get_current_dispatch_mode() is not None
        or torch.compiler.is_compiling()
    )


# --------------------------------------------------------------------------- custom ops


def _ssm_state_update_impl(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
) -> None:
    # The launcher makes the tensors' device current itself (only when it is not).
    launch_ssm_update(
        state, x, dt, A, B, C, out, src_indices,
        D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dst_indices=dst_indices,
        track_indices=track_indices, track_mask=track_mask,
    )  # fmt: skip


_ssm_state_update_op = torch.library.custom_op(
    "hybridmeta::ssm_state_update", _ssm_state_update_impl, mutates_args=("state", "out")
)


@_ssm_state_update_op.register_fake
def _ssm_state_update_fake(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
) -> None:
    return None


def _conv_update_impl(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    silu: bool,
) -> None:
    # The launcher makes the tensors' device current itself (only when it is not).
    launch_conv_update(x, conv_state, weight, bias, out, slot_indices, silu=silu)


_conv_update_op = torch.library.custom_op(
    "hybridmeta::causal_conv1d_update", _conv_update_impl, mutates_args=("conv_state", "out")
)


@_conv_update_op.register_fake
def _conv_update_fake(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slot_indices: torch.Tensor,
    silu: bool,
) -> None:
    return None


def _track_save_impl(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
) -> None:
    with _on_device(ssm_pool.device):
        launch_track_save(conv_pool, ssm_pool, src_indices, track_indices, track_mask)


_track_save_op = torch.library.custom_op(
    "hybridmeta::track_save", _track_save_impl, mutates_args=("conv_pool", "ssm_pool")
)


@_track_save_op.register_fake
def _track_save_fake(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
) -> None:
    return None


# --------------------------------------------------------------------------- public ops


def ssm_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dst_indices: torch.Tensor | None = None,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba2 single-token SSM state update over a slot pool, in place.

    For each live row ``b`` (``state_indices[b] >= 0``) and head ``h`` (group
    ``g = h // (nheads // ngroups)``)::

        dt'  = softplus(dt[b, h] + dt_bias[h])          # bias / softplus optional
        s    = state[src] * exp(A[h] * dt') + dt' * x[b, h, :, None] * B[b, g, None, :]
        out  = (s @ C[b, g]) + D[h] * x[b, h]            # then * silu(z[b, h]) if z given
        state[dst] = s;  state[track[b]] = s if track_mask[b]

    Pad rows (``state_indices[b] == -1``) read and write no state and get zero output.

    Parameters
    ----------
    state : torch.Tensor
        ``[slots, nheads, headdim, dstate]``, float32 / bfloat16 / float16. Updated in place.
    x : torch.Tensor
        ``[bs, nheads, headdim]``, a float dtype.
    dt : torch.Tensor
        ``[bs, nheads]``.
    A : torch.Tensor
        ``[nheads]`` (negative decay rates).
    B, C : torch.Tensor
        ``[bs, ngroups, dstate]``; ``nheads % ngroups == 0``.
    state_indices : torch.Tensor
        ``[bs]`` int32/int64: source slot of each row, ``-1`` for a pad row.
    D, dt_bias : torch.Tensor, optional
        ``[nheads]``.
    z : torch.Tensor, optional
        ``[bs, nheads, headdim]`` gate.
    dt_softplus : bool
        Apply softplus to ``dt + dt_bias``.
    dst_indices : torch.Tensor, optional
        ``[bs]`` slot to write the new state to (default: the source slot); ``-1`` writes
        no state for that row.
    track_indices, track_mask : torch.Tensor, optional
        Both or neither. ``[bs]`` track slot and bool flag: flagged live rows also store the
        new state into their track slot in the same pass.
    out : torch.Tensor, optional
        ``[bs, nheads, headdim]`` in ``x.dtype``; allocated if not given.

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (message names it); in debug mode also
        on an index outside ``[-1, slots)`` or two rows writing one slot. Nothing is written.
    """
    op = "ssm_state_update"
    # One cheap expression first; the detailed checks below only run (and name the broken
    # rule) when it fails, so a valid call pays a few microseconds of host time.
    if not ssm_args_ok(state, x, dt, A, B, C, state_indices, D, z, dt_bias, dst_indices,
                       track_indices, track_mask, out):  # fmt: skip
        _check_ssm_args(op, state, x, dt, A, B, C, state_indices, D, z, dt_bias, dst_indices,
                        track_indices, track_mask, out)  # fmt: skip
    if is_debug():
        slots = state.shape[0]
        _debug_check_ssm(op, slots, state_indices, dst_indices, track_indices, track_mask)
    if out is None:
        out = torch.empty_like(x)
    run = torch.ops.hybridmeta.ssm_state_update if _observed(state) else _ssm_state_update_impl
    run(
        state, x, dt, A, B, C, out, state_indices, D, z, dt_bias, dt_softplus,
        dst_indices, track_indices, track_mask,
    )  # fmt: skip
    return out


def _check_ssm_args(
    op: str,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    """The detailed checks of :func:`ssm_state_update`: raise naming the broken rule."""
    state = check_pool(op, "state", state, dims="[slots, nheads, headdim, dstate]")
    dev = state.device
    _, nheads, headdim, dstate = state.shape
    x = check_tensor(op, "x", x, shape=(None, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, nheads, headdim]")  # fmt: skip
    bs = x.shape[0]
    check_tensor(
        op, "dt", dt, shape=(bs, nheads), dtypes=FLOAT_DTYPES, device=dev, dims="[bs, nheads]"
    )
    check_tensor(op, "A", A, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    B = check_tensor(op, "B", B, shape=(bs, None, dstate), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, ngroups, dstate]")  # fmt: skip
    ngroups = B.shape[1]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"{op}: `B` ngroups={ngroups} must divide nheads={nheads}")
    check_tensor(op, "C", C, shape=(bs, ngroups, dstate), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[bs, ngroups, dstate]")  # fmt: skip
    check_optional(op, "D", D, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    check_optional(op, "dt_bias", dt_bias, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[nheads]")  # fmt: skip
    check_optional(op, "z", z, shape=(bs, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[bs, nheads, headdim]")  # fmt: skip
    check_tensor(op, "state_indices", state_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    check_optional(op, "dst_indices", dst_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if (track_indices is None) != (track_mask is None):
        raise ValueError(
            f"{op}: `track_indices` and `track_mask` must be given together or not at all"
        )
    check_optional(op, "track_indices", track_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    check_optional(op, "track_mask", track_mask, shape=(bs,), dtypes=MASK_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(op, "out", out, shape=(bs, nheads, headdim), dtypes=(x.dtype,), device=dev,
                     dims="[bs, nheads, headdim]")  # fmt: skip
    for name, idx in (("state_indices", state_indices), ("dst_indices", dst_indices),
                      ("track_indices", track_indices), ("track_mask", track_mask)):  # fmt: skip
        if idx is not None and not idx.is_contiguous():
            # The kernel reads row b's entry at offset b.
            raise ValueError(f"{op}: `{name}` must be contiguous, got strides {list(idx.stride())}")


def _debug_check_ssm(
    op: str,
    slots: int,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> None:
    check_index_range(op, "state_indices", src, slots)
    live = src >= 0
    writes: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    if dst is not None:
        check_index_range(op, "dst_indices", dst, slots)
        writes.append(("dst_indices", dst, live))
    else:
        writes.append(("state_indices", src, live))
    if track is not None and mask is not None:
        check_index_range(op, "track_indices", track, slots)
        writes.append(("track_indices", track, live & mask))
    check_disjoint_writes(op, writes, ("state_indices", src, live))


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cache_indices: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal-conv1d decode update over a conv-state pool, in place.

    For each live row ``b`` with slot ``s = cache_indices[b] >= 0``::

        win = [conv_state[s, :, 0], ..., conv_state[s, :, k-2], x[b]]    # [conv_dim, k]
        out[b] = act(sum_j win[:, j] * weight[:, j] + bias)
        conv_state[s] = win[:, 1:]

    Pad rows (``cache_indices[b] == -1``) read and write no state and get zero output.

    Parameters
    ----------
    x : torch.Tensor
        ``[bs, conv_dim]``.
    conv_state : torch.Tensor
        ``[slots, conv_dim, k - 1]``, updated in place.
    weight : torch.Tensor
        ``[conv_dim, k]``.
    bias : torch.Tensor, optional
        ``[conv_dim]``.
    cache_indices : torch.Tensor
        ``[bs]`` int32/int64 slot of each row; ``-1`` for a pad row.
    activation : {"silu", "swish", None}
        Output activation.
    out : torch.Tensor, optional
        ``[bs, conv_dim]`` in ``x.dtype``; allocated if not given.

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    op = "causal_conv1d_update"
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{op}: `activation` must be None, 'silu' or 'swish', got {activation!r}")
    conv_state = check_pool(op, "conv_state", conv_state, dims="[slots, conv_dim, k - 1]")
    dev = conv_state.device
    slots, dim, wm1 = conv_state.shape
    x = check_tensor(
        op, "x", x, shape=(None, dim), dtypes=FLOAT_DTYPES, device=dev, dims="[bs, conv_dim]"
    )
    bs = x.shape[0]
    check_tensor(op, "weight", weight, shape=(dim, wm1 + 1), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[conv_dim, k]")  # fmt: skip
    check_optional(
        op, "bias", bias, shape=(dim,), dtypes=FLOAT_DTYPES, device=dev, dims="[conv_dim]"
    )
    check_tensor(op, "cache_indices", cache_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(
            op, "out", out, shape=(bs, dim), dtypes=(x.dtype,), device=dev, dims="[bs, conv_dim]"
        )
    if is_debug():
        check_index_range(op, "cache_indices", cache_indices, slots)
        live = cache_indices >= 0
        check_disjoint_writes(op, [("cache_indices", cache_indices, live)], None)
    if out is None:
        out = torch.empty_like(x)
    run = torch.ops.hybridmeta.causal_conv1d_update if _observed(conv_state) else _conv_update_impl
    run(x, conv_state, weight, bias, out, cache_indices, activation is not None)
    return out


def track_save(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    *,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
) -> None:
    """Copy conv and SSM state of every layer from each flagged row's slot to its track slot.

    One launch covers all layers of both layer-major pools. Rows whose mask is false, or
    whose source or track slot is ``-1``, are skipped.

    Parameters
    ----------
    conv_pool : torch.Tensor
        ``[layers, slots, conv_dim, k - 1]``; each ``[layer, slot]`` block contiguous.
    ssm_pool : torch.Tensor
        ``[layers, slots, nheads, headdim, dstate]``; each ``[layer, slot]`` block contiguous.
    src_indices, track_indices : torch.Tensor
        ``[bs]`` int32/int64: working slot and track slot of each row.
    track_mask : torch.Tensor
        ``[bs]`` bool: rows to copy.
    """
    op = "track_save"
    ssm_pool = check_pool(op, "ssm_pool", ssm_pool, dims="[layers, slots, nheads, headdim, dstate]")
    dev = ssm_pool.device
    layers, slots = ssm_pool.shape[:2]
    check_tensor(op, "conv_pool", conv_pool, shape=(layers, slots, None, None), dtypes=STATE_DTYPES,
                 device=dev, dims="[layers, slots, conv_dim, k - 1]")  # fmt: skip
    check_slot_contiguous(op, "ssm_pool", ssm_pool, 2)
    check_slot_contiguous(op, "conv_pool", conv_pool, 2)
    check_tensor(op, "src_indices", src_indices, shape=(None,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    bs = src_indices.shape[0]
    check_tensor(op, "track_indices", track_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    check_tensor(
        op, "track_mask", track_mask, shape=(bs,), dtypes=MASK_DTYPES, device=dev, dims="[bs]"
    )
    if is_debug():
        check_index_range(op, "src_indices", src_indices, slots)
        check_index_range(op, "track_indices", track_indices, slots)
        active = track_mask & (src_indices >= 0)
        check_disjoint_writes(
            op, [("track_indices", track_indices, active)], ("src_indices", src_indices, active)
        )
    run = torch.ops.hybridmeta.track_save if _observed(ssm_pool) else _track_save_impl
    run(conv_pool, ssm_pool, src_indices, track_indices, track_mask)


# --------------------------------------------------------------------------- metadata entries


class DecodeIndices(Protocol):
    """The per-row slot fields the decode kernels read from forward metadata.

    ``hybridmeta.model.ForwardMetadata`` / ``Mamba2Metadata`` satisfy it; each tensor is the
    live ``[bs]`` view (never the padded static buffer).
    """

    @property
    def mamba_cache_indices(self) -> torch.Tensor: ...

    @property
    def mamba_track_indices(self) -> torch.Tensor | None: ...

    @property
    def mamba_track_mask(self) -> torch.Tensor | None: ...


def _rows_match(op: str, md: DecodeIndices, bs: int) -> torch.Tensor:
    idx = md.mamba_cache_indices
    if idx.shape[0] != bs:
        raise ValueError(
            f"{op}: metadata `mamba_cache_indices` has {idx.shape[0]} rows but the inputs have "
            f"bs={bs}; pass the decode rows' metadata (its live [bs] views)"
        )
    return idx


def ssm_state_update_from_metadata(
    md: DecodeIndices,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    fuse_track: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`ssm_state_update` with slots taken from metadata.

    Uses ``md.mamba_cache_indices`` as source (and destination) slots and, when
    ``fuse_track`` is set and the metadata carries both ``mamba_track_indices`` and
    ``mamba_track_mask``, stores flagged rows' new state into their track slots in the same
    pass.
    """
    idx = _rows_match("ssm_state_update_from_metadata", md, x.shape[0])
    track, mask = md.mamba_track_indices, md.mamba_track_mask
    if not fuse_track or track is None or mask is None:
        track = mask = None
    return ssm_state_update(
        state, x, dt, A, B, C, state_indices=idx, D=D, z=z, dt_bias=dt_bias,
        dt_softplus=dt_softplus, track_indices=track, track_mask=mask, out=out,
    )  # fmt: skip


def causal_conv1d_update_from_metadata(
    md: DecodeIndices,
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`causal_conv1d_update` with slots from ``md.mamba_cache_indices``."""
    idx = _rows_match("causal_conv1d_update_from_metadata", md, x.shape[0])
    return causal_conv1d_update(
        x, conv_state, weight, bias, cache_indices=idx, activation=activation, out=out
    )


def track_save_from_metadata(
    md: DecodeIndices, conv_pool: torch.Tensor, ssm_pool: torch.Tensor
) -> None:
    """:func:`track_save` with slots from ``md.mamba_cache_indices`` / ``mamba_track_*``.

    Does nothing when the metadata carries no track fields.
    """
    track, mask = md.mamba_track_indices, md.mamba_track_mask
    if track is None or mask is None:
        return
    track_save(
        conv_pool, ssm_pool, src_indices=md.mamba_cache_indices, track_indices=track,
        track_mask=mask,
    )  # fmt: skip
