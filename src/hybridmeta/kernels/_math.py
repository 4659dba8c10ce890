"""The Mamba2 layer math in pure torch: the one statement every reference op composes.

A Mamba2 layer (without its projections and gated norm), per row and token ``t``:

* conv: ``u_t = act(bias + sum_k w[:, k] * win_t[:, k])`` where ``win_t`` is the row's last
  ``K - 1`` inputs followed by ``xBC_t``; the conv state keeps the last ``K - 1`` inputs;
* split ``u_t`` into ``x [H, P]``, ``B [G, N]``, ``C [G, N]`` (head ``h`` uses group
  ``h // (H // G)``);
* ``dt = softplus(dt_raw + dt_bias)`` (optional), ``h_t = exp(dt * A) h_{t-1} + dt x_t B_t^T``,
  ``y_t = (h_t C_t + D x_t) * silu(z_t)`` (``D`` and the gate optional).

All arithmetic is fp32. The decode and verify references apply :func:`ssm_step` /
:func:`conv_step` token by token; the chunked scan reference evaluates the same
recurrence chunk-wise (:mod:`hybridmeta.kernels.ssd_scan`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "SSMParams",
    "conv_step",
    "discretize",
    "index_copy_rows_",
    "process_dt",
    "scatter_rows_",
    "split_xbc",
    "ssm_step",
]


class SSMParams(NamedTuple):
    """Per-layer SSM parameters of the prefill scan (a named tuple: code that
    ``torch.compile`` traces can build one).

    Parameters
    ----------
    A : torch.Tensor
        ``[H]`` negative decay rates (``-exp(A_log)``).
    D : torch.Tensor
        ``[H]`` skip connection.
    dt_bias : torch.Tensor
        ``[H]`` added to the raw ``dt`` before the softplus.
    dt_softplus : bool
        Apply ``softplus`` to ``dt + dt_bias`` (Mamba2 does).
    """

    A: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    dt_softplus: bool = True


def discretize(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    softplus: bool,
    limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *limit)`` in fp32 (bias, softplus and limit optional);
    ``dt`` is ``[..., H]``.

    ``F.softplus`` returns its input above 20, as the kernels do; the clamp keeps NaN, as
    the kernels' does.
    """
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if softplus:
        d = F.softplus(d)
    if limit is not None:
        d = d.clamp(min=limit[0], max=limit[1])
    return d


def process_dt(dt: torch.Tensor, params: SSMParams) -> torch.Tensor:
    """:func:`discretize` with a layer's :class:`SSMParams`."""
    return discretize(dt, params.dt_bias, params.dt_softplus)


def ssm_step(
    s: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the SSM recurrence for ``R`` rows.

    Parameters
    ----------
    s : torch.Tensor
        ``[R, H, P, N]`` fp32 state before the token.
    x : torch.Tensor
        ``[R, H, P]``.
    dt : torch.Tensor
        ``[R, H]`` discretised (:func:`discretize`).
    A : torch.Tensor
        ``[H]``.
    B, C : torch.Tensor
        ``[R, G, N]``.
    D : torch.Tensor, optional
        ``[H]``.
    z : torch.Tensor, optional
        ``[R, H, P]`` gate: the output is multiplied by ``silu(z)``.

    Returns
    -------
    new_state : torch.Tensor
        ``[R, H, P, N]`` fp32.
    y : torch.Tensor
        ``[R, H, P]`` fp32.
    """
    rep = x.shape[1] // B.shape[1]
    xf = x.float()
    Bh = B.float().repeat_interleave(rep, dim=1)  # [R, H, N]
    Ch = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(A.float()[None, :] * dt)  # [R, H]
    new = s * dA[:, :, None, None] + (xf * dt[:, :, None])[..., None] * Bh[:, :, None, :]
    y = torch.einsum("rhpn,rhn->rhp", new, Ch)
    if D is not None:
        y = y + xf * D.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z.float())
    return new, y


def conv_step(
    window: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token through the depthwise causal conv1d for ``R`` rows.

    Parameters
    ----------
    window : torch.Tensor
        ``[R, C, K-1]`` the row's last ``K - 1`` inputs, oldest first.
    x : torch.Tensor
        ``[R, C]`` the new input.
    weight : torch.Tensor
        ``[C, K]``.
    bias : torch.Tensor, optional
        ``[C]``.

    Returns
    -------
    y : torch.Tensor
        ``[R, C]`` fp32.
    new_window : torch.Tensor
        ``[R, C, K-1]`` fp32: the window shifted left by one with ``x`` appended.
    """
    full = torch.cat([window.float(), x.float()[:, :, None]], dim=2)  # [R, C, K]
    y = (full * weight.float()[None]).sum(dim=2)
    if bias is not None:
        y = y + bias.float()[None]
    if silu:
        y = F.silu(y)
    return y, full[:, :, 1:]


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


def scatter_rows_(
    pool: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    values: torch.Tensor,
    write: torch.Tensor,
) -> None:
    """``pool.select(dim, index[r]) = values[r]`` for the rows ``r`` where ``write``.

    Rows that do not write (pad rows, invalid ids: ``write`` false) leave the pool untouched, with fixed
    shapes and no device-to-host read, so the references capture into CUDA graphs (and the
    CPU emulation) like the kernels. Written slots must be distinct (the ops' contract);
    each slot takes its value from the one row that writes it.

    Parameters
    ----------
    pool : torch.Tensor
        The state pool; slots along ``dim``.
    index : torch.Tensor
        ``[R]`` slot of each row (any value where ``write`` is false).
    values : torch.Tensor
        ``[R, *slot_shape]`` (with ``dim`` moved to the front of the pool's shape).
    write : torch.Tensor
        ``[R]`` bool.
    """
    slots = pool.shape[dim]
    if slots == 0 or values.shape[0] == 0:
        return
    rows = torch.arange(index.shape[0], device=index.device)
    target = torch.where(write, index, 0).long()
    # For each slot, the row that writes it (-1: none). amax: deterministic.
    who = torch.full((slots,), -1, dtype=torch.long, device=index.device)
    who.scatter_reduce_(0, target, torch.where(write, rows, -1), reduce="amax")
    view = pool.movedim(dim, 0)  # [slots, ...], a view of the pool
    gathered = values.index_select(0, who.clamp(min=0)).to(pool.dtype)  # [slots, ...]
    hit = (who >= 0).view(slots, *([1] * (view.dim() - 1)))
    view.copy_(torch.where(hit, gathered, view))


def index_copy_rows_(
    pool: torch.Tensor, index: torch.Tensor, values: torch.Tensor, write: torch.Tensor
) -> None:
    """``pool[index[r]] = values[r]`` (along dim 0) for the rows ``r`` where ``write``, with
    one ``index_copy_`` and no device-to-host read.

    A row that does not write (an invalid or pad slot, whose index may lie anywhere) copies
    the first writing row's value into that row's slot instead (or, when no row writes,
    slot 0's own value into slot 0): duplicate targets carry identical bytes, so the result
    is exact whatever order the copies land in, and only the writing rows' slots change.
    Unlike :func:`scatter_rows_` the pool is not rewritten whole (the prefill ops' state
    writes, on the GPU too). Written slots must be distinct (the ops' contract).
    """
    if pool.shape[0] == 0 or index.shape[0] == 0:
        return
    idx = index.long()
    # the first writing row (0 when none writes), as a 1-element index: indexing with a
    # 0-d device tensor (`idx[first]`) is a device-to-host read on CUDA
    first = write.int().argmax().view(1)
    any_w = write.any()
    tgt = torch.where(write, idx, torch.where(any_w, idx.index_select(0, first), 0))
    v = values.to(pool.dtype)
    fill = torch.where(any_w, v.index_select(0, first), pool[:1])
    v = torch.where(write.view(-1, *([1] * (v.dim() - 1))), v, fill)
    pool.index_copy_(0, tgt, v)
