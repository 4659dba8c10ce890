"""The compat tests' oracle: the peers' documented semantics, row by row and token by token
in fp32 Python loops (written from the peers' sources as read, independently of
:mod:`hybridmeta.compat`), with hybridmeta's two deliberate rules: pad rows get zero
output, and a pad / null id is never written.

Shapes are Nemotron-H / Nano-9B style (groups, heads a multiple of groups, conv width 4,
``conv_dim = H * P + 2 * G * N``), scaled down.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

H, P, G, N, K = 4, 8, 2, 16, 4  # heads, headdim, groups, dstate, conv width
CONV_DIM = H * P + 2 * G * N


@attrs.frozen(kw_only=True)
class Layer:
    """Per-head SSM parameters and the peers' stride-0 expansions of them."""

    A: torch.Tensor  # [H]
    D: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H]

    def A3(self) -> torch.Tensor:
        return self.A[:, None, None].expand(H, P, N)

    def D2(self) -> torch.Tensor:
        return self.D[:, None].expand(H, P)

    def bias2(self) -> torch.Tensor:
        return self.dt_bias[:, None].expand(H, P)


def layer(seed: int = 0) -> Layer:
    g = torch.Generator().manual_seed(seed)
    return Layer(
        A=-(torch.rand(H, generator=g) + 0.5),
        D=torch.randn(H, generator=g),
        dt_bias=torch.randn(H, generator=g) * 0.5,
    )


def expand_dt(dt: torch.Tensor) -> torch.Tensor:
    """``[.., H] -> [.., H, P]`` stride 0: what the peers' mixers pass."""
    return dt[..., None].expand(*dt.shape, P)


def ssm_token(
    s: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    lay: Layer,
    z: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of one row: ``s [H, P, N]`` fp32, ``x [H, P]``, ``dt [H]`` raw (bias and
    softplus applied here), ``B, C [G, N]``. Returns (new state fp32, y fp32)."""
    d = F.softplus(dt.float() + lay.dt_bias.float())
    b = B.float().repeat_interleave(H // G, dim=0)
    c = C.float().repeat_interleave(H // G, dim=0)
    xs = x.float()
    new = s * torch.exp(d * lay.A.float())[:, None, None] + (d[:, None] * xs)[:, :, None] * b[:, None, :]
    y = (new * c[:, None, :]).sum(-1) + lay.D.float()[:, None] * xs
    if z is not None:
        y = y * F.silu(z.float())
    return new, y


def ssm_row(
    s0: torch.Tensor | None,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    lay: Layer,
    z: torch.Tensor | None = None,
    parents: Sequence[int] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Tokens ``x [L, H, P]`` of one row from ``s0`` (None: zeros); ``parents[t]`` (``-1``:
    the start state) makes a tree. Returns (state after each token, y [L, H, P])."""
    start = torch.zeros(H, P, N) if s0 is None else s0.float()
    states: list[torch.Tensor] = []
    ys = []
    for t in range(x.shape[0]):
        p = t - 1 if parents is None else parents[t]
        prev = start if p < 0 else states[p]
        new, y = ssm_token(prev, x[t], dt[t], B[t], C[t], lay, None if z is None else z[t])
        states.append(new)
        ys.append(y)
    return states, torch.stack(ys) if ys else torch.zeros(0, H, P)


def conv_row(
    window: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool = True,
    parents: Sequence[int] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Tokens ``x [L, C]`` of one row from ``window [C, K - 1]``; ``parents[t]`` (``-1``: the
    window) makes a tree. Returns (y [L, C] fp32, the window after each token)."""
    wins: list[torch.Tensor] = []
    ys = []
    for t in range(x.shape[0]):
        p = t - 1 if parents is None else parents[t]
        prev = window.float() if p < 0 else wins[p]
        full = torch.cat([prev, x[t].float()[:, None]], dim=1)
        acc = (full * weight.float()).sum(1)
        if bias is not None:
            acc = acc + bias.float()
        ys.append(F.silu(acc) if silu else acc)
        wins.append(full[:, 1:])
    return (torch.stack(ys) if ys else torch.zeros(0, x.shape[1])), wins
