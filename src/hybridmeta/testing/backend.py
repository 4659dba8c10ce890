"""The small typed protocol through which the replay harness drives a decode backend.

An engine wraps its CUDA-graph decode path in a :class:`GraphedDecodeBackend` subclass:
a handful of methods that say where the static buffers and the state pools are, how the
engine refreshes the buffers for one step, which function it captures per bucket, and its
own eager reference. Capture and replay belong to the harness, through
:mod:`hybridmeta.graphs.capture` (real CUDA graphs on a GPU, the CPU emulation elsewhere)
or through the backend's own :class:`~hybridmeta.graphs.capture.GraphBackend`.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hybridmeta.graphs.buffers import default_buckets
from hybridmeta.graphs.capture import GraphBackend, default_backend
from hybridmeta.testing.strategies import Batch

__all__ = ["GraphedDecodeBackend", "Reference"]


@dataclass(frozen=True)
class Reference:
    """What the backend's eager path computes for one step on its live rows alone.

    Attributes
    ----------
    pools : mapping of str to torch.Tensor
        The state pools after the step (new tensors; the inputs are left untouched).
    outputs : mapping of str to torch.Tensor
        Per-row outputs, ``bs`` (or ``bs * k``) leading rows.
    """

    pools: Mapping[str, torch.Tensor]
    outputs: Mapping[str, torch.Tensor]


class GraphedDecodeBackend(abc.ABC):
    """An engine's graphed decode step, as the replay harness sees it.

    The life cycle the harness drives::

        backend.prepare_capture(B); graph_B = capture(lambda: backend.forward(B))  # each bucket
        # then, for every step:
        poison every static buffer (whole buffer, from row 0)
        backend.refresh(batch, inputs, B)      # B = smallest bucket >= batch.bs
        graph_B.replay()
        compare graph_B.outputs[:bs] and the pools with backend.reference(...)

    Subclasses set :attr:`max_bs`, :attr:`num_slots` and :attr:`device` (class or instance
    attributes) and implement the abstract methods. Every static buffer must be allocated
    once, before capture, with ``max_bs`` rows (or ``max_bs * k``, or ``max_bs + 1``)
    along dimension 0.
    """

    #: Largest captured batch size; the static buffers have this many rows.
    max_bs: int
    #: Real slots of the state pools: rows ``[0, num_slots)`` are checked, rows past it are
    #: the backend's scratch (a trash row for pad writes, say).
    num_slots: int
    #: The device of the buffers and pools.
    device: torch.device
    #: ``(rtol, atol)`` between graph and reference; ``(0, 0)`` demands bit equality, which
    #: holds when the graph and the reference compute a live row the same way. torch's CPU
    #: elementwise transcendentals (``exp``, ``silu``, ``softplus``) and ``einsum`` do not
    #: promise that across tensor sizes (a vector body and a scalar tail), so a reference
    #: that runs them on ``bs`` rows against a graph on the bucket's rows needs an ulp-level
    #: tolerance. Slots no live row addresses are compared bit for bit whatever this is.
    tolerance: tuple[float, float] = (0.0, 0.0)

    @property
    def buckets(self) -> Sequence[int]:
        """Captured batch sizes, ascending, ending at :attr:`max_bs`."""
        return default_buckets(self.max_bs)

    def graph_backend(self) -> GraphBackend:
        """How to capture: real CUDA graphs on a CUDA device, the emulation elsewhere.

        Override to use the engine's own capture (a
        :class:`~hybridmeta.graphs.capture.GraphBackend` subclass).
        """
        return default_backend(self.device)

    @abc.abstractmethod
    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        """Every static buffer a captured graph reads, at full size, by name.

        The harness overwrites them (stale-tail fillers) before each refresh; a buffer's
        dimension 0 must be its row dimension.
        """

    @abc.abstractmethod
    def state_pools(self) -> Mapping[str, torch.Tensor]:
        """The state pools, slot along dimension 0, by name."""

    @abc.abstractmethod
    def make_inputs(self, batch: Batch, gen: torch.Generator) -> Mapping[str, torch.Tensor]:
        """The step's per-row float inputs (hidden states, ...), on the CPU."""

    @abc.abstractmethod
    def prepare_capture(self, bucket: int) -> None:
        """Write the static buffers as the engine does before capturing ``bucket``."""

    @abc.abstractmethod
    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        """The function captured for ``bucket``: reads the static buffers and pools,
        updates the pools, returns per-row outputs with ``bucket`` (or ``bucket * k``)
        leading rows."""

    @abc.abstractmethod
    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        """Write one step into the static buffers, as the engine does before replay."""

    @abc.abstractmethod
    def reference(
        self,
        pools: Mapping[str, torch.Tensor],
        batch: Batch,
        inputs: Mapping[str, torch.Tensor],
    ) -> Reference:
        """The engine's eager path on the live rows alone, from copies of ``pools``."""
