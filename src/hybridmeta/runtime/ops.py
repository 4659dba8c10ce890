"""Pure-torch norms of the reference runtime (the Mamba2 math lives in
:mod:`hybridmeta.kernels`).

Fixed shapes, no device-to-host reads: the decode path captures into a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gated_rms_norm", "rms_norm"]


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
