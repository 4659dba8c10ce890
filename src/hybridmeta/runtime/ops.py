"""Pure-torch operators of the reference runtime (the seam where fused kernels plug in).

Every function here is written against fixed shapes and device-side index tensors, so the
decode path can be captured into a CUDA graph and none of them reads a device value back
to the host. The SSD math follows ``transformers``' ``mamba2_chunk_scan`` (the oracle the
tests compare with), batched over padded prefill rows and with initial states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "causal_conv_prefill",
    "conv_step",
    "gated_rms_norm",
    "rms_norm",
    "ssd_chunked",
    "ssm_step",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Nemotron-H computes it: normalise in fp32, multiply the weight in fp32."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(dtype)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """The mixer's gated, grouped RMSNorm: ``norm(y * silu(z))`` per group of channels.

    Parameters
    ----------
    y, z : torch.Tensor
        ``[T, I]`` SSM output and gate.
    weight : torch.Tensor
        ``[I]``.
    """
    dtype = y.dtype
    h = y.float() * F.silu(z.float())
    shape = h.shape
    g = h.view(*shape[:-1], shape[-1] // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(shape).to(dtype)


def causal_conv_prefill(
    x: torch.Tensor, context: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU over padded rows that continue from a conv state.

    Parameters
    ----------
    x : torch.Tensor
        ``[P, L, C]`` inputs (pad positions at the end of a row hold zeros).
    context : torch.Tensor
        ``[P, C, K-1]`` the last ``K-1`` inputs before each row (zeros for a fresh request).
    weight : torch.Tensor
        ``[C, K]``.

    Returns
    -------
    out : torch.Tensor
        ``[P, L, C]`` activations.
    window : torch.Tensor
        ``[P, C, K-1+L]`` the context followed by the inputs; the conv state after ``r``
        tokens of a row is ``window[p, :, r:r+K-1]``.
    """
    window = torch.cat([context.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [P, C, K-1+L]
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out).transpose(1, 2).to(x.dtype), window


def conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token through the causal conv1d + SiLU.

    Parameters
    ----------
    x : torch.Tensor
        ``[B, C]``.
    state : torch.Tensor
        ``[B, C, K-1]``.

    Returns
    -------
    out : torch.Tensor
        ``[B, C]``.
    new_state : torch.Tensor
        ``[B, C, K-1]``.
    """
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype), window[..., 1:]


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(a[..., j+1:i+1])`` for ``j <= i``, ``-inf`` above the diagonal."""
    n = a.shape[-1]
    e = a[..., None].expand(*a.shape, n)
    lower = torch.tril(torch.ones(n, n, device=a.device, dtype=torch.bool), diagonal=-1)
    e = e.masked_fill(~lower, 0)
    s = torch.cumsum(e, dim=-2)
    keep = torch.tril(torch.ones(n, n, device=a.device, dtype=torch.bool), diagonal=0)
    return s.masked_fill(~keep, -torch.inf)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    init: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of padded rows, each on its own chunk grid starting at its first token.

    Parameters
    ----------
    x : torch.Tensor
        ``[P, L, H, D]``, ``L`` a multiple of ``chunk``.
    dt : torch.Tensor
        ``[P, L, H]`` discretisation steps after softplus/clamp; 0 at pad positions, which
        makes a pad position leave the state unchanged.
    a : torch.Tensor
        ``[H]`` (negative).
    b, c : torch.Tensor
        ``[P, L, G, N]``.
    d : torch.Tensor
        ``[H]`` skip connection.
    init : torch.Tensor
        ``[P, H, D, N]`` fp32 initial states.

    Returns
    -------
    y : torch.Tensor
        ``[P, L, H, D]`` fp32.
    states : torch.Tensor
        ``[P, L//chunk + 1, H, D, N]`` fp32: ``states[:, k]`` is the state after ``k*chunk``
        tokens of the row (``states[:, 0] == init``; the last entry is the final state).
    """
    p, seq, h, hd = x.shape
    g = b.shape[2]
    nc = seq // chunk
    rep = h // g
    xf = x.float()
    dtf = dt.float()
    bf = b.float().repeat_interleave(rep, dim=2)  # [P, L, H, N]
    cf = c.float().repeat_interleave(rep, dim=2)
    d_res = d.float()[:, None] * xf
    xdt = xf * dtf[..., None]
    adt = a.float() * dtf  # [P, L, H]

    xdt = xdt.reshape(p, nc, chunk, h, hd)
    bf = bf.reshape(p, nc, chunk, h, -1)
    cf = cf.reshape(p, nc, chunk, h, -1)
    adt = adt.reshape(p, nc, chunk, h).permute(0, 3, 1, 2)  # [P, H, nc, l]
    a_cum = torch.cumsum(adt, dim=-1)

    # intra-chunk (diagonal blocks)
    decay = torch.exp(_segsum(adt))  # [P, H, nc, l, s]
    scores = torch.einsum("bclhn,bcshn->bclsh", cf, bf)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores * decay.permute(0, 2, 3, 4, 1), xdt)

    # state contributed by each chunk
    decay_states = torch.exp(a_cum[..., -1:] - a_cum)  # [P, H, nc, l]
    chunk_states = torch.einsum(
        "bclhn,bclhp->bchpn", bf * decay_states.permute(0, 2, 3, 1)[..., None], xdt
    )  # [P, nc, H, D, N]

    # inter-chunk recurrence: states at every chunk boundary, starting from init
    all_states = torch.cat([init.float()[:, None], chunk_states], dim=1)  # [P, nc+1, H, D, N]
    decay_chunk = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, all_states)  # [P, nc+1, H, D, N]

    # state -> output
    c_states = torch.einsum("bclhn,bchpn->bclhp", cf, states[:, :-1])
    y_off = c_states * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(p, seq, h, hd) + d_res
    return y, states


def ssm_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token through the selective state update.

    Parameters
    ----------
    x : torch.Tensor
        ``[B, H, D]``.
    dt : torch.Tensor
        ``[B, H]`` after softplus/clamp.
    a, d : torch.Tensor
        ``[H]``.
    b, c : torch.Tensor
        ``[B, G, N]``.
    state : torch.Tensor
        ``[B, H, D, N]`` fp32.

    Returns
    -------
    y : torch.Tensor
        ``[B, H, D]`` fp32.
    new_state : torch.Tensor
        ``[B, H, D, N]`` fp32.
    """
    h = x.shape[1]
    rep = h // b.shape[1]
    xf = x.float()
    dtf = dt.float()
    bh = b.float().repeat_interleave(rep, dim=1)  # [B, H, N]
    ch = c.float().repeat_interleave(rep, dim=1)
    da = torch.exp(dtf * a.float())  # [B, H]
    new = state * da[..., None, None] + (dtf[..., None] * xf)[..., None] * bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, ch) + d.float()[:, None] * xf
    return y, new
