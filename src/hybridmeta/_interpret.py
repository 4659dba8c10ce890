"""Choose how Triton kernels run: compiled on a CUDA device, interpreted without one.

Triton decides at ``@triton.jit`` time (and decorates its own library functions at its
import) whether kernels are interpreted, from ``TRITON_INTERPRET``. hybridmeta's package
``__init__`` calls :func:`select_triton_mode` before any submodule imports triton.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch


def select_triton_mode() -> None:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device exists and the user chose nothing."""
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return
    if "triton" in sys.modules:
        # Triton's own library functions (tl.sum, ...) were decorated in compiled mode at
        # its import: interpreted kernels calling them would fail.
        warnings.warn(
            "hybridmeta: no CUDA device and triton was imported before TRITON_INTERPRET was "
            "set; set TRITON_INTERPRET=1 (or import hybridmeta) before importing triton so "
            "the kernels can run under the interpreter",
            RuntimeWarning,
            stacklevel=3,
        )
    os.environ["TRITON_INTERPRET"] = "1"
