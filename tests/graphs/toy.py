"""Small Mamba2-like decode steps that read the metadata, each with an eager oracle.

A step reads the metadata the way the Mamba2 decode layer does: the working slot of every
row (state update in place), the track mask and track slots (store the new state of
flagged rows into their track slot), and writes one output per row.

* :class:`ToyMamba`: pure torch. Pad rows (slot ``-1``) read a zero state and write into a
  trash row past the pool, so they touch no real slot.
* :class:`KernelMamba`: the Triton decode kernel of :mod:`hybridmeta.kernels` (a
  ``torch.library`` op, so the CPU emulation records it), compared with its pure-torch
  reference.

``defective=True`` reproduces sglang #32555: the track-save is handed the *whole* static
track buffer and takes its last ``num_decodes`` rows, which under a bucket smaller than
``max_bs`` are rows that were never refreshed.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import torch

from hybridmeta.graphs import InputSpec
from hybridmeta.model import Mamba2Metadata


def _track_rows(md: Mamba2Metadata, defective: bool, max_bs: int) -> torch.Tensor:
    track = md.mamba_track_indices
    assert track is not None
    if defective:
        # The defect: the whole max_bs buffer, then the last num_decodes rows.
        whole = torch.as_strided(track, (max_bs,), (1,), track.storage_offset())
        return whole[-md.num_decodes :]
    return track


class StepModel(abc.ABC):
    """A decode step over a state pool whose first ``num_slots`` rows are real slots."""

    #: Whether the graph must match the oracle bit for bit (else fp32 kernel tolerances).
    exact: bool = True

    def __init__(self, state: torch.Tensor, num_slots: int, *, defective: bool, max_bs: int):
        self.state = state
        self.num_slots = num_slots
        self.defective = defective
        self.max_bs = max_bs

    @property
    @abc.abstractmethod
    def input_specs(self) -> dict[str, InputSpec]:
        """Static per-row inputs of the step."""

    @abc.abstractmethod
    def step(
        self, md: Mamba2Metadata, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The captured step: returns ``{"y": [B, ...]}``."""

    @abc.abstractmethod
    def random_inputs(self, gen: torch.Generator, bs: int) -> dict[str, torch.Tensor]:
        """Live inputs of ``bs`` rows, on the CPU."""

    @abc.abstractmethod
    def oracle(
        self,
        pool: torch.Tensor,
        inputs: Mapping[str, torch.Tensor],
        slots: list[int],
        track: list[int],
        mask: list[bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager reference on the live rows alone (CPU): ``(expected pool, expected y)``."""


class ToyMamba(StepModel):
    """Pure torch: ``h' = h * decay + x``, ``y = sum(h' * c)``; pool ``[slots + 1, H, D]``."""

    def __init__(
        self,
        num_slots: int,
        heads: int,
        dim: int,
        *,
        gen: torch.Generator,
        device: torch.device,
        defective: bool = False,
        max_bs: int = 0,
    ) -> None:
        state = torch.randn(num_slots + 1, heads, dim, generator=gen).to(device)
        super().__init__(state, num_slots, defective=defective, max_bs=max_bs)
        self.decay = torch.rand(heads, generator=gen).to(device)
        self.c = torch.randn(heads, dim, generator=gen).to(device)
        self.heads, self.dim = heads, dim

    @property
    def input_specs(self) -> dict[str, InputSpec]:
        return {"x": InputSpec((self.heads, self.dim), torch.float32)}

    def step(
        self, md: Mamba2Metadata, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        x = inputs["x"]  # [B, H, D]
        trash = self.num_slots
        slots = md.mamba_cache_indices  # [B]
        valid = slots >= 0
        dst = torch.where(valid, slots, trash)
        h = self.state.index_select(0, dst) * valid[:, None, None]  # [B, H, D]
        h_new = h * self.decay[None, :, None] + x
        self.state.index_copy_(0, dst, h_new)
        assert md.mamba_track_mask is not None
        track = _track_rows(md, self.defective, self.max_bs)
        flag = md.mamba_track_mask & valid & (track >= 0)
        self.state.index_copy_(0, torch.where(flag, track, trash), h_new)
        return {"y": (h_new * self.c[None]).sum(-1)}  # [B, H]

    def random_inputs(self, gen: torch.Generator, bs: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(bs, self.heads, self.dim, generator=gen)}

    def oracle(
        self,
        pool: torch.Tensor,
        inputs: Mapping[str, torch.Tensor],
        slots: list[int],
        track: list[int],
        mask: list[bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pool = pool.clone()
        decay, c = self.decay.cpu(), self.c.cpu()
        ys = []
        for i, slot in enumerate(slots):  # one row at a time: the oracle, not the hot path
            h_new = pool[slot] * decay[:, None] + inputs["x"][i]
            pool[slot] = h_new
            if mask[i]:
                pool[track[i]] = h_new
            ys.append((h_new * c).sum(-1))
        return pool, torch.stack(ys)


class KernelMamba(StepModel):
    """The Triton SSM decode update with fused track-save; pool ``[slots, H, P, N]``."""

    exact = False

    def __init__(
        self,
        num_slots: int,
        heads: int,
        headdim: int,
        dstate: int,
        *,
        gen: torch.Generator,
        device: torch.device,
        defective: bool = False,
        max_bs: int = 0,
    ) -> None:
        state = torch.randn(num_slots, heads, headdim, dstate, generator=gen).to(device)
        super().__init__(state, num_slots, defective=defective, max_bs=max_bs)
        self.A = (-torch.rand(heads, generator=gen) - 0.1).to(device)
        self.D = torch.randn(heads, generator=gen).to(device)
        self.heads, self.headdim, self.dstate = heads, headdim, dstate

    @property
    def input_specs(self) -> dict[str, InputSpec]:
        f32 = torch.float32
        return {
            "x": InputSpec((self.heads, self.headdim), f32),
            "dt": InputSpec((self.heads,), f32),
            "B": InputSpec((1, self.dstate), f32),
            "C": InputSpec((1, self.dstate), f32),
        }

    def step(
        self, md: Mamba2Metadata, inputs: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        # Imported here: the pure-torch variants must not depend on the kernels package.
        from hybridmeta.kernels import ssm_state_update

        assert md.mamba_track_mask is not None
        y = ssm_state_update(
            self.state,
            inputs["x"],
            inputs["dt"],
            self.A,
            inputs["B"],
            inputs["C"],
            state_indices=md.mamba_cache_indices,
            D=self.D,
            track_indices=_track_rows(md, self.defective, self.max_bs),
            track_mask=md.mamba_track_mask,
            impl="triton",  # the kernel under test (the interpreter on the CPU)
        )
        return {"y": y}  # [B, H, P]

    def random_inputs(self, gen: torch.Generator, bs: int) -> dict[str, torch.Tensor]:
        return {
            "x": torch.randn(bs, self.heads, self.headdim, generator=gen),
            "dt": torch.rand(bs, self.heads, generator=gen),
            "B": torch.randn(bs, 1, self.dstate, generator=gen),
            "C": torch.randn(bs, 1, self.dstate, generator=gen),
        }

    def oracle(
        self,
        pool: torch.Tensor,
        inputs: Mapping[str, torch.Tensor],
        slots: list[int],
        track: list[int],
        mask: list[bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from tests.kernels._support import ssm_state_update_ref

        return ssm_state_update_ref(
            pool,
            inputs["x"],
            inputs["dt"],
            self.A.cpu(),
            inputs["B"],
            inputs["C"],
            torch.tensor(slots),
            D=self.D.cpu(),
            track_indices=torch.tensor(track),
            track_mask=torch.tensor(mask),
        )
