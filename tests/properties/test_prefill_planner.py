"""Property: the planner's indices equal the ones implied by brute force over the tokens."""

from __future__ import annotations

from contextlib import ExitStack
from itertools import pairwise
from typing import Any
from unittest import mock

import attrs
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from hybridmeta import ForwardMetadata, Mamba2Metadata, conventions_of, planner
from hybridmeta.chunks import chunk_indices_offsets_oracle
from hybridmeta.core import fields_of
from hybridmeta.debug import debug_mode
from hybridmeta.planner import BOOL_PARTS, plan_host, plan_mixed_batch
from hybridmeta.staging import to_device_packed
from tests.oracle import oracle_track_plan
from tests.properties.strategies.prefill import (
    ROW_ORDER_FORWARDS,
    WRONG_ARGUMENT_KINDS,
    BatchSpec,
    batch_specs,
    decodes_first,
    make_layer,
    plan_kwargs,
    plan_of,
    run_pipeline,
    wrong_plan_arguments,
)


def _walk(spec: BatchSpec) -> tuple[list[int], list[int], list[int], list[tuple[str, int, int]]]:
    """Per prefill token: its logical chunk, position in it, row; and the labels of the
    extended conv input (token i, then each row's initial window)."""
    L, k1 = spec.chunk_size, spec.conv_kernel - 1
    chunk: list[int] = []
    pos: list[int] = []
    row: list[int] = []
    labels: list[tuple[str, int, int]] = []
    key: tuple[int, int] | None = None
    t = 0
    for r in range(spec.num_prefills):
        for i in range(spec.extend_lens[r]):
            if (t // L, r) != key:
                key = (t // L, r)
                chunk.append(chunk[-1] + 1 if chunk else 0)
                pos.append(0)
            else:
                chunk.append(chunk[-1])
                pos.append(pos[-1] + 1)
            row.append(r)
            labels.append(("tok", r, spec.prefix_lens[r] + i))  # absolute position
            t += 1
    for r in range(spec.num_prefills):
        for c in range(k1):
            labels.append(("init", r, spec.prefix_lens[r] - k1 + c))
    return chunk, pos, row, labels


@given(spec=batch_specs(min_prefills=0, max_decodes=3))
def test_plan_matches_brute_force(spec: BatchSpec) -> None:
    assume(len(spec.extend_lens) > 0)
    with debug_mode():  # the metadata's syncing validators accept the plan too
        md = plan_of(spec)
    n_pre = spec.num_prefills
    qsl = [0]
    for n in spec.extend_lens:
        qsl.append(qsl[-1] + n)
    assert md.query_start_loc.tolist() == qsl
    assert md.mamba_cache_indices.tolist() == list(spec.slots)
    assert md.num_prefills == n_pre
    assert md.num_decodes == spec.num_decodes
    assert md.num_prefill_tokens == qsl[n_pre]
    expected = oracle_track_plan(
        spec.extend_lens,
        spec.prefix_lens,
        spec.track_mask,
        spec.track_slots,
        num_decodes=spec.num_decodes,
        chunk_size=spec.chunk_size,
        track_interval=spec.track_interval,
    )
    finals = [t for t in expected if t.kind == "final"]
    hs = [t for t in expected if t.kind == "h"]
    rcs = [t for t in expected if t.kind == "recompute"]
    # the forward's mask flags exactly the rows whose boundary ends them; every saving
    # row's track slot is in mamba_track_indices, the others hold -1
    assert md.mamba_track_mask is not None and md.mamba_track_indices is not None
    n = len(spec.extend_lens)
    assert md.mamba_track_mask.tolist() == [r in {t.row for t in finals} for r in range(n)]
    saving = {t.row: t.dst for t in expected}
    assert md.mamba_track_indices.tolist() == [saving.get(r, -1) for r in range(n)]
    assert md.has_mamba_track_mask == bool(finals)

    chunk, pos, row, labels = _walk(spec)
    if n_pre:
        assert md.mixed is not None
        ch = md.mixed.chunks
        ind, off = chunk_indices_offsets_oracle(spec.extend_lens[:n_pre], spec.chunk_size)
        assert ch.start.tolist() == [i * spec.chunk_size + o for i, o in zip(ind, off, strict=True)]
        assert md.mixed.has_initial_states.tolist() == [p > 0 for p in spec.prefix_lens[:n_pre]]
        assert ch.token_chunk.tolist() == chunk
        assert ch.token_pos.tolist() == pos
        assert ch.row.tolist() == [row[t] for t in ch.start.tolist()]
        assert ch.first.tolist() == [t == 0 or row[t - 1] != row[t] for t in ch.start.tolist()]
        last = [max(i for i, rr in enumerate(row) if rr == r) for r in range(n_pre)]
        assert ch.row_last_chunk.tolist() == [chunk[t] for t in last]
        T, L = len(row), spec.chunk_size
        assert ch.phys_last_chunk.tolist() == [
            chunk[min((j + 1) * L, T) - 1] for j in range(-(-T // L))
        ]
        tr = md.mixed.track
        assert tr.h_rows.tolist() == [t.row for t in hs]
        # the h state is the end of the boundary's physical chunk: its last logical chunk
        assert tr.h_chunk.tolist() == [ch.phys_last_chunk.tolist()[t.h_index] for t in hs]
        assert tr.recompute_rows.tolist() == [t.row for t in rcs]
        for t, c, k in zip(rcs, tr.recompute_chunk.tolist(), tr.recompute_len.tolist(), strict=True):
            last_tok = qsl[t.row] + t.k - 1  # the boundary token
            assert (c, k) == (chunk[last_tok], pos[last_tok] + 1)
            assert 1 <= k < spec.chunk_size
        # every h entry's physical chunk ends right after the boundary token
        for t in hs:
            assert (t.h_index + 1) * spec.chunk_size == qsl[t.row] + t.k
        # conv windows: every token reads its K-1 predecessors of its own row and itself
        # (the row's initial state before its first token); each row's final window is its
        # last K-1 inputs
        k1 = spec.conv_kernel - 1
        cv = md.mixed.conv
        for tok, idx in enumerate(cv.token_windows.tolist()):
            p = labels[tok][2]
            want = [(row[tok], p - k1 + c) for c in range(k1 + 1)]
            assert [labels[i][1:] for i in idx] == want
        for r, idx in enumerate(cv.final_windows.tolist()):
            end = spec.prefix_lens[r] + spec.extend_lens[r]
            assert [labels[i][1:] for i in idx] == [(r, end - k1 + c) for c in range(k1)]
        # mid-row saves: the K-1 inputs before the boundary, of the row itself
        mids = hs + rcs
        assert tuple(tr.windows.shape) == (len(mids), k1)
        for t, idx in zip(mids, tr.windows.tolist(), strict=True):
            b = spec.prefix_lens[t.row] + t.k
            got = [labels[i][1:] for i in idx]
            assert got == [(t.row, b - k1 + c) for c in range(k1)]
    else:
        assert md.mixed is None
        assert not hs and not rcs


def _leaves(obj: object, prefix: str = "") -> dict[str, Any]:
    """Every field of a metadata object, nested metadata flattened (``mixed.chunks.start``)."""
    out: dict[str, Any] = {}
    for spec in fields_of(type(obj)):
        v = getattr(obj, spec.name)
        if attrs.has(type(v)):
            out.update(_leaves(v, f"{prefix}{spec.name}."))
        else:
            out[prefix + spec.name] = v
    return out


@given(spec=batch_specs(min_prefills=0, max_decodes=3), track=st.booleans())
def test_one_call_equals_the_two_steps(spec: BatchSpec, track: bool) -> None:
    # plan_mixed_batch stages the plan's arrays itself, masks as bool; the engine's two
    # steps (to_device_packed, with or without as_bool, then hp.metadata) build the same
    # metadata: every tensor equal in dtype, shape and values, every host field equal.
    assume(len(spec.extend_lens) > 0)
    kw: dict[str, Any] = {
        "extend_lens": spec.extend_lens,
        "prefix_lens": spec.prefix_lens,
        "slots": spec.slots,
        "num_decodes": spec.num_decodes,
        "chunk_size": spec.chunk_size,
        "conv_kernel": spec.conv_kernel,
    }
    if track:
        kw.update(track_interval=spec.track_interval, track_mask=spec.track_mask,
                  track_slots=spec.track_slots)  # fmt: skip
    md = plan_mixed_batch(**kw)
    got = _leaves(md)
    hp = plan_host(**kw)
    cpu = torch.device("cpu")
    for as_bool in ((), BOOL_PARTS):
        want = _leaves(hp.metadata(to_device_packed(hp.arrays, cpu, as_bool=as_bool)))
        assert got.keys() == want.keys()
        for name, w in want.items():
            g = got[name]
            if isinstance(w, torch.Tensor):
                assert isinstance(g, torch.Tensor), name
                assert (g.dtype, g.shape, g.is_contiguous()) == (w.dtype, w.shape, True), name
                assert torch.equal(g, w), name
            else:
                assert g == w, name
    # every tensor of the one-call metadata, masks included, is a view of its one buffer
    base = md.mamba_cache_indices.untyped_storage().data_ptr()
    for name, g in got.items():
        if isinstance(g, torch.Tensor):
            assert g.untyped_storage().data_ptr() == base, name


@given(data=st.data(), spec=batch_specs(min_prefills=0, max_decodes=3))
def test_wrong_arguments_are_refused_by_name_before_planning(
    data: st.DataObject, spec: BatchSpec
) -> None:
    # One argument of a valid batch made wrong, of each kind in turn (a count's type, a
    # per-row argument's shape or dtype, a value past int64, an overflowing position):
    # refused with a message naming it and the rule, before any phase of the plan runs
    # (each phase after the checks raises if reached).
    assume(len(spec.extend_lens) > 0)

    def computed(*_: object, **__: object) -> None:
        raise AssertionError("planned from a wrong argument")

    with ExitStack() as stack:
        for phase in ("_track_kinds", "_chunks", "_conv_windows", "_pack"):
            stack.enter_context(mock.patch.object(planner, phase, computed))
        for kind in WRONG_ARGUMENT_KINDS:
            name, wrong, rule = data.draw(wrong_plan_arguments(spec, kind), label=kind)
            kw = {**plan_kwargs(spec), name: wrong}
            for entry in (plan_host, plan_mixed_batch):
                with pytest.raises((TypeError, ValueError)) as err:
                    entry(**kw)
                message = str(err.value)
                assert message.startswith("plan_mixed_batch: "), message
                assert name in message, message
                assert rule in message, message


@given(spec=batch_specs(min_prefills=0, max_decodes=3), cls=st.sampled_from(ROW_ORDER_FORWARDS))
def test_decodes_first_batches_plan_the_same_requests(
    spec: BatchSpec, cls: type[ForwardMetadata]
) -> None:
    # The same batch with its decode rows first (vLLM's order, declared on the engine's
    # source class) plans the same requests: every per-row field is the prefills-first
    # one permuted, the prefill rows and decode rows select the same requests, the prefill
    # plan is the same with its batch rows renamed, and the prefill ops leave every slot
    # of the pools identical.
    assume(len(spec.extend_lens) > 0)
    null = conventions_of(cls).null_slot
    if null >= 0:  # a reserved null slot is no live row's: move the batch's slots past it
        spec = attrs.evolve(
            spec,
            slots=tuple(s + 1 for s in spec.slots),
            track_slots=tuple(s + 1 for s in spec.track_slots),
            pool_size=spec.pool_size + 1,
        )
    kw, perm = decodes_first(spec)
    pos = {r: i for i, r in enumerate(perm)}  # prefills-first row -> decodes-first row
    md = plan_of(spec)
    with debug_mode():  # the debug checks accept the decodes-first plan (and its null slot)
        df = plan_mixed_batch(**kw, forward_cls=cls)
    assert isinstance(df, Mamba2Metadata) and conventions_of(df) == conventions_of(cls)
    assert (df.num_prefills, df.num_decodes, df.num_prefill_tokens) == (
        md.num_prefills, md.num_decodes, md.num_prefill_tokens
    )

    def permuted(values: list[Any]) -> list[Any]:
        return [values[r] for r in perm]

    def lens(t: torch.Tensor) -> list[int]:
        q = t.tolist()
        return [b - a for a, b in pairwise(q)]

    assert df.query_start_loc.tolist()[0] == 0
    assert lens(df.query_start_loc) == permuted(lens(md.query_start_loc))
    assert df.mamba_cache_indices.tolist() == permuted(md.mamba_cache_indices.tolist())
    assert df.mamba_track_mask is not None and md.mamba_track_mask is not None
    assert df.mamba_track_mask.tolist() == permuted(md.mamba_track_mask.tolist())
    assert df.mamba_track_indices is not None and md.mamba_track_indices is not None
    assert df.mamba_track_indices.tolist() == [
        null if v == -1 else v for v in permuted(md.mamba_track_indices.tolist())
    ]
    assert df.has_mamba_track_mask == md.has_mamba_track_mask
    assert df.prefill_slots.tolist() == md.prefill_slots.tolist()
    dec_df = df.mamba_cache_indices[df.decode_rows()]
    assert dec_df.tolist() == md.mamba_cache_indices[md.decode_rows()].tolist()
    hp, hp_df = plan_host(**plan_kwargs(spec)), plan_host(**kw, forward_cls=cls)
    views = to_device_packed(hp_df.arrays, torch.device("cpu"), as_bool=BOOL_PARTS)
    assert hp_df.forward_cls is cls and isinstance(hp_df.forward(views), cls)
    two_steps, one_call = _leaves(hp_df.metadata(views)), _leaves(df)  # the same metadata
    assert two_steps.keys() == one_call.keys()
    for name, w in two_steps.items():
        g = one_call[name]
        assert torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w, name
    assert list(hp_df.final_rows) == sorted(pos[r] for r in hp.final_rows)
    assert list(hp_df.h_rows) == [pos[r] for r in hp.h_rows]
    assert list(hp_df.recompute_rows) == [pos[r] for r in hp.recompute_rows]
    if not spec.num_prefills:
        assert df.mixed is None and md.mixed is None
        return
    assert df.mixed is not None and md.mixed is not None
    want, got = _leaves(md.mixed), _leaves(df.mixed)
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if name in ("track.h_rows", "track.recompute_rows"):  # batch rows
            assert g.tolist() == [pos[r] for r in w.tolist()], name
        elif isinstance(w, torch.Tensor):
            assert torch.equal(g, w), name
        else:
            assert g == w, name
    # the prefill ops (conv, scan, extend track-save, then the forward's track-save) over
    # either plan: every slot of both pools bit-identical
    pf_data, df_data = make_layer(spec), make_layer(spec)
    run_pipeline(spec, pf_data, md)
    run_pipeline(spec, df_data, df)
    assert torch.equal(df_data.conv_pool, pf_data.conv_pool)
    assert torch.equal(df_data.ssm_pool, pf_data.ssm_pool)
