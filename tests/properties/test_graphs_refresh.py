"""Properties of ``StaticBuffers.refresh`` for any sequence of steps and buckets.

After refreshing ``bs`` live rows into bucket ``B`` (from any earlier buffer contents):
the handed-out views have exactly ``B`` rows, hold the live rows then the declared pad, and
rows ``[B:max_bs)`` are bit-identical to what was there before (never written).
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridmeta.graphs import InputSpec, StaticBuffers
from hybridmeta.model import ForwardMetadata
from tests.properties.strategies.graphs import DecodeStepSpec, decode_steps

MAX_BS = 6
SLOTS = 2 * MAX_BS + 2


def _snapshot(buffers: StaticBuffers) -> dict[str, torch.Tensor]:
    snap: dict[str, torch.Tensor] = {}
    buffers.poison_(0, lambda name, t: snap.__setitem__(name, t.clone()))
    return snap


@given(
    steps=st.lists(decode_steps(num_slots=SLOTS, max_bs=MAX_BS), min_size=1, max_size=4),
    data=st.data(),
)
def test_refresh_writes_exactly_the_bucket(
    steps: list[DecodeStepSpec], data: st.DataObject
) -> None:
    table = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(len(steps)))
    inverse = torch.argsort(table)  # the strategy's slots are physical: step ids are virtual
    buffers = StaticBuffers(
        max_bs=MAX_BS,
        num_slots=SLOTS,
        device="cpu",
        inputs={"x": InputSpec((2,), torch.float32, pad=0.25)},
        slot_table=table,
    )
    for spec in steps:
        bs = spec.bs
        bucket = data.draw(st.integers(bs, MAX_BS), label="bucket")
        with_track = data.draw(st.booleans(), label="with_track")
        gen = torch.Generator().manual_seed(spec.seed)

        def poison(name: str, t: torch.Tensor, gen: torch.Generator = gen) -> None:
            t.copy_(torch.randint(-1, SLOTS, t.shape, generator=gen).to(t.dtype))

        buffers.poison_(0, poison)
        before = _snapshot(buffers)
        x = torch.randn(bs, 2, generator=gen)
        fwd = ForwardMetadata(
            query_start_loc=torch.arange(bs + 1),
            mamba_cache_indices=inverse[torch.tensor(spec.slots)],
            mamba_track_indices=torch.tensor(spec.track) if with_track else None,
            mamba_track_mask=torch.tensor(spec.mask) if with_track else None,
            has_mamba_track_mask=with_track and any(spec.mask),
        )
        md = buffers.refresh(fwd, bucket, {"x": x})
        pad = bucket - bs

        assert md.num_decodes == bucket
        assert md.query_start_loc.tolist() == [*range(bs + 1), *[bs] * pad]
        assert md.mamba_cache_indices.tolist() == list(spec.slots) + [-1] * pad
        assert md.mamba_track_indices is not None
        assert md.mamba_track_mask is not None
        # A step that saves nothing (has_mamba_track_mask False) has its track fields padded.
        used = with_track and any(spec.mask)
        track = list(spec.track) if used else [-1] * bs
        mask = list(spec.mask) if used else [False] * bs
        assert md.mamba_track_indices.tolist() == track + [-1] * pad
        assert md.mamba_track_mask.tolist() == mask + [False] * pad
        xv = buffers.views(bucket)["x"]
        assert torch.equal(xv[:bs], x)
        assert (xv[bs:] == 0.25).all()

        after = _snapshot(buffers)
        for name, old in before.items():
            extra = 1 if name == "query_start_loc" else 0
            assert torch.equal(after[name][bucket + extra :], old[bucket + extra :]), name
