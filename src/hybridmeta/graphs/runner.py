"""Capture one graph per bucket ``(B, T)`` and replay it for padded steps.

``B`` is the batch-size bucket, ``T`` the draft-length bucket of a speculative verify (or
commit) step; a decode step has ``T = 1``. Capture and replay take the same metadata path:
:meth:`StaticBuffers.pad_all` / :meth:`StaticBuffers.refresh` write the buffers in place
and build the metadata through ``evolve_from`` over views of exactly ``B`` rows and ``T``
draft columns. The step function sees only those views, so a kernel in it cannot reach rows
or columns past the bucket. The host plan (which bucket, how many rows and columns) comes
from the step's own shapes; nothing on the replay path reads device values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from hybridmeta.debug import debug_mode
from hybridmeta.graphs.buffers import Bucket, StaticBuffers, bucket_for, default_buckets
from hybridmeta.graphs.capture import CapturedGraph, GraphBackend, default_backend
from hybridmeta.model import ForwardMetadata, Mamba2Metadata

__all__ = ["GraphRunner", "StepFn"]

#: A captured step: metadata and static input views (``B`` rows, ``B * T`` per token) ->
#: per-row (``B``) or per-token (``B * T``) outputs.
StepFn = Callable[[Mamba2Metadata, Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


class GraphRunner:
    """One captured graph per bucket ``(B, T)``; ``run`` pads the step to the smallest one
    that fits and replays it.

    Parameters
    ----------
    step : StepFn
        ``step(metadata, inputs) -> outputs``. Reads only the given views, the state it
        closes over (pools, intermediate-state buffers, sliced with the metadata's own
        ``B`` and ``T``), and tensors it allocates; every output has ``B`` (per-row) or
        ``B * T`` (per-token) leading rows.
    buffers : StaticBuffers
        The static buffers the graphs read.
    buckets : sequence of int, optional
        Captured batch sizes (default :func:`default_buckets`); the largest must be
        ``buffers.max_bs``.
    draft_buckets : sequence of int, optional
        Captured draft lengths ``T`` (default: every ``T`` in ``1 .. buffers.max_draft``,
        so each step's ``T`` is exact and no draft column is ever padded); the largest must
        be ``buffers.max_draft``. A step with ``t`` columns replays the smallest ``T >= t``
        and its columns ``[t:T)`` are padded from the declarations.
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
        draft_buckets: Sequence[int] | None = None,
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
        drafts = (
            sorted(set(draft_buckets))
            if draft_buckets is not None
            else list(range(1, buffers.max_draft + 1))
        )
        if not drafts or drafts[0] < 1 or drafts[-1] != buffers.max_draft:
            raise ValueError(
                f"GraphRunner: draft_buckets must be >= 1 and end at max_draft="
                f"{buffers.max_draft}, got {drafts}"
            )
        self.step = step
        self.buffers = buffers
        self.buckets: tuple[int, ...] = tuple(chosen)
        self.draft_buckets: tuple[int, ...] = tuple(drafts)
        self.backend = backend if backend is not None else default_backend(buffers.device)
        if self.backend.device != buffers.device:
            raise ValueError(
                f"GraphRunner: backend device {self.backend.device} != buffers device {buffers.device}"
            )
        self.warmup = warmup
        self._graphs: dict[Bucket, CapturedGraph[Mapping[str, torch.Tensor]]] = {}
        self._captured_md: dict[Bucket, Mamba2Metadata] = {}
        self._complete = False
        # (bucket, error) of a capture() that failed part way; cleared by the next capture().
        self._capture_error: tuple[Bucket, str] | None = None

    @property
    def captured(self) -> bool:
        """Whether every bucket has been captured (by the last :meth:`capture`, which did
        not fail)."""
        return self._complete

    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool).

        Capture runs on metadata whose rows are all padding, so warm-up and the emulated
        capture (which executes the ops once) write no state. A capture that fails part way
        leaves the runner with no graph: :meth:`run` and :meth:`graph` then refuse, naming
        the bucket and the error, until a later ``capture()`` succeeds.
        """
        self._graphs, self._captured_md = {}, {}
        self._complete, self._capture_error = False, None
        graphs: dict[Bucket, CapturedGraph[Mapping[str, torch.Tensor]]] = {}
        captured_md: dict[Bucket, Mamba2Metadata] = {}
        key: Bucket = (self.buckets[-1], self.draft_buckets[-1])
        try:
            for cols in sorted(self.draft_buckets, reverse=True):
                for rows in sorted(self.buckets, reverse=True):
                    key = (rows, cols)
                    md = self.buffers.pad_all(key)
                    views = self.buffers.views(key)

                    def call(
                        md: Mamba2Metadata = md, views: Mapping[str, torch.Tensor] = views
                    ) -> Mapping[str, torch.Tensor]:
                        return self.step(md, views)

                    # Syncing debug checks inside the step (kernel ops check index ranges
                    # in debug mode) cannot be captured; refresh runs its own outside.
                    with debug_mode(False):
                        graph = self.backend.capture(call, warmup=self.warmup)
                    self._check_outputs(key, graph.outputs)
                    graphs[key] = graph
                    captured_md[key] = md
        except BaseException as e:
            self._capture_error = (key, f"{type(e).__name__}: {e}")
            raise
        self._graphs, self._captured_md = graphs, captured_md
        self._complete = True

    def _refuse_incomplete(self, where: str) -> RuntimeError:
        if self._capture_error is not None:
            key, error = self._capture_error
            return RuntimeError(
                f"{where}: the last capture() failed at bucket {key} ({error}); a runner "
                "without every bucket's graph refuses to run (nothing was written); fix the "
                "cause and call capture() again"
            )
        return RuntimeError(f"{where}: call capture() first")

    def _check_outputs(self, key: Bucket, outputs: Mapping[str, torch.Tensor]) -> None:
        rows, cols = key
        allowed = (rows, rows * cols)
        for name, t in outputs.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] not in allowed:
                raise ValueError(
                    f"GraphRunner: output {name!r} must be a tensor with {allowed[0]} (per row) or "
                    f"{allowed[1]} (per token) leading rows at bucket {key}"
                )

    def graph(
        self, bucket: int, draft: int | None = None
    ) -> CapturedGraph[Mapping[str, torch.Tensor]]:
        """The captured graph of ``(bucket, draft)`` (default ``draft``: the widest), e.g.
        to replay it alone in a benchmark.

        Its ``replay()`` refuses (``RuntimeError``, nothing replayed) unless the buffers
        hold exactly this bucket (:attr:`StaticBuffers.refreshed_bucket`: the last
        ``buffers.refresh(step, bucket)`` or ``run`` was for it): any other bucket's graph
        would read rows another step left behind. Replaying it again after its refresh
        re-applies the same step (a benchmark's loop)."""
        if not self._complete:
            raise self._refuse_incomplete("GraphRunner.graph")
        key = (bucket, draft if draft is not None else self.draft_buckets[-1])
        if key not in self._graphs:
            raise KeyError(
                f"GraphRunner.graph: bucket {key} not captured; have {sorted(self._graphs)}"
            )
        return _BucketGraph(self, key, self._graphs[key])

    def bucket_for(self, bs: int) -> int:
        """The captured batch-size bucket that serves ``bs`` rows."""
        return bucket_for(self.buckets, bs)

    def draft_bucket_for(self, t: int) -> int:
        """The captured draft-length bucket that serves ``t`` draft columns."""
        if t > self.draft_buckets[-1]:
            raise ValueError(
                f"GraphRunner: draft_token_num={t} exceeds the largest captured draft bucket "
                f"{self.draft_buckets[-1]}"
            )
        return bucket_for(self.draft_buckets, t)

    def run(
        self, step: ForwardMetadata, inputs: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Refresh the buffers for ``step``, replay its bucket's graph, return live outputs.

        Returns
        -------
        dict of str to torch.Tensor
            The first ``bs`` rows of each per-row output and the ``bs * t`` live tokens of
            each per-token output. Views of captured storage (the next ``run`` overwrites
            them), except per-token outputs of a step whose ``t`` was padded to a wider
            bucket: those are gathered into a new tensor.
        """
        if not self._complete:
            raise self._refuse_incomplete("GraphRunner.run")
        if not isinstance(step, ForwardMetadata):
            raise TypeError(
                f"GraphRunner.run: step must be a ForwardMetadata (or the buffers' metadata "
                f"class), got {type(step).__qualname__}"
            )
        bs = int(step.mamba_cache_indices.shape[0])
        if not 0 < bs <= self.buffers.max_bs:
            raise ValueError(
                f"GraphRunner.run: mamba_cache_indices has bs={bs} rows; need 0 < bs <= "
                f"max_bs={self.buffers.max_bs}"
            )
        t = self.buffers.draft_columns(step)
        key = (self.bucket_for(bs), self.draft_bucket_for(t))
        md = self.buffers.refresh(step, key, inputs)
        self._check_same_views(key, md)
        graph = self._graphs[key]
        graph.replay()
        rows, cols = key
        out: dict[str, torch.Tensor] = {}
        for name, o in graph.outputs.items():
            if o.shape[0] == rows:
                out[name] = o[:bs]
            elif cols == t:
                out[name] = o[: bs * t]
            else:
                out[name] = o.view(rows, cols, *o.shape[1:])[:bs, :t].reshape(bs * t, *o.shape[1:])
        return out

    def _check_same_views(self, key: Bucket, md: Mamba2Metadata) -> None:
        # Replay must read the storage the graph captured (sglang #26019: rebuilt metadata
        # at replay left capture-time pointers behind). Identity of the cached views.
        captured = self._captured_md[key]
        if md is captured:  # outside debug mode refresh returns the captured object itself
            return
        for name in self.buffers.field_names:
            if getattr(md, name) is not getattr(captured, name):
                raise RuntimeError(
                    f"GraphRunner: refreshed {name} is not the view captured for bucket {key}"
                )


class _BucketGraph(CapturedGraph[Mapping[str, torch.Tensor]]):
    """A captured bucket as :meth:`GraphRunner.graph` hands it out: it replays only while
    the buffers hold its bucket, and only while it is the runner's current graph."""

    def __init__(
        self, runner: GraphRunner, key: Bucket, graph: CapturedGraph[Mapping[str, torch.Tensor]]
    ) -> None:
        super().__init__(graph.outputs)
        self._runner = runner
        self._key = key
        self._graph = graph

    def replay(self) -> None:
        runner, key = self._runner, self._key
        where = f"GraphRunner.graph{key}.replay"
        if not runner._complete:
            raise runner._refuse_incomplete(where)
        if runner._graphs.get(key) is not self._graph:
            raise RuntimeError(
                f"{where}: this graph belongs to an earlier capture(); take the current one "
                "from runner.graph(...)"
            )
        held = runner.buffers.refreshed_bucket
        if held != key:
            now = (
                "no complete bucket (nothing refreshed since capture, or a write failed)"
                if held is None
                else f"bucket {held}"
            )
            raise RuntimeError(
                f"{where}: the static buffers hold {now}, not {key}: this graph would read "
                f"rows that no refresh for it wrote (another step's slots and inputs); call "
                f"buffers.refresh(step, {key}) first, or runner.run(step), which refreshes the "
                "bucket it replays"
            )
        self._graph.replay()
