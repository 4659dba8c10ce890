"""Token-by-token, request-by-request Mamba2 recurrence: the tests' executable oracle.

Nothing here is fast and nothing here is clever: every token of every request is pushed
through the causal conv1d window and the SSM recurrence one at a time, in fp32, with
plain Python loops, written independently of the library's math. The prefill ops
(:mod:`hybridmeta.kernels.ssd_scan`, :mod:`hybridmeta.kernels.conv_prefill`,
:mod:`hybridmeta.kernels.extend_track`) and the planner (:mod:`hybridmeta.planner`) are
checked against this module; no library code imports it.

The layer math (no in/out projection, no gated norm):

* conv: ``u_t = silu(bias + sum_k w[:, k] * xBC[t - (K-1) + k])`` where inputs before the
  request's first new token come from its conv state ``[conv_dim, K-1]`` (oldest first);
* split ``u_t`` into ``x [H, P]``, ``B [G, N]``, ``C [G, N]`` (head ``h`` uses group
  ``h // (H // G)``);
* ``dt = softplus(dt_raw + dt_bias)``, ``h_t = exp(dt * A) * h_{t-1} + dt * x_t B_t^T``,
  ``y_t = h_t C_t + D * x_t``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from hybridmeta.kernels import SSMParams


def process_dt(dt: torch.Tensor, params: SSMParams) -> torch.Tensor:
    """``softplus(dt + dt_bias)`` in fp32; ``dt`` is ``[..., H]``."""
    out = dt.float() + params.dt_bias.float()
    return F.softplus(out) if params.dt_softplus else out


def oracle_conv_row(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    init_state: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Causal conv1d + SiLU over one request, token by token.

    Parameters
    ----------
    xbc : torch.Tensor
        ``[L, conv_dim]`` new inputs of the request.
    weight : torch.Tensor
        ``[conv_dim, K]``.
    bias : torch.Tensor or None
        ``[conv_dim]``.
    init_state : torch.Tensor or None
        ``[conv_dim, K-1]``, oldest input first; ``None`` means zeros.

    Returns
    -------
    out : torch.Tensor
        ``[L, conv_dim]`` fp32.
    windows : list of torch.Tensor
        ``windows[k]`` is the conv state ``[conv_dim, K-1]`` after ``k`` new tokens.
    """
    conv_dim, k_width = weight.shape
    w = weight.float()
    window = (
        torch.zeros(conv_dim, k_width - 1) if init_state is None else init_state.float().clone()
    )
    windows = [window.clone()]
    outs = []
    for t in range(xbc.shape[0]):
        full = torch.cat([window, xbc[t].float()[:, None]], dim=1)  # [C, K]
        acc = (full * w).sum(dim=1)
        if bias is not None:
            acc = acc + bias.float()
        outs.append(F.silu(acc))
        window = full[:, 1:].clone()
        windows.append(window.clone())
    out = torch.stack(outs) if outs else torch.zeros(0, conv_dim)
    return out, windows


def oracle_ssm_row(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    init_state: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The SSM recurrence over one request, token by token.

    Parameters
    ----------
    x : torch.Tensor
        ``[L, H, P]``.
    dt : torch.Tensor
        ``[L, H]`` raw (before bias and softplus).
    B, C : torch.Tensor
        ``[L, G, N]``.
    params : SSMParams
    init_state : torch.Tensor or None
        ``[H, P, N]``; ``None`` means zeros.

    Returns
    -------
    y : torch.Tensor
        ``[L, H, P]`` fp32.
    states : list of torch.Tensor
        ``states[k]`` is the SSM state ``[H, P, N]`` after ``k`` new tokens.
    """
    _, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    rep = nheads // ngroups
    A = params.A.float()
    D = params.D.float()
    state = (
        torch.zeros(nheads, headdim, dstate) if init_state is None else init_state.float().clone()
    )
    states = [state.clone()]
    ys = []
    for t in range(x.shape[0]):
        d = process_dt(dt[t], params)  # [H]
        b = B[t].float().repeat_interleave(rep, dim=0)  # [H, N]
        c = C[t].float().repeat_interleave(rep, dim=0)  # [H, N]
        xt = x[t].float()  # [H, P]
        decay = torch.exp(d * A)  # [H]
        state = state * decay[:, None, None] + (d[:, None] * xt)[:, :, None] * b[:, None, :]
        ys.append((state * c[:, None, :]).sum(-1) + D[:, None] * xt)
        states.append(state.clone())
    y = torch.stack(ys) if ys else torch.zeros(0, nheads, headdim)
    return y, states


@attrs.frozen(kw_only=True)
class OracleRow:
    """What one request must produce: outputs and every intermediate state.

    ``conv_states[k]`` / ``ssm_states[k]`` are the states after ``k`` of the request's new
    tokens (``k = 0`` is the initial state), so the state at absolute sequence position
    ``prefix_len + k`` is at index ``k``.
    """

    u: torch.Tensor  # [L, conv_dim] conv output (after SiLU)
    y: torch.Tensor  # [L, H, P]
    conv_states: list[torch.Tensor]  # L+1 x [conv_dim, K-1]
    ssm_states: list[torch.Tensor]  # L+1 x [H, P, N]


def split_xbc(
    u: torch.Tensor, nheads: int, headdim: int, ngroups: int, dstate: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the conv output ``[T, conv_dim]`` into ``x [T,H,P]``, ``B, C [T,G,N]``."""
    d_x = nheads * headdim
    d_b = ngroups * dstate
    if u.shape[-1] != d_x + 2 * d_b:
        raise ValueError(
            f"split_xbc: conv_dim {u.shape[-1]} != nheads*headdim + 2*ngroups*dstate "
            f"= {d_x + 2 * d_b}"
        )
    x = u[:, :d_x].reshape(-1, nheads, headdim)
    B = u[:, d_x : d_x + d_b].reshape(-1, ngroups, dstate)
    C = u[:, d_x + d_b :].reshape(-1, ngroups, dstate)
    return x, B, C


def oracle_layer(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    extend_lens: Sequence[int],
    init_conv: Sequence[torch.Tensor | None],
    init_ssm: Sequence[torch.Tensor | None],
    *,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    params: SSMParams,
    nheads: int,
    headdim: int,
    ngroups: int,
    dstate: int,
) -> list[OracleRow]:
    """Conv + SSM of a whole batch, request by request, token by token.

    Parameters
    ----------
    xbc : torch.Tensor
        ``[T, conv_dim]`` inputs of all rows, concatenated in row order.
    dt : torch.Tensor
        ``[T, H]`` raw ``dt``.
    extend_lens : sequence of int
        New tokens per row (sum ``T``).
    init_conv, init_ssm : sequence of (torch.Tensor or None)
        Per-row initial states (``None``: start from zeros).

    Returns
    -------
    list of OracleRow
    """
    if sum(extend_lens) != xbc.shape[0]:
        raise ValueError(f"oracle_layer: sum(extend_lens)={sum(extend_lens)} != T={xbc.shape[0]}")
    rows = []
    start = 0
    for r, n in enumerate(extend_lens):
        u, conv_states = oracle_conv_row(
            xbc[start : start + n], conv_weight, conv_bias, init_conv[r]
        )
        x, B, C = split_xbc(u, nheads, headdim, ngroups, dstate)
        y, ssm_states = oracle_ssm_row(x, dt[start : start + n], B, C, params, init_ssm[r])
        rows.append(OracleRow(u=u, y=y, conv_states=conv_states, ssm_states=ssm_states))
        start += n
    return rows


@attrs.frozen(kw_only=True)
class OracleTrack:
    """The track save implied by brute force for one tracked row.

    ``kind`` is ``"final"`` (boundary ends the row), ``"h"`` (boundary on the global chunk
    grid; ``h_index`` is the physical chunk whose end it is) or ``"recompute"`` (off the
    grid). ``k`` is the number of the row's new tokens before the boundary.
    """

    row: int
    kind: str
    k: int
    h_index: int
    dst: int


def oracle_track_plan(
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    track_mask: Sequence[bool],
    track_slots: Sequence[int],
    *,
    num_decodes: int,
    chunk_size: int,
    track_interval: int,
) -> list[OracleTrack]:
    """Walk every token of the flattened batch and report each row's last boundary.

    A boundary is an absolute sequence position that is a positive multiple of
    ``track_interval``, reached by one of the row's new tokens. Only the last one of a row
    is kept (a row has one track slot). Prefill tokens lie on one global grid of
    ``chunk_size``; decode rows (last ``num_decodes``) are off that grid and only ever
    produce ``"final"`` saves.
    """
    n_rows = len(extend_lens)
    n_prefill = n_rows - num_decodes
    last: dict[int, tuple[int, int]] = {}  # row -> (k, global token position after it)
    g = 0
    for r in range(n_rows):
        for k in range(1, extend_lens[r] + 1):
            g += 1  # g: number of flattened tokens consumed so far
            if track_mask[r] and (prefix_lens[r] + k) % track_interval == 0:
                last[r] = (k, g)
    out = []
    for r in sorted(last):
        k, g_end = last[r]
        if k == extend_lens[r]:
            out.append(OracleTrack(row=r, kind="final", k=k, h_index=-1, dst=track_slots[r]))
        elif r < n_prefill and g_end % chunk_size == 0:
            out.append(
                OracleTrack(
                    row=r, kind="h", k=k, h_index=g_end // chunk_size - 1, dst=track_slots[r]
                )
            )
        else:
            out.append(OracleTrack(row=r, kind="recompute", k=k, h_index=-1, dst=track_slots[r]))
    return out
