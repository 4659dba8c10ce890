"""hybridmeta: correct-by-construction metadata, CUDA-graph buffers and decode kernels for
hybrid Mamba2/attention inference engines.

The names below are loaded on first use (PEP 562 ``__getattr__``), so ``import hybridmeta``
and the tools that need none of them (``hybridmeta audit``, a static check) start without
importing torch. Nothing is set in the process either way: Triton kernels choose the
interpreter per launch (:mod:`hybridmeta._interpret`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridmeta.core import (
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
    from hybridmeta.debug import (
        debug_mode,
        is_debug,
    )
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

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "BATCH": "hybridmeta.core",
    "BOOL": "hybridmeta.core",
    "FLOAT": "hybridmeta.core",
    "INDEX": "hybridmeta.core",
    "TOKENS": "hybridmeta.core",
    "Conventions": "hybridmeta.core",
    "Dim": "hybridmeta.core",
    "FieldSpec": "hybridmeta.core",
    "ForwardMetadata": "hybridmeta.model",
    "Mamba2Metadata": "hybridmeta.model",
    "MixedHostPlan": "hybridmeta.planner",
    "MixedMetadata": "hybridmeta.model",
    "Pad": "hybridmeta.core",
    "PadRule": "hybridmeta.core",
    "Role": "hybridmeta.core",
    "RowOrder": "hybridmeta.core",
    "Rows": "hybridmeta.core",
    "SpecCommitMetadata": "hybridmeta.model",
    "check_values": "hybridmeta.core",
    "conventions_of": "hybridmeta.core",
    "debug_mode": "hybridmeta.debug",
    "field": "hybridmeta.core",
    "fields_of": "hybridmeta.core",
    "is_debug": "hybridmeta.debug",
    "is_derived": "hybridmeta.core",
    "is_extension": "hybridmeta.core",
    "metadata": "hybridmeta.core",
    "plan_host": "hybridmeta.planner",
    "plan_mixed_batch": "hybridmeta.planner",
    "plan_verify": "hybridmeta.planner",
    "prepare_commit": "hybridmeta.model",
    "prepare_decode": "hybridmeta.model",
    "prepare_target_verify": "hybridmeta.model",
    "source_of": "hybridmeta.core",
    "specialized": "hybridmeta.core",
    "tensor_field": "hybridmeta.core",
}

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


if not TYPE_CHECKING:  # hidden from type checkers, so a misspelt name stays an error there

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'hybridmeta' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
