"""The runtime's decode step, captured per bucket over the static graph buffers.

One decode step is :meth:`~hybridmeta.runtime.model.NemotronH.forward_decode` of a
:class:`~hybridmeta.model.Mamba2Metadata` and two per-row inputs (token ids and
positions); it ends with the forward's track-save, which reads ``mamba_track_mask`` /
``mamba_track_indices`` (the decode track-save whose stale static buffer was sglang
#32555).

:class:`DecodeGraphs` captures that step per bucket with :class:`hybridmeta.graphs.GraphRunner`
over :class:`hybridmeta.graphs.StaticBuffers` (real CUDA graphs on a GPU, the dispatcher
emulation on the CPU), so the step only ever sees views of exactly ``B`` rows whose pad rows
carry slot ``-1``. Run eagerly, the same function takes the planner's metadata of the live
rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridmeta.graphs import GraphRunner, InputSpec, StaticBuffers
from hybridmeta.graphs.capture import GraphBackend
from hybridmeta.model import ForwardMetadata, Mamba2Metadata
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.state import StatePool

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    """Captured decode steps, one per bucket, over :class:`hybridmeta.graphs.StaticBuffers`.

    Parameters
    ----------
    model, pool
        The model and the slot pool the graphs read and write (their storage must
        outlive the graphs and never be reallocated).
    max_bs : int
        Rows of the static buffers; the largest bucket.
    buckets : sequence of int, optional
        Captured batch sizes (default :func:`hybridmeta.graphs.default_buckets`: powers of
        two below ``max_bs``, then ``max_bs``).
    backend : GraphBackend, optional
        Default: CUDA graphs on a CUDA device, the emulation elsewhere.
    """

    def __init__(
        self,
        model: NemotronH,
        pool: StatePool,
        *,
        max_bs: int,
        buckets: Sequence[int] | None = None,
        backend: GraphBackend | None = None,
    ) -> None:
        device = pool.conv.device
        self.model = model
        self.pool = pool
        self.buffers = StaticBuffers(
            max_bs=max_bs,
            num_slots=pool.num_slots,
            device=device,
            inputs={
                "input_ids": InputSpec(shape=(), dtype=torch.int64, pad=0),
                "positions": InputSpec(shape=(), dtype=torch.int64, pad=0),
            },
        )

        def step(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            with torch.no_grad():
                return {
                    "logits": model.forward_decode(ins["input_ids"], ins["positions"], md, pool)
                }

        self.runner = GraphRunner(step, self.buffers, buckets=buckets, backend=backend)

    @property
    def backend_name(self) -> str:
        return self.runner.backend.name

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.runner.buckets

    def capture(self) -> None:
        """Capture every bucket (rows are all padding while capturing)."""
        self.runner.capture()

    def run(
        self,
        fwd: ForwardMetadata,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Replay the bucket of ``fwd``'s rows; returns ``[bs, V]`` logits.

        The returned tensor aliases the graph's output storage: the next ``run``
        overwrites it.
        """
        out = self.runner.run(fwd, {"input_ids": input_ids, "positions": positions})
        return out["logits"]
