"""vLLM 0.33 drop-ins: the functions of :mod:`hybridmeta.compat.vllm` with vLLM 0.33's
signatures.

Against 0.32: ``selective_state_update`` is unchanged; ``causal_conv1d_update`` and
``causal_conv1d_fn`` lose the prefix-caching "all" mode arguments
(``block_idx_*_scheduled_token``, ``initial_state_idx``, ``num_computed_tokens``,
``block_size_to_align``); ``mamba_chunk_scan_combined_varlen`` gains ``final_states_out``
and ``final_state_indices`` (write each sequence's final state into
``final_states_out[final_state_indices[b]]`` and return ``None``).
"""

from __future__ import annotations

import torch

from hybridmeta.compat import vllm as _v32
from hybridmeta.compat.vllm import NULL_BLOCK_ID, PAD_SLOT_ID, selective_state_update

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba_chunk_scan_combined_varlen",
    "selective_state_update",
]


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int = NULL_BLOCK_ID,
    validate_data: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM 0.33's ``causal_conv1d_update``: :func:`hybridmeta.compat.vllm.causal_conv1d_update`."""
    return _v32.causal_conv1d_update(
        x, conv_state, weight, bias, activation, conv_state_indices, num_accepted_tokens,
        query_start_loc, max_query_len, null_block_id, validate_data=validate_data, out=out,
    )  # fmt: skip


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    null_block_id: int = NULL_BLOCK_ID,
    metadata: object = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """vLLM 0.33's ``causal_conv1d_fn``: :func:`hybridmeta.compat.vllm.causal_conv1d_fn`."""
    return _v32.causal_conv1d_fn(
        x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
        activation, pad_slot_id, null_block_id, metadata=metadata, validate_data=validate_data,
    )  # fmt: skip


def mamba_chunk_scan_combined_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor,
    last_chunk_indices: torch.Tensor,
    seq_idx: torch.Tensor,
    out: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
    final_states_out: torch.Tensor | None = None,
    final_state_indices: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """vLLM 0.33's ``mamba_chunk_scan_combined_varlen``: 0.32's, and with
    ``final_states_out`` the final states are written to ``final_states_out[
    final_state_indices]`` (in its dtype) and ``None`` is returned."""
    op = "vllm_v033.mamba_chunk_scan_combined_varlen"
    if final_states_out is not None:
        if return_intermediate_states:
            raise ValueError(f"{op}: `final_states_out` excludes `return_intermediate_states`")
        if final_state_indices is None:
            raise ValueError(f"{op}: `final_states_out` needs `final_state_indices`")
    states = _v32.mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx,
        out, D, z, dt_bias, initial_states, dt_softplus, dt_limit, return_intermediate_states,
        final_states_out.dtype if final_states_out is not None else state_dtype,
    )  # fmt: skip
    if final_states_out is None:
        return states
    assert final_state_indices is not None
    final_states_out.index_copy_(0, final_state_indices.long(), states)
    return None
