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
    NULL_BLOCK_ID,
    VLLM_CONVENTIONS,
    DecodeGraphBuffers,
    VllmDecodeForward,
    VllmMamba2Step,
    check_speculative,
    decode_rows,
    mamba2_metadata,
)
from hybridmeta.model import Mamba2Metadata
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
    state = torch.tensor(slots, dtype=torch.int32).view(n, 1)
    return VllmMamba2Step(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        mamba_cache_indices=state[:, 0],
        seq_lens=torch.tensor([c + 1 for c in computed], dtype=torch.int32),
        state_indices=state,
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        num_decode_rows=n,
        num_decode_tokens=n,
        query_lens=np.ones(n, dtype=np.int64),
        computed_lens=np.array(computed, dtype=np.int64),
        chunk_size=8,
        conv_kernel=K,
    )


class VllmDecodeGraphs(GraphedDecodeBackend):
    """The plugin's FULL-graph decode: persistent buffers + the layer body, one layer.

    The pools are in vLLM's layout (conv state ``[blocks, K - 1, conv_dim]``, handed to
    the ops as its transpose view), block 0 is vLLM's null block (never a live slot): the
    harness's slot ``s`` is block ``s + 1``, and the pools it checks are blocks ``1..``.
    """

    # The same reference ops in graph and eager, but on 4 rows (the bucket) against 3 (the
    # live rows): torch's CPU SiLU / exp take their vector body or their scalar tail by
    # the tensor's size, so a live row can differ by an ulp (seen: 1.5e-8 in the conv's
    # SiLU, 3e-8 in the state). A stale tail moves a row by O(1): the planted defect below.
    tolerance = (1e-6, 1e-6)

    def __init__(self, *, max_bs: int = 4, num_slots: int = 7, stale_tail: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.max_bs, self.num_slots, self.device = max_bs, num_slots, torch.device("cpu")
        self.stale_tail = stale_tail
        self.conv = torch.randn(num_slots + 1, K - 1, CONV, generator=g)
        self.ssm = torch.randn(num_slots + 1, H, P, N, generator=g)
        self.weight = torch.randn(CONV, K, generator=g) * 0.5
        self.bias = torch.randn(CONV, generator=g) * 0.1
        self.A = -torch.rand(H, generator=g) - 0.1
        self.D = torch.randn(H, generator=g)
        self.dt_bias = torch.randn(H, generator=g) * 0.3
        self.graphs = DecodeGraphBuffers(
            max_bs=max_bs, num_slots=num_slots + 1, device="cpu",
            inputs={"xbc": InputSpec((CONV,), torch.float32), "dt": InputSpec((H,), torch.float32)},
        )  # fmt: skip
        self._md: dict[int, Any] = {}

    def static_buffers(self) -> Mapping[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        self.graphs.buffers.poison_(0, lambda name, rows: out.__setitem__(name, rows))
        return out

    def state_pools(self) -> Mapping[str, torch.Tensor]:
        return {"conv": self.conv[1:], "ssm": self.ssm[1:]}  # block 0: vLLM's null block

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
            from hybridmeta.model import prepare_decode

            # vLLM's conventions kept (pad rows carry the null block): the defect is only
            # the rows read. (With the root's pad -1 the null block 0 of the pad rows reads
            # as a live slot twice, which the op refuses as a write collision before any
            # replay runs.)
            md = prepare_decode(VllmDecodeForward(
                query_start_loc=torch.arange(bucket + 1, dtype=torch.int32),
                mamba_cache_indices=whole[-bucket:],
            ))  # fmt: skip
        return {"y": self._layer(md, ins["xbc"], ins["dt"], self.conv, self.ssm)}

    def refresh(self, batch: Batch, inputs: Mapping[str, torch.Tensor], bucket: int) -> None:
        step = decode_step([s + 1 for s in batch.slots], [3] * batch.bs)
        self.graphs.refresh(step, bucket, dict(inputs))

    def reference(self, pools: Mapping[str, torch.Tensor], batch: Batch,
                  inputs: Mapping[str, torch.Tensor]) -> Reference:  # fmt: skip
        conv = torch.cat((self.conv[:1], pools["conv"]))
        ssm = torch.cat((self.ssm[:1], pools["ssm"]))
        md = mamba2_metadata(decode_step([s + 1 for s in batch.slots], [3] * batch.bs))
        y = self._layer(md, inputs["xbc"], inputs["dt"], conv, ssm)
        return Reference(pools={"conv": conv[1:], "ssm": ssm[1:]}, outputs={"y": y})


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
    with an align-mode checkpoint (vLLM's position: the last block boundary strictly
    before the row's last token, the row's end a boundary or not); distinct blocks, 0
    never live."""
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
        ok = r >= nd and p > pre and draw(st.booleans())
        offsets.append(p - pre if ok else 0)
        ck.append(ckpt_blocks[r] if ok else NULL_BLOCK_ID)
    qsl = np.concatenate(([0], np.cumsum(query))).astype(np.int32)
    state = torch.tensor(slots, dtype=torch.int32).view(n, 1)
    return VllmMamba2Step(
        query_start_loc=torch.from_numpy(qsl),
        mamba_cache_indices=state[:, 0],
        seq_lens=torch.tensor([c + q for c, q in zip(computed, query, strict=True)], dtype=torch.int32),
        state_indices=state,
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        checkpoint_slots=torch.tensor(ck, dtype=torch.int32),
        num_decode_rows=nd,
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

    mamba_cache_indices: torch.Tensor
    num_decode_rows: int
    num_decode_tokens: int
    chunk_size: int
    conv_kernel: int
    checkpoint_slots: torch.Tensor
    checkpoint_offsets: tuple[int, ...]


def _as_ops_see_it(step: VllmMamba2Step) -> OpsView:
    """The step's fields as the Mamba2 ops read them from the metadata: the rows in the
    step's own order (no permutation), the checkpoints as the planned track saves."""
    md = mamba2_metadata(step)
    assert isinstance(md, VllmMamba2Step) and md.conventions.null_slot == NULL_BLOCK_ID
    n = step.query_lens.shape[0]
    offsets = [0] * n
    slots = torch.full((n,), NULL_BLOCK_ID, dtype=torch.int32)
    if md.mixed is not None and md.mamba_track_indices is not None:
        tr, ch, qsl = md.mixed.track, md.mixed.chunks, md.query_start_loc.tolist()
        first = md.prefill_tokens().start
        # h saves: the state after the chunk; recompute saves: after recompute_len tokens
        # of the chunk (prefill-flat positions, back to positions inside the row)
        ends = [(r, int(ch.start[c] + ch.length[c])) for r, c in
                zip(tr.h_rows.tolist(), tr.h_chunk.tolist(), strict=True)]
        ends += [(r, int(ch.start[c]) + ln) for r, c, ln in
                 zip(tr.recompute_rows.tolist(), tr.recompute_chunk.tolist(),
                     tr.recompute_len.tolist(), strict=True)]  # fmt: skip
        for r, g in ends:
            offsets[r] = g + first - qsl[r]
            slots[r] = int(md.mamba_track_indices[r])
    return OpsView(
        mamba_cache_indices=md.mamba_cache_indices.to(step.mamba_cache_indices.dtype),
        num_decode_rows=md.num_decodes,
        num_decode_tokens=md.decode_tokens().stop - md.decode_tokens().start,
        chunk_size=md.mixed.chunks.chunk_size if md.mixed is not None else step.chunk_size,
        conv_kernel=md.mixed.conv.kernel_size if md.mixed is not None else step.conv_kernel,
        checkpoint_slots=slots,
        checkpoint_offsets=tuple(offsets),
    )


def test_every_field_the_ops_read_reaches_the_metadata() -> None:
    report = check_field_flow(
        VllmMamba2Step,
        _as_ops_see_it,
        derived=OpsView,
        sources=vllm_steps(),
        fields=("mamba_cache_indices", "num_decode_rows", "num_decode_tokens", "chunk_size",
                "conv_kernel", "checkpoint_slots", "checkpoint_offsets"),
    )
    assert report.ok, report.format()


def test_the_layer_gets_the_builders_step() -> None:
    step = decode_step([2, 5], [4, 9])
    md = mamba2_metadata(step)
    # one object: a Mamba2Metadata specialised for the step's class, every vLLM field in it
    assert isinstance(md, Mamba2Metadata) and isinstance(md, VllmMamba2Step)
    assert type(md).__qualname__ == "Mamba2Metadata[VllmMamba2Step]"
    assert md.state_indices is step.state_indices and md.seq_lens is step.seq_lens
    assert md.conventions == VLLM_CONVENTIONS and md.decode_rows() == slice(0, 2)
    assert (md.conventions.null_slot, md.conventions.decodes_first) == (0, True)
    assert md.mamba_cache_indices.tolist() == [2, 5]
    assert decode_rows(np.array([1, 1, 1, 5]), np.array([3, 0, 2, 0])) == 1  # fresh 1-token prompt


def test_a_mixed_step_keeps_vllms_row_order_and_fields() -> None:
    qsl = torch.tensor([0, 1, 2, 12], dtype=torch.int32)
    state = torch.tensor([[3], [7], [5]], dtype=torch.int32)
    s = VllmMamba2Step(
        query_start_loc=qsl, mamba_cache_indices=state[:, 0],
        seq_lens=torch.tensor([5, 9, 10], dtype=torch.int32), state_indices=state,
        num_computed_tokens=torch.tensor([4, 8, 0], dtype=torch.int32),
        num_decode_rows=2, num_decode_tokens=2,
        query_lens=np.array([1, 1, 10]), computed_lens=np.array([4, 8, 0]),
        chunk_size=4, conv_kernel=K,
    )  # fmt: skip
    md = mamba2_metadata(s)
    assert isinstance(md, VllmMamba2Step) and md.seq_lens is s.seq_lens
    assert (md.decode_rows(), md.prefill_rows()) == (slice(0, 2), slice(2, 3))
    assert md.mamba_cache_indices.tolist() == [3, 7, 5]  # vLLM's order, no permutation
    assert md.query_start_loc.tolist() == qsl.tolist()


def test_full_graph_pad_rows_carry_vllms_null_block() -> None:
    # as vLLM's own persistent buffers: a bucket of 4 for 2 live rows pads with block 0,
    # which the decode ops take as their pad id (block 0 unread and unwritten)
    backend = VllmDecodeGraphs(max_bs=4, num_slots=7)
    assert backend.graphs.capture(4).mamba_cache_indices.tolist() == [0, 0, 0, 0]
    ins = {"xbc": torch.randn(2, CONV), "dt": torch.randn(2, H)}
    md = backend.graphs.refresh(decode_step([3, 6], [4, 9]), 4, ins)
    assert md.mamba_cache_indices.tolist() == [3, 6, 0, 0] and md.conventions.null_slot == 0
    conv0, ssm0 = backend.conv[0].clone(), backend.ssm[0].clone()
    views = backend.graphs.buffers.views(4)
    y = backend._layer(md, views["xbc"], views["dt"], backend.conv, backend.ssm)
    assert bool((y[2:] == 0).all())
    assert torch.equal(backend.conv[0], conv0) and torch.equal(backend.ssm[0], ssm0)


def test_speculation_the_plugin_does_not_serve_is_refused_in_one_line() -> None:
    check_speculative(None, 0, "align")  # no speculation
    check_speculative("ngram", 2, "none")  # served
    for method, mode, what in (("eagle", "none", "'eagle'"), ("ngram", "align", "align-mode")):
        with pytest.raises(NotImplementedError) as err:
            check_speculative(method, 2, mode)
        assert "\n" not in str(err.value) and what in str(err.value), err.value
    # speculative decode rows: up to 1 + num_spec tokens, a prompt still prefilling is not one
    q, c = np.array([3, 1, 2, 2]), np.array([5, 9, 4, 0])
    assert decode_rows(q, c, 3) == 3  # the fresh prompt (no state) ends the decode rows
    assert decode_rows(q, c, 3, np.array([False, False, True, False])) == 2
