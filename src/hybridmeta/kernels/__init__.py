"""Mamba2 decode kernels in Triton, each beside a pure-torch reference.

* :func:`ssm_state_update` - single-token SSM state update (optional fused track write).
* :func:`causal_conv1d_update` - causal-conv1d decode update.
* :func:`track_save` - prefix-cache track-save over layer-major pools, one launch.
* :func:`ssm_verify_update`, :func:`conv_verify_update`, :func:`spec_commit` - speculative
  decoding: multi-token verify (chains and trees) and the commit of accepted states
  (one module per op, each beside its ``*_reference``; see ``docs/spec_decode.md``).

References live in :mod:`hybridmeta.kernels.reference`. On a machine without CUDA the
kernels run under the Triton interpreter: importing ``hybridmeta`` sets
``TRITON_INTERPRET=1`` (unless already set) before any kernel is decorated.
"""

from __future__ import annotations

from hybridmeta.kernels.conv_verify import conv_verify_update
from hybridmeta.kernels.ops import (
    DecodeIndices,
    causal_conv1d_update,
    causal_conv1d_update_from_metadata,
    ssm_state_update,
    ssm_state_update_from_metadata,
    track_save,
    track_save_from_metadata,
)
from hybridmeta.kernels.spec_commit import spec_commit, spec_track_token
from hybridmeta.kernels.ssm_verify import ssm_verify_update

__all__ = [
    "DecodeIndices",
    "causal_conv1d_update",
    "causal_conv1d_update_from_metadata",
    "conv_verify_update",
    "spec_commit",
    "spec_track_token",
    "ssm_state_update",
    "ssm_state_update_from_metadata",
    "ssm_verify_update",
    "track_save",
    "track_save_from_metadata",
]
