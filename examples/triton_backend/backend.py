"""A conv + SSM decode step on hybridmeta's Triton kernels, wrapped for the replay harness."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridmeta.graphs import InputSpec, StaticBuffers
from hybridmeta.kernels import (
    Impl,
    causal_conv1d_update_from_metadata,
    causal_conv1d_update_reference,
    ssm_state_update_from_metadata,
    ssm_state_update_reference,
)
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, prepare_decode
from hybridmeta.testing import Batch, GraphedDecodeBackend, Reference


class KernelBackend(GraphedDecodeBackend):
    """One Mamba2 decode layer: conv update, then SSM update with the fused track write.

    Parameters
    ----------
    stale_tail : bool
        Reproduce seed defect 1 on the kernels: hand the SSM kernel's track write the last
        ``bucket`` rows of the whole ``max_bs`` track buffer.
    impl : {"triton", "reference", "auto"}
        The ops' implementation: the Triton kernels by default (interpreted on the CPU).
    """

    tolerance = (3e-4, 1e-3)  # fp32 kernel vs reference (exp / reductions round differently)

    def __init__(
        self,
        *,
        max_bs: int = 2,
        num_slots: int = 5,
        heads: int = 2,
        headdim: int = 4,
        dstate: int = 4,
        width: int = 3,
        device: torch.device | str = "cpu",
        seed: int = 0,
        stale_tail: bool = False,
        impl: Impl = "triton",
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        dev = torch.device(device)
        self.max_bs, self.num_slots, self.device = max_bs, num_slots, dev
        self.heads, self.headdim, self.dstate = heads, headdim, dstate
        self.conv_dim = heads * headdim
        self.stale_tail = stale_tail
        self.impl: Impl = impl

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dev)

        self.ssm = rnd(num_slots, heads, headdim, dstate)  # [S, H, P, N]
        self.conv = rnd(num_slots, self.conv_dim, width - 1)  # [S, C, k-1]
        self.weight = rnd(self.conv_dim, width) * 0.5  # [C, k]
        self.A = (-torch.rand(heads, generator=gen) - 0.1).to(dev)  # [H]
        self.D = rnd(heads)
        f32 = torch.float32
        self.buffers = StaticBuffers(
            max_bs=max_bs,
            num_slots=num_slots,
            device=dev,
            optional_fields=("mamba_track_indices", "mamba_track_mask"),
            inputs={
                "x": InputSpec((self.conv_dim,), f32),
                "dt": InputSpec((heads,), f32),
                "B": InputSpec((1, dstate), f32),
                "C": InputSpec((1, dstate), f32),
            },
        )
        self._md: dict[int, Mamba2Metadata] = {}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        # StaticBuffers never hands out its raw buffers; its testing aid does (from row 0).
        out: dict[str, torch.Tensor] = {}
        self.buffers.poison_(0, lambda name, rows: out.__setitem__(name, rows))
        return out

    def state_pools(self) -> Mapping[str, torch.Tensor]:
        return {"conv": self.conv, "ssm": self.ssm}

    def make_inputs(self, batch: Batch, gen: torch.Generator) -> Mapping[str, torch.Tensor]:
        bs = batch.bs
        return {
            "x": torch.randn(bs, self.conv_dim, generator=gen),
            "dt": torch.rand(bs, self.heads, generator=gen),
            "B": torch.randn(bs, 1, self.dstate, generator=gen),
            "C": torch.randn(bs, 1, self.dstate, generator=gen),
        }

    def prepare_capture(self, bucket: int) -> None:
        self._md[bucket] = self.buffers.pad_all(bucket)

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        md, ins = self._md[bucket], self.buffers.views(bucket)
        if self.stale_tail:
            assert md.mamba_track_indices is not None
            whole = torch.as_strided(md.mamba_track_indices, (self.max_bs,), (1,))
            kept = {f: getattr(md, f) for f in _FWD_FIELDS}
            fwd = ForwardMetadata(**kept, mamba_track_indices=whole[-bucket:])
            md = prepare_decode(fwd)
        xc = causal_conv1d_update_from_metadata(
            md, ins["x"], self.conv, self.weight, impl=self.impl
        )  # [B, C]
        y = ssm_state_update_from_metadata(
            md, self.ssm, xc.view(bucket, self.heads, self.headdim), ins["dt"], self.A,
            ins["B"], ins["C"], D=self.D, fuse_track=True, impl=self.impl,
        )  # fmt: skip
        return {"y": y}  # [B, H, P]

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        dev = self.device
        fwd = ForwardMetadata(
            query_start_loc=torch.arange(batch.bs + 1, device=dev),
            mamba_cache_indices=torch.tensor(batch.slots, device=dev),
            mamba_track_indices=torch.tensor(batch.track_slots, device=dev),
            mamba_track_mask=torch.tensor(batch.track_mask, device=dev),
            has_mamba_track_mask=True,
        )
        self.buffers.refresh(fwd, bucket, inputs)

    def reference(
        self, pools: Mapping[str, torch.Tensor], batch: Batch, inputs: Mapping[str, torch.Tensor]
    ) -> Reference:
        # The op references work in place on the copies of the pools the harness passes.
        slots = torch.tensor(batch.slots)
        conv, ssm = pools["conv"].cpu(), pools["ssm"].cpu()
        xc = torch.empty_like(inputs["x"])
        causal_conv1d_update_reference(
            inputs["x"], conv, self.weight.cpu(), None, xc, slots, silu=True
        )
        y = torch.empty(batch.bs, self.heads, self.headdim)
        ssm_state_update_reference(
            ssm, xc.view(batch.bs, self.heads, self.headdim), inputs["dt"], self.A.cpu(),
            inputs["B"], inputs["C"], y, slots, D=self.D.cpu(),
            track_indices=torch.tensor(batch.track_slots), track_mask=torch.tensor(batch.track_mask),
        )  # fmt: skip
        return Reference(pools={"conv": conv, "ssm": ssm}, outputs={"y": y})


_FWD_FIELDS = (
    "query_start_loc",
    "mamba_cache_indices",
    "mamba_track_mask",
    "has_mamba_track_mask",
)
