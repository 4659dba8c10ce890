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

import logging

import torch
from vllm.distributed import (  # type: ignore[import-not-found]
    get_tensor_model_parallel_rank as _tp_rank,
)
from vllm.forward_context import get_forward_context  # type: ignore[import-not-found]
from vllm.model_executor.layers.mamba.mamba_mixer2 import (  # type: ignore[import-not-found]
    MambaMixer2,
)
from vllm.model_executor.layers.mamba.mamba_utils import (  # type: ignore[import-not-found]
    is_conv_state_dim_first,
)

from hybridmeta.integrations.vllm.layer import LayerShape, conv_ssm
from hybridmeta.model import Mamba2Metadata

__all__ = ["HybridMambaMixer2"]

log = logging.getLogger("vllm.hybridmeta")

class HybridMambaMixer2(MambaMixer2):  # type: ignore[misc]
    """vLLM's ``MambaMixer2`` whose conv + SSM run through hybridmeta's ops."""

    _announced = False  # one log line per process, at the first forward with metadata

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor) -> None:
        """Conv + SSM of one forward: ``output[:T]`` gets the SSM output of every token.

        ``projected_states``: ``[T, ...]`` in_proj output (gate, xBC, dt), tokens in vLLM's
        order (decode rows first); the states live in this layer's ``kv_cache``.
        """
        raw = get_forward_context().attn_metadata
        md = raw.get(self.prefix) if isinstance(raw, dict) else None
        if md is None:
            return  # vLLM's profile run: no metadata, no state (vLLM's layer returns too)
        if not isinstance(md, Mamba2Metadata):
            raise TypeError(
                f"hybridmeta MambaMixer2 {self.prefix}: the layer's attention metadata is a "
                f"{type(md).__name__}, not the hybridmeta backend's Mamba2Metadata; is the "
                "hybridmeta Mamba2 backend registered (HYBRIDMETA_VLLM=1)?"
            )
        if not HybridMambaMixer2._announced:
            HybridMambaMixer2._announced = True
            sh = self.hybridmeta_shape
            log.info(
                "hybridmeta MambaMixer2 serving (tp rank %d of %d: %d heads, %d groups)",
                _tp_rank(), self.tp_size,
                sh.heads, sh.groups,
            )  # fmt: skip
        xbc, dt = torch.split(
            projected_states[..., self.tped_intermediate_size :],
            [self.tped_conv_size, self.tped_dt_size],
            dim=-1,
        )
        # The ops take the pool as [slots, conv_dim, K - 1] (a view of vLLM's layout).
        conv = self.kv_cache[0]
        conv_state = conv if is_conv_state_dim_first() else conv.transpose(-1, -2)
        conv_ssm(
            md, xbc, dt, output, conv_state=conv_state, ssm_state=self.kv_cache[1],
            conv_weight=self.conv_weights, conv_bias=self.conv1d.bias, A=self.A, D=self.D,
            dt_bias=self.dt_bias, shape=self.hybridmeta_shape,
        )  # fmt: skip

    @property
    def hybridmeta_shape(self) -> LayerShape:
        """This rank's shard: vLLM shards heads and groups (replicated groups included)."""
        return LayerShape(
            heads=self.num_heads // self.tp_size,
            head_dim=self.head_dim,
            groups=self.n_groups // self.tp_size,
            state=self.ssm_state_size,
            activation=self.activation,
        )
