"""Issue 21's kernel cases, one test each (every one failed on the code before the fix):
ids outside the pool, ids that are not the pad id, aliasing pools, impossible ``dt_limit``
values, and the argument checks that come with the declared pad id.

The pools are views ``big[:S]`` (or ``big[:, :S]``) of a larger buffer, so a write past
the pool lands in memory the test can see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from hybridmeta import debug_mode
from hybridmeta.kernels import (
    Impl,
    SlotIndexError,
    causal_conv1d_update,
    check_errors,
    conv_verify_update,
    reset_errors,
    spec_commit,
    ssm_state_update,
    ssm_verify_update,
    track_save,
    track_save_reference,
)
from tests.kernels._support import bits
from tests.op_log import OpLog

S, H, P, N, L, D, K, T = 4, 2, 4, 8, 2, 6, 4, 3


@pytest.fixture(autouse=True)
def _clean_record() -> None:
    reset_errors()


def _ssm_inputs(bs: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(bs)
    return {
        "x": torch.randn(bs, H, P, generator=g),
        "dt": torch.randn(bs, H, generator=g),
        "A": -torch.rand(H, generator=g),
        "B": torch.randn(bs, 1, N, generator=g),
        "C": torch.randn(bs, 1, N, generator=g),
    }


def _pools() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer-major pools of ``S`` slots inside buffers of ``S + 3``: (conv, ssm, big, big)."""
    g = torch.Generator().manual_seed(1)
    conv_big = torch.randn(L, S + 3, D, K - 1, generator=g)
    ssm_big = torch.randn(L, S + 3, H, P, N, generator=g)
    return conv_big[:, :S], ssm_big[:, :S], conv_big, ssm_big


def _refused(
    call: Callable[[], object],
    match: str,
    *bufs: torch.Tensor,
    exc: type[Exception] = SlotIndexError,
) -> None:
    """``call`` raises ``exc`` matching ``match`` and writes none of ``bufs``."""
    before = [bits(b) for b in bufs]
    with pytest.raises(exc, match=match):
        call()
    for b, t in zip(before, bufs, strict=True):
        assert torch.equal(bits(t), b), "a refused call wrote"


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_ssm_update_state_index_past_the_pool_writes_nothing(impl: Impl) -> None:
    """Was: ``state_indices=[S]`` with ``impl="triton"`` wrote past the pool."""
    big = torch.randn(S + 2, H, P, N)
    a = _ssm_inputs(1)
    _refused(
        lambda: ssm_state_update(
            big[:S], **a, state_indices=torch.tensor([S]), impl=impl
        ),
        r"`state_indices` values must be -1 \(pad\) or in \[0, 4\); row 0 holds 4",
        big,
    )


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dst_indices", S + 1, r"`dst_indices` values must be -1 \(pad\) or in \[0, 4\); row 0 holds 5"),
        ("track_indices", S, r"`track_indices` values must be -1 \(pad\) or in \[0, 4\); row 0 holds 4"),
    ],
)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_ssm_update_destination_or_track_past_the_pool_writes_nothing(
    impl: Impl, field: str, value: int, match: str
) -> None:
    """Was: ``dst_indices=[S+1]`` / ``track_indices=[S]`` wrote past the pool; the reference
    advanced the working slot first, then raised torch's error (a retry applied the token
    twice)."""
    big = torch.randn(S + 2, H, P, N)
    a = _ssm_inputs(1)
    kw: dict[str, Any] = {field: torch.tensor([value])}
    if field == "track_indices":
        kw["track_mask"] = torch.tensor([True])
    _refused(
        lambda: ssm_state_update(
            big[:S], **a, state_indices=torch.tensor([1]), impl=impl, **kw
        ),
        match,
        big,
    )


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_track_save_track_slot_past_the_pool_writes_nothing(impl: Impl) -> None:
    """Was: ``track_save(track_indices=[S])`` wrote past both pools."""
    conv, ssm, conv_big, ssm_big = _pools()
    _refused(
        lambda: track_save(
            conv, ssm, src_indices=torch.tensor([0, 1]), track_indices=torch.tensor([2, S]),
            track_mask=torch.tensor([True, True]), impl=impl,
        ),
        r"track_save: `track_indices` values must be -1 \(pad\) or in \[0, 4\); row 1 holds 4",
        conv_big, ssm_big,
    )  # fmt: skip


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_track_save_source_past_the_pool_copies_nothing_into_a_live_slot(impl: Impl) -> None:
    """Was: ``track_save(src_indices=[S])`` copied foreign bytes (past the pool) into the
    live track slot."""
    conv, ssm, conv_big, ssm_big = _pools()
    _refused(
        lambda: track_save(
            conv, ssm, src_indices=torch.tensor([S]), track_indices=torch.tensor([2]),
            track_mask=torch.tensor([True]), impl=impl,
        ),
        r"track_save: `src_indices` values must be -1 \(pad\) or in \[0, 4\); row 0 holds 4",
        conv_big, ssm_big,
    )  # fmt: skip


def test_the_reference_names_the_argument_not_an_internal_tensor() -> None:
    """Was: the reference raised torch's ``index out of range`` about an internal tensor.
    Its device path (no host check: what a graph replays) now writes nothing and records
    the argument by name."""
    conv, ssm, conv_big, ssm_big = _pools()
    conv0, ssm0 = conv_big.clone(), ssm_big.clone()
    track_save_reference(conv, ssm, torch.tensor([1, 0]), torch.tensor([3, S + 7]),
                         torch.tensor([True, True]))  # fmt: skip
    for big, old in ((conv_big, conv0), (ssm_big, ssm0)):
        assert torch.equal(big[:, 3], old[:, 1]), "row 0 (valid) copied slot 1 into slot 3"
        others = [j for j in range(S + 3) if j != 3]
        assert torch.equal(bits(big[:, others]), bits(old[:, others])), "row 1 wrote"
    fault = check_errors()
    assert fault is not None and (fault.op, fault.field, fault.row, fault.value) == (
        "track_save", "track_indices", 1, S + 7,
    )  # fmt: skip


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("value", [-2, -5])
def test_an_id_below_the_pad_id_is_not_a_pad_row(impl: Impl, value: int) -> None:
    """Was: slot ``-2`` (any value below -1) made a live row produce zeros and keep its old
    state, silently."""
    big = torch.randn(S + 2, H, P, N)
    a = _ssm_inputs(2)
    _refused(
        lambda: ssm_state_update(
            big[:S], **a, state_indices=torch.tensor([1, value]), impl=impl
        ),
        rf"row 1 holds {value}",
        big,
    )
    conv = torch.randn(S, D, K - 1)
    _refused(
        lambda: causal_conv1d_update(
            torch.randn(2, D), conv, torch.randn(D, K), cache_indices=torch.tensor([value, 0]),
            impl=impl,
        ),
        rf"`cache_indices` values must be -1 \(pad\) or in \[0, 4\); row 0 holds {value}",
        conv,
    )  # fmt: skip


def _commit_args(acc: list[int]) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    conv, ssm, conv_big, ssm_big = _pools()
    return {
        "conv_pool": conv, "ssm_pool": ssm,
        "inter_conv": torch.randn(L, len(acc), T, D, K - 1, generator=g),
        "inter_ssm": torch.randn(L, len(acc), T, H, P, N, generator=g),
        "state_indices": torch.arange(len(acc)), "accepted_index": torch.tensor(acc),
        "_bufs": (conv_big, ssm_big),
    }  # fmt: skip


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_commit_of_the_count_instead_of_the_index_is_refused(impl: Impl) -> None:
    """Was: ``accepted_index=[.., T]`` (the count passed for the index) silently skipped the
    row's commit."""
    a = _commit_args([1, T])
    bufs = a.pop("_bufs")
    _refused(
        lambda: spec_commit(**a, impl=impl),
        r"spec_commit: `accepted_index` values must be -1 or a draft column in \[0, T=3\); "
        r"row 1 holds 3",
        *bufs,
    )


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_track_slot_that_is_another_rows_working_slot_is_refused(
    impl: Impl, debug: bool
) -> None:
    """The two implementations disagreed on it (a race in the kernel): it has no defined
    result. Where the ids are on the host (CPU tensors) it is refused by name, debug mode
    or not, before anything is written (docs/kernels.md, "Write collisions"); was: refused
    in debug mode only."""
    big = torch.randn(S + 2, H, P, N)
    a = _ssm_inputs(2)
    with debug_mode() if debug else contextlib.nullcontext():
        _refused(
            lambda: ssm_state_update(
                big[:S], **a, state_indices=torch.tensor([1, 2]),
                track_indices=torch.tensor([3, 1]), track_mask=torch.tensor([False, True]),
                impl=impl,
            ),
            r"slot 1 is written twice: by `state_indices` of row 0 and `track_indices` of row 1",
            big,
            exc=ValueError,
        )  # fmt: skip


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_a_commit_whose_track_slot_is_another_rows_working_slot_is_refused(impl: Impl) -> None:
    """spec_commit's counterpart, outside debug mode (host-known ids): row 1's track copy
    would land in the slot row 0 commits into."""
    a = _commit_args([1, 0])
    bufs = a.pop("_bufs")
    _refused(
        lambda: spec_commit(
            **a, track_indices=torch.tensor([3, 0]), track_mask=torch.tensor([False, True]),
            track_token=torch.tensor([0, 0]), impl=impl,
        ),
        r"slot 0 is written twice",
        *bufs,
        exc=ValueError,
    )  # fmt: skip


def test_vllm_pad_zero_keeps_slot_zero_a_null_slot() -> None:
    """``pad_slot_id=0`` (vLLM's ``NULL_BLOCK_ID``): rows holding 0 are pad rows, slot 0 is
    never written, and ``-1`` is an invalid id there."""
    big = torch.randn(S + 2, H, P, N)
    state = big[:S]
    a = _ssm_inputs(3)
    before = state.clone()
    out = ssm_state_update(state, **a, state_indices=torch.tensor([0, 2, 0]), pad_slot_id=0)
    assert torch.equal(state[0], before[0]) and not torch.equal(state[2], before[2])
    assert bool((out[[0, 2]] == 0).all())
    _refused(
        lambda: ssm_state_update(state, **a, state_indices=torch.tensor([2, -1, 0]), pad_slot_id=0),
        r"`state_indices` values must be 0 \(pad\) or in \[0, 4\); row 1 holds -1",
        big,
    )


# --------------------------------------------------------------------------- aliasing pools


def _expanded(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its slot axis expanded: every slot aliases slot 0."""
    return t[:1].expand(t.shape[0], *t.shape[1:])


def _alias_calls() -> list[tuple[str, Callable[[torch.Tensor], object], torch.Tensor]]:
    a = _ssm_inputs(2)
    idx = torch.tensor([0, 1])
    conv, ssm, _, _ = _pools()
    v = {"x": torch.randn(2, T, H, P), "dt": torch.randn(2, T, H), "A": a["A"],
         "B": torch.randn(2, T, 1, N), "C": torch.randn(2, T, 1, N)}  # fmt: skip
    c = _commit_args([0, 1])
    c.pop("_bufs")
    return [
        ("ssm_state_update", lambda p: ssm_state_update(p, **a, state_indices=idx), torch.randn(S, H, P, N)),
        ("causal_conv1d_update", lambda p: causal_conv1d_update(torch.randn(2, D), p, torch.randn(D, K), cache_indices=idx), torch.randn(S, D, K - 1)),
        ("track_save ssm", lambda p: track_save(conv, p, src_indices=idx, track_indices=idx + 2, track_mask=idx > 0), ssm.clone()),
        ("track_save conv", lambda p: track_save(p, ssm, src_indices=idx, track_indices=idx + 2, track_mask=idx > 0), conv.clone()),
        ("ssm_verify_update", lambda p: ssm_verify_update(p, **v, state_indices=idx, inter=torch.zeros(2, T, H, P, N)), torch.randn(S, H, P, N)),
        ("conv_verify_update", lambda p: conv_verify_update(torch.randn(2, T, D), p, torch.randn(D, K), cache_indices=idx, inter=torch.zeros(2, T, D, K - 1)), torch.randn(S, D, K - 1)),
        ("spec_commit", lambda p: spec_commit(**{**c, "ssm_pool": p}), c["ssm_pool"].clone()),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(7), ids=[c[0] for c in _alias_calls()])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_every_op_refuses_a_pool_that_aliases_itself(case: int, impl: Impl) -> None:
    """Was: an expanded (stride-0) state pool was accepted by the Triton SSM update (every
    slot one block)."""
    name, call, pool = _alias_calls()[case]
    layer_major = name.startswith(("track_save", "spec_commit"))
    bad = _expanded(pool) if not layer_major else pool[:, :1].expand(*pool.shape)
    from hybridmeta.kernels import implementation

    with implementation(impl), pytest.raises(ValueError, match=r"must not alias itself"):
        call(bad)
    # A slot stride smaller than one slot's extent overlaps too.
    flat = torch.zeros(pool.numel())
    per = pool[0].numel() if not layer_major else pool[0, 0].numel()
    if not layer_major:
        overlap = flat.as_strided(pool.shape, (per // 2, *pool.stride()[1:]))
        with implementation(impl), pytest.raises(ValueError, match=r"must not alias itself"):
            call(overlap)


# --------------------------------------------------------------------------- dt_limit


@pytest.mark.parametrize(
    ("lim", "match"),
    [
        ((float("inf"), float("inf")), r"finite lo >= 0"),
        ((-0.5, 1.0), r"finite lo >= 0"),
        ((-float("inf"), 1.0), r"finite lo >= 0"),
        ((0.5, 0.1), r"lo <= hi"),
        ((0.1, float("nan")), r"lo <= hi"),
    ],
    ids=["inf-inf", "negative", "minus-inf", "reversed", "nan-hi"],
)
@pytest.mark.parametrize("op", ["update", "verify"])
def test_impossible_dt_limits_are_refused(op: str, lim: tuple[float, float], match: str) -> None:
    """Was: ``dt_limit=(inf, inf)`` wrote NaN into the pool; negative bounds were accepted."""
    state = torch.randn(S, H, P, N)
    before = bits(state)
    a = _ssm_inputs(1)

    def run() -> object:
        if op == "update":
            return ssm_state_update(state, **a, state_indices=torch.tensor([1]), dt_limit=lim)
        return ssm_verify_update(
            state, a["x"][:, None], a["dt"][:, None], a["A"], a["B"][:, None],
            a["C"][:, None], state_indices=torch.tensor([1]),
            inter=torch.zeros(1, 1, H, P, N), dt_limit=lim,
        )  # fmt: skip

    with pytest.raises(ValueError, match=rf"`dt_limit` must have (a )?{match}"):
        run()
    assert torch.equal(bits(state), before)


def test_a_floor_with_no_ceiling_is_accepted() -> None:
    state = torch.randn(S, H, P, N)
    ssm_state_update(
        state, **_ssm_inputs(1), state_indices=torch.tensor([1]), dt_limit=(0.0, float("inf"))
    )


# --------------------------------------------------------------------------- pad_slot_id


def _pad_calls() -> list[tuple[str, Callable[[object], object]]]:
    a = _ssm_inputs(1)
    idx = torch.tensor([0])
    conv, ssm, _, _ = _pools()
    c = _commit_args([0])
    c.pop("_bufs")
    v = {"x": torch.randn(1, T, H, P), "dt": torch.randn(1, T, H), "A": a["A"],
         "B": torch.randn(1, T, 1, N), "C": torch.randn(1, T, 1, N)}  # fmt: skip
    return [
        ("ssm_state_update", lambda p: ssm_state_update(torch.randn(S, H, P, N), **a, state_indices=idx, pad_slot_id=p)),  # type: ignore[arg-type]
        ("causal_conv1d_update", lambda p: causal_conv1d_update(torch.randn(1, D), torch.randn(S, D, K - 1), torch.randn(D, K), cache_indices=idx, pad_slot_id=p)),  # type: ignore[arg-type]
        ("track_save", lambda p: track_save(conv, ssm, src_indices=idx, track_indices=idx, track_mask=idx > 0, pad_slot_id=p)),  # type: ignore[arg-type]
        ("ssm_verify_update", lambda p: ssm_verify_update(torch.randn(S, H, P, N), **v, state_indices=idx, inter=torch.zeros(1, T, H, P, N), pad_slot_id=p)),  # type: ignore[arg-type]
        ("conv_verify_update", lambda p: conv_verify_update(torch.randn(1, T, D), torch.randn(S, D, K - 1), torch.randn(D, K), cache_indices=idx, inter=torch.zeros(1, T, D, K - 1), pad_slot_id=p)),  # type: ignore[arg-type]
        ("spec_commit", lambda p: spec_commit(**c, pad_slot_id=p)),  # type: ignore[arg-type]
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _pad_calls()])
@pytest.mark.parametrize("pad", [True, 1.0, 2**31, -(2**31) - 1, "0"], ids=repr)
def test_a_pad_slot_id_that_is_not_an_int32_is_refused(case: int, pad: object) -> None:
    name, call = _pad_calls()[case]
    with pytest.raises(ValueError, match=rf"{name}: `pad_slot_id` must be an int in int32"):
        call(pad)


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("split", [False, True], ids=["one-pass", "split-keys"])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_attention_slots_and_positions_outside_the_caches_touch_nothing(
    impl: Impl, split: bool
) -> None:
    """The KV write and the attention read ids on the device too: a slot outside
    ``[-1, S)`` or a live row's position outside ``[0, max_len)`` writes nothing (not even
    the scratch row), reads nothing, gives NaN and is recorded (the first row)."""
    from hybridmeta.kernels.attention_decode import (
        decode_attention_reference,
        kv_cache_write_reference,
        launch_decode_attention,
    )

    Sa, M, KVH, hd, B, Tq = 3, 32, 1, 16, 4, 2
    g = torch.Generator().manual_seed(2)
    kbig, vbig = (torch.randn(Sa + 3, M, KVH, hd, generator=g) for _ in range(2))
    kc, vc = kbig[: Sa + 1], vbig[: Sa + 1]  # S slots and the scratch row, then a guard
    k, v, q = (torch.randn(B, Tq, KVH, hd, generator=g) for _ in range(3))
    slots = torch.tensor([1, Sa + 1, -1, 0])  # row 1: the guard past the scratch row
    pos = torch.tensor([[3, 4], [0, 1], [99, -5], [5, M]])  # row 3 token 1: past max_len
    k0, v0 = kbig.clone(), vbig.clone()
    if impl == "triton":
        torch.ops.hybridmeta.kv_cache_write(k, v, kc, vc, slots, pos, error_record_cpu())
    else:
        kv_cache_write_reference(k, v, kc, vc, slots, pos)
    written = {(1, 3), (1, 4), (0, 5)}
    for big, old, x in ((kbig, k0, k), (vbig, v0, v)):
        for s_ in range(Sa + 3):
            for m in range(M):
                if (s_, m) not in written:
                    assert torch.equal(bits(big[s_, m]), bits(old[s_, m])), (s_, m)
        assert torch.equal(big[1, 3], x[0, 0]) and torch.equal(big[0, 5], x[3, 0])
    fault = check_errors()
    assert fault is not None and (fault.op, fault.field, fault.row, fault.value) == (
        "kv_cache_write", "slots", 1, Sa + 1,
    )  # fmt: skip

    if impl == "triton":
        out = torch.full((B, Tq, KVH * hd), 7.0)
        launch_decode_attention(
            q, kc, vc, slots, pos, 0.25, out, block_n=16, splits=(2, 16) if split else None
        )
    else:
        out = decode_attention_reference(q, kc, vc, slots, pos, 0.25)
    assert not bool(torch.isnan(out[[0, 3], 0]).any()), "the live tokens read their keys"
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isnan(out[3, 1]).all())
    assert bool((out[2] == 0).all()), "a pad row reads nothing, outputs zeros"
    fault = check_errors()
    assert fault is not None and (fault.op, fault.field, fault.row) == (
        "decode_attention", "slots", 1,
    )  # fmt: skip
    # Without the bad row, the bad position is the first fault.
    slots2 = torch.tensor([1, 2, -1, 0])
    out2 = (
        decode_attention_reference(q, kc, vc, slots2, pos, 0.25) if impl == "reference" else out
    )
    if impl == "triton":
        launch_decode_attention(q, kc, vc, slots2, pos, 0.25, out2, block_n=16)
    fault = check_errors()
    assert fault is not None and (fault.field, fault.row, fault.value) == ("positions", 3, M)
    assert "`positions` values must be in [0, 32); row 3 holds 32" in fault.message()


def error_record_cpu() -> torch.Tensor:
    from hybridmeta.kernels import error_record

    return error_record("cpu")


# --------------------------------------------------------------------------- prefill ops


def _prefill_case(slots: tuple[int, ...], track_slots: tuple[int, ...] = (7, 8)) -> Any:
    from tests.kernels.test_ssd_scan import spec_of
    from tests.properties.strategies.prefill import make_layer

    # Row 0 resumes from its slot (prefix 3), row 1 starts fresh; both track a boundary
    # inside their new tokens (interval 4).
    spec = spec_of(
        extend_lens=(6, 7), prefix_lens=(3, 0), slots=slots, track_mask=(True, True),
        track_slots=track_slots, chunk_size=4, track_interval=4, pool_size=10,
    )  # fmt: skip
    return spec, make_layer(spec)


def _guarded_pools(data: Any, extra: int = 3) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The layer's data with its pools moved into the front of buffers ``extra`` slots
    longer: ``(data, conv_big, ssm_big)``."""
    conv_big = torch.cat([data.conv_pool, torch.randn(extra, *data.conv_pool.shape[1:])])
    ssm_big = torch.cat([data.ssm_pool, torch.randn(extra, *data.ssm_pool.shape[1:])])
    data = attrs.evolve(data, conv_pool=conv_big[:-extra], ssm_pool=ssm_big[:-extra])
    return data, conv_big, ssm_big


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_prefill_slot_past_the_pool_is_refused_before_anything_runs(impl: Impl) -> None:
    """Was: a pool smaller than the slots gave torch's raw index error (the Triton scan
    raised after its kernels ran)."""
    from tests.properties.strategies.prefill import plan_of, run_pipeline

    spec, data = _prefill_case((2, 10 + 1))
    data, conv_big, ssm_big = _guarded_pools(data)
    md = plan_of(spec)
    _refused(
        lambda: run_pipeline(spec, data, md, impl=impl),
        r"causal_conv1d_prefill: `prefill_slots` values must be -1 \(pad\) or in \[0, 10\); "
        r"row 1 holds 11",
        conv_big, ssm_big,
    )  # fmt: skip


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_prefill_slot_past_the_pool_on_the_device_writes_nothing(impl: Impl) -> None:
    """The device path of the same call: the row with the invalid slot reads and writes no
    state (nor its track slots), its outputs are NaN; the other row is exact."""
    from tests.properties.strategies.prefill import plan_of, run_pipeline

    spec, data = _prefill_case((2, 10 + 1))
    data, conv_big, ssm_big = _guarded_pools(data)
    conv0, ssm0 = conv_big.clone(), ssm_big.clone()
    md = plan_of(spec)
    ref_spec, ref_data = _prefill_case((2, 5))  # the same rows, row 1 in a valid slot
    ref_conv, ref_scan = run_pipeline(ref_spec, ref_data, plan_of(ref_spec), impl=impl)
    with OpLog():
        conv, scan = run_pipeline(spec, data, md, impl=impl)
    fault = check_errors()
    assert fault is not None and (fault.op, fault.field, fault.row, fault.value) == (
        "causal_conv1d_prefill", "prefill_slots", 1, 11,
    )  # fmt: skip
    n0 = spec.extend_lens[0]
    assert bool(torch.isnan(scan.y[n0:]).all()), "row 1's outputs are poisoned"
    assert torch.allclose(scan.y[:n0], ref_scan.y[:n0], atol=1e-5), "row 0 is exact"
    assert torch.allclose(conv.out[:n0], ref_conv.out[:n0])
    # Row 0 wrote its working slot 2 and its track slot 7; nothing else changed.
    for big, old in ((conv_big, conv0), (ssm_big, ssm0)):
        others = [s for s in range(big.shape[0]) if s not in (2, 7)]
        assert torch.equal(bits(big[others]), bits(old[others])), "the invalid row wrote"
        assert not torch.equal(big[2], old[2])


def test_prefill_track_slot_past_the_pool_is_refused() -> None:
    from tests.properties.strategies.prefill import plan_of, run_pipeline

    spec, data = _prefill_case((2, 5), track_slots=(7, 10 + 2))
    data, conv_big, ssm_big = _guarded_pools(data)
    before = (bits(conv_big), bits(ssm_big))
    md = plan_of(spec)
    with pytest.raises(SlotIndexError, match=r"extend_track_save: `mamba_track_indices` values "
                       r"must be -1 \(pad\) or in \[0, 10\); row 1 holds 12"):  # fmt: skip
        run_pipeline(spec, data, md)
    # The conv and the scan ran (their slots are valid); the track save wrote nothing.
    assert torch.equal(bits(conv_big)[10:], before[0][10:])
    assert torch.equal(bits(ssm_big)[10:], before[1][10:])
    assert torch.equal(bits(ssm_big)[7], before[1][7]), "row 0's boundary was not saved either"


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ("ssm int32", TypeError, r"ssd_chunked_scan: `ssm_state` must have dtype"),
        ("conv int32", TypeError, r"causal_conv1d_prefill: `conv_state` must have dtype"),
        ("A long", ValueError, r"ssd_chunked_scan: `params.A` must have shape \[nheads\]"),
        ("D short", ValueError, r"ssd_chunked_scan: `params.D` must have shape \[nheads\]"),
        ("dt_bias long", ValueError, r"`params.dt_bias` must have shape \[nheads\]"),
        ("ssm meta", ValueError, r"ssd_chunked_scan: `x` must be on the state's device meta"),
        ("conv meta", ValueError, r"causal_conv1d_prefill: `xbc` must be on the state's device"),
        ("ssm expanded", ValueError, r"ssd_chunked_scan: `ssm_state` must not alias itself"),
    ],
)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_prefill_ops_validate_like_the_decode_ops(
    impl: Impl, change: str, exc: type[Exception], match: str
) -> None:
    """Was: an int32 state pool was accepted (states truncated), a pool on another device
    gave torch's errors, parameters of the wrong length broadcasting errors."""
    from hybridmeta.kernels import SSMParams
    from tests.properties.strategies.prefill import plan_of, run_pipeline

    spec, data = _prefill_case((2, 5))
    H = spec.nheads
    p = data.params
    ssm, conv = data.ssm_pool, data.conv_pool
    change_of = {
        "ssm int32": {"ssm_pool": ssm.to(torch.int32)},
        "conv int32": {"conv_pool": conv.to(torch.int32)},
        "A long": {"params": SSMParams(A=torch.randn(H + 1), D=p.D, dt_bias=p.dt_bias)},
        "D short": {"params": SSMParams(A=p.A, D=torch.randn(H - 1), dt_bias=p.dt_bias)},
        "dt_bias long": {"params": SSMParams(A=p.A, D=p.D, dt_bias=torch.randn(H + 1))},
        "ssm meta": {"ssm_pool": ssm.to("meta")},
        "conv meta": {"conv_pool": conv.to("meta")},
        "ssm expanded": {"ssm_pool": ssm[:1].expand(*ssm.shape)},
    }
    data = attrs.evolve(data, **change_of[change])
    before = {k: getattr(data, k).clone() for k in ("conv_pool", "ssm_pool")}
    with pytest.raises(exc, match=match):
        run_pipeline(spec, data, plan_of(spec), impl=impl)
    # The scan's pool is never written (the conv's only by a conv that passed its checks).
    untouched = ["ssm_pool"] + (["conv_pool"] if change.startswith("conv") else [])
    for k in untouched:
        if before[k].device.type != "meta":
            assert torch.equal(getattr(data, k), before[k]), k
