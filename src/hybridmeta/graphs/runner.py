"""Capture one decode graph per batch-size bucket and replay it for padded steps.

Capture and replay take the same metadata path: :meth:`StaticBuffers.pad_all` /
:meth:`StaticBuffers.refresh` write the buffers in place and build the metadata through
``Mamba2Metadata.evolve_from`` over views of exactly ``B`` rows. The step function sees only
those views, so a kernel in it cannot reach rows past the bucket. The host plan (which
bucket, how many rows) comes from the step's own shapes; nothing on the replay path reads
device values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from hybridmeta.debug import debug_mode
from hybridmeta.graphs.buffers import StaticBuffers, bucket_for, default_buckets
from hybridmeta.graphs.capture import CapturedGraph, GraphBackend, default_backend
from hybridmeta.model import ForwardMetadata, Mamba2Metadata

__all__ = ["GraphRunner", "StepFn"]

#: A captured step: metadata and static input views (``B`` rows) -> per-row outputs.
StepFn = Callable[[Mamba2Metadata, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


class GraphRunner:
    """One captured graph per bucket; ``run`` pads ``bs`` to its bucket and replays.

    Parameters
    ----------
    step : StepFn
        ``step(metadata, inputs) -> outputs``. Reads only the given views, the state pools
        it closes over, and tensors it allocates; every output has ``B`` (per-row) or
        ``B * draft_token_num`` (per-token) leading rows.
    buffers : StaticBuffers
        The static buffers the graphs read.
    buckets : sequence of int, optional
        Captured batch sizes (default :func:`default_buckets`); the largest must be
        ``buffers.max_bs``.
    backend : GraphBackend, optional
        Default: real CUDA graphs on a CUDA device, the emulation elsewhere.
    warmup : int
        Eager runs (all rows padding) before each capture.
    """

    def __init__(
        self,
        step: StepFn,
        buffers: StaticBuffers,
        *,
        buckets: Sequence[int] | None = None,
        backend: GraphBackend | None = None,
        warmup: int = 1,
    ) -> None:
        chosen = (
            sorted(set(buckets)) if buckets is not None else list(default_buckets(buffers.max_bs))
        )
        if not chosen or chosen[0] < 1 or chosen[-1] != buffers.max_bs:
            raise ValueError(
                f"GraphRunner: buckets must be >= 1 and end at max_bs={buffers.max_bs}, got {chosen}"
            )
        self.step = step
        self.buffers = buffers
        self.buckets: tuple[int, ...] = tuple(chosen)
        self.backend = backend if backend is not None else default_backend(buffers.device)
        if self.backend.device != buffers.device:
            raise ValueError(
                f"GraphRunner: backend device {self.backend.device} != buffers device {buffers.device}"
            )
        self.warmup = warmup
        self._graphs: dict[int, CapturedGraph[Mapping[str, torch.Tensor]]] = {}
        self._captured_md: dict[int, Mamba2Metadata] = {}

    @property
    def captured(self) -> bool:
        """Whether every bucket has been captured."""
        return len(self._graphs) == len(self.buckets)

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool).

        Capture runs on metadata whose rows are all padding, so warm-up and the emulated
        capture (which executes the ops once) write no state.
        """
        for bucket in sorted(self.buckets, reverse=True):
            md = self.buffers.pad_all(bucket)
            views = self.buffers.views(bucket)

            def call(
                md: Mamba2Metadata = md, views: Mapping[str, torch.Tensor] = views
            ) -> Mapping[str, torch.Tensor]:
                return self.step(md, views)

            # Syncing debug checks inside the step (kernel ops check index ranges in debug
            # mode) cannot be captured; refresh runs its own debug checks outside the graph.
            with debug_mode(False):
                graph = self.backend.capture(call, warmup=self.warmup)
            self._check_outputs(bucket, graph.outputs)
            self._graphs[bucket] = graph
            self._captured_md[bucket] = md

    def _check_outputs(self, bucket: int, outputs: Mapping[str, torch.Tensor]) -> None:
        allowed = (bucket, bucket * self.buffers.draft_token_num)
        for name, t in outputs.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] not in allowed:
                raise ValueError(
                    f"GraphRunner: output {name!r} must be a tensor with {allowed[0]} (per row) or "
                    f"{allowed[1]} (per token) leading rows at bucket {bucket}"
                )

    def graph(self, bucket: int) -> CapturedGraph[Mapping[str, torch.Tensor]]:
        """The captured graph of ``bucket`` (to replay it alone, e.g. in a benchmark)."""
        if bucket not in self._graphs:
            raise KeyError(
                f"GraphRunner.graph: bucket {bucket} not captured; have {sorted(self._graphs)}"
            )
        return self._graphs[bucket]

    def bucket_for(self, bs: int) -> int:
        """The captured bucket that serves ``bs`` rows."""
        return bucket_for(self.buckets, bs)

    def run(
        self, step: ForwardMetadata, inputs: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Refresh the buffers for ``step``, replay its bucket's graph, return live outputs.

        Returns
        -------
        dict of str to torch.Tensor
            Views of the first ``bs`` (per-token: ``bs * draft_token_num``) rows of the
            graph outputs. They alias captured storage: the next ``run`` overwrites them.
        """
        if not self._graphs:
            raise RuntimeError("GraphRunner.run: call capture() first")
        bs = int(step.mamba_cache_indices.shape[0])
        if not 0 < bs <= self.buffers.max_bs:
            raise ValueError(
                f"GraphRunner.run: mamba_cache_indices has bs={bs} rows; need 0 < bs <= "
                f"max_bs={self.buffers.max_bs}"
            )
        bucket = self.bucket_for(bs)
        md = self.buffers.refresh(step, bucket, inputs)
        self._check_same_views(bucket, md)
        graph = self._graphs[bucket]
        graph.replay()
        draft = self.buffers.draft_token_num
        return {
            name: t[: bs if t.shape[0] == bucket else bs * draft]
            for name, t in graph.outputs.items()
        }

    def _check_same_views(self, bucket: int, md: Mamba2Metadata) -> None:
        # Replay must read the storage the graph captured (sglang #26019: rebuilt metadata
        # at replay left capture-time pointers behind). Identity of the cached views.
        captured = self._captured_md[bucket]
        if md is captured:  # outside debug mode refresh returns the captured object itself
            return
        for name in self.buffers.field_names:
            if getattr(md, name) is not getattr(captured, name):
                raise RuntimeError(
                    f"GraphRunner: refreshed {name} is not the view captured for bucket {bucket}"
                )
