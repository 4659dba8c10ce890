"""The plugin's Mamba2 attention backend: vLLM's metadata in, hybridmeta's out.

Registered by :func:`hybridmeta.integrations.vllm.plugin.register` through vLLM's
declared extension point ``register_backend(MambaAttentionBackendEnum.MAMBA2, ...,
is_mamba=True)``. The builder keeps vLLM's own builder state (its persistent decode
buffers, chunk size, the prefill-checkpoint builder that keeps the checkpoints in
lockstep with vLLM's scheduler) and replaces ``build``: it reads what vLLM hands it into
one :class:`~hybridmeta.integrations.vllm.metadata.VllmMamba2Step` (:func:`step_from_vllm`),
an extension of hybridmeta's ``ForwardMetadata`` declaring vLLM's conventions, and
translates that through the one translation point,
:func:`~hybridmeta.integrations.vllm.metadata.mamba2_metadata`, into the
``Mamba2Metadata`` every Mamba2 layer of the forward reads.

Importing this module imports vLLM (it runs only inside a vLLM process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm.v1.attention.backends.mamba2_attn import (  # type: ignore[import-not-found]
    Mamba2AttentionBackend,
    Mamba2AttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import (  # type: ignore[import-not-found]
    mamba_get_block_table_tensor,
)

from hybridmeta.integrations.vllm.metadata import (
    NULL_BLOCK_ID,
    DecodeGraphBuffers,
    VllmMamba2Step,
    check_speculative,
    decode_rows,
    mamba2_metadata,
)
from hybridmeta.model import Mamba2Metadata

__all__ = ["HybridMamba2Backend", "HybridMamba2Builder", "step_from_vllm"]


def step_from_vllm(
    common: Any,
    *,
    kv_cache_spec: Any,
    mamba_cache_mode: str,
    chunk_size: int,
    conv_kernel: int,
    checkpoints: Callable[[list[int]], Any] | None,
    num_accepted_tokens: torch.Tensor | None = None,
    num_rows: int | None = None,
    num_spec: int = 0,
) -> VllmMamba2Step:
    """Read vLLM's ``CommonAttentionMetadata`` (and its prefill checkpoints) into a step.

    The one reader of vLLM's fields: every field the builder is handed that the Mamba2
    layers need lands in a declared field of :class:`VllmMamba2Step`.

    Decode rows are the leading rows that resume from their state with one new token
    (vLLM's batch reorder puts them first); a one-token *first* chunk of a prompt has no
    state and is a prefill row, as in vLLM's own builder. ``num_rows``: the live rows
    (default every request row; a FULL-graph batch's padding rows come after them).

    With speculative decoding (``num_spec`` > 0) a decode row has up to ``1 + num_spec``
    tokens and a prompt still prefilling is not one (``is_prefilling``, as vLLM splits
    the batch); the decode rows' accepted counts are vLLM's (every token accepted where
    vLLM has none yet, as its builder does), the other rows' 1.
    """
    n = int(common.num_reqs) if num_rows is None else num_rows
    qsl_cpu = common.query_start_loc_cpu[: n + 1].numpy()
    query_lens = np.diff(qsl_cpu).astype(np.int64)
    seq_lens_cpu = common.seq_lens_cpu_upper_bound
    if seq_lens_cpu is None:
        raise ValueError("hybridmeta vLLM builder: seq_lens_cpu_upper_bound is required")
    computed = seq_lens_cpu[:n].numpy().astype(np.int64) - query_lens
    prefilling = getattr(common, "is_prefilling", None) if num_spec else None
    num_decodes = decode_rows(
        query_lens, computed, 1 + num_spec,
        None if prefilling is None else prefilling[:n].numpy().astype(bool),
    )  # fmt: skip
    # vLLM's checkpoint builder (lockstep with its scheduler) covers the prefill rows.
    checkpoint = (
        checkpoints(list(range(num_decodes, n))) if checkpoints is not None and num_decodes < n
        else None
    )  # fmt: skip
    state = mamba_get_block_table_tensor(
        common.block_table_tensor[:n], common.seq_lens[:n], kv_cache_spec, mamba_cache_mode
    )
    if state.dim() == 1:
        state = state.unsqueeze(-1)
    seq_lens = common.seq_lens[:n]
    accepted: torch.Tensor | None = None
    if num_spec and num_decodes:
        qsl_d = common.query_start_loc[: num_decodes + 1]
        acc_d = (
            torch.diff(qsl_d) if num_accepted_tokens is None else num_accepted_tokens[:num_decodes]
        )
        accepted = torch.cat((acc_d, acc_d.new_ones(n - num_decodes)))
    offsets: tuple[int, ...] | None = None
    ckpt_slots: torch.Tensor | None = None
    interval = 0
    if checkpoint is not None:
        offsets = (0,) * num_decodes + tuple(int(o) for o in checkpoint.offsets)
        ckpt_slots = torch.cat(
            (
                torch.full((num_decodes,), NULL_BLOCK_ID, dtype=checkpoint.state_indices.dtype,
                           device=checkpoint.state_indices.device),
                checkpoint.state_indices,
            )
        )  # fmt: skip
        interval = int(kv_cache_spec.block_size)
    return VllmMamba2Step(
        query_start_loc=common.query_start_loc[: n + 1],
        mamba_cache_indices=state[:, 0],
        seq_lens=seq_lens,
        state_indices=state,
        num_computed_tokens=common.compute_num_computed_tokens()[:n],
        checkpoint_slots=ckpt_slots,
        num_accepted_tokens=accepted,
        num_decode_rows=num_decodes,
        num_decode_tokens=int(qsl_cpu[num_decodes]),
        query_lens=query_lens,
        computed_lens=computed,
        checkpoint_offsets=offsets,
        chunk_size=chunk_size,
        conv_kernel=conv_kernel,
        checkpoint_interval=interval,
    )


class HybridMamba2Builder(Mamba2AttentionMetadataBuilder):  # type: ignore[misc]
    """vLLM's Mamba2 builder with hybridmeta's ``build``.

    ``supports_update_block_table`` is off: vLLM then builds each KV-cache group's
    metadata through :meth:`build` (one path), instead of patching a copy of another
    group's metadata in place.
    """

    supports_update_block_table = False

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device) -> None:  # fmt: skip
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_speculative(
            getattr(vllm_config.speculative_config, "method", None),
            int(self.num_spec_tokens),
            vllm_config.cache_config.mamba_cache_mode,
        )
        if self.use_replayssm:
            raise NotImplementedError("hybridmeta vLLM plugin: ReplaySSM is not supported")
        # conv blocks hold K - 1 + num_spec columns (the drafts' history)
        conv_shape = kv_cache_spec.shapes[0]
        self.conv_kernel = int(min(conv_shape)) + 1 - int(self.num_spec_tokens)
        # vLLM's FULL-graph decode path: persistent buffers from StaticBuffers.
        self.graphs: DecodeGraphBuffers | None = None
        if self.compilation_config.cudagraph_mode.has_full_cudagraphs() and not self.num_spec_tokens:
            blocks = vllm_config.cache_config.num_gpu_blocks
            self.graphs = DecodeGraphBuffers(
                max_bs=self.decode_cudagraph_max_bs,
                num_slots=int(blocks) if blocks else 2**31 - 1,
                device=device,
            )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
        **kwargs: Any,
    ) -> Mamba2Metadata:
        n = int(common_attn_metadata.num_reqs)
        lens = np.diff(common_attn_metadata.query_start_loc_cpu[: n + 1].numpy())
        live = n - int(np.argmax(lens[::-1] != 0)) if lens.any() else 0  # padding rows last
        step = self.build_step(common_attn_metadata, num_rows=live, **kwargs)
        decode_only = step.num_decode_rows == live
        if self.graphs is not None and decode_only and n <= self.graphs.buffers.max_bs:
            return self.graphs.refresh(step, n)  # views of exactly the bucket's n rows
        return mamba2_metadata(step)  # a Mamba2Metadata[VllmMamba2Step]

    def build_step(
        self, common_attn_metadata: Any, num_rows: int | None = None, **kwargs: Any
    ) -> VllmMamba2Step:
        """The declared step of one forward (no hybridmeta plan yet)."""
        return step_from_vllm(
            common_attn_metadata,
            kv_cache_spec=self.kv_cache_spec,
            mamba_cache_mode=self.vllm_config.cache_config.mamba_cache_mode,
            chunk_size=self.chunk_size,
            conv_kernel=self.conv_kernel,
            checkpoints=lambda rows: self.checkpoint_builder.build(common_attn_metadata, rows),
            num_accepted_tokens=kwargs.get("num_accepted_tokens"),
            num_rows=num_rows,
            num_spec=int(self.num_spec_tokens),
        )


class HybridMamba2Backend(Mamba2AttentionBackend):  # type: ignore[misc]
    """The Mamba2 backend whose builder is :class:`HybridMamba2Builder`."""

    @staticmethod
    def get_name() -> str:
        return "HYBRIDMETA_MAMBA2"

    @staticmethod
    def get_builder_cls() -> type[HybridMamba2Builder]:
        return HybridMamba2Builder
