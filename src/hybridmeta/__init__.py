"""hybridmeta: correct-by-construction metadata, CUDA-graph buffers and decode kernels for
hybrid Mamba2/attention inference engines."""

from hybridmeta.core import (
    BATCH,
    BOOL,
    FLOAT,
    INDEX,
    TOKENS,
    Dim,
    FieldSpec,
    Pad,
    PadRule,
    Role,
    Rows,
    check_values,
    field,
    fields_of,
    is_derived,
    metadata,
    source_of,
    tensor_field,
)
from hybridmeta.debug import debug_mode, is_debug
from hybridmeta.model import (
    ForwardMetadata,
    Mamba2Metadata,
    MixedMetadata,
    SpecCommitMetadata,
    prepare_commit,
    prepare_decode,
    prepare_target_verify,
)
from hybridmeta.planner import (
    MixedHostPlan,
    plan_host,
    plan_mixed_batch,
    plan_verify,
)

__all__ = [
    "BATCH",
    "BOOL",
    "FLOAT",
    "INDEX",
    "TOKENS",
    "Dim",
    "FieldSpec",
    "ForwardMetadata",
    "Mamba2Metadata",
    "MixedHostPlan",
    "MixedMetadata",
    "Pad",
    "PadRule",
    "Role",
    "Rows",
    "SpecCommitMetadata",
    "check_values",
    "debug_mode",
    "field",
    "fields_of",
    "is_debug",
    "is_derived",
    "metadata",
    "plan_host",
    "plan_mixed_batch",
    "plan_verify",
    "prepare_commit",
    "prepare_decode",
    "prepare_target_verify",
    "source_of",
    "tensor_field",
]
__version__ = "0.1.0"
