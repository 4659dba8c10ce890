"""hybridmeta's own Triton decode kernels driven through :mod:`hybridmeta.testing`.

:class:`~examples.triton_backend.backend.KernelBackend` is a decode step built from
hybridmeta's parts: :class:`hybridmeta.graphs.StaticBuffers` for the static buffers and
their refresh, :func:`hybridmeta.kernels.causal_conv1d_update_from_metadata` and
:func:`hybridmeta.kernels.ssm_state_update_from_metadata` (fused track write), with the
pure-torch references as its eager path. On a machine without CUDA the kernels run under
the Triton interpreter: keep sizes tiny and examples few.
"""
