"""Extend track-save: save the track boundaries that lie inside prefill rows.

The forward's metadata plans them (``md.mixed.track``, :class:`~hybridmeta.model.ExtendTrackPlan`):
on-grid boundaries take a chunk state of the scan, off-grid ones a recomputed state, and
each takes its conv window from the layer's conv input. The slots are the rows'
``mamba_track_indices``. A boundary that ends its row is saved with the decode rows', by
:func:`~hybridmeta.kernels.track_save_from_metadata` after the layers ran.

One implementation, in torch (a few gathers and index copies per layer): it is this op's
reference too.

A boundary whose track slot is the metadata's pad id saves nothing ("no track slot"); one
whose track slot (or its row's working slot) is neither the pad id nor in ``[0, slots)``
saves nothing and the fault goes to the device's error record (:mod:`hybridmeta.kernels._errors`); with CPU tensors or
in debug mode the op raises :class:`~hybridmeta.kernels.SlotIndexError` before writing.

The save is the ``torch.library`` op ``hybridmeta::extend_track_save`` (the plan's tensors
as arguments, both pools and the error record declared mutated); the public function checks
the arguments before it.
"""

from __future__ import annotations

import torch

from hybridmeta.debug import is_debug
from hybridmeta.kernels._dispatch import no_output_fake, observed
from hybridmeta.kernels._errors import fault_keys, host_check, record_, record_for
from hybridmeta.kernels._math import index_copy_rows_
from hybridmeta.kernels._validate import check_pool, check_slots, pad_slot_of, slot_kinds
from hybridmeta.kernels.conv_prefill import ConvPrefillOutput
from hybridmeta.kernels.ssd_scan import SSDScanOutput
from hybridmeta.model import Mamba2Metadata

_OP = "extend_track_save"

__all__ = ["extend_track_save"]


def _gather_extended(
    xbc: torch.Tensor, init_windows: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """``extended_conv_input(xbc, init_windows)[idx]`` without concatenating all ``T``
    tokens: ``idx < T`` reads ``xbc``, the rest the initial windows."""
    T, dim = xbc.shape
    init = init_windows.reshape(-1, dim).to(xbc.dtype)  # [R*(K-1), dim]
    tok = xbc.index_select(0, idx.clamp(max=T - 1).reshape(-1)).view(*idx.shape, dim)
    ini = init.index_select(0, (idx - T).clamp(min=0).reshape(-1)).view(*idx.shape, dim)
    return torch.where((idx < T)[..., None], tok, ini)


def extend_track_save(
    md: Mamba2Metadata,
    *,
    xbc: torch.Tensor,
    conv: ConvPrefillOutput,
    scan: SSDScanOutput,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> None:
    """Copy every mid-row boundary's conv window and SSM state into its track slot.

    Call after :func:`~hybridmeta.kernels.causal_conv1d_prefill` and
    :func:`~hybridmeta.kernels.ssd_chunked_scan` of the layer.

    Parameters
    ----------
    md : Mamba2Metadata
        The forward's metadata (``md.mixed.track``: the plan; ``mamba_track_indices``: the
        slots).
    xbc : torch.Tensor
        ``[T, conv_dim]`` the conv *inputs* of the prefill rows.
    conv : ConvPrefillOutput
        The conv's result (its ``init_windows`` feed windows that reach before a row's
        first new token).
    scan : SSDScanOutput
        The scan's result (``tracked_h``, ``recomputed``).
    conv_state : torch.Tensor
        ``[num_slots, conv_dim, K-1]`` pool (written in place).
    ssm_state : torch.Tensor
        ``[num_slots, H, P, N]`` pool (written in place).

    Raises
    ------
    TypeError, ValueError
        A pool of a non-float dtype, of another slot count or device than the other, or
        aliasing itself; a scan of another forward. Nothing is written.
    SlotIndexError
        A boundary's track slot that is neither the pad id nor in ``[0, slots)``, when the
        slots can be read without a sync or in debug mode. Nothing is written.
    """
    conv_state = check_pool(_OP, "conv_state", conv_state, dims="[slots, conv_dim, K - 1]")
    ssm_state = check_pool(_OP, "ssm_state", ssm_state, dims="[slots, H, P, N]")
    num_slots = ssm_state.shape[0]
    check_slots(_OP, "ssm_state", num_slots)
    if conv_state.shape[0] != num_slots or conv_state.device != ssm_state.device:
        raise ValueError(
            f"{_OP}: `conv_state` and `ssm_state` must have one slot count and device, got "
            f"{conv_state.shape[0]} slots on {conv_state.device} and {num_slots} on "
            f"{ssm_state.device}"
        )
    mixed = md.mixed
    if mixed is None:
        return
    tr = mixed.track
    n_h, n_rc = tr.num_h, tr.num_recompute
    if not n_h and not n_rc:  # host-side (shapes), no device read
        return
    track = md.mamba_track_indices
    if track is None:
        raise ValueError(
            "extend_track_save: the metadata plans track boundaries but has no mamba_track_indices"
        )
    if scan.tracked_h.shape[0] != n_h or scan.recomputed.shape[0] != n_rc:
        raise ValueError(
            f"extend_track_save: scan holds {scan.tracked_h.shape[0]} / {scan.recomputed.shape[0]} "
            f"boundary states but the plan has {n_h} / {n_rc}; pass this forward's scan"
        )
    if track.device != ssm_state.device or xbc.device != ssm_state.device:
        raise ValueError(
            f"{_OP}: `xbc` and the metadata must be on the pools' device {ssm_state.device}, "
            f"got {xbc.device} and {track.device}"
        )
    pad = pad_slot_of(md)
    if is_debug() or (ssm_state.device.type == "cpu" and not observed(ssm_state)):
        keys, _ = _track_faults(
            md.mamba_cache_indices, track, tr.h_rows, tr.recompute_rows, num_slots, pad
        )
        host_check(_OP, keys, pad, num_slots)
    run = torch.ops.hybridmeta.extend_track_save if observed(ssm_state) else _extend_track_impl
    run(
        xbc, conv.init_windows, scan.tracked_h, scan.recomputed, conv_state, ssm_state, track,
        md.mamba_cache_indices, tr.h_rows, tr.recompute_rows, tr.windows, pad,
        record_for(ssm_state),
    )  # fmt: skip


def _track_faults(
    cache_indices: torch.Tensor,
    track_indices: torch.Tensor,
    h_rows: torch.Tensor,
    recompute_rows: torch.Tensor,
    num_slots: int,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, ok)`` per boundary: its fault key, and whether it may be saved (no sync)."""
    rows = torch.cat([h_rows, recompute_rows])  # the boundaries' metadata rows
    mid_dst = track_indices.index_select(0, rows)
    mid_src = cache_indices.index_select(0, rows)
    # A boundary of a row whose working slot is invalid holds a poisoned state: not saved.
    src_pad, src_ok = slot_kinds(mid_src, num_slots, pad)
    pad_rows, ok = slot_kinds(mid_dst, num_slots, pad)
    keys = fault_keys(
        [(~src_pad & ~src_ok, 0, mid_src), (src_ok & ~pad_rows & ~ok, 1, mid_dst)], rows=rows
    )
    return keys, ok & src_ok


# --------------------------------------------------------------------------- custom op


def _extend_track_impl(
    xbc: torch.Tensor,
    init_windows: torch.Tensor,
    tracked_h: torch.Tensor,
    recomputed: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    track_indices: torch.Tensor,
    cache_indices: torch.Tensor,
    h_rows: torch.Tensor,
    recompute_rows: torch.Tensor,
    windows: torch.Tensor,
    pad: int,
    errors: torch.Tensor,
) -> None:
    """The save on checked arguments (at least one boundary)."""
    n_h, n_rc = tracked_h.shape[0], recomputed.shape[0]
    num_slots = ssm_state.shape[0]
    keys, ok = _track_faults(cache_indices, track_indices, h_rows, recompute_rows, num_slots, pad)
    mid_dst = track_indices.index_select(0, torch.cat([h_rows, recompute_rows]))
    win = _gather_extended(xbc, init_windows, windows)  # [n_mid, K-1, dim]
    index_copy_rows_(conv_state, mid_dst, win.transpose(1, 2), ok)
    states = (
        torch.cat([tracked_h, recomputed]) if n_h and n_rc else (tracked_h if n_h else recomputed)
    )
    index_copy_rows_(ssm_state, mid_dst, states, ok)
    record_(errors, _OP, keys, pad, num_slots)


_extend_track_op = torch.library.custom_op(
    "hybridmeta::extend_track_save",
    _extend_track_impl,
    mutates_args=("conv_state", "ssm_state", "errors"),
)
_extend_track_op.register_fake(no_output_fake)
