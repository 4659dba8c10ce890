"""The adapter that lets :func:`hybridmeta.testing.check_replay` drive the legacy engine.

This is all an engine developer writes: where the static buffers and the pool are, how
the engine's runner refreshes and what it captures, and the engine's eager path.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from examples.legacy_engine.engine import MambaDecodeEngine
from examples.legacy_engine.metadata import Mamba2Metadata, prepare_decode_dropping
from hybridmeta.testing import Batch, GraphedDecodeBackend, Reference


class LegacyEngineBackend(GraphedDecodeBackend):
    """:class:`MambaDecodeEngine` through the replay harness's protocol."""

    def __init__(self, engine: MambaDecodeEngine) -> None:
        self.engine = engine
        self.max_bs = engine.max_bs
        self.num_slots = engine.num_slots
        self.device = engine.device
        self._md: dict[int, Mamba2Metadata] = {}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        e = self.engine
        return {
            "query_start_loc": e.query_start_loc,
            "cache_indices": e.cache_indices,
            "track_indices": e.track_indices,
            "track_mask": e.track_mask,
            "hidden": e.hidden,
        }

    def state_pools(self) -> Mapping[str, torch.Tensor]:
        return {"ssm": self.engine.ssm_state}

    def make_inputs(self, batch: Batch, gen: torch.Generator) -> Mapping[str, torch.Tensor]:
        e = self.engine
        return {"hidden": torch.randn(batch.bs, e.heads, e.dim, generator=gen)}

    def prepare_capture(self, bucket: int) -> None:
        e = self.engine
        e.replay_prepare([], [], [], torch.zeros(0, e.heads, e.dim), bucket)
        self._md[bucket] = e.capture_metadata(bucket)

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        return {"y": self.engine.mamba_decode(self._md[bucket], self.engine.hidden[:bucket])}

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        self.engine.replay_prepare(
            batch.slots, batch.track_slots, batch.track_mask, inputs["hidden"], bucket
        )

    def reference(
        self, pools: Mapping[str, torch.Tensor], batch: Batch, inputs: Mapping[str, torch.Tensor]
    ) -> Reference:
        eager = self.engine.with_state(pools["ssm"])
        y = eager.forward_eager(batch.slots, batch.track_slots, batch.track_mask, inputs["hidden"])
        return Reference(pools={"ssm": eager.ssm_state}, outputs={"y": y})


def stale_tail_backend() -> LegacyEngineBackend:
    """Version (a): seed defect 1, the whole track buffer reaches the track-save."""
    return LegacyEngineBackend(MambaDecodeEngine(hand_whole_track_buffer=True))


def dropped_field_backend() -> LegacyEngineBackend:
    """Version (b): seed defect 2, the constructor drops ``has_mamba_track_mask``."""
    return LegacyEngineBackend(MambaDecodeEngine(prepare_decode=prepare_decode_dropping))


def fixed_backend() -> LegacyEngineBackend:
    """Both defects fixed."""
    return LegacyEngineBackend(MambaDecodeEngine())
