"""Pure-torch references for the decode kernels: the executable specification.

Each function returns new tensors (the updated pool and the output) and never touches
its inputs, so a test can compare a kernel run against it on copies. Math is in fp32;
results are cast to the pool's / input's dtype exactly where the kernels cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssm_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    src_indices: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dst_indices: torch.Tensor | None = None,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference Mamba2 single-token state update.

    Parameters are as for :func:`hybridmeta.kernels.ops.ssm_state_update`.

    Returns
    -------
    new_state : torch.Tensor
        A copy of ``state`` with every live row's new state written to its destination
        slot (``dst_indices`` or, absent that, its source slot) and, for flagged rows,
        to its track slot.
    out : torch.Tensor
        ``[bs, nheads, headdim]`` in ``x.dtype``; zeros for pad rows.
    """
    nheads = x.shape[1]
    ngroups = B.shape[1]
    live = src_indices >= 0  # [bs]
    safe_src = torch.where(live, src_indices, 0).long()
    s = state[safe_src].float() * live[:, None, None, None]  # [bs, H, P, N]
    d = dt.float()  # [bs, H]
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = torch.where(d <= 20.0, F.softplus(d), d)
    dA = torch.exp(A.float()[None, :] * d)  # [bs, H]
    rep = nheads // ngroups
    Bh = B.float().repeat_interleave(rep, dim=1)  # [bs, H, N]
    Ch = C.float().repeat_interleave(rep, dim=1)
    xf = x.float()  # [bs, H, P]
    s = s * dA[:, :, None, None] + (xf * d[:, :, None])[..., None] * Bh[:, :, None, :]
    out = torch.einsum("bhpn,bhn->bhp", s, Ch)
    if D is not None:
        out = out + xf * D.float()[None, :, None]
    if z is not None:
        zf = z.float()
        out = out * (zf * torch.sigmoid(zf))
    out = torch.where(live[:, None, None], out, torch.zeros_like(out)).to(x.dtype)

    new_state = state.clone()
    s_cast = s.to(state.dtype)
    dst = dst_indices if dst_indices is not None else src_indices
    write = live & (dst >= 0)
    new_state[dst[write].long()] = s_cast[write]
    if track_indices is not None:
        assert track_mask is not None
        tw = live & track_mask.bool() & (track_indices >= 0)
        new_state[track_indices[tw].long()] = s_cast[tw]
    return new_state, out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_indices: torch.Tensor,
    *,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference causal-conv1d decode update.

    Returns
    -------
    new_conv_state : torch.Tensor
        Copy of ``conv_state`` with each live row's window shifted left by one and ``x``
        appended.
    out : torch.Tensor
        ``[bs, conv_dim]`` in ``x.dtype``; zeros for pad rows.
    """
    live = slot_indices >= 0
    safe = torch.where(live, slot_indices, 0).long()
    st = conv_state[safe].float() * live[:, None, None]  # [bs, D, k-1]
    win = torch.cat([st, x.float()[:, :, None]], dim=2)  # [bs, D, k]
    out = (win * weight.float()[None]).sum(dim=2)
    if bias is not None:
        out = out + bias.float()[None]
    if silu:
        out = out * torch.sigmoid(out)
    out = torch.where(live[:, None], out, torch.zeros_like(out)).to(x.dtype)
    new_state = conv_state.clone()
    new_state[slot_indices[live].long()] = win[live, :, 1:].to(conv_state.dtype)
    return new_state, out


def track_save_ref(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference track-save: copies of both pools with flagged rows' slots copied over.

    A row is copied when its mask is set and both its source and track slot are ``>= 0``.
    """
    rows = track_mask.bool() & (src_indices >= 0) & (track_indices >= 0)
    src = src_indices[rows].long()
    dst = track_indices[rows].long()
    new_conv = conv_pool.clone()
    new_ssm = ssm_pool.clone()
    new_conv[:, dst] = conv_pool[:, src]
    new_ssm[:, dst] = ssm_pool[:, src]
    return new_conv, new_ssm
