"""Extend track-save: save the track boundaries that lie inside prefill rows.

The forward's metadata plans them (``md.mixed.track``, :class:`~hybridmeta.model.ExtendTrackPlan`):
on-grid boundaries take a chunk state of the scan, off-grid ones a recomputed state, and
each takes its conv window from the layer's conv input. The slots are the rows'
``mamba_track_indices``. A boundary that ends its row is saved with the decode rows', by
:func:`~hybridmeta.kernels.track_save_from_metadata` after the layers ran.

One implementation, in torch (a few gathers and index copies per layer): it is this op's
reference too. It is the ``torch.library`` op ``hybridmeta::extend_track_save`` (the plan's
tensors as arguments, both pools declared mutated).
"""

from __future__ import annotations

import torch

from hybridmeta.kernels._dispatch import no_output_fake, observed
from hybridmeta.kernels.conv_prefill import ConvPrefillOutput
from hybridmeta.kernels.ssd_scan import SSDScanOutput
from hybridmeta.model import Mamba2Metadata

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
    """
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
            "extend_track_save: the metadata plans track boundaries but has no "
            "mamba_track_indices"
        )
    if scan.tracked_h.shape[0] != n_h or scan.recomputed.shape[0] != n_rc:
        raise ValueError(
            f"extend_track_save: scan holds {scan.tracked_h.shape[0]} / {scan.recomputed.shape[0]} "
            f"boundary states but the plan has {n_h} / {n_rc}; pass this forward's scan"
        )
    run = torch.ops.hybridmeta.extend_track_save if observed(ssm_state) else _extend_track_impl
    run(
        xbc, conv.init_windows, scan.tracked_h, scan.recomputed, conv_state, ssm_state, track,
        tr.h_rows, tr.recompute_rows, tr.windows,
    )  # fmt: skip


# --------------------------------------------------------------------------- custom op


def _extend_track_impl(
    xbc: torch.Tensor,
    init_windows: torch.Tensor,
    tracked_h: torch.Tensor,
    recomputed: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    track_indices: torch.Tensor,
    h_rows: torch.Tensor,
    recompute_rows: torch.Tensor,
    windows: torch.Tensor,
) -> None:
    """The save on checked arguments (at least one boundary)."""
    n_h, n_rc = tracked_h.shape[0], recomputed.shape[0]
    mid_dst = track_indices.index_select(0, torch.cat([h_rows, recompute_rows]))
    win = _gather_extended(xbc, init_windows, windows)  # [n_mid, K-1, dim]
    conv_state.index_copy_(0, mid_dst, win.transpose(1, 2).to(conv_state.dtype))
    states = torch.cat([tracked_h, recomputed]) if n_h and n_rc else (
        tracked_h if n_h else recomputed
    )
    ssm_state.index_copy_(0, mid_dst, states.to(ssm_state.dtype))


_extend_track_op = torch.library.custom_op(
    "hybridmeta::extend_track_save", _extend_track_impl, mutates_args=("conv_state", "ssm_state")
)
_extend_track_op.register_fake(no_output_fake)
