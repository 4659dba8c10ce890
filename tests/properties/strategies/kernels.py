"""Hypothesis strategies for the decode kernels.

Each strategy draws a *case* (shapes, dtypes, options and a slot plan: pad rows shuffled
among live rows, distinct written slots) plus a seed; ``*_tensors`` turns a case into
tensors on a device. Tensors are drawn from the seed with torch, not element by element,
so examples stay cheap under the Triton interpreter.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import strategies as st

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16)


@attrs.frozen
class SlotPlan:
    """Per-row slots. ``src[b] == -1`` marks a pad row; unused entries hold garbage."""

    slots: int
    src: tuple[int, ...]
    dst: tuple[int, ...] | None
    track: tuple[int, ...] | None
    track_mask: tuple[bool, ...] | None

    @property
    def bs(self) -> int:
        return len(self.src)

    def written(self) -> set[int]:
        """Slots a correct kernel writes (dst or src of live rows, track of flagged live rows)."""
        out: set[int] = set()
        for b, s in enumerate(self.src):
            if s < 0:
                continue
            d = self.dst[b] if self.dst is not None else s
            if d >= 0:
                out.add(d)
            flagged = self.track_mask is not None and self.track_mask[b]
            if self.track is not None and flagged and self.track[b] >= 0:
                out.add(self.track[b])
        return out


@st.composite
def slot_plans(
    draw: st.DrawFn, bs: int, *, with_dst: bool, with_track: bool, max_spare: int = 3
) -> SlotPlan:
    """Live rows get distinct slots; dst / track slots are distinct from all of those.

    Pad rows (and unflagged rows' track entries) carry garbage: ``-1``, other rows' live
    slots, or any in-range slot, so a kernel that honours them wrongly is caught.
    """
    n_live = draw(st.integers(0, bs))
    order = draw(st.permutations(range(bs)))
    live_rows = set(order[:n_live])  # pads shuffled among live rows
    need = n_live * (1 + int(with_dst) + int(with_track))
    slots = max(1, need + draw(st.integers(0, max_spare)))
    perm = draw(st.permutations(range(slots)))
    free = iter(perm)
    src = [next(free) if b in live_rows else -1 for b in range(bs)]
    any_slot = st.integers(-1, slots - 1)
    dst: list[int] | None = None
    if with_dst:
        # A live row may also write nothing (-1); a pad row's dst is garbage.
        dst = [next(free) if b in live_rows else draw(any_slot) for b in range(bs)]
        for b in sorted(live_rows):
            if draw(st.integers(0, 4)) == 0:
                dst[b] = -1
    track: list[int] | None = None
    mask: list[bool] | None = None
    if with_track:
        track, mask = [], []
        for b in range(bs):
            flagged = draw(st.booleans())
            mask.append(flagged)
            if b in live_rows:
                slot = next(free)
                # Unflagged live rows keep a valid-looking slot: it must not be written.
                track.append(slot if flagged or draw(st.booleans()) else -1)
            else:
                track.append(draw(any_slot))
    return SlotPlan(
        slots=slots,
        src=tuple(src),
        dst=tuple(dst) if dst is not None else None,
        track=tuple(track) if track is not None else None,
        track_mask=tuple(mask) if mask is not None else None,
    )


@attrs.frozen
class SsmCase:
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype
    has_D: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    plan: SlotPlan
    tail: int  # extra rows of the static buffers past bs (filled with garbage)
    seed: int


@st.composite
def ssm_cases(
    draw: st.DrawFn,
    *,
    max_bs: int = 4,
    heads: tuple[int, ...] = (1, 2, 4),
    headdims: st.SearchStrategy[int] | None = None,
    dstates: st.SearchStrategy[int] | None = None,
    with_dst: bool | None = None,
    with_track: bool | None = None,
) -> SsmCase:
    """A small SSM-update problem (sizes chosen for the CPU interpreter)."""
    nheads = draw(st.sampled_from(heads))
    ngroups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if nheads % g == 0]))
    headdim = draw(headdims if headdims is not None else st.integers(1, 20))
    dstate = draw(dstates if dstates is not None else st.integers(1, 20))
    bs = draw(st.integers(1, max_bs))
    dst = draw(st.booleans()) if with_dst is None else with_dst
    trk = draw(st.booleans()) if with_track is None else with_track
    return SsmCase(
        nheads=nheads,
        headdim=headdim,
        dstate=dstate,
        ngroups=ngroups,
        state_dtype=draw(st.sampled_from(STATE_DTYPES)),
        act_dtype=draw(st.sampled_from(ACT_DTYPES)),
        has_D=draw(st.booleans()),
        has_z=draw(st.booleans()),
        has_dt_bias=draw(st.booleans()),
        dt_softplus=draw(st.booleans()),
        plan=draw(slot_plans(bs, with_dst=dst, with_track=trk)),
        tail=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _idx(values: tuple[int, ...] | None, device: torch.device) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, dtype=torch.int64, device=device)


@attrs.frozen
class SsmTensors:
    state: torch.Tensor
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    state_indices: torch.Tensor
    dst_indices: torch.Tensor | None
    track_indices: torch.Tensor | None
    track_mask: torch.Tensor | None


def ssm_tensors(case: SsmCase, device: torch.device) -> SsmTensors:
    """Inputs of one SSM case: compact ``[bs]`` tensors, random but finite."""
    g = torch.Generator().manual_seed(case.seed)
    p = case.plan
    bs, H, P, N, G = p.bs, case.nheads, case.headdim, case.dstate, case.ngroups
    act = case.act_dtype

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device)

    mask = p.track_mask
    return SsmTensors(
        state=rnd(p.slots, H, P, N).to(case.state_dtype),
        x=rnd(bs, H, P).to(act),
        dt=rnd(bs, H, scale=0.5).to(act),
        A=-torch.rand(H, generator=g).to(device) * 2.0,
        B=rnd(bs, G, N).to(act),
        C=rnd(bs, G, N).to(act),
        D=rnd(H) if case.has_D else None,
        z=rnd(bs, H, P).to(act) if case.has_z else None,
        dt_bias=rnd(H, scale=0.5) if case.has_dt_bias else None,
        state_indices=torch.tensor(p.src, dtype=torch.int64, device=device),
        dst_indices=_idx(p.dst, device),
        track_indices=_idx(p.track, device),
        track_mask=None if mask is None else torch.tensor(mask, dtype=torch.bool, device=device),
    )


@attrs.frozen
class ConvCase:
    conv_dim: int
    width: int
    state_dtype: torch.dtype
    act_dtype: torch.dtype
    has_bias: bool
    silu: bool
    channels_inner: bool  # state stored [slots, k-1, conv_dim] (viewed as [slots, conv_dim, k-1])
    plan: SlotPlan
    tail: int
    seed: int


@st.composite
def conv_cases(
    draw: st.DrawFn, *, max_bs: int = 4, dims: st.SearchStrategy[int] | None = None
) -> ConvCase:
    """A small causal-conv1d update problem."""
    bs = draw(st.integers(1, max_bs))
    return ConvCase(
        conv_dim=draw(dims if dims is not None else st.integers(1, 300)),
        width=draw(st.integers(2, 5)),
        state_dtype=draw(st.sampled_from(STATE_DTYPES)),
        act_dtype=draw(st.sampled_from(ACT_DTYPES)),
        has_bias=draw(st.booleans()),
        silu=draw(st.booleans()),
        channels_inner=draw(st.booleans()),
        plan=draw(slot_plans(bs, with_dst=False, with_track=False)),
        tail=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@attrs.frozen
class ConvTensors:
    x: torch.Tensor
    conv_state: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    cache_indices: torch.Tensor


def conv_tensors(case: ConvCase, device: torch.device) -> ConvTensors:
    """Inputs of one conv case."""
    g = torch.Generator().manual_seed(case.seed)
    p = case.plan
    D, k = case.conv_dim, case.width
    if case.channels_inner:
        state = torch.randn(p.slots, k - 1, D, generator=g).transpose(1, 2)
    else:
        state = torch.randn(p.slots, D, k - 1, generator=g)
    return ConvTensors(
        x=torch.randn(p.bs, D, generator=g).to(device, case.act_dtype),
        conv_state=state.to(device, case.state_dtype),
        weight=(torch.randn(D, k, generator=g) * 0.5).to(device, case.act_dtype),
        bias=torch.randn(D, generator=g).to(device, case.act_dtype) if case.has_bias else None,
        cache_indices=torch.tensor(p.src, dtype=torch.int64, device=device),
    )


@attrs.frozen
class TrackCase:
    layers: int
    nheads: int
    headdim: int
    dstate: int
    conv_dim: int
    width: int
    ssm_dtype: torch.dtype
    conv_dtype: torch.dtype
    plan: SlotPlan
    tail: int
    seed: int


@st.composite
def track_cases(draw: st.DrawFn, *, max_bs: int = 4) -> TrackCase:
    """A small track-save problem over layer-major pools."""
    bs = draw(st.integers(1, max_bs))
    return TrackCase(
        layers=draw(st.integers(1, 3)),
        nheads=draw(st.integers(1, 3)),
        headdim=draw(st.integers(1, 6)),
        dstate=draw(st.integers(1, 8)),
        conv_dim=draw(st.integers(1, 24)),
        width=draw(st.integers(2, 4)),
        ssm_dtype=draw(st.sampled_from(STATE_DTYPES)),
        conv_dtype=draw(st.sampled_from(STATE_DTYPES)),
        plan=draw(slot_plans(bs, with_dst=False, with_track=True)),
        tail=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def track_tensors(case: TrackCase, device: torch.device) -> dict[str, torch.Tensor]:
    """Pools and row tensors of one track-save case."""
    g = torch.Generator().manual_seed(case.seed)
    p = case.plan
    assert p.track is not None
    assert p.track_mask is not None
    L = case.layers
    return {
        "conv_pool": torch.randn(L, p.slots, case.conv_dim, case.width - 1, generator=g).to(
            device, case.conv_dtype
        ),
        "ssm_pool": torch.randn(L, p.slots, case.nheads, case.headdim, case.dstate, generator=g).to(
            device, case.ssm_dtype
        ),
        "src_indices": torch.tensor(p.src, dtype=torch.int64, device=device),
        "track_indices": torch.tensor(p.track, dtype=torch.int64, device=device),
        "track_mask": torch.tensor(p.track_mask, dtype=torch.bool, device=device),
    }


def garbage_rows(
    t: torch.Tensor, tail: int, *, live_slots: list[int], slots: int, seed: int
) -> torch.Tensor:
    """A static buffer: ``t`` followed by ``tail`` rows of garbage.

    Index tensors get other rows' live slot ids and out-of-range ids; bool tensors get
    True; float tensors get NaN. Returns the buffer; ``buf[: t.shape[0]]`` is a view.
    """
    buf = torch.empty((t.shape[0] + tail, *t.shape[1:]), dtype=t.dtype, device=t.device)
    buf[: t.shape[0]] = t
    if tail == 0:
        return buf
    if t.dtype == torch.bool:
        buf[t.shape[0] :] = True
    elif t.dtype in (torch.int32, torch.int64):
        g = torch.Generator().manual_seed(seed)
        pool = [*live_slots, slots, slots + 7, 2**30, -5]
        picks = torch.randint(0, len(pool), (tail, *t.shape[1:]), generator=g)
        buf[t.shape[0] :] = torch.tensor(pool, dtype=t.dtype)[picks].to(t.device)
    else:
        buf[t.shape[0] :] = float("nan")
    return buf


# --------------------------------------------------------------------------- speculative decoding


@st.composite
def draft_trees(draw: st.DrawFn, T: int, *, chain_weight: int = 3) -> tuple[int, ...]:
    """A draft tree of ``T`` tokens as a parent array, topologically ordered.

    ``retrieve_parent_token`` convention: token 0 is a root (``-1``); every other token's
    parent is an earlier token or, now and then, ``-1`` (another root, starting again from
    the working state). Chains (``parent[t] = t - 1``) are drawn often on purpose.
    """
    if T == 0:
        return ()
    if draw(st.integers(0, chain_weight)) == 0:
        return (-1, *range(T - 1))
    return (-1, *(draw(st.integers(-1, t - 1)) for t in range(1, T)))


def tree_paths(parents: tuple[int, ...], n: int | None = None) -> list[list[int]]:
    """Root-to-leaf paths (lists of columns) of the tree formed by the first ``n`` tokens."""
    n = len(parents) if n is None else n
    has_child = [False] * n
    for t in range(n):
        if parents[t] >= 0:
            has_child[parents[t]] = True
    paths: list[list[int]] = []
    for leaf in range(n):
        if has_child[leaf]:
            continue
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


@attrs.frozen
class SpecCase:
    """A verify + commit problem: one Mamba2 layer (SSM and conv), ``bs`` rows of ``T`` drafts.

    ``src[b] == -1`` marks a pad row; ``parents`` is ``None`` for chains, else one tree per
    row (pad rows' trees are garbage a kernel must ignore); ``num_draft`` is ``None`` for
    ``T`` live columns in every row. ``tail_rows`` / ``tail_cols`` are garbage rows and
    draft columns of the static buffers past ``[:bs, :T]``.
    """

    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    conv_dim: int
    width: int
    state_dtype: torch.dtype
    conv_dtype: torch.dtype
    act_dtype: torch.dtype
    has_D: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    has_conv_bias: bool
    silu: bool
    T: int
    slots: int
    src: tuple[int, ...]
    parents: tuple[tuple[int, ...], ...] | None
    num_draft: tuple[int, ...] | None
    tail_rows: int
    tail_cols: int
    seed: int

    @property
    def bs(self) -> int:
        return len(self.src)

    def live_count(self, b: int) -> int:
        """Live draft columns of row ``b`` (0 for a pad row)."""
        if self.src[b] < 0:
            return 0
        return self.T if self.num_draft is None else self.num_draft[b]

    def parent_of(self, b: int, t: int) -> int:
        return t - 1 if self.parents is None else self.parents[b][t]


@st.composite
def spec_cases(
    draw: st.DrawFn,
    *,
    max_bs: int = 3,
    max_T: int = 4,
    trees: bool | None = None,
    ragged: bool | None = None,
) -> SpecCase:
    """A small verify problem (sizes chosen for the CPU interpreter, which runs every
    program of the grid one after another: a few heads, rows and draft columns)."""
    nheads = draw(st.sampled_from((1, 2)))
    ngroups = draw(st.sampled_from([g for g in (1, 2) if nheads % g == 0]))
    bs = draw(st.integers(1, max_bs))
    T = draw(st.integers(1, max_T))
    n_live = draw(st.integers(0, bs))
    order = draw(st.permutations(range(bs)))
    live_rows = set(order[:n_live])  # pads shuffled among live rows
    slots = max(1, n_live + draw(st.integers(0, 3)))
    perm = iter(draw(st.permutations(range(slots))))
    src = tuple(next(perm) if b in live_rows else -1 for b in range(bs))
    use_trees = draw(st.booleans()) if trees is None else trees
    parents = tuple(draw(draft_trees(T)) for _ in range(bs)) if use_trees else None
    use_ragged = draw(st.booleans()) if ragged is None else ragged
    num_draft = tuple(draw(st.integers(0, T)) for _ in range(bs)) if use_ragged else None
    return SpecCase(
        nheads=nheads,
        headdim=draw(st.integers(1, 10)),
        dstate=draw(st.integers(1, 16)),
        ngroups=ngroups,
        conv_dim=draw(st.integers(1, 40)),
        width=draw(st.integers(2, 5)),
        state_dtype=draw(st.sampled_from(STATE_DTYPES)),
        conv_dtype=draw(st.sampled_from(STATE_DTYPES)),
        act_dtype=draw(st.sampled_from(ACT_DTYPES)),
        has_D=draw(st.booleans()),
        has_z=draw(st.booleans()),
        has_dt_bias=draw(st.booleans()),
        dt_softplus=draw(st.booleans()),
        has_conv_bias=draw(st.booleans()),
        silu=draw(st.booleans()),
        T=T,
        slots=slots,
        src=src,
        parents=parents,
        num_draft=num_draft,
        tail_rows=draw(st.integers(0, 2)),
        tail_cols=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@attrs.frozen
class SpecTensors:
    """Compact ``[bs, T]`` inputs of one :class:`SpecCase` (random but finite)."""

    state: torch.Tensor  # [slots, H, P, N]
    x: torch.Tensor  # [bs, T, H, P]
    dt: torch.Tensor  # [bs, T, H]
    A: torch.Tensor
    B: torch.Tensor  # [bs, T, G, N]
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    conv_state: torch.Tensor  # [slots, conv_dim, k-1]
    xc: torch.Tensor  # [bs, T, conv_dim]
    weight: torch.Tensor  # [conv_dim, k]
    conv_bias: torch.Tensor | None
    state_indices: torch.Tensor  # [bs]
    parent: torch.Tensor | None  # [bs, T]
    num_draft: torch.Tensor | None  # [bs]


def spec_tensors(case: SpecCase, device: torch.device) -> SpecTensors:
    """Inputs of one spec case. Pad rows' parents and counts are garbage on purpose."""
    g = torch.Generator().manual_seed(case.seed)
    bs, T, H, P, N, G = case.bs, case.T, case.nheads, case.headdim, case.dstate, case.ngroups
    act = case.act_dtype
    D_, k = case.conv_dim, case.width

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device)

    parent = None
    if case.parents is not None:
        rows = [
            list(case.parents[b])
            if case.src[b] >= 0
            else torch.randint(-3, T + 3, (T,), generator=g).tolist()
            for b in range(bs)
        ]
        parent = torch.tensor(rows, dtype=torch.int64, device=device).reshape(bs, T)
    num_draft = None
    if case.num_draft is not None:
        counts = [case.num_draft[b] if case.src[b] >= 0 else T + 5 for b in range(bs)]
        num_draft = torch.tensor(counts, dtype=torch.int64, device=device)
    # A time step is positive: with dt_softplus the kernel makes it so, without it the
    # engine passes dt (and dt_bias) already positive. Then exp(A * dt) <= 1 and the state's
    # rounding errors do not grow along a row (the tolerances below rely on it).
    dt = rnd(bs, T, H, scale=0.5)
    dt_bias = rnd(H, scale=0.5) if case.has_dt_bias else None
    if not case.dt_softplus:
        dt = dt.abs()
        dt_bias = None if dt_bias is None else dt_bias.abs()
    return SpecTensors(
        state=rnd(case.slots, H, P, N).to(case.state_dtype),
        x=rnd(bs, T, H, P).to(act),
        dt=dt.to(act),
        A=-torch.rand(H, generator=g).to(device) * 2.0,
        B=rnd(bs, T, G, N).to(act),
        C=rnd(bs, T, G, N).to(act),
        D=rnd(H) if case.has_D else None,
        z=rnd(bs, T, H, P).to(act) if case.has_z else None,
        dt_bias=dt_bias,
        conv_state=rnd(case.slots, D_, k - 1).to(case.conv_dtype),
        xc=rnd(bs, T, D_).to(act),
        weight=(rnd(D_, k) * 0.5).to(act),
        conv_bias=rnd(D_).to(act) if case.has_conv_bias else None,
        state_indices=torch.tensor(case.src, dtype=torch.int64, device=device),
        parent=parent,
        num_draft=num_draft,
    )


def garbage_block(
    t: torch.Tensor, tail_rows: int, tail_cols: int, *, slots: int, seed: int
) -> torch.Tensor:
    """A ``[bs + tail_rows, T + tail_cols, ...]`` static buffer holding ``t`` in its
    ``[:bs, :T]`` corner and garbage elsewhere (NaN for floats; for integers other columns,
    out-of-range ids and ``-1``). Returns the buffer; ``buf[:bs, :T]`` is a view."""
    bs, T = t.shape[:2]
    buf = torch.empty((bs + tail_rows, T + tail_cols, *t.shape[2:]), dtype=t.dtype, device=t.device)
    if t.dtype.is_floating_point:
        buf.fill_(float("nan"))
    else:
        g = torch.Generator().manual_seed(seed)
        pool = torch.tensor([-1, 0, slots, 2**30, T + 1], dtype=t.dtype)
        picks = torch.randint(0, len(pool), buf.shape, generator=g)
        buf.copy_(pool[picks].to(t.device))
    buf[:bs, :T] = t
    return buf


@attrs.frozen
class CommitCase:
    """A commit problem over layer-major pools: per-row accepted column and track boundary."""

    layers: int
    nheads: int
    headdim: int
    dstate: int
    conv_dim: int
    width: int
    ssm_dtype: torch.dtype
    conv_dtype: torch.dtype
    T: int
    slots: int
    src: tuple[int, ...]
    accepted: tuple[int, ...]  # [-1, T)
    track: tuple[int, ...] | None
    track_mask: tuple[bool, ...] | None
    track_token: tuple[int, ...] | None
    tail: int
    seed: int

    @property
    def bs(self) -> int:
        return len(self.src)


@st.composite
def commit_cases(draw: st.DrawFn, *, max_bs: int = 4, with_track: bool | None = None) -> CommitCase:
    """Live rows get distinct working slots; track slots are distinct from all of those.

    Pad rows carry garbage accepted columns and track entries; unflagged rows keep a
    valid-looking track slot and boundary column that must not be written.
    """
    bs = draw(st.integers(1, max_bs))
    T = draw(st.integers(1, 4))
    n_live = draw(st.integers(0, bs))
    order = draw(st.permutations(range(bs)))
    live_rows = set(order[:n_live])
    trk = draw(st.booleans()) if with_track is None else with_track
    slots = max(1, n_live * (2 if trk else 1) + draw(st.integers(0, 3)))
    free = iter(draw(st.permutations(range(slots))))
    src = tuple(next(free) if b in live_rows else -1 for b in range(bs))
    accepted = tuple(draw(st.integers(-1, T - 1)) for _ in range(bs))
    track = mask = token = None
    if trk:
        track_l: list[int] = []
        mask_l: list[bool] = []
        token_l: list[int] = []
        for b in range(bs):
            flagged = draw(st.booleans())
            mask_l.append(flagged)
            token_l.append(draw(st.integers(-1, T - 1)))
            if b in live_rows:
                track_l.append(next(free) if flagged or draw(st.booleans()) else -1)
            else:
                track_l.append(draw(st.integers(-1, slots - 1)))
        track, mask, token = tuple(track_l), tuple(mask_l), tuple(token_l)
    return CommitCase(
        layers=draw(st.integers(1, 3)),
        nheads=draw(st.integers(1, 3)),
        headdim=draw(st.integers(1, 6)),
        dstate=draw(st.integers(1, 8)),
        conv_dim=draw(st.integers(1, 24)),
        width=draw(st.integers(2, 4)),
        ssm_dtype=draw(st.sampled_from(STATE_DTYPES)),
        conv_dtype=draw(st.sampled_from(STATE_DTYPES)),
        T=T,
        slots=slots,
        src=src,
        accepted=accepted,
        track=track,
        track_mask=mask,
        track_token=token,
        tail=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def commit_tensors(case: CommitCase, device: torch.device) -> dict[str, torch.Tensor | None]:
    """Pools, intermediate buffers and per-row tensors of one commit case."""
    g = torch.Generator().manual_seed(case.seed)
    L, bs, T = case.layers, case.bs, case.T
    H, P, N, D_, k = case.nheads, case.headdim, case.dstate, case.conv_dim, case.width

    def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return {
        "conv_pool": rnd(L, case.slots, D_, k - 1, dtype=case.conv_dtype),
        "ssm_pool": rnd(L, case.slots, H, P, N, dtype=case.ssm_dtype),
        "inter_conv": rnd(L, bs, T, D_, k - 1, dtype=case.conv_dtype),
        "inter_ssm": rnd(L, bs, T, H, P, N, dtype=case.ssm_dtype),
        "state_indices": torch.tensor(case.src, dtype=torch.int64, device=device),
        "accepted_index": torch.tensor(case.accepted, dtype=torch.int64, device=device),
        "track_indices": _idx(case.track, device),
        "track_mask": None
        if case.track_mask is None
        else torch.tensor(case.track_mask, dtype=torch.bool, device=device),
        "track_token": _idx(case.track_token, device),
    }


@attrs.frozen
class AttentionCase:
    """Decode / verify attention over a slot pool: ``T`` tokens per row, row ``b`` at
    positions ``first[b] .. first[b] + T - 1`` of slot ``src[b]`` (``-1``: a pad row,
    whose ``first`` is garbage), keys cut into ``splits`` (``None``: the default rule)."""

    slots: int
    src: tuple[int, ...]
    first: tuple[int, ...]
    T: int
    max_len: int
    kv_heads: int
    group: int
    head_dim: int
    dtype: torch.dtype
    splits: tuple[int, int] | None
    seed: int

    @property
    def bs(self) -> int:
        return len(self.src)


@st.composite
def attention_cases(draw: st.DrawFn, *, max_bs: int = 3) -> AttentionCase:
    bs = draw(st.integers(1, max_bs))
    plan = draw(slot_plans(bs, with_dst=False, with_track=False))
    T = draw(st.integers(1, 3))
    max_len = draw(st.integers(T, 40))
    first = tuple(
        draw(st.integers(0, max_len - T)) if s >= 0 else draw(st.integers(-5, 10**6))
        for s in plan.src
    )
    keys = draw(st.sampled_from((16, 32)))
    # the default rule, one pass, or splits of 16 / 32 keys covering max_len
    splits = draw(st.sampled_from((None, (1, max_len), (-(-max_len // keys), keys))))
    return AttentionCase(
        slots=plan.slots,
        src=plan.src,
        first=first,
        T=T,
        max_len=max_len,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from((1, 3, 5))),
        head_dim=draw(st.sampled_from((8, 16))),
        dtype=draw(st.sampled_from((torch.float32, torch.bfloat16))),
        splits=splits,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# --------------------------------------------------------------------------- ids of every kind
#
# The safety properties (``tests/properties/test_kernels_safety.py``) draw every slot field
# with pad rows, valid slots and invalid ids mixed, under a declared pad id, and run the
# ops on pools that are views into a larger guard buffer.

#: Invalid ids tried besides the ones just outside the pool: far below, far above, and
#: past int32 (int64 index tensors only).
_FAR_IDS = (-2, -7, -(2**31), 2**31 - 1)
_HUGE_IDS = (2**40, -(2**40), 2**62)


@attrs.frozen
class Ids:
    """A row layout of one slot pool: its size, the declared pad id and the index dtype."""

    slots: int
    pad: int
    dtype: torch.dtype
    guard: int  # slots of guard buffer before and after the pool

    def valid(self, v: int) -> bool:
        return 0 <= v < self.slots and v != self.pad

    def kind(self, v: int) -> str:
        """``"pad"``, ``"valid"`` or ``"invalid"``."""
        if v == self.pad:
            return "pad"
        return "valid" if self.valid(v) else "invalid"


@st.composite
def id_layouts(draw: st.DrawFn, need: int, *, max_spare: int = 2) -> Ids:
    """A pool with at least ``need`` valid slots, a pad id (``-1``, vLLM's ``0``, or any
    small id in or around the pool) and an index dtype."""
    pad = draw(st.sampled_from([-1, -1, 0, 0]) | st.integers(-3, need + 3))
    slots = need + draw(st.integers(0, max_spare))
    if 0 <= pad < slots or (pad >= slots and draw(st.booleans())):
        slots += 1  # the pad id takes a slot of the pool (vLLM's reserved null slot)
    return Ids(
        slots=slots,
        pad=pad,
        dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        guard=draw(st.integers(1, 2)),
    )


@st.composite
def invalid_ids(draw: st.DrawFn, ids: Ids) -> int:
    """An id that is neither the pad id nor a valid slot of ``ids``."""
    near = [ids.slots, ids.slots + 1, ids.slots + 3, -1, -2]
    far = list(_FAR_IDS) + (list(_HUGE_IDS) if ids.dtype == torch.int64 else [])
    v = draw(st.sampled_from([x for x in near + far if x != ids.pad and not ids.valid(x)]))
    return v


@st.composite
def any_ids(draw: st.DrawFn, ids: Ids) -> int:
    """Garbage a field may hold where it is not looked at: pad, valid or invalid."""
    return draw(
        st.sampled_from([ids.pad, -1, 0, ids.slots - 1, ids.slots])
        | invalid_ids(ids)
        | st.integers(0, max(ids.slots - 1, 0))
    )


class SlotDraw:
    """Draws distinct valid slots of a layout (written and read slots never collide)."""

    def __init__(self, draw: st.DrawFn, ids: Ids) -> None:
        free = [s for s in range(ids.slots) if ids.valid(s)]
        self._free = list(draw(st.permutations(free)))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None


#: Row kinds for a source id, drawn with these weights.
ROW_KINDS = ("valid", "valid", "pad", "invalid")


@attrs.frozen
class SafeSsmCase:
    ids: Ids
    nheads: int
    headdim: int
    dstate: int
    src: tuple[int, ...]
    dst: tuple[int, ...] | None
    track: tuple[int, ...] | None
    mask: tuple[bool, ...] | None
    seed: int

    @property
    def bs(self) -> int:
        return len(self.src)


@st.composite
def safe_ssm_cases(draw: st.DrawFn, *, max_bs: int = 5) -> SafeSsmCase:
    """An SSM update whose source, destination and track ids mix pad, valid and invalid
    values (distinct written slots, never another row's source)."""
    bs = draw(st.integers(1, max_bs))
    with_dst, with_track = draw(st.booleans()), draw(st.booleans())
    ids = draw(id_layouts(bs * (1 + int(with_dst) + int(with_track))))
    pool = SlotDraw(draw, ids)
    kinds = [draw(st.sampled_from(ROW_KINDS)) for _ in range(bs)]
    src: list[int] = []
    for k in kinds:
        s = pool.take() if k == "valid" else None
        src.append(s if s is not None else (ids.pad if k != "invalid" else draw(invalid_ids(ids))))

    def field(row_live: bool) -> int:
        if not row_live:
            return draw(any_ids(ids))  # a pad row's other ids are never looked at
        k = draw(st.sampled_from(("valid", "valid", "none", "invalid")))
        if k == "valid":
            s = pool.take()
            if s is not None:
                return s
        return ids.pad if k != "invalid" else draw(invalid_ids(ids))

    dst = tuple(field(ids.valid(s)) for s in src) if with_dst else None
    track = mask = None
    if with_track:
        mask = tuple(draw(st.booleans()) for _ in range(bs))
        track = tuple(
            field(ids.valid(s)) if m else draw(any_ids(ids)) for s, m in zip(src, mask, strict=True)
        )
    return SafeSsmCase(
        ids=ids, nheads=draw(st.integers(1, 2)), headdim=draw(st.integers(1, 4)),
        dstate=draw(st.integers(1, 6)), src=tuple(src), dst=dst, track=track, mask=mask,
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@attrs.frozen
class SafeRowsCase:
    """One source id per row (conv update), or source, track id and flag (track-save)."""

    ids: Ids
    src: tuple[int, ...]
    track: tuple[int, ...] | None
    mask: tuple[bool, ...] | None
    seed: int

    @property
    def bs(self) -> int:
        return len(self.src)


@st.composite
def safe_rows_cases(draw: st.DrawFn, *, with_track: bool, max_bs: int = 5) -> SafeRowsCase:
    """Conv update (``with_track=False``) or track-save ids of every kind: distinct valid
    working slots; track slots distinct, never another row's working slot."""
    bs = draw(st.integers(1, max_bs))
    ids = draw(id_layouts(bs * (2 if with_track else 1)))
    pool = SlotDraw(draw, ids)
    src: list[int] = []
    for _ in range(bs):
        k = draw(st.sampled_from(ROW_KINDS))
        s = pool.take() if k == "valid" else None
        src.append(s if s is not None else (ids.pad if k != "invalid" else draw(invalid_ids(ids))))
    track = mask = None
    if with_track:
        mask = tuple(draw(st.booleans()) for _ in range(bs))
        out: list[int] = []
        for s, m in zip(src, mask, strict=True):
            if not (m and ids.valid(s)):
                out.append(draw(any_ids(ids)))
                continue
            k = draw(st.sampled_from(("valid", "valid", "none", "invalid")))
            t = pool.take() if k == "valid" else None
            out.append(t if t is not None else (ids.pad if k != "invalid" else draw(invalid_ids(ids))))
        track = tuple(out)
    return SafeRowsCase(
        ids=ids, src=tuple(src), track=track, mask=mask, seed=draw(st.integers(0, 2**31 - 1))
    )


@attrs.frozen
class SafeVerifyCase:
    ids: Ids
    T: int
    src: tuple[int, ...]
    num_draft: tuple[int, ...] | None
    parent: tuple[tuple[int, ...], ...] | None
    seed: int

    @property
    def bs(self) -> int:
        return len(self.src)


@st.composite
def safe_verify_cases(draw: st.DrawFn, *, max_bs: int = 4) -> SafeVerifyCase:
    """Verify ids: working slots of every kind, live counts in and out of ``[0, T]``,
    parents in and out of ``[-1, t)`` (a valid tree, or one bad entry)."""
    bs = draw(st.integers(1, max_bs))
    T = draw(st.integers(1, 3))
    ids = draw(id_layouts(bs))
    pool = SlotDraw(draw, ids)
    src: list[int] = []
    for _ in range(bs):
        k = draw(st.sampled_from(ROW_KINDS))
        s = pool.take() if k == "valid" else None
        src.append(s if s is not None else (ids.pad if k != "invalid" else draw(invalid_ids(ids))))
    nd = None
    if draw(st.booleans()):
        nd = tuple(
            draw(st.integers(0, T) | st.sampled_from([-1, T + 1, T + 5])) if draw(st.booleans())
            else T
            for _ in range(bs)
        )  # fmt: skip
    par = None
    if draw(st.booleans()):
        rows = [list(draw(draft_trees(T))) for _ in range(bs)]
        for r in rows:
            if draw(st.integers(0, 3)) == 0:
                t = draw(st.integers(0, T - 1))
                r[t] = draw(st.sampled_from([t, t + 1, T + 2, -2, -(2**31)]))
        par = tuple(tuple(r) for r in rows)
    return SafeVerifyCase(
        ids=ids, T=T, src=tuple(src), num_draft=nd, parent=par,
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@attrs.frozen
class SafeCommitCase:
    ids: Ids
    T: int
    src: tuple[int, ...]
    acc: tuple[int, ...]
    track: tuple[int, ...] | None
    mask: tuple[bool, ...] | None
    token: tuple[int, ...] | None
    seed: int

    @property
    def bs(self) -> int:
        return len(self.src)


@st.composite
def safe_commit_cases(draw: st.DrawFn, *, max_bs: int = 4) -> SafeCommitCase:
    """Commit ids: working and track slots of every kind (distinct written slots),
    accepted and boundary columns in and out of ``[-1, T)``."""
    bs = draw(st.integers(1, max_bs))
    T = draw(st.integers(1, 3))
    with_track = draw(st.booleans())
    ids = draw(id_layouts(bs * (2 if with_track else 1)))
    pool = SlotDraw(draw, ids)
    cols = st.integers(-1, T - 1) | st.sampled_from([T, T + 2, -2, -(2**31)])
    src: list[int] = []
    for _ in range(bs):
        k = draw(st.sampled_from(ROW_KINDS))
        s = pool.take() if k == "valid" else None
        src.append(s if s is not None else (ids.pad if k != "invalid" else draw(invalid_ids(ids))))
    acc = tuple(draw(cols) for _ in range(bs))
    track = mask = token = None
    if with_track:
        mask = tuple(draw(st.booleans()) for _ in range(bs))
        out: list[int] = []
        for s, m in zip(src, mask, strict=True):
            if not (m and ids.valid(s)):
                out.append(draw(any_ids(ids)))
                continue
            k = draw(st.sampled_from(("valid", "valid", "none", "invalid")))
            t = pool.take() if k == "valid" else None
            out.append(t if t is not None else (ids.pad if k != "invalid" else draw(invalid_ids(ids))))
        track = tuple(out)
        token = tuple(draw(cols) for _ in range(bs))
    return SafeCommitCase(
        ids=ids, T=T, src=tuple(src), acc=acc, track=track, mask=mask, token=token,
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip
