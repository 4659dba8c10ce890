"""The decode step of the runtime, built on the metadata layer and captured per bucket.

One decode step is a function of a :class:`~hybridmeta.model.Mamba2Metadata` (built by
``prepare_decode`` from a :class:`~hybridmeta.model.ForwardMetadata`) and two per-row
inputs (token ids and positions). It runs every layer and then saves the Mamba state of
rows flagged in ``mamba_track_mask`` into their ``mamba_track_indices`` slot: the decode
track-save whose stale static buffer was sglang #32555.

:class:`DecodeGraphs` captures that step per bucket with :class:`hybridmeta.graphs.GraphRunner`
over :class:`hybridmeta.graphs.StaticBuffers` (real CUDA graphs on a GPU, the dispatcher
emulation on the CPU), so the step only ever sees views of exactly ``B`` rows whose pad rows
carry slot ``-1``. :func:`decode_step` is the same function run eagerly on the live rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridmeta.graphs import GraphRunner, InputSpec, StaticBuffers
from hybridmeta.graphs.capture import GraphBackend
from hybridmeta.model import ForwardMetadata, Mamba2Metadata
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.plan import DecodeInputs
from hybridmeta.runtime.state import DUMMY_SLOT, StatePool

__all__ = ["DecodeGraphs", "decode_metadata", "decode_step"]


def decode_metadata(
    slots: torch.Tensor, track_slots: torch.Tensor, track_mask: torch.Tensor
) -> ForwardMetadata:
    """``ForwardMetadata`` of a decode-only step (one token per row), with its track plan.

    Parameters
    ----------
    slots : torch.Tensor
        ``[bs]`` int64 working slot per row.
    track_slots : torch.Tensor
        ``[bs]`` int64 track slot per row, ``-1`` where the row saves nothing.
    track_mask : torch.Tensor
        ``[bs]`` bool rows that save their state this step.
    """
    bs = slots.shape[0]
    return ForwardMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int64, device=slots.device),
        mamba_cache_indices=slots,
        mamba_track_indices=track_slots,
        mamba_track_mask=track_mask,
        has_mamba_track_mask=True,
    )


def _track_save(pool: StatePool, md: Mamba2Metadata, kernels: str) -> None:
    """Copy conv + SSM state of flagged rows, all Mamba layers, working slot -> track slot."""
    assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
    if kernels == "triton":
        from hybridmeta.kernels import track_save_from_metadata

        track_save_from_metadata(md, pool.conv, pool.ssm)
        return
    # fixed shapes: unflagged and pad rows copy the dummy slot onto itself
    ok = md.mamba_track_mask & (md.mamba_cache_indices >= 0) & (md.mamba_track_indices >= 0)
    src = torch.where(ok, md.mamba_cache_indices, DUMMY_SLOT)
    dst = torch.where(ok, md.mamba_track_indices, DUMMY_SLOT)
    for t in (pool.conv, pool.ssm):
        t.index_copy_(1, dst, t.index_select(1, src))


def decode_step(
    model: NemotronH,
    pool: StatePool,
    md: Mamba2Metadata,
    inputs: Mapping[str, torch.Tensor],
    *,
    kernels: str = "torch",
) -> dict[str, torch.Tensor]:
    """One decode forward of ``B`` rows (``md`` and ``inputs`` have exactly ``B`` rows).

    Returns ``{"logits": [B, V]}``; flagged rows' Mamba state is saved to their track slot.
    """
    with torch.no_grad():
        logits = model.forward_decode(
            DecodeInputs(
                input_ids=inputs["input_ids"],
                slots=md.mamba_cache_indices,
                positions=inputs["positions"],
                kernels=kernels,
            ),
            pool,
        )
        if md.has_mamba_track_mask:
            _track_save(pool, md, kernels)
    return {"logits": logits}


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
    kernels : {"torch", "triton"}
        Mamba decode ops captured in the graphs.
    """

    def __init__(
        self,
        model: NemotronH,
        pool: StatePool,
        *,
        max_bs: int,
        buckets: Sequence[int] | None = None,
        backend: GraphBackend | None = None,
        kernels: str = "torch",
    ) -> None:
        device = pool.conv.device
        self.model = model
        self.pool = pool
        self.kernels = kernels
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
            return decode_step(model, pool, md, ins, kernels=kernels)

        self.runner = GraphRunner(
            step,
            self.buffers,
            buckets=buckets,
            backend=backend,
        )

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
