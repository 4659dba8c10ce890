"""The legacy engine's Mamba2-like decode layer and its CUDA-graph runner, in plain torch.

State update per live row (slot ``s``; pad rows carry ``-1`` and touch only a trash row
past the pool): ``h = ssm_state[s] * decay + hidden``, ``y = sum(h * c)``; rows flagged in
``mamba_track_mask`` also store ``h`` into their track slot (the prefix cache).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from examples.legacy_engine.metadata import ForwardMetadata, Mamba2Metadata, prepare_decode

PrepareDecode = Callable[[ForwardMetadata], Mamba2Metadata]


class MambaDecodeEngine:
    """One Mamba2-like layer with its state pool and static graph buffers.

    Parameters
    ----------
    max_bs : int
        Largest captured batch; every static buffer has ``max_bs`` rows.
    num_slots : int
        Slots of the state pool (one more trash row is allocated past them).
    prepare_decode : callable
        The ``ForwardMetadata -> Mamba2Metadata`` constructor the engine uses.
    hand_whole_track_buffer : bool
        Seed defect 1: give the metadata the whole ``max_bs`` track buffer instead of the
        bucket's rows.
    """

    def __init__(
        self,
        *,
        max_bs: int = 4,
        num_slots: int = 10,
        heads: int = 2,
        dim: int = 3,
        device: torch.device | str = "cpu",
        seed: int = 0,
        prepare_decode: PrepareDecode = prepare_decode,
        hand_whole_track_buffer: bool = False,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        dev = torch.device(device)
        self.max_bs, self.num_slots, self.heads, self.dim = max_bs, num_slots, heads, dim
        self.device = dev
        self.prepare_decode = prepare_decode
        self.hand_whole_track_buffer = hand_whole_track_buffer
        self.ssm_state = torch.randn(num_slots + 1, heads, dim, generator=gen).to(dev)  # [S+1, H, D]
        self.decay = torch.rand(heads, generator=gen).to(dev)  # [H]
        self.c = torch.randn(heads, dim, generator=gen).to(dev)  # [H, D]
        # Static CUDA-graph buffers: allocated once, max_bs rows, zero-filled.
        i32 = torch.int32
        self.query_start_loc = torch.zeros(max_bs + 1, dtype=i32, device=dev)
        self.cache_indices = torch.zeros(max_bs, dtype=i32, device=dev)
        self.track_indices = torch.zeros(max_bs, dtype=i32, device=dev)
        self.track_mask = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        self.hidden = torch.zeros(max_bs, heads, dim, device=dev)

    # ------------------------------------------------------------------ the layer

    def mamba_decode(self, md: Mamba2Metadata, hidden: torch.Tensor) -> torch.Tensor:
        """The decode layer (eager and captured alike). ``hidden``: ``[bs, H, D]``."""
        trash = self.num_slots
        slots = md.mamba_cache_indices.long()  # [bs]
        live = slots >= 0
        dst = torch.where(live, slots, trash)
        h = self.ssm_state.index_select(0, dst) * live[:, None, None]  # [bs, H, D]
        h_new = h * self.decay[None, :, None] + hidden
        self.ssm_state.index_copy_(0, dst, h_new)
        if md.has_mamba_track_mask:
            self.track_save(md, h_new, live)
        return (h_new * self.c[None]).sum(-1)  # [bs, H]

    def track_save(self, md: Mamba2Metadata, h_new: torch.Tensor, live: torch.Tensor) -> None:
        """Save flagged decode rows' new state into their track slots."""
        assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
        # Decode rows come last in a mixed batch: take the last num_decodes entries.
        track = md.mamba_track_indices[-md.num_decodes :].long()
        mask = md.mamba_track_mask[-md.num_decodes :]
        flag = mask & live[-md.num_decodes :] & (track >= 0)
        dst = torch.where(flag, track, self.num_slots)
        self.ssm_state.index_copy_(0, dst, h_new[-md.num_decodes :])

    # ------------------------------------------------------------------ eager path

    def forward_eager(
        self, slots: Sequence[int], track: Sequence[int], mask: Sequence[bool], hidden: torch.Tensor
    ) -> torch.Tensor:
        """One eager decode step on exactly ``len(slots)`` rows."""
        dev, bs = self.device, len(slots)
        fwd = ForwardMetadata(
            query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=dev),
            mamba_cache_indices=torch.tensor(list(slots), dtype=torch.int32, device=dev),
            mamba_track_indices=torch.tensor(list(track), dtype=torch.int32, device=dev),
            mamba_track_mask=torch.tensor(list(mask), dtype=torch.bool, device=dev),
            has_mamba_track_mask=any(mask),
        )
        return self.mamba_decode(self.prepare_decode(fwd), hidden.to(dev))

    def with_state(self, ssm_state: torch.Tensor) -> MambaDecodeEngine:
        """A copy sharing weights and buffers but running on ``ssm_state``."""
        other = copy.copy(self)
        other.ssm_state = ssm_state
        return other

    # ------------------------------------------------------------------ graph runner

    def capture_metadata(self, bucket: int) -> Mamba2Metadata:
        """The metadata a graph of ``bucket`` rows is captured with (views of the buffers)."""
        track = self.track_indices if self.hand_whole_track_buffer else self.track_indices[:bucket]
        fwd = ForwardMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            mamba_cache_indices=self.cache_indices[:bucket],
            mamba_track_indices=track,
            mamba_track_mask=self.track_mask[:bucket],
            has_mamba_track_mask=True,  # the graph serves tracking steps: rows are masked
        )
        return self.prepare_decode(fwd)

    def replay_prepare(
        self,
        slots: Sequence[int],
        track: Sequence[int],
        mask: Sequence[bool],
        hidden: torch.Tensor,
        bucket: int,
    ) -> None:
        """Write a step's rows into the static buffers and pad rows ``[bs:bucket)``."""
        dev, bs = self.device, len(slots)
        self.query_start_loc[: bs + 1] = torch.arange(bs + 1, dtype=torch.int32, device=dev)
        self.query_start_loc[bs + 1 : bucket + 1] = bs
        self.cache_indices[:bs] = torch.tensor(list(slots), dtype=torch.int32, device=dev)
        self.cache_indices[bs:bucket] = -1
        self.track_indices[:bs] = torch.tensor(list(track), dtype=torch.int32, device=dev)
        self.track_indices[bs:bucket] = -1
        self.track_mask[:bs] = torch.tensor(list(mask), dtype=torch.bool, device=dev)
        self.track_mask[bs:bucket] = False
        self.hidden[:bs] = hidden.to(dev)
        self.hidden[bs:bucket] = 0.0
