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
from hybridmeta.core import conventions_of
from hybridmeta.integrations.vllm.metadata import VllmMamba2Step
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
    spec = isinstance(md, VllmMamba2Step) and md.num_accepted_tokens is not None
    # The token ranges in the declared row order (vLLM's: the decode rows' tokens first).
    # A speculative step's decode rows have 1 .. 1 + num_spec tokens each: their count is
    # the step's num_decode_tokens (varlen rows; docs/vllm_api_needs.md item 9).
    if isinstance(md, VllmMamba2Step) and spec:
        ndt = md.num_decode_tokens
        dec, pre = slice(0, ndt), slice(ndt, ndt + md.num_prefill_tokens)
    else:
        dec, pre = md.decode_tokens(), md.prefill_tokens()
    K1 = conv_weight.shape[1] - 1
    # The running conv window is columns 0 .. K - 2 of a block (vLLM widens the blocks to
    # K - 1 + num_spec columns with speculative decoding: the rest is draft history).
    conv_window = conv_state[:, :, :K1]
    if md.num_prefills:
        tp = md.num_prefill_tokens
        xbc_p = xbc[pre]
        conv = kernels.causal_conv1d_prefill(
            xbc_p, conv_weight, conv_bias, md=md, conv_state=conv_window,
            activation=shape.activation,
        )  # fmt: skip
        x, b, c = kernels.split_xbc(conv.out, H, P, G, N)
        params = kernels.SSMParams(A=A, D=D, dt_bias=dt_bias, dt_softplus=True)
        scan = kernels.ssd_chunked_scan(
            x, dt[pre], b, c, params=params, md=md, ssm_state=ssm_state
        )
        kernels.extend_track_save(
            md, xbc=xbc_p, conv=conv, scan=scan, conv_state=conv_window, ssm_state=ssm_state
        )
        output[pre].copy_(scan.y.reshape(tp, -1))
        CALLS["prefill"] += 1
    if md.num_decodes and isinstance(md, VllmMamba2Step) and spec:
        _spec_decode(md, xbc[dec], dt[dec], output[dec], conv_state=conv_state,
                     ssm_state=ssm_state, conv_weight=conv_weight, conv_bias=conv_bias, A=A,
                     D=D, dt_bias=dt_bias, shape=shape)  # fmt: skip
        CALLS["spec_decode"] += 1
    elif md.num_decodes:
        nd = md.num_decodes
        u = kernels.causal_conv1d_update_from_metadata(
            md, xbc[dec], conv_window, conv_weight, conv_bias, activation=shape.activation
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


def _spec_decode(
    md: VllmMamba2Step,
    xbc: torch.Tensor,
    dt: torch.Tensor,
    out: torch.Tensor,
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
    """The speculative decode rows of a vLLM step (``ngram`` and every draft method: the
    target's verify), in vLLM's state layout, through hybridmeta's verify ops.

    vLLM gives each decode row ``1 + num_spec`` state blocks (``md.state_indices``) and
    the tokens it accepted last step (``md.num_accepted_tokens``): the row's SSM state is
    read from column ``num_accepted - 1``, the state after each of its tokens goes to
    that token's column, and its conv window is read at column offset ``num_accepted -
    1`` of block 0, which then holds the window's last ``K - 2`` inputs and every new
    input. There is no commit: the next step's accepted count picks the column. Every
    tensor comes from the metadata (vLLM's fields, carried by ``Mamba2Metadata[
    VllmMamba2Step]``); the null slot is the metadata's declared one. The composition is
    :mod:`hybridmeta.compat.vllm`'s (``conv_verify_update`` / ``ssm_verify_update`` into
    scratch, then the stores vLLM's layout asks for).
    """
    from hybridmeta.compat import vllm as vllm_ops  # the verify compositions in vLLM's layout

    H, P, G, N = shape.heads, shape.head_dim, shape.groups, shape.state
    assert isinstance(md, Mamba2Metadata) and md.num_accepted_tokens is not None
    rows = md.decode_rows()
    state_indices = md.state_indices[rows]
    accepted = md.num_accepted_tokens[rows]
    qsl = md.query_start_loc[rows.start : rows.stop + 1]
    null = conventions_of(md).null_slot
    u = torch.empty_like(xbc)
    vllm_ops.causal_conv1d_update(
        xbc, conv_state, conv_weight, conv_bias, shape.activation,
        conv_state_indices=state_indices, num_accepted_tokens=accepted, query_start_loc=qsl,
        max_query_len=state_indices.shape[1], null_block_id=null, out=u,
    )  # fmt: skip
    x, b, c = kernels.split_xbc(u, H, P, G, N)
    y = torch.empty_like(x)
    vllm_ops.selective_state_update(
        ssm_state, x, dt[:, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N),
        b, c, D[:, None].expand(-1, P), dt_bias[:, None].expand(-1, P), dt_softplus=True,
        state_batch_indices=state_indices, dst_state_batch_indices=state_indices,
        null_block_id=null, out=y, num_accepted_tokens=accepted, cu_seqlens=qsl,
    )  # fmt: skip
    out.copy_(y.reshape(out.shape[0], -1))
