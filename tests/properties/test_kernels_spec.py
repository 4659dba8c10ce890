"""Properties of the speculative-decoding kernels: verify (chains, trees) and commit.

Every verify run hands the kernels ``[:bs, :T]`` views of static buffers whose rows past
``bs`` and draft columns past ``T`` hold garbage (NaN, other rows' slots, out-of-range
ids): results must not depend on them and the buffers' tails must stay unwritten.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridmeta import debug_mode
from hybridmeta.kernels import (
    causal_conv1d_update,
    conv_verify_update,
    spec_commit,
    spec_track_token,
    ssm_state_update,
    ssm_verify_update,
)
from tests.kernels._support import (
    DEVICE,
    TOLERANCES,
    assert_close,
    bits,
    conv_verify_update_ref,
    nan_empty,
    spec_commit_ref,
    ssm_verify_update_ref,
)
from tests.properties.strategies import kernels as kst


@attrs.frozen
class Verified:
    """Static buffers the verify kernels wrote into (``[:bs, :T]`` is the live corner)."""

    inter: torch.Tensor  # [bs + tr, T + tc, H, P, N]
    out: torch.Tensor  # [bs + tr, T + tc, H, P]
    inter_conv: torch.Tensor  # [bs + tr, T + tc, conv_dim, k-1]
    out_conv: torch.Tensor  # [bs + tr, T + tc, conv_dim]


def _verify(
    case: kst.SpecCase,
    t: kst.SpecTensors,
    *,
    tail_rows: int = 0,
    tail_cols: int = 0,
    state: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> Verified:
    """Run both verify kernels on ``[:bs, :T]`` views of garbage-tailed static buffers."""
    bs, T = case.bs, case.T
    live = [s for s in case.src if s >= 0]
    n = 0

    def block(v: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal n
        n += 1
        if v is None:
            return None
        buf = kst.garbage_block(v, tail_rows, tail_cols, slots=case.slots, seed=case.seed + n)
        return buf[:bs, :T]

    def rows(v: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal n
        n += 1
        if v is None:
            return None
        buf = kst.garbage_rows(v, tail_rows, live_slots=live, slots=case.slots, seed=case.seed + n)
        return buf[:bs]

    H, P, N = case.nheads, case.headdim, case.dstate
    shape = (bs + tail_rows, T + tail_cols)
    v = Verified(
        inter=nan_empty(*shape, H, P, N, dtype=case.state_dtype),
        out=nan_empty(*shape, H, P, dtype=case.act_dtype),
        inter_conv=nan_empty(*shape, case.conv_dim, case.width - 1, dtype=case.conv_dtype),
        out_conv=nan_empty(*shape, case.conv_dim, dtype=case.act_dtype),
    )
    si, nd, par = rows(t.state_indices), rows(t.num_draft), block(t.parent)
    x, dt, B, C, z, xc = (block(u) for u in (t.x, t.dt, t.B, t.C, t.z, t.xc))
    assert x is not None and dt is not None and B is not None and C is not None
    assert si is not None and xc is not None
    res = ssm_verify_update(
        t.state if state is None else state, x, dt, t.A, B, C, state_indices=si,
        inter=v.inter[:bs, :T], D=t.D, z=z, dt_bias=t.dt_bias, dt_softplus=case.dt_softplus,
        parent=par, num_draft=nd, out=v.out[:bs, :T],
    )  # fmt: skip
    assert res.data_ptr() == v.out.data_ptr()
    conv_verify_update(
        xc, t.conv_state if conv_state is None else conv_state, t.weight, t.conv_bias,
        cache_indices=si, inter=v.inter_conv[:bs, :T], activation="silu" if case.silu else None,
        parent=par, num_draft=nd, out=v.out_conv[:bs, :T],
    )  # fmt: skip
    return v


def _keep(case: kst.SpecCase) -> torch.Tensor:
    """[bs, T] bool: the live (row, column) pairs."""
    cols = torch.arange(case.T)
    n = torch.tensor([case.live_count(b) for b in range(case.bs)])
    return (cols[None, :] < n[:, None]).to(DEVICE)


def _close_state(
    actual: torch.Tensor, expected: torch.Tensor, case: kst.SpecCase, what: str, *, conv: bool
) -> None:
    """:func:`assert_close`, loosened on the CPU interpreter where values went through bf16.

    The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest, as torch does). The
    verify kernels round through the state dtype after every token (SSM state) or for every
    ancestor input (conv window): against the torch reference a bf16 pool makes results
    differ by bf16 steps, and the SSM state's steps compound over the ``T`` tokens of a row.
    """
    dtype = case.conv_dtype if conv else case.state_dtype
    if DEVICE.type == "cuda" or dtype != torch.bfloat16:
        assert_close(actual, expected, what)
        return
    assert not bool(torch.isnan(actual).any()), f"{what}: NaN in result"
    rtol, atol = TOLERANCES[torch.bfloat16]
    scale = 1 if conv else case.T
    torch.testing.assert_close(
        actual, expected, rtol=rtol * scale, atol=atol * scale, msg=lambda m: f"{what}: {m}"
    )


def _close_out_to_own_states(v: Verified, t: kst.SpecTensors, case: kst.SpecCase) -> None:
    """SSM output on the CPU interpreter with a bf16 state: ``out`` against the kernel's own states.

    There each token's state is truncated to bf16 where torch rounds, so the reference's
    states drift from the kernel's by bf16 steps. The output of token ``t`` is
    ``(C_t . h_t + D x_t) silu(z_t)`` of the fp32 state ``h_t`` whose bf16 copy the kernel
    stored in ``inter``; they differ by at most one bf16 truncation (``2**-7`` relative),
    so the bound per element is ``2**-7 * sum_n |C_n| |inter_n| * |silu(z)|`` (doubled, plus
    fp32 slack). Dead columns are zero (checked by :func:`_check_tails`).
    """
    bs, T = case.bs, case.T
    keep = _keep(case)
    inter = torch.nan_to_num(v.inter[:bs, :T].float()) * keep[:, :, None, None, None]
    rep = case.nheads // case.ngroups
    Ch = t.C.float().repeat_interleave(rep, dim=2)  # [bs, T, H, N]
    y = torch.einsum("bthpn,bthn->bthp", inter, Ch)
    scale = torch.einsum("bthpn,bthn->bthp", inter.abs(), Ch.abs())
    if t.D is not None:
        y = y + t.x.float() * t.D.float()[None, None, :, None]
    gate = torch.ones_like(y)
    if t.z is not None:
        gate = torch.nn.functional.silu(t.z.float())
    expected = y * gate * keep[:, :, None, None]
    # The output's own rounding to the activation dtype (truncation here too).
    out_ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(case.act_dtype, 0.0)
    bound = 2 * 2.0**-7 * scale * gate.abs() + (1e-4 + out_ulp) * (1 + expected.abs())
    err = (v.out[:bs, :T].float() - expected).abs()
    assert not bool(torch.isnan(v.out[:bs, :T]).any()), "ssm out: NaN"
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"ssm out: element {worst} (flat) differs from the output of the kernel's own state by "
        f"{err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"
    )


def _check_tails(v: Verified, case: kst.SpecCase) -> None:
    """Nothing past the live corner, and no dead (row, column) block, was written."""
    bs, T = case.bs, case.T
    for name in ("inter", "out", "inter_conv", "out_conv"):
        buf = getattr(v, name)
        assert bool(torch.isnan(buf[bs:]).all()), f"{name}: a row past bs was written"
        assert bool(torch.isnan(buf[:, T:]).all()), f"{name}: a column past T was written"
    dead = ~_keep(case)
    assert bool(torch.isnan(v.inter[:bs, :T][dead]).all()), "inter: a dead block was written"
    assert bool(torch.isnan(v.inter_conv[:bs, :T][dead]).all()), "inter_conv: dead block written"
    # Dead columns and pad rows get a defined output: zeros.
    assert bool((v.out[:bs, :T][dead] == 0).all()), "out: a dead column is not zero"
    assert bool((v.out_conv[:bs, :T][dead] == 0).all()), "out_conv: a dead column is not zero"


@given(case=kst.spec_cases())
def test_verify_matches_reference_and_ignores_stale_tails(case: kst.SpecCase) -> None:
    t = kst.spec_tensors(case, DEVICE)
    bs, T = case.bs, case.T
    state0, conv0 = t.state.clone(), t.conv_state.clone()
    v = _verify(case, t)
    ref_inter, ref_out = ssm_verify_update_ref(
        t.state, t.x, t.dt, t.A, t.B, t.C, torch.full_like(v.inter[:bs, :T], float("nan")),
        t.state_indices, D=t.D,
        z=t.z, dt_bias=t.dt_bias, dt_softplus=case.dt_softplus, parent=t.parent,
        num_draft=t.num_draft,
    )  # fmt: skip
    ref_ic, ref_oc = conv_verify_update_ref(
        t.xc, t.conv_state, t.weight, t.conv_bias, torch.full_like(v.inter_conv[:bs, :T], float("nan")),
        t.state_indices, silu=case.silu, parent=t.parent, num_draft=t.num_draft,
    )  # fmt: skip
    keep = _keep(case)
    _check_tails(v, case)
    if DEVICE.type == "cuda" or case.state_dtype != torch.bfloat16:
        assert_close(v.out[:bs, :T], ref_out, "ssm out")
    else:
        _close_out_to_own_states(v, t, case)
    _close_state(v.inter[:bs, :T][keep], ref_inter[keep], case, "ssm inter", conv=False)
    _close_state(v.out_conv[:bs, :T], ref_oc, case, "conv out", conv=True)
    _close_state(v.inter_conv[:bs, :T][keep], ref_ic[keep], case, "conv inter", conv=True)
    # The pools are only read.
    assert torch.equal(bits(t.state), bits(state0))
    assert torch.equal(bits(t.conv_state), bits(conv0))

    # Garbage rows past bs and columns past T in every static buffer change nothing.
    g = _verify(case, t, tail_rows=max(case.tail_rows, 1), tail_cols=max(case.tail_cols, 1))
    _check_tails(g, case)
    for name in ("inter", "out", "inter_conv", "out_conv"):
        assert torch.equal(bits(getattr(g, name)[:bs, :T]), bits(getattr(v, name)[:bs, :T])), name


def _sequential_along(
    case: kst.SpecCase, t: kst.SpecTensors, paths: list[tuple[int, list[int]]]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Single-token kernel updates along each ``(row, path)``, batched by depth.

    Each path gets its own scratch slot seeded with its row's working state; at depth
    ``d`` every path still that long is one row of a single-token update. Returns, per
    depth, the scratch SSM pool, the SSM output, the scratch conv pool and the conv output.
    """
    P_ = len(paths)
    rows = torch.tensor([b for b, _ in paths], dtype=torch.long, device=DEVICE)
    src = t.state_indices[rows]
    ssm = t.state[src].clone()  # [paths, H, P, N]
    conv = t.conv_state[src].clone()
    depth = max(len(p) for _, p in paths)
    ssm_after, ssm_out, conv_after, conv_out = [], [], [], []
    for d in range(depth):
        on = [d < len(p) for _, p in paths]
        cols = torch.tensor([p[d] if d < len(p) else 0 for _, p in paths], device=DEVICE)
        idx = torch.tensor([i if on[i] else -1 for i in range(P_)], device=DEVICE)

        z = None if t.z is None else t.z[rows, cols]
        o = ssm_state_update(
            ssm, t.x[rows, cols], t.dt[rows, cols], t.A, t.B[rows, cols], t.C[rows, cols],
            state_indices=idx, D=t.D, z=z, dt_bias=t.dt_bias, dt_softplus=case.dt_softplus,
        )  # fmt: skip
        ssm_out.append(o)
        oc = causal_conv1d_update(
            t.xc[rows, cols], conv, t.weight, t.conv_bias, cache_indices=idx,
            activation="silu" if case.silu else None,
        )  # fmt: skip
        conv_out.append(oc)
        ssm_after.append(ssm.clone())
        conv_after.append(conv.clone())
    return ssm_after, ssm_out, conv_after, conv_out


def _live_paths(case: kst.SpecCase) -> list[tuple[int, list[int]]]:
    out: list[tuple[int, list[int]]] = []
    for b in range(case.bs):
        n = case.live_count(b)
        if n == 0:
            continue
        parents = tuple(case.parent_of(b, c) for c in range(case.T))
        out.extend((b, p) for p in kst.tree_paths(parents, n))
    return out


@given(case=kst.spec_cases(trees=False))
def test_chain_verify_equals_sequential_single_token_updates(case: kst.SpecCase) -> None:
    """A chain verify equals T sequential ``ssm_state_update`` / ``causal_conv1d_update``
    calls: the state after every token and every token's output."""
    _verify_equals_paths(case)


@given(case=kst.spec_cases(trees=True))
def test_tree_verify_equals_sequential_updates_along_each_path(case: kst.SpecCase) -> None:
    """Per root-to-leaf path of each row's tree, the single-token updates along the path give
    the verify's intermediate state and output at every token of the path."""
    _verify_equals_paths(case)


def _verify_equals_paths(case: kst.SpecCase) -> None:
    t = kst.spec_tensors(case, DEVICE)
    v = _verify(case, t)
    paths = _live_paths(case)
    _check_tails(v, case)
    if not paths:
        return
    ssm_after, ssm_out, conv_after, conv_out = _sequential_along(case, t, paths)
    for i, (b, path) in enumerate(paths):
        for d, col in enumerate(path):
            where = f"row {b} path {path} depth {d}"
            # Both sides round the state to its dtype after every token, with the same
            # rounding mode: the single-token table tolerance holds.
            assert_close(v.inter[b, col], ssm_after[d][i], f"ssm state, {where}")
            assert_close(v.out[b, col], ssm_out[d][i], f"ssm out, {where}")
            assert_close(v.inter_conv[b, col], conv_after[d][i], f"conv window, {where}")
            assert_close(v.out_conv[b, col], conv_out[d][i], f"conv out, {where}")


@given(case=kst.spec_cases(), data=st.data())
def test_commit_after_k_accepted_equals_k_sequential_updates(
    case: kst.SpecCase, data: st.DataObject
) -> None:
    """Verify, accept ``k`` tokens along one path per row, commit (with a track boundary):
    the working slot holds the state after the ``k`` sequential updates, the track slot the
    state at exactly the boundary token, and every other slot is bit-identical."""
    t = kst.spec_tensors(case, DEVICE)
    bs, T = case.bs, case.T
    # One extra slot per row for its track copy (distinct from every working slot).
    g = torch.Generator().manual_seed(case.seed)
    ssm_pool = torch.cat([t.state, torch.randn(bs, *t.state.shape[1:], generator=g).to(t.state)])
    conv_pool = torch.cat(
        [t.conv_state, torch.randn(bs, *t.conv_state.shape[1:], generator=g).to(t.conv_state)]
    )
    ssm_pool, conv_pool = ssm_pool[None].clone(), conv_pool[None].clone()  # layer-major, L = 1
    t = attrs.evolve(t, state=ssm_pool[0].clone(), conv_state=conv_pool[0].clone())
    v = _verify(case, t)

    interval = data.draw(st.integers(1, 5), label="interval")
    paths: list[list[int]] = []
    ks: list[int] = []
    for b in range(bs):
        n = case.live_count(b)
        options = kst.tree_paths(tuple(case.parent_of(b, c) for c in range(T)), n) if n else [[]]
        path = data.draw(st.sampled_from(options), label=f"path {b}")
        paths.append(path)
        ks.append(data.draw(st.integers(0, len(path)), label=f"k {b}"))
    seq_lens = torch.tensor(
        [data.draw(st.integers(0, 3 * interval), label=f"seq_len {b}") for b in range(bs)],
        device=DEVICE,
    )
    path_t = torch.tensor([p + [0] * (T - len(p)) for p in paths], device=DEVICE).reshape(bs, T)
    k_t = torch.tensor(ks, device=DEVICE)
    accepted = torch.where(
        k_t > 0, path_t.gather(1, (k_t - 1).clamp(min=0)[:, None])[:, 0], torch.full_like(k_t, -1)
    )
    track_token = spec_track_token(seq_lens, k_t, interval, path=path_t)
    track = torch.tensor([case.slots + b for b in range(bs)], device=DEVICE)
    mask = torch.tensor(
        [data.draw(st.booleans(), label=f"flag {b}") for b in range(bs)], device=DEVICE
    )

    before_ssm, before_conv = ssm_pool.clone(), conv_pool.clone()
    spec_commit(
        conv_pool, ssm_pool, v.inter_conv[None, :bs, :T], v.inter[None, :bs, :T],
        state_indices=t.state_indices, accepted_index=accepted, track_indices=track,
        track_mask=mask, track_token=track_token,
    )  # fmt: skip

    expect_ssm, expect_conv = before_ssm.clone(), before_conv.clone()
    walked = [(b, paths[b][: ks[b]]) for b in range(bs) if case.src[b] >= 0 and ks[b] > 0]
    if walked:
        ssm_after, _, conv_after, _ = _sequential_along(case, t, walked)
        for i, (b, path) in enumerate(walked):
            slot = case.src[b]
            expect_ssm[0, slot] = ssm_after[len(path) - 1][i]
            expect_conv[0, slot] = conv_after[len(path) - 1][i]
            j = int(track_token[b])
            if bool(mask[b]) and j >= 0:
                d = path.index(j)  # the boundary token lies on the accepted path
                # Exactly the boundary: seq_len + d + 1 tokens are in that state.
                assert (int(seq_lens[b]) + d + 1) % interval == 0
                expect_ssm[0, case.slots + b] = ssm_after[d][i]
                expect_conv[0, case.slots + b] = conv_after[d][i]
    changed = (
        (bits(expect_ssm) != bits(before_ssm)).flatten(2).any(dim=2)[0]
        | (bits(expect_conv) != bits(before_conv)).flatten(2).any(dim=2)[0]
    )
    untouched = (~changed).nonzero()[:, 0]
    # Pad rows, rows with nothing accepted, unflagged rows' track slots: bit-identical.
    assert torch.equal(bits(ssm_pool[:, untouched]), bits(before_ssm[:, untouched]))
    assert torch.equal(bits(conv_pool[:, untouched]), bits(before_conv[:, untouched]))
    assert_close(ssm_pool, expect_ssm, "committed ssm pool")
    assert_close(conv_pool, expect_conv, "committed conv pool")
    # The commit itself is a copy: bit-exact against the intermediate buffers.
    ref_conv, ref_ssm = spec_commit_ref(
        before_conv, before_ssm, v.inter_conv[None, :bs, :T], v.inter[None, :bs, :T],
        t.state_indices, accepted, track, mask, track_token,
    )  # fmt: skip
    assert torch.equal(bits(ssm_pool), bits(ref_ssm))
    assert torch.equal(bits(conv_pool), bits(ref_conv))


@given(case=kst.commit_cases())
def test_commit_matches_reference_bitwise(case: kst.CommitCase) -> None:
    t = kst.commit_tensors(case, DEVICE)
    args = {k: t[k] for k in ("state_indices", "accepted_index", "track_indices", "track_mask",
                              "track_token")}  # fmt: skip
    conv, ssm, ic, iss = (t[k] for k in ("conv_pool", "ssm_pool", "inter_conv", "inter_ssm"))
    assert conv is not None and ssm is not None and ic is not None and iss is not None
    ref_conv, ref_ssm = spec_commit_ref(conv, ssm, ic, iss, **args)
    bs = case.bs
    live = [s for s in case.src if s >= 0]
    tailed = {
        k: None
        if u is None
        else kst.garbage_rows(u, case.tail, live_slots=live, slots=case.slots, seed=case.seed + i)[
            :bs
        ]
        for i, (k, u) in enumerate(args.items())
    }
    # Intermediate buffers: static [max_bs, max_draft] buffers, NaN past the live corner.
    T = case.T
    ic_buf = torch.full((ic.shape[0], bs + 1, T + 1, *ic.shape[3:]), float("nan")).to(ic)
    is_buf = torch.full((iss.shape[0], bs + 1, T + 1, *iss.shape[3:]), float("nan")).to(iss)
    ic_buf[:, :bs, :T] = ic
    is_buf[:, :bs, :T] = iss
    conv_k, ssm_k = conv.clone(), ssm.clone()
    spec_commit(conv_k, ssm_k, ic_buf[:, :bs, :T], is_buf[:, :bs, :T], **tailed)  # type: ignore[arg-type]
    assert torch.equal(bits(conv_k), bits(ref_conv))
    assert torch.equal(bits(ssm_k), bits(ref_ssm))


@given(case=kst.spec_cases(trees=True, max_bs=2, max_T=3), data=st.data())
def test_debug_mode_refuses_a_bad_draft_and_writes_nothing(
    case: kst.SpecCase, data: st.DataObject
) -> None:
    """A live column whose parent is not an earlier column, or a live row's draft count past
    T, is refused in debug mode by both verify ops before anything is written."""
    live_rows = [b for b in range(case.bs) if case.src[b] >= 0]
    if not live_rows:
        return
    t = kst.spec_tensors(case, DEVICE)
    assert t.parent is not None
    b = data.draw(st.sampled_from(live_rows), label="row")
    n = case.live_count(b)
    if n > 0 and data.draw(st.booleans(), label="corrupt parent"):
        col = data.draw(st.integers(0, n - 1), label="column")
        bad = data.draw(st.sampled_from([col, col + 1, case.T + 2, -2]), label="parent")
        parent = t.parent.clone()
        parent[b, col] = bad
        t = attrs.evolve(t, parent=parent)
        match = r"`parent` values must be -1 \(a root\) or an earlier column"
    else:
        nd = t.num_draft.clone() if t.num_draft is not None else torch.full_like(
            t.state_indices, case.T
        )
        nd[b] = data.draw(st.sampled_from([case.T + 1, -1]), label="num_draft")
        t = attrs.evolve(t, num_draft=nd)
        match = r"`num_draft` values must be in \[0, T="
    with debug_mode():
        for run in ("ssm", "conv"):
            inter = nan_empty(case.bs, case.T, case.nheads, case.headdim, case.dstate,
                              dtype=case.state_dtype)  # fmt: skip
            inter_c = nan_empty(case.bs, case.T, case.conv_dim, case.width - 1,
                                dtype=case.conv_dtype)  # fmt: skip
            out = nan_empty(case.bs, case.T, case.nheads, case.headdim, dtype=case.act_dtype)
            out_c = nan_empty(case.bs, case.T, case.conv_dim, dtype=case.act_dtype)
            if run == "ssm":
                with pytest.raises(ValueError, match=match):
                    ssm_verify_update(
                        t.state, t.x, t.dt, t.A, t.B, t.C, state_indices=t.state_indices,
                        inter=inter, parent=t.parent, num_draft=t.num_draft, out=out,
                    )  # fmt: skip
            else:
                with pytest.raises(ValueError, match=match):
                    conv_verify_update(
                        t.xc, t.conv_state, t.weight, cache_indices=t.state_indices,
                        inter=inter_c, parent=t.parent, num_draft=t.num_draft, out=out_c,
                    )  # fmt: skip
            for name, buf in (("inter", inter), ("inter_conv", inter_c), ("out", out),
                              ("out_conv", out_c)):  # fmt: skip
                assert bool(torch.isnan(buf).all()), f"{run}: {name} written before refusing"


@given(case=kst.commit_cases(with_track=True), data=st.data())
def test_debug_mode_refuses_a_bad_commit_and_writes_nothing(
    case: kst.CommitCase, data: st.DataObject
) -> None:
    """An accepted or boundary column outside [-1, T), or two rows writing one slot, is
    refused in debug mode; both pools stay bit-identical."""
    live_rows = [b for b in range(case.bs) if case.src[b] >= 0]
    if not live_rows:
        return
    t = kst.commit_tensors(case, DEVICE)
    b = data.draw(st.sampled_from(live_rows), label="row")
    kind = data.draw(st.sampled_from(["accepted", "token", "collision"]), label="defect")
    acc, trk, mask, tok = (t[k] for k in ("accepted_index", "track_indices", "track_mask",
                                          "track_token"))  # fmt: skip
    assert acc is not None and trk is not None and mask is not None and tok is not None
    if kind == "accepted":
        acc[b] = data.draw(st.sampled_from([case.T, case.T + 3, -2]), label="value")
        match = r"`accepted_index` values must be -1 or a draft column in \[0, T="
    elif kind == "token":
        mask[b] = True
        trk[b] = max(case.src) + case.slots  # a fresh slot, in range below
        tok[b] = data.draw(st.sampled_from([case.T, -2]), label="value")
        match = r"`track_token` values must be -1 or a draft column"
    else:
        # Row b's boundary copy targets another live row's working slot (or its own).
        other = data.draw(st.sampled_from(live_rows), label="other")
        acc[other] = 0
        mask[b], tok[b], trk[b] = True, 0, case.src[other]
        match = r"slot \d+ is written twice"
    slots = case.slots + max(case.src) + case.slots + 1
    grow = slots - case.slots
    pools = {}
    for k in ("conv_pool", "ssm_pool"):
        p = t[k]
        assert p is not None
        pools[k] = torch.cat([p, torch.zeros(p.shape[0], grow, *p.shape[2:]).to(p)], dim=1)
    before = {k: bits(p) for k, p in pools.items()}
    ic, iss, si = t["inter_conv"], t["inter_ssm"], t["state_indices"]
    assert ic is not None and iss is not None and si is not None
    with debug_mode(), pytest.raises(ValueError, match=match):
        spec_commit(
            pools["conv_pool"], pools["ssm_pool"], ic, iss, state_indices=si, accepted_index=acc,
            track_indices=trk, track_mask=mask, track_token=tok,
        )  # fmt: skip
    for k, p in pools.items():
        assert torch.equal(bits(p), before[k]), k
