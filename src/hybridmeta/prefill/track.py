"""Extend track-save: execute a plan's track entries (prefix cache of recurrent state)."""

from __future__ import annotations

import torch

from hybridmeta.prefill.conv import ConvPrefillOutput
from hybridmeta.prefill.planner import PrefillPlan
from hybridmeta.prefill.scan import SSDScanOutput

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
    plan: PrefillPlan,
    *,
    xbc: torch.Tensor | None,
    conv: ConvPrefillOutput | None,
    scan: SSDScanOutput | None,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> None:
    """Copy every tracked boundary's conv window and SSM state into its track slot.

    Call after :func:`~hybridmeta.prefill.causal_conv1d_prefill` and
    :func:`~hybridmeta.prefill.ssd_chunked_scan` of the layer, and after the decode rows'
    state update: ``final`` entries copy the working slot, which must already hold the
    row's final state.

    Parameters
    ----------
    plan : PrefillPlan
    xbc : torch.Tensor or None
        ``[T, conv_dim]`` the conv *inputs* of the prefill rows.
    conv : ConvPrefillOutput or None
        The conv's result (its ``init_windows`` feed windows that reach before a row's
        first new token).
    scan : SSDScanOutput or None
        The scan's result (``tracked_h``, ``recomputed``).
    conv_state : torch.Tensor
        ``[num_slots, conv_dim, K-1]`` pool (written in place).
    ssm_state : torch.Tensor
        ``[num_slots, H, P, N]`` pool (written in place).

    ``xbc``, ``conv`` and ``scan`` may be ``None`` only when the plan has no mid-row
    entry (``plan.track.h_rows`` and ``plan.track.recompute_rows`` empty), for example in
    a decode-only batch.

    Raises
    ------
    ValueError
        A mid-row entry is planned but ``xbc``, ``conv`` or ``scan`` is missing.
    """
    tr = plan.track
    if tr.empty:  # host-side decision, no device read
        return
    if tr.h_rows or tr.recompute_rows:
        if xbc is None or conv is None or scan is None:
            raise ValueError(
                "extend_track_save: the plan saves mid-row boundaries (rows "
                f"{tr.h_rows + tr.recompute_rows}), which needs xbc, conv and scan; got None"
            )
        windows = _gather_extended(xbc, conv.init_windows, tr.conv_indices)  # [n_mid, K-1, dim]
        conv_state.index_copy_(0, tr.conv_dst, windows.transpose(1, 2).to(conv_state.dtype))
        if tr.h_rows:
            ssm_state.index_copy_(0, tr.h_dst, scan.tracked_h.to(ssm_state.dtype))
        if tr.recompute_rows:
            ssm_state.index_copy_(0, tr.recompute_dst, scan.recomputed.to(ssm_state.dtype))
    if tr.final_rows:
        # Source and destination slots are disjoint (the planner refuses a track slot that
        # is a working slot), so the gather-then-scatter cannot read what it writes.
        conv_state.index_copy_(0, tr.final_dst, conv_state.index_select(0, tr.final_src))
        ssm_state.index_copy_(0, tr.final_dst, ssm_state.index_select(0, tr.final_src))
