"""Drop-in functions with the signatures and semantics of the peers' Mamba2 kernels,
built on hybridmeta's ops: where an engine that already calls vLLM's, sglang's or
FlashInfer's functions plugs hybridmeta in.

One module per peer (``docs/compat.md`` states each function's semantics, what it does not
support and what it composes):

* :mod:`hybridmeta.compat.vllm`: vLLM 0.32 ``selective_state_update``,
  ``causal_conv1d_update``, ``causal_conv1d_fn``, ``mamba_chunk_scan_combined_varlen``;
  :mod:`hybridmeta.compat.vllm_v033` the same for vLLM 0.33;
* :mod:`hybridmeta.compat.sglang`: sglang 0.5.23 ``selective_state_update``,
  ``causal_conv1d_update`` (its Triton one);
* :mod:`hybridmeta.compat.flashinfer`: FlashInfer 0.7.4 ``selective_state_update``.

The implementation of each op call is chosen as for every hybridmeta op: inside
``with hybridmeta.kernels.implementation(...)``, else Triton on CUDA and the pure-torch
reference elsewhere (the peers' signatures have no ``impl=``).
"""
