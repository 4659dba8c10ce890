"""Chunked SSD scan (Mamba2 prefill) over the flattened variable-length batch, in torch.

The vectorised baseline: no Python loop over rows or chunks, no device-to-host sync. The
flattened prefill tokens are cut into *logical* chunks (a new one at every physical chunk
boundary of the global grid and at every row start, see :mod:`hybridmeta.chunks`); each
logical chunk is padded to ``chunk_size`` tokens with ``dt = 0`` (decay 1, no input), so:

1. intra-chunk outputs are a masked ``[L, L]`` attention-like product per chunk;
2. each chunk's own state contribution ``S_c`` and total decay ``a_c`` follow;
3. the state entering each chunk is an inclusive scan of the affine maps
   ``s -> a_c * s + S_c``, with the map of a row's first chunk replaced by the constant
   ``a_c * h0 + S_c`` (``h0`` the row's initial state or zero): ``log2(num_chunks)``
   vectorised doubling steps (Hillis-Steele);
4. outputs add the entering state's contribution; row final states are written to the
   rows' working slots.

All arithmetic is fp32; outputs take ``x``'s dtype, the pool keeps its own.
"""

from __future__ import annotations

import attrs
import torch

from hybridmeta.prefill.oracle import SSMParams, process_dt
from hybridmeta.prefill.planner import PrefillPlan

__all__ = [
    "SSDScanOutput",
    "chunk_grid",
    "empty_scan",
    "finish_scan",
    "recompute_states",
    "ssd_chunked_scan",
]


@attrs.frozen(kw_only=True)
class SSDScanOutput:
    """What the scan returns besides the state written to the pool.

    Attributes
    ----------
    y : torch.Tensor
        ``[T, H, P]`` outputs, ``x``'s dtype.
    final_states : torch.Tensor
        ``[num_prefills, H, P, N]`` fp32, also written to the rows' working slots.
    tracked_h : torch.Tensor
        ``[n_h, H, P, N]`` fp32 chunk states for ``plan.track.h_src`` (state after those
        physical chunks of the global grid).
    recomputed : torch.Tensor
        ``[n_rc, H, P, N]`` fp32 off-grid boundary states for ``plan.track.recompute_*``.
    chunk_states : torch.Tensor or None
        ``[num_physical_chunks, H, P, N]`` fp32 state after every physical chunk of the
        global grid, when asked for (``return_chunk_states=True``).
    """

    y: torch.Tensor
    final_states: torch.Tensor
    tracked_h: torch.Tensor
    recomputed: torch.Tensor
    chunk_states: torch.Tensor | None


def chunk_grid(
    dt: torch.Tensor, params: SSMParams, plan: PrefillPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of each logical chunk padded to ``chunk_size``, their ``dt`` and ``cumsum(dt*A)``.

    Returns
    -------
    tok : torch.Tensor
        ``[NL, L]`` token index (pad positions point at token 0 and carry ``dt = 0``).
    dtc : torch.Tensor
        ``[NL, L, H]`` processed ``dt`` (fp32), zero on pad positions.
    Acum : torch.Tensor
        ``[NL, L, H]`` within-chunk cumulative ``dt * A`` (constant over the padding).
    """
    L = plan.chunk_size
    ar = torch.arange(L, device=dt.device)
    tok = plan.chunk_start[:, None] + ar[None, :]  # [NL, L]
    valid = ar[None, :] < plan.chunk_len[:, None]  # [NL, L]
    tok = torch.where(valid, tok, 0)
    dtc = process_dt(dt, params)[tok] * valid[..., None].float()  # [NL, L, H]
    Acum = torch.cumsum(dtc * params.A.float().to(dt.device), dim=1)  # [NL, L, H]
    return tok, dtc, Acum


def recompute_states(
    x: torch.Tensor,
    B: torch.Tensor,
    tok: torch.Tensor,
    dtc: torch.Tensor,
    Acum: torch.Tensor,
    state_in: torch.Tensor,
    plan: PrefillPlan,
) -> torch.Tensor:
    """States at the plan's off-grid boundaries: ``[n_rc, H, P, N]`` fp32.

    The state entering the boundary's logical chunk, decayed to position ``k-1``, plus the
    chunk's first ``k`` tokens: ``exp(Acum_{k-1}) s_in + sum_{j<k} exp(Acum_{k-1} - Acum_j)
    dt_j x_j B_j^T``. Only the recompute chunks are gathered.
    """
    tr = plan.track
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    rep = H // G
    L = plan.chunk_size
    c_rc = tr.recompute_chunk  # [n_rc]
    n_rc = c_rc.shape[0]
    t_rc = tok.index_select(0, c_rc)  # [n_rc, L]
    d_rc = dtc.index_select(0, c_rc)  # [n_rc, L, H]
    A_rc = Acum.index_select(0, c_rc)  # [n_rc, L, H]
    last = (tr.recompute_len - 1).clamp(min=0)  # [n_rc]
    A_k = A_rc.gather(1, last[:, None, None].expand(-1, 1, H))  # [n_rc, 1, H]
    keep = torch.arange(L, device=x.device)[None, :] < tr.recompute_len[:, None]  # [n_rc, L]
    w = torch.exp(torch.where(keep[..., None], A_k - A_rc, float("-inf"))) * d_rc  # [n_rc, L, H]
    # gather, then convert: only the recompute chunks' tokens, never all T of them
    xw = x[t_rc].float() * w[..., None]  # [n_rc, L, H, P]
    S_rc = torch.einsum("rlgn,rlgqp->rgqpn", B[t_rc].float(), xw.view(n_rc, L, G, rep, P)).reshape(
        n_rc, H, P, N
    )
    s_in = state_in.index_select(0, c_rc).float()
    return torch.exp(A_k[:, 0, :])[:, :, None, None] * s_in + S_rc


def finish_scan(
    x: torch.Tensor,
    B: torch.Tensor,
    y: torch.Tensor,
    grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    *,
    plan: PrefillPlan,
    ssm_state: torch.Tensor,
    return_chunk_states: bool,
) -> SSDScanOutput:
    """The end both scans share: write the rows' final states to their working slots and
    gather the tracked, recomputed and (optionally) per-physical-chunk states.

    ``grid`` is :func:`chunk_grid`'s result; ``state_in`` / ``state_out`` are
    ``[NL, H, P, N]`` fp32, the states entering and leaving every logical chunk.
    """
    final = state_out.index_select(0, plan.row_last_chunk)  # [R, H, P, N]
    ssm_state.index_copy_(0, plan.slots, final.to(ssm_state.dtype))
    tracked_h = state_out.index_select(0, plan.track.h_logical)
    if plan.track.recompute_rows:  # host-side: most steps have no off-grid boundary
        recomputed = recompute_states(x, B, *grid, state_in, plan)
    else:
        recomputed = state_out.new_zeros(0, *state_out.shape[1:])
    chunk_states = state_out.index_select(0, plan.phys_last_chunk) if return_chunk_states else None
    return SSDScanOutput(
        y=y,
        final_states=final,
        tracked_h=tracked_h,
        recomputed=recomputed,
        chunk_states=chunk_states,
    )


def empty_scan(x: torch.Tensor, N: int, *, return_chunk_states: bool) -> SSDScanOutput:
    """What both scans return for a plan without prefill tokens (a decode-only batch)."""
    _, H, P = x.shape
    empty = torch.zeros(0, H, P, N, device=x.device)
    return SSDScanOutput(
        y=x.new_zeros(0, H, P),
        final_states=empty,
        tracked_h=empty,
        recomputed=empty,
        chunk_states=empty if return_chunk_states else None,
    )


def check_scan_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    plan: PrefillPlan,
    ssm_state: torch.Tensor,
) -> tuple[int, int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"ssd_chunked_scan: x must be [T, H, P], got shape {tuple(x.shape)}")
    T, H, P = x.shape
    if plan.num_prefill_tokens != T:
        raise ValueError(
            f"ssd_chunked_scan: x has {T} tokens but the plan has {plan.num_prefill_tokens} "
            "prefill tokens (pass the prefill rows only; decode rows take the decode kernel)"
        )
    if dt.shape != (T, H):
        raise ValueError(f"ssd_chunked_scan: dt must be [T, H] = {(T, H)}, got {tuple(dt.shape)}")
    if B.dim() != 3 or B.shape[0] != T or B.shape != C.shape:
        raise ValueError(
            f"ssd_chunked_scan: B and C must be [T, G, N] with T = {T}, got "
            f"{tuple(B.shape)} and {tuple(C.shape)}"
        )
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"ssd_chunked_scan: nheads {H} is not a multiple of ngroups {G}")
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (H, P, N):
        raise ValueError(
            f"ssd_chunked_scan: ssm_state must be [slots, H, P, N] = [*, {H}, {P}, {N}], got "
            f"{tuple(ssm_state.shape)}"
        )
    return H, P, G, N


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    params: SSMParams,
    plan: PrefillPlan,
    ssm_state: torch.Tensor,
    return_chunk_states: bool = False,
) -> SSDScanOutput:
    """Mamba2 SSD prefill over the prefill rows of a planned batch.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, H, P]`` prefill tokens (rows concatenated in plan order).
    dt : torch.Tensor
        ``[T, H]`` raw ``dt`` (bias and softplus applied here, per ``params``).
    B, C : torch.Tensor
        ``[T, G, N]``.
    params : SSMParams
    plan : PrefillPlan
        From :func:`hybridmeta.prefill.plan_mixed_batch`.
    ssm_state : torch.Tensor
        ``[num_slots, H, P, N]`` state pool. Rows with an initial state read it from their
        working slot; every prefill row's final state is written back there (in place).
    return_chunk_states : bool
        Also return the state after every physical chunk of the global grid.

    Returns
    -------
    SSDScanOutput
    """
    H, P, G, N = check_scan_inputs(x, dt, B, C, plan, ssm_state)
    T = x.shape[0]
    dev = x.device
    L = plan.chunk_size
    NL = plan.num_logical_chunks
    rep = H // G
    if T == 0:
        return empty_scan(x, N, return_chunk_states=return_chunk_states)

    D = params.D.float().to(dev)  # [H]
    grid = chunk_grid(dt, params, plan)
    tok, dtc, Acum = grid
    xc = x.float()[tok]  # [NL, L, H, P]
    Bc = B.float()[tok]  # [NL, L, G, N]
    Cc = C.float()[tok]  # [NL, L, G, N]
    xdt = xc * dtc[..., None]  # [NL, L, H, P]

    # 1. intra-chunk: y_i = sum_{j<=i} (C_i . B_j) exp(Acum_i - Acum_j) dt_j x_j
    Ah = Acum.permute(0, 2, 1)  # [NL, H, L]
    seg = Ah[:, :, :, None] - Ah[:, :, None, :]  # [NL, H, L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    decay = torch.exp(seg.masked_fill(~causal, float("-inf")))  # [NL, H, L, L]
    CB = torch.einsum("clgn,csgn->cgls", Cc, Bc)  # [NL, G, L, L]
    scores = CB[:, :, None] * decay.view(NL, G, rep, L, L)  # [NL, G, rep, L, L]
    y = torch.einsum("cgrls,csgrp->clgrp", scores, xdt.view(NL, L, G, rep, P))
    y = y.reshape(NL, L, H, P)

    # 2. each chunk's own contribution to the state at its end, and its total decay.
    to_end = torch.exp(Acum[:, -1:, :] - Acum)  # [NL, L, H]
    S = torch.einsum(
        "clgn,clgrp->cgrpn", Bc, (xdt * to_end[..., None]).view(NL, L, G, rep, P)
    ).reshape(NL, H, P, N)
    a = torch.exp(Acum[:, -1, :])  # [NL, H]

    # 3. initial states: pool rows gathered (zero where the row has none), then the scan.
    h0 = ssm_state.index_select(0, plan.slots).float()  # [R, H, P, N]
    h0 = torch.where(plan.has_initial_states[:, None, None, None], h0, 0.0)
    h0c = h0.index_select(0, plan.chunk_row)  # [NL, H, P, N]
    first = plan.chunk_first
    S = torch.where(first[:, None, None, None], S + a[:, :, None, None] * h0c, S)
    a = torch.where(first[:, None], 0.0, a)
    out = S
    d = 1
    while d < NL:  # log2(NL) steps; NL is a host int (plan shape), no sync
        out = torch.cat([out[:d], out[d:] + a[d:, :, None, None] * out[:-d]])
        a = torch.cat([a[:d], a[d:] * a[:-d]])
        d *= 2
    state_out = out  # [NL, H, P, N]
    prev = torch.cat([torch.zeros_like(state_out[:1]), state_out[:-1]])
    state_in = torch.where(first[:, None, None, None], h0c, prev)  # [NL, H, P, N]

    # 4. entering state's contribution: exp(Acum_i) C_i . state_in
    y_off = torch.einsum("clgn,cgrpn->clgrp", Cc, state_in.view(NL, G, rep, P, N))
    y = y + (y_off * torch.exp(Acum).view(NL, L, G, rep)[..., None]).reshape(NL, L, H, P)
    y = y + D[None, None, :, None] * xc
    y_tok = y[plan.token_chunk, plan.token_pos].to(x.dtype)  # [T, H, P]
    return finish_scan(
        x,
        B,
        y_tok,
        grid,
        state_in,
        state_out,
        plan=plan,
        ssm_state=ssm_state,
        return_chunk_states=return_chunk_states,
    )
