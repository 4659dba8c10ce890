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

With speculative decoding, :class:`VerifyGraphs` captures the two steps of a verify per
bucket ``(B, T)`` (``T`` draft tokens per row, every ``T`` up to the draft length captured
exactly): :meth:`~hybridmeta.runtime.model.NemotronH.forward_verify` over a target-verify
``Mamba2Metadata``, and the commit over a ``SpecCommitMetadata``, each over its own static
buffers declared from the metadata classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridmeta import kernels
from hybridmeta.core import TOKENS
from hybridmeta.graphs import GraphRunner, InputSpec, StaticBuffers
from hybridmeta.graphs.capture import GraphBackend
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, SpecCommitMetadata
from hybridmeta.runtime.model import NemotronH
from hybridmeta.runtime.state import StatePool

__all__ = ["DecodeGraphs", "VerifyGraphs"]


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


class VerifyGraphs:
    """Captured verify and commit steps, one of each per bucket ``(B, T)``.

    Parameters
    ----------
    model, pool
        The model and the slot pool (with its intermediate-state buffers, at least
        ``max_bs`` rows by ``max_draft`` tokens) the graphs read and write.
    max_bs : int
        Rows of the static buffers; the largest batch bucket.
    max_draft : int
        Tokens per row of the widest verify (pending token + draft); every ``T`` in
        ``1 .. max_draft`` is captured, so a step's ``T`` is always exact.
    buckets : sequence of int, optional
        Captured batch sizes (default :func:`hybridmeta.graphs.default_buckets`).
    backend : GraphBackend, optional
        Default: CUDA graphs on a CUDA device, the emulation elsewhere.
    """

    def __init__(
        self,
        model: NemotronH,
        pool: StatePool,
        *,
        max_bs: int,
        max_draft: int,
        buckets: Sequence[int] | None = None,
        backend: GraphBackend | None = None,
    ) -> None:
        device = pool.conv.device
        self.model = model
        self.pool = pool
        pool.verify_states(max_bs, max_draft)  # the intermediate buffers must fit
        common = {
            "max_bs": max_bs,
            "num_slots": pool.num_slots,
            "device": device,
            "max_draft": max_draft,
            "static": {"is_target_verify": True},
        }
        tokens = InputSpec(shape=(), dtype=torch.int64, rows=TOKENS, pad=0)
        self.verify_buffers = StaticBuffers(
            inputs={"input_ids": tokens, "positions": tokens},
            **common,  # type: ignore[arg-type]
        )
        self.commit_buffers = StaticBuffers(
            metadata_class=SpecCommitMetadata,
            **common,  # type: ignore[arg-type]
        )

        def verify(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            with torch.no_grad():
                return {
                    "logits": model.forward_verify(ins["input_ids"], ins["positions"], md, pool)
                }

        def commit(md: Mamba2Metadata, ins: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            assert isinstance(md, SpecCommitMetadata)
            inter_conv, inter_ssm = pool.verify_states(md.num_decodes, md.draft_token_num)
            kernels.spec_commit_from_metadata(md, pool.conv, pool.ssm, inter_conv, inter_ssm)
            return {}

        self.verify_runner = GraphRunner(
            verify, self.verify_buffers, buckets=buckets, backend=backend
        )
        self.commit_runner = GraphRunner(
            commit, self.commit_buffers, buckets=buckets, backend=backend
        )

    @property
    def backend_name(self) -> str:
        return self.verify_runner.backend.name

    @property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """Every captured ``(B, T)``."""
        r = self.verify_runner
        return tuple((b, t) for t in r.draft_buckets for b in r.buckets)

    def capture(self) -> None:
        """Capture every bucket of both steps (rows are all padding while capturing)."""
        self.verify_runner.capture()
        self.commit_runner.capture()

    def verify(
        self, fwd: ForwardMetadata, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Replay the verify of ``fwd``'s bucket; returns ``[bs * T, V]`` logits (aliasing
        the graph's output storage: the next ``verify`` overwrites them)."""
        out = self.verify_runner.run(fwd, {"input_ids": input_ids, "positions": positions})
        return out["logits"]

    def commit(self, cmd: SpecCommitMetadata) -> None:
        """Replay the commit of ``cmd``'s bucket."""
        self.commit_runner.run(cmd)
