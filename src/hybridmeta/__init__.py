"""hybridmeta: correct-by-construction metadata, CUDA-graph buffers and decode kernels for
hybrid Mamba2/attention inference engines."""

from hybridmeta._interpret import select_triton_mode

select_triton_mode()  # before any submodule imports triton


from hybridmeta.core import (  # noqa: E402
    BATCH,
    BOOL,
    FLOAT,
    INDEX,
    TOKENS,
    Conventions,
    Dim,
    FieldSpec,
    Pad,
    PadRule,
    Role,
    RowOrder,
    Rows,
    check_values,
    conventions_of,
    field,
    fields_of,
    is_derived,
    is_extension,
    metadata,
    source_of,
    specialized,
    tensor_field,
)
from hybridmeta.debug import debug_mode, is_debug  # noqa: E402
from hybridmeta.model import (  # noqa: E402
    ForwardMetadata,
    Mamba2Metadata,
    MixedMetadata,
    SpecCommitMetadata,
    prepare_commit,
    prepare_decode,
    prepare_target_verify,
)
from hybridmeta.planner import (  # noqa: E402
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
    "Conventions",
    "Dim",
    "FieldSpec",
    "ForwardMetadata",
    "Mamba2Metadata",
    "MixedHostPlan",
    "MixedMetadata",
    "Pad",
    "PadRule",
    "Role",
    "RowOrder",
    "Rows",
    "SpecCommitMetadata",
    "check_values",
    "conventions_of",
    "debug_mode",
    "field",
    "fields_of",
    "is_debug",
    "is_derived",
    "is_extension",
    "metadata",
    "plan_host",
    "plan_mixed_batch",
    "plan_verify",
    "prepare_commit",
    "prepare_decode",
    "prepare_target_verify",
    "source_of",
    "specialized",
    "tensor_field",
]
__version__ = "0.1.0"
