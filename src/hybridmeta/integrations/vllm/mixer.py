"""The plugin's ``MambaMixer2``: vLLM's layer, with conv and SSM through hybridmeta's ops.

Registered by :func:`hybridmeta.integrations.vllm.plugin.register` through vLLM's
declared extension point ``PluggableLayer.register_oot(name="MambaMixer2")``: every model
that builds a ``MambaMixer2`` (Nemotron-H and its MoE variants, Granite 4.0-H,
Falcon-H1, Bamba, Zamba2, Mamba2) gets this class instead.

It is a subclass: vLLM's constructor, weights, tensor-parallel linear layers, weight
loaders, in_proj, gated RMSNorm, out_proj and KV-cache spec stay vLLM's. Only the conv +
SSM part (``conv_ssm_forward``, which vLLM's ``forward`` reaches through its
``torch.ops.vllm.mamba_mixer2`` custom op) is replaced: prefill conv, chunked scan,
align-mode checkpoint saves, decode conv update and SSM update all run through
hybridmeta's ops (the pure-torch reference on the CPU, Triton on a GPU), and read every
slot, plan and count from the forward's ``Mamba2Metadata``. Under tensor parallelism the
layer holds its shard (heads, groups and conv channels of its rank) and the ops work on
that shard as on a whole layer.

Importing this module imports vLLM.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from vllm.forward_context import get_forward_context  # type: ignore[import-not-found]
from vllm.model_executor.layers.mamba.mamba_mixer2 import (  # type: ignore[import-not-found]
    MambaMixer2,
)
from vllm.model_executor.layers.mamba.mamba_utils import (  # type: ignore[import-not-found]
    is_conv_state_dim_first,
)

from hybridmeta import kernels
from hybridmeta.integrations.vllm.metadata import VllmForward

__all__ = ["HybridMambaMixer2"]

#: vLLM's Mamba2 layers clamp dt to (0, inf) (no limit): the same here.
DT_LIMIT = (0.0, math.inf)


class HybridMambaMixer2(MambaMixer2):  # type: ignore[misc]
    """vLLM's ``MambaMixer2`` whose conv + SSM run through hybridmeta's ops."""

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor) -> None:
        """Conv + SSM of one forward: ``output[:T]`` gets the SSM output of every token.

        ``projected_states``: ``[T, ...]`` in_proj output (gate, xBC, dt), tokens in vLLM's
        order (decode rows first); the states live in this layer's ``kv_cache``.
        """
        raw = get_forward_context().attn_metadata
        fwd = raw.get(self.prefix) if isinstance(raw, dict) else None
        if fwd is None:
            return  # vLLM's profile run: no metadata, no state (vLLM's layer returns too)
        if not isinstance(fwd, VllmForward):
            raise TypeError(
                f"hybridmeta MambaMixer2 {self.prefix}: the layer's attention metadata is a "
                f"{type(fwd).__name__}, not the hybridmeta backend's VllmForward; is the "
                "hybridmeta Mamba2 backend registered (HYBRIDMETA_VLLM=1)?"
            )
        md = fwd.md
        xbc, dt = torch.split(
            projected_states[..., self.tped_intermediate_size :],
            [self.tped_conv_size, self.tped_dt_size],
            dim=-1,
        )
        # The ops take the pool as [slots, conv_dim, K - 1] (a view of vLLM's layout).
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        ssm_state = self.kv_cache[1]  # [slots, heads, head_dim, state]
        H = self.num_heads // self.tp_size
        G = self.n_groups // self.tp_size
        P, N = self.head_dim, self.ssm_state_size
        weight = self.conv_weights  # [conv_dim, K]
        bias = self.conv1d.bias
        nd = md.num_decodes  # vLLM's decode tokens come first (one each)
        tp = md.num_prefill_tokens
        if md.num_prefills:
            xbc_p = xbc[nd : nd + tp]
            conv = kernels.causal_conv1d_prefill(
                xbc_p, weight, bias, md=md, conv_state=conv_state, activation=self.activation
            )
            x, b, c = kernels.split_xbc(conv.out, H, P, G, N)
            params = kernels.SSMParams(A=self.A, D=self.D, dt_bias=self.dt_bias, dt_softplus=True)
            scan = kernels.ssd_chunked_scan(
                x, dt[nd : nd + tp], b, c, params=params, md=md, ssm_state=ssm_state
            )
            kernels.extend_track_save(
                md, xbc=xbc_p, conv=conv, scan=scan, conv_state=conv_state, ssm_state=ssm_state
            )
            output[nd : nd + tp].copy_(scan.y.reshape(tp, -1))
        if nd:
            u = kernels.causal_conv1d_update_from_metadata(
                md, xbc[:nd], conv_state, weight, bias, activation=self.activation
            )
            x, b, c = kernels.split_xbc(u, H, P, G, N)
            y = kernels.ssm_state_update_from_metadata(
                md, ssm_state, x, dt[:nd], self.A, b, c, D=self.D, dt_bias=self.dt_bias,
                dt_softplus=True, dt_limit=DT_LIMIT,
            )  # fmt: skip
            output[:nd].copy_(y.reshape(nd, -1))
        # Rows whose track boundary ends them save after their update (align mode's
        # checkpoints lie inside prefill rows; this is a no-op unless the plan says so).
        kernels.track_save_from_metadata(md, conv_state.unsqueeze(0), ssm_state.unsqueeze(0))

    @property
    def hybridmeta_info(self) -> dict[str, Any]:
        """What this shard runs (for logs and tests)."""
        return {
            "heads": self.num_heads // self.tp_size,
            "groups": self.n_groups // self.tp_size,
            "tp_size": self.tp_size,
        }
