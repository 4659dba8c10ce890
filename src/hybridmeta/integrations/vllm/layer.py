"""The conv + SSM of one Mamba2 layer over one vLLM forward, through hybridmeta's ops.

The body of the plugin's ``MambaMixer2.conv_ssm_forward``, with no vLLM import (tested
against the token-by-token oracle without vLLM). Tokens are in the metadata's declared row
order (vLLM's: decode rows first, one token each, then the prefill rows' tokens); every
slot, plan, count and token range the ops use comes from ``md``, the forward's
``Mamba2Metadata``, and the ops take its declared null slot as their pad id.
"""

from __future__ import annotations

import math
from collections import Counter

import attrs
import torch

from hybridmeta import kernels
from hybridmeta.model import Mamba2Metadata

__all__ = ["CALLS", "DT_LIMIT", "LayerShape", "conv_ssm"]

#: vLLM's Mamba2 layers apply no dt limit (``dt_limit=(0, inf)``): the same here.
DT_LIMIT = (0.0, math.inf)
#: Layer calls served in this process, by kind ("prefill", "decode"): logs and tests read
#: it to see that the plugin, not vLLM's own path, ran.
CALLS: Counter[str] = Counter()


@attrs.frozen(kw_only=True)
class LayerShape:
    """One tensor-parallel shard of a Mamba2 layer: its heads, head dim, groups, state."""

    heads: int
    head_dim: int
    groups: int
    state: int
    activation: str = "silu"


def conv_ssm(
    md: Mamba2Metadata,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    output: torch.Tensor,
    *,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    shape: LayerShape,
) -> None:
    """Write the SSM output of every token into ``output[:T]`` and update the states.

    Parameters
    ----------
    md : Mamba2Metadata
        The forward's metadata (:func:`~hybridmeta.integrations.vllm.metadata.mamba2_metadata`).
    xbc : torch.Tensor
        ``[>= T, conv_dim]`` conv inputs, vLLM's token order; rows past ``T`` are ignored.
    dt : torch.Tensor
        ``[>= T, heads]`` raw dt.
    output : torch.Tensor
        ``[>= T, heads * head_dim]``.
    conv_state, ssm_state : torch.Tensor
        This layer's pools: ``[slots, conv_dim, K - 1]`` (any strides: vLLM's is a
        transpose view) and ``[slots, heads, head_dim, state]``.
    conv_weight, conv_bias, A, D, dt_bias : torch.Tensor
        The layer's conv weight ``[conv_dim, K]`` and bias, ``A = -exp(A_log)``, ``D`` and
        ``dt_bias`` (``[heads]`` each).
    """
    H, P, G, N = shape.heads, shape.head_dim, shape.groups, shape.state
    # The token ranges in the declared row order (vLLM's: the decode rows' tokens first).
    dec, pre = md.decode_tokens(), md.prefill_tokens()
    if md.num_prefills:
        tp = md.num_prefill_tokens
        xbc_p = xbc[pre]
        conv = kernels.causal_conv1d_prefill(
            xbc_p, conv_weight, conv_bias, md=md, conv_state=conv_state,
            activation=shape.activation,
        )  # fmt: skip
        x, b, c = kernels.split_xbc(conv.out, H, P, G, N)
        params = kernels.SSMParams(A=A, D=D, dt_bias=dt_bias, dt_softplus=True)
        scan = kernels.ssd_chunked_scan(
            x, dt[pre], b, c, params=params, md=md, ssm_state=ssm_state
        )
        kernels.extend_track_save(
            md, xbc=xbc_p, conv=conv, scan=scan, conv_state=conv_state, ssm_state=ssm_state
        )
        output[pre].copy_(scan.y.reshape(tp, -1))
        CALLS["prefill"] += 1
    if md.num_decodes:
        nd = md.num_decodes
        u = kernels.causal_conv1d_update_from_metadata(
            md, xbc[dec], conv_state, conv_weight, conv_bias, activation=shape.activation
        )
        x, b, c = kernels.split_xbc(u, H, P, G, N)
        y = kernels.ssm_state_update_from_metadata(
            md, ssm_state, x, dt[dec], A, b, c, D=D, dt_bias=dt_bias, dt_softplus=True,
            dt_limit=DT_LIMIT,
        )  # fmt: skip
        output[dec].copy_(y.reshape(nd, -1))
        CALLS["decode"] += 1
    # No row-end track save: in align mode a row's state at its own end is its block
    # (vLLM copies it on), and the translation plans only vLLM's checkpoints, each at a
    # boundary strictly inside its prefill row (the planner's track_positions).
