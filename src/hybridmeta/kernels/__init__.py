"""The op tree: every Mamba2 kernel of hybridmeta, decode and prefill, one module per op.

Each module holds its Triton implementation (where there is one), its ``torch.library``
op and fake, its public function with full argument checks, and beside them the one
pure-torch reference of that op (``*_reference``), which is also the CPU path. The
implementation is a property of the op call (``impl=``, or :func:`implementation`), never
of the caller's scheduling. Every op reads its slots and plans from the forward's
``Mamba2Metadata`` through its ``*_from_metadata`` entry (decode, verify) or its ``md``
argument (prefill); the commit after a verify reads a ``SpecCommitMetadata``.

Decode: :mod:`~hybridmeta.kernels.ssm_update`, :mod:`~hybridmeta.kernels.conv_update`,
:mod:`~hybridmeta.kernels.track_save`. Prefill: :mod:`~hybridmeta.kernels.conv_prefill`,
:mod:`~hybridmeta.kernels.ssd_scan`, :mod:`~hybridmeta.kernels.extend_track`. Speculative
verify: :mod:`~hybridmeta.kernels.ssm_verify`, :mod:`~hybridmeta.kernels.conv_verify`,
:mod:`~hybridmeta.kernels.spec_commit` (``docs/spec_decode.md``). The layer's norms:
:mod:`~hybridmeta.kernels.rms_norm`; the MLP's activation:
:mod:`~hybridmeta.kernels.activations`; one-row projections: :mod:`~hybridmeta.kernels.linear`. The shared math is :mod:`~hybridmeta.kernels._math`.

Slot ids: every op that takes them has ``pad_slot_id`` (default ``-1``; the
``*_from_metadata`` entries take the metadata's declared null slot). An id that is neither
the pad id nor a valid slot is handled on the device (the row writes nothing, its output
is NaN) and recorded in the device's error record, which :func:`check_errors` /
:func:`raise_if_faulted` read at a sync point (``docs/kernels.md``, "Pad ids, invalid ids
and the error record").

A Triton kernel launched on CPU tensors runs in the Triton interpreter, on CUDA tensors
compiled: decided per launch (:mod:`hybridmeta._interpret`), whatever the import order;
importing hybridmeta sets no environment variable.
"""

from __future__ import annotations

from hybridmeta.kernels._dispatch import Impl, implementation
from hybridmeta.kernels._errors import (
    KernelFault,
    SlotIndexError,
    check_errors,
    error_record,
    raise_if_faulted,
    reset_errors,
)
from hybridmeta.kernels._math import SSMParams, split_xbc
from hybridmeta.kernels.activations import relu_square, relu_square_reference
from hybridmeta.kernels.attention_decode import (
    decode_attention,
    decode_attention_reference,
    kv_cache_write,
    kv_cache_write_reference,
)
from hybridmeta.kernels.conv_prefill import ConvPrefillOutput, causal_conv1d_prefill
from hybridmeta.kernels.conv_update import (
    causal_conv1d_update,
    causal_conv1d_update_from_metadata,
    causal_conv1d_update_reference,
)
from hybridmeta.kernels.conv_verify import (
    conv_verify_update,
    conv_verify_update_from_metadata,
    conv_verify_update_reference,
)
from hybridmeta.kernels.extend_track import extend_track_save
from hybridmeta.kernels.linear import linear, linear_reference
from hybridmeta.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from hybridmeta.kernels.spec_commit import (
    spec_commit,
    spec_commit_from_metadata,
    spec_commit_reference,
    spec_track_token,
)
from hybridmeta.kernels.ssd_scan import (
    SSDScanOutput,
    ssd_chunked_scan,
    ssd_chunked_scan_reference,
)
from hybridmeta.kernels.ssm_update import (
    ssm_state_update,
    ssm_state_update_from_metadata,
    ssm_state_update_reference,
)
from hybridmeta.kernels.ssm_verify import (
    ssm_verify_update,
    ssm_verify_update_from_metadata,
    ssm_verify_update_reference,
)
from hybridmeta.kernels.track_save import (
    track_save,
    track_save_from_metadata,
    track_save_reference,
)

__all__ = [
    "ConvPrefillOutput",
    "Impl",
    "KernelFault",
    "SSDScanOutput",
    "SSMParams",
    "SlotIndexError",
    "add_rms_norm",
    "add_rms_norm_reference",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "causal_conv1d_update_from_metadata",
    "causal_conv1d_update_reference",
    "check_errors",
    "conv_verify_update",
    "conv_verify_update_from_metadata",
    "conv_verify_update_reference",
    "decode_attention",
    "decode_attention_reference",
    "error_record",
    "extend_track_save",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "implementation",
    "kv_cache_write",
    "kv_cache_write_reference",
    "linear",
    "linear_reference",
    "raise_if_faulted",
    "relu_square",
    "relu_square_reference",
    "reset_errors",
    "rms_norm",
    "rms_norm_reference",
    "spec_commit",
    "spec_commit_from_metadata",
    "spec_commit_reference",
    "spec_track_token",
    "split_xbc",
    "ssd_chunked_scan",
    "ssd_chunked_scan_reference",
    "ssm_state_update",
    "ssm_state_update_from_metadata",
    "ssm_state_update_reference",
    "ssm_verify_update",
    "ssm_verify_update_from_metadata",
    "ssm_verify_update_reference",
    "track_save",
    "track_save_from_metadata",
    "track_save_reference",
]
