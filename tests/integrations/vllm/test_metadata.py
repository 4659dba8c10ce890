"""The declared vLLM step and its one translation, under hybridmeta's harness.

* ``check_replay`` drives the plugin's FULL-graph decode path (:class:`DecodeGraphBuffers`
  feeding the plugin's layer body) through captures and replays with every static
  buffer's stale tail poisoned (CPU graph emulation here, real graphs on a GPU), against
  the eager path (:func:`mamba2_metadata` on the live rows).
* ``check_field_flow``: every field of the step that a Mamba2 op reads reaches the
  ``Mamba2Metadata`` the ops are given (the working slots through vLLM's running column,
  the checkpoint blocks as track slots), and the step the layer receives is the builder's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from hybridmeta.graphs.buffers import InputSpec
from hybridmeta.integrations.vllm.layer import LayerShape, conv_ssm
from hybridmeta.integrations.vllm.metadata import (
    DecodeGraphBuffers,
    VllmForward,
    VllmMamba2Step,
    decode_rows,
    mamba2_metadata,
)
from hybridmeta.testing import (
    Batch,
    GraphedDecodeBackend,
    Reference,
    check_field_flow,
    check_replay,
)

H, P, G, N, K = 2, 4, 1, 4, 4
CONV = H * P + 2 * G * N
SHAPE = LayerShape(heads=H, head_dim=P, groups=G, state=N)


def decode_step(slots: list[int], computed: list[int]) -> VllmMamba2Step:
    n = len(slots)
    return VllmMamba2Step(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor([c + 1 for c in computed], dtype=torch.int32),
        state_indices=torch.tensor(slots, dtype=torch.int32).view(n, 1),
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        num_decodes=n,
        num_decode_tokens=n,
        query_lens=np.ones(n, dtype=np.int64),
        computed_lens=np.array(computed, dtype=np.int64),
        chunk_size=8,
        conv_kernel=K,
    )


class VllmDecodeGraphs(GraphedDecodeBackend):
    """The plugin's FULL-graph decode: persistent buffers + the layer body, one layer.

    The pools are in vLLM's layout (conv state ``[blocks, K - 1, conv_dim]``, handed to
    the ops as its transpose view), block 0 is vLLM's null block (never a live slot).
    """

    tolerance = (0.0, 0.0)  # the same reference ops in graph and eager: bit-equal

    def __init__(self, *, max_bs: int = 4, num_slots: int = 7, stale_tail: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.max_bs, self.num_slots, self.device = max_bs, num_slots, torch.device("cpu")
        self.stale_tail = stale_tail
        self.conv = torch.randn(num_slots, K - 1, CONV, generator=g)
        self.ssm = torch.randn(num_slots, H, P, N, generator=g)
        self.weight = torch.randn(CONV, K, generator=g) * 0.5
        self.bias = torch.randn(CONV, generator=g) * 0.1
        self.A = -torch.rand(H, generator=g) - 0.1
        self.D = torch.randn(H, generator=g)
        self.dt_bias = torch.randn(H, generator=g) * 0.3
        self.graphs = DecodeGraphBuffers(
            max_bs=max_bs, num_slots=num_slots, device="cpu",
            inputs={"xbc": InputSpec((CONV,), torch.float32), "dt": InputSpec((H,), torch.float32)},
        )  # fmt: skip
        self._md: dict[int, Any] = {}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        self.graphs.buffers.poison_(0, lambda name, rows: out.__setitem__(name, rows))
        return out

    def state_pools(self) -> Mapping[str, torch.Tensor]:
        return {"conv": self.conv, "ssm": self.ssm}

    def make_inputs(self, batch: Batch, gen: torch.Generator) -> Mapping[str, torch.Tensor]:
        return {"xbc": torch.randn(batch.bs, CONV, generator=gen),
                "dt": torch.randn(batch.bs, H, generator=gen)}  # fmt: skip

    def prepare_capture(self, bucket: int) -> None:
        self._md[bucket] = self.graphs.capture(bucket)

    def _layer(self, md: Any, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor,
               ssm: torch.Tensor) -> torch.Tensor:  # fmt: skip
        out = torch.zeros(xbc.shape[0], H * P)
        conv_ssm(
            md, xbc, dt, out, conv_state=conv.transpose(-1, -2), ssm_state=ssm,
            conv_weight=self.weight, conv_bias=self.bias, A=self.A, D=self.D,
            dt_bias=self.dt_bias, shape=SHAPE,
        )  # fmt: skip
        return out

    def forward(self, bucket: int) -> Mapping[str, torch.Tensor]:
        md, ins = self._md[bucket], self.graphs.buffers.views(bucket)
        if self.stale_tail:  # the planted defect: the decode reads the whole max_bs buffer
            whole = torch.as_strided(md.mamba_cache_indices, (self.max_bs,), (1,))
            from hybridmeta.model import ForwardMetadata, prepare_decode

            md = prepare_decode(ForwardMetadata(
                query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
                mamba_cache_indices=whole[-bucket:],
            ))  # fmt: skip
        return {"y": self._layer(md, ins["xbc"], ins["dt"], self.conv, self.ssm)}

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        step = decode_step(list(batch.slots), [3] * batch.bs)
        self.graphs.refresh(step, bucket, dict(inputs))

    def reference(self, pools: Mapping[str, torch.Tensor], batch: Batch,
                  inputs: Mapping[str, torch.Tensor]) -> Reference:  # fmt: skip
        conv, ssm = pools["conv"].clone(), pools["ssm"].clone()
        md = mamba2_metadata(decode_step(list(batch.slots), [3] * batch.bs))
        y = self._layer(md, inputs["xbc"], inputs["dt"], conv, ssm)
        return Reference(pools={"conv": conv, "ssm": ssm}, outputs={"y": y})


def test_full_graph_decode_ignores_stale_tails() -> None:
    check_replay(VllmDecodeGraphs, track=False)


def test_replay_finds_a_planted_stale_tail() -> None:
    from hybridmeta.testing import ReplayFailure

    with pytest.raises(ReplayFailure):
        check_replay(lambda: VllmDecodeGraphs(stale_tail=True), track=False)


# ------------------------------------------------------------------ field flow


@st.composite
def vllm_steps(draw: st.DrawFn) -> VllmMamba2Step:
    """Mixed vLLM steps: decode rows first, prefill rows with and without state, some
    with an align-mode checkpoint; distinct blocks, 0 never live."""
    nd = draw(st.integers(0, 3))
    npf = draw(st.integers(0 if nd else 1, 3))
    chunk, interval = 4, 8
    query = [1] * nd + [draw(st.integers(2, 20)) for _ in range(npf)]
    computed = [draw(st.integers(1, 30)) for _ in range(nd)]
    computed += [draw(st.sampled_from([0, 8, 16])) for _ in range(npf)]
    n = nd + npf
    blocks = draw(st.permutations(list(range(1, 2 * n + 3))))
    slots, ckpt_blocks = blocks[:n], blocks[n : 2 * n]
    offsets, ck = [], []
    for r in range(n):
        pre, ext = computed[r], query[r]
        p = (pre + ext - 1) // interval * interval  # vLLM's position: strictly inside
        ok = r >= nd and pre % interval == 0 and p >= pre + interval and (pre + ext) % interval
        ok = ok and draw(st.booleans())
        offsets.append(p - pre if ok else 0)
        ck.append(ckpt_blocks[r] if ok else 0)
    qsl = np.concatenate(([0], np.cumsum(query))).astype(np.int32)
    return VllmMamba2Step(
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.tensor([c + q for c, q in zip(computed, query, strict=True)], dtype=torch.int32),
        state_indices=torch.tensor(slots, dtype=torch.int32).view(n, 1),
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        checkpoint_slots=torch.tensor(ck, dtype=torch.int32),
        num_decodes=nd,
        num_decode_tokens=nd,
        query_lens=np.array(query, dtype=np.int64),
        computed_lens=np.array(computed, dtype=np.int64),
        checkpoint_offsets=tuple(offsets),
        chunk_size=chunk,
        conv_kernel=K,
        checkpoint_interval=interval,
    )


@dataclass(frozen=True)
class OpsView:
    """The step's fields as the Mamba2 ops read them from the metadata (vLLM's row order)."""

    state_indices: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    chunk_size: int
    conv_kernel: int
    checkpoint_slots: torch.Tensor


def _as_ops_see_it(step: VllmMamba2Step) -> OpsView:
    """The step's fields as the Mamba2 ops read them from the metadata, in vLLM's row order."""
    md = mamba2_metadata(step)
    nd, n = step.num_decodes, step.num_rows
    # metadata rows: prefill rows first (interim), then the decode rows
    back = np.concatenate((np.arange(n - nd, n), np.arange(0, n - nd))) if 0 < nd < n else np.arange(n)
    slots = md.mamba_cache_indices.long()[torch.from_numpy(back)]
    out: dict[str, Any] = {
        "state_indices": slots.view(n, 1).to(step.state_indices.dtype),
        "num_decodes": md.num_decodes,
        "num_decode_tokens": md.num_decodes,
        "chunk_size": md.mixed.chunks.chunk_size if md.mixed is not None else step.chunk_size,
        "conv_kernel": md.mixed.conv.kernel_size if md.mixed is not None else step.conv_kernel,
    }
    track = md.mamba_track_indices
    if track is not None:
        out["checkpoint_slots"] = torch.where(
            track.long()[torch.from_numpy(back)] < 0, 0, track.long()[torch.from_numpy(back)]
        ).to(torch.int32)
    else:
        out["checkpoint_slots"] = torch.zeros(n, dtype=torch.int32)
    return OpsView(**out)


def test_every_field_the_ops_read_reaches_the_metadata() -> None:
    report = check_field_flow(
        VllmMamba2Step,
        _as_ops_see_it,
        derived=OpsView,
        sources=vllm_steps(),
        fields=("state_indices", "num_decodes", "num_decode_tokens", "chunk_size",
                "conv_kernel", "checkpoint_slots"),
    )
    assert report.ok, report.format()


def test_the_layer_gets_the_builders_step() -> None:
    step = decode_step([2, 5], [4, 9])
    fwd = VllmForward(md=mamba2_metadata(step), step=step)
    assert fwd.step is step and fwd.md.mamba_cache_indices.tolist() == [2, 5]
    assert decode_rows(np.array([1, 1, 1, 5]), np.array([3, 0, 2, 0])) == 1  # fresh 1-token prompt
