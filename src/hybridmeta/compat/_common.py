"""What every peer module of :mod:`hybridmeta.compat` shares: argument normalisation and
the compositions of hybridmeta ops that the peers' multi-token and index conventions need.

Pad ids are not translated: each composition takes the peer's pad id (``pad``) and passes
it to the ops as their ``pad_slot_id``; its own torch writes skip the pad id and any id
outside the pool (:func:`valid_slots`).

Everything here is sync-free (fixed shapes, device ops only) unless its docstring says
otherwise, so the peer functions built on it capture into CUDA graphs like the ops.

Compositions (each listed in ``docs/compat.md``, "Compositions", with its cost):

* :func:`ssm_tokens` with ``T > 1`` (or an intermediate buffer, or per-token
  destinations): :func:`~hybridmeta.kernels.ssm_verify_update` into a scratch
  ``[N, T, H, P, N]`` buffer, then :func:`write_rows_` copies the states the peer stores
  (per-token destination slots, the final state, the peer's intermediate buffer);
* :func:`conv_tokens`: :func:`~hybridmeta.kernels.conv_verify_update` for the outputs
  (and windows), the new conv state assembled in torch (:func:`shifted_windows`) and
  written with :func:`write_rows_`; a per-row window offset (``num_accepted_tokens``)
  gathers the windows first;
* varlen inputs are padded to ``[N, T, ...]`` (:func:`varlen_pad`) and the outputs
  scattered back (:func:`varlen_unpad_`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hybridmeta.kernels import (
    causal_conv1d_update,
    conv_verify_update,
    ssm_state_update,
    ssm_verify_update,
)

__all__ = [
    "activation_name",
    "conv_tokens",
    "per_head",
    "sibling_parents",
    "ssm_tokens",
    "valid_slots",
    "varlen_pad",
    "varlen_unpad_",
    "write_rows_",
]


def valid_slots(ids: torch.Tensor, pad: int, num_slots: int) -> torch.Tensor:
    """``[..]`` bool: the ids that name a slot of a pool of ``num_slots``, not the pad id.

    What the compositions' own torch writes honour (the ops check their ids themselves,
    with the peer's pad id passed as their ``pad_slot_id``): a pad id writes nothing, and
    so does any other id outside the pool (the ops poison such a row's output and record
    the fault)."""
    return (ids != pad) & (ids >= 0) & (ids < num_slots)


def activation_name(op: str, activation: object) -> str | None:
    """A peer's ``activation`` (``None``, ``True`` / ``False``, ``"silu"``, ``"swish"``) as
    hybridmeta's (``"silu"`` or ``None``); anything else is a ``ValueError``."""
    if isinstance(activation, bool):
        return "silu" if activation else None
    if activation is None:
        return None
    if activation in ("silu", "swish"):
        return "silu"
    raise ValueError(f"{op}: `activation` must be None, True, 'silu' or 'swish', got {activation!r}")


def per_head(op: str, name: str, t: torch.Tensor, tied: Sequence[int]) -> torch.Tensor:
    """The per-head values of a peer's stride-0 expansion (``A [H, P, N]``, ``D [H, P]``,
    ``dt_bias [H, P]``): dims ``tied`` must be stride 0 (or size 1); index 0 is taken there.

    A tensor that really varies along a tied dim (Mamba1-style ``A [dim, dstate]``, a
    per-headdim ``dt``) is a ``NotImplementedError`` naming the argument: the hybridmeta
    kernels take one value per head.
    """
    for d in tied:
        if t.shape[d] != 1 and t.stride(d) != 0:
            raise NotImplementedError(
                f"{op}: `{name}` varies along dim {d} (shape {list(t.shape)}, strides "
                f"{list(t.stride())}); hybridmeta takes one value per head: pass the peers' "
                f"stride-0 expansion of per-head values (e.g. A[:, None, None].expand(...))"
            )
    index: list[int | slice] = [slice(None)] * t.dim()
    for d in tied:
        index[d] = 0
    return t[tuple(index)].contiguous()


def write_rows_(
    pool: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    values: torch.Tensor,
    write: torch.Tensor,
) -> None:
    """``pool[index[0][r], index[1][r], ...] = values[r]`` for the rows ``r`` where ``write``.

    Sync-free and deterministic: rows that do not write rewrite the first writing row's
    block with its own value (the same bits), or, when no row writes, block ``(0, ...)``
    with its current value; so no host read decides which rows write. Written blocks must
    be distinct (the peers' contract). ``pool`` may be a strided view.
    """
    R = write.shape[0]
    if R == 0:
        return
    vals = values.to(pool.dtype)
    wr = write.view(R, *([1] * (vals.dim() - 1)))
    any_w = write.any()
    # a 1-element index tensor, not a 0-d one: indexing with a 0-d tensor reads it on the host
    first = torch.argmax(write.to(torch.int8)).view(1)
    fill_idx = [torch.where(any_w, i.index_select(0, first)[0], 0) for i in index]
    zero = tuple(0 for _ in index)
    fill_val = torch.where(any_w, vals.index_select(0, first)[0], pool[zero])
    tgt = tuple(torch.where(write, i.long(), f) for i, f in zip(index, fill_idx, strict=True))
    pool.index_put_(tgt, torch.where(wr, vals, fill_val))


def varlen_pad(t: torch.Tensor, starts: torch.Tensor, T: int) -> torch.Tensor:
    """``[N, T, ...]``: token ``starts[b] + j`` of a packed ``[total, ...]`` tensor at
    ``[b, j]`` (positions past the end repeat the last token; callers mask them)."""
    total = t.shape[0]
    N = starts.shape[0]
    if total == 0:
        return t.new_zeros((N, T, *t.shape[1:]))
    pos = starts.long()[:, None] + torch.arange(T, device=t.device)[None, :]
    return t[pos.clamp(max=total - 1)]


def varlen_unpad_(out: torch.Tensor, padded: torch.Tensor, cu: torch.Tensor) -> None:
    """``out[cu[b] + j] = padded[b, j]`` for the tokens ``cu[b] <= cu[b] + j < cu[b + 1]``
    with ``j < T``; other tokens of ``out`` keep their values. One gather and one select over
    ``out`` (no duplicates, no host read)."""
    total = out.shape[0]
    N, T = padded.shape[:2]
    if total == 0 or N == 0:
        return
    tok = torch.arange(total, device=out.device)
    starts = cu[:-1].long()
    row = torch.searchsorted(cu[1:].long().contiguous(), tok, right=True)
    row_c = row.clamp(max=N - 1)
    j = tok - starts[row_c]
    ok = (row < N) & (j >= 0) & (j < T)
    got = padded[row_c, j.clamp(0, T - 1)]
    out.copy_(torch.where(ok.view(total, *([1] * (out.dim() - 1))), got.to(out.dtype), out))


def sibling_parents(
    next_token: torch.Tensor, next_sibling: torch.Tensor, T: int
) -> torch.Tensor:
    """sglang's EAGLE tree as parents: ``[N, T]`` int64, ``parent[b, 0] = 0``.

    Walking the tokens in order, token ``t`` makes itself the parent of
    ``next_token[b, t]`` and gives its own parent to ``next_sibling[b, t]`` (``-1``: none),
    as sglang's conv kernel does; a token no rule reaches keeps parent ``0``. ``3 T``
    small torch ops (a host loop over the ``T`` columns, no host read).
    """
    N = next_token.shape[0]
    par = torch.zeros(N, T, dtype=torch.long, device=next_token.device)
    for t in range(T):
        for link, value in ((next_token[:, t].long(), None), (next_sibling[:, t].long(), t)):
            ok = (link >= 0) & (link < T)
            col = link.clamp(0, T - 1)[:, None]
            new = torch.full_like(col, t) if value is None else par[:, t : t + 1]
            par.scatter_(1, col, torch.where(ok[:, None], new, par.gather(1, col)))
    return par


def ssm_tokens(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    src: torch.Tensor,
    lens: torch.Tensor | None = None,
    parent: torch.Tensor | None = None,
    token_dst: torch.Tensor | None = None,
    final_dst: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
    buffer_rows: torch.Tensor | None = None,
    out: torch.Tensor,
    pad: int = -1,
) -> None:
    """``T`` tokens of ``N`` rows through the SSM, storing the states a peer stores.

    ``x, z, out [N, T, H, P]``, ``dt [N, T, H]``, ``B, C [N, T, G, N]``, ``A, D,
    dt_bias [H]``; ``src [N]`` the slot each row starts from (``pad``, the peer's pad id
    passed to the ops as ``pad_slot_id``: a pad row);
    ``lens [N]`` the live tokens of each row (default ``T``); ``parent [N, T]`` the tree
    (our convention: ``-1`` restarts from ``src``). Stores: ``token_dst [N, T]`` the slot of
    each token's state (``pad``: none), ``final_dst [N]`` the slot of the state after the
    row's last live token (``pad``: none), ``buffer [E, S, H, P, N]`` at entry
    ``buffer_rows[b]`` step ``t`` (``-1`` none). Pad rows and dead tokens store nothing
    and get zero output (``out`` is written at every ``[b, t]``); a source id outside the
    pool is the ops' invalid id (poisoned output, the fault recorded), and stores nothing.
    """
    N, T = x.shape[:2]
    nslots = state.shape[0]
    live = src != pad
    if lens is not None:
        live = live & (lens > 0)
    src = torch.where(live, src, pad)
    single = T == 1 and parent is None and buffer is None
    if single:
        dst = final_dst if final_dst is not None else token_dst[:, 0] if token_dst is not None else None
        dst_peer = torch.full_like(src, pad) if dst is None else torch.where(live, dst, pad)
        ssm_state_update(
            state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state_indices=src, D=D,
            z=None if z is None else z[:, 0], dt_bias=dt_bias, dt_softplus=dt_softplus,
            dst_indices=dst_peer, out=out[:, 0], pad_slot_id=pad,
        )  # fmt: skip
        return
    live = live & valid_slots(src, pad, nslots)  # rows whose states are stored
    _, H, P, Ns = state.shape
    inter = torch.empty(N, T, H, P, Ns, dtype=state.dtype, device=state.device)
    num_draft = None if lens is None else lens.clamp(0, T)
    ssm_verify_update(
        state, x, dt, A, B, C, state_indices=src, inter=inter, D=D, z=z, dt_bias=dt_bias,
        dt_softplus=dt_softplus, parent=parent, num_draft=num_draft, out=out, pad_slot_id=pad,
    )  # fmt: skip
    cols = torch.arange(T, device=src.device)
    n_live = torch.full_like(src, T) if num_draft is None else num_draft.long()
    alive = live[:, None] & (cols[None, :] < n_live[:, None])  # [N, T]
    flat = inter.view(N * T, H, P, Ns)
    if token_dst is not None:
        ok = alive & valid_slots(token_dst, pad, nslots)
        write_rows_(state, (token_dst.reshape(-1),), flat, ok.reshape(-1))
    if final_dst is not None:
        last = (n_live - 1).clamp(min=0)
        write_rows_(state, (final_dst,), inter[torch.arange(N, device=src.device), last],
                    live & valid_slots(final_dst, pad, nslots))  # fmt: skip
    if buffer is not None and buffer_rows is not None:
        e = buffer_rows.long()[:, None].expand(N, T).reshape(-1)
        t = cols[None, :].expand(N, T).reshape(-1)
        write_rows_(buffer, (e, t), flat, (alive & (buffer_rows[:, None] >= 0)).reshape(-1))


def shifted_windows(
    win: torch.Tensor, x: torch.Tensor, lens: torch.Tensor, keep: int
) -> torch.Tensor:
    """``[N, C, keep]``: per row, the ``keep`` columns of ``[win, x[:, :lens[b]]^T]`` that
    end at its last live input (``win [N, C, W]``, ``x [N, T, C]``)."""
    full = torch.cat([win, x.transpose(1, 2).to(win.dtype)], dim=2)  # [N, C, W + T]
    end = win.shape[2] + lens.long()  # exclusive
    cols = end[:, None] - keep + torch.arange(keep, device=win.device)[None, :]
    idx = cols.clamp(min=0)[:, None, :].expand(-1, win.shape[1], -1)
    return full.gather(2, idx)


def conv_tokens(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: str | None,
    slots: torch.Tensor,
    lens: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    parent: torch.Tensor | None = None,
    state_write: str,
    buffer: torch.Tensor | None = None,
    buffer_rows: torch.Tensor | None = None,
    out: torch.Tensor,
    pad: int = -1,
) -> None:
    """``T`` tokens of ``N`` rows through the causal conv1d, writing the conv state a peer
    writes.

    ``x, out [N, T, C]`` (``x`` already in the pool's dtype); ``conv_state [slots, C, L]``
    (``L >= K - 1``, any strides); ``slots [N]`` (``pad``, the peer's pad id passed to the
    ops as ``pad_slot_id``: a pad row; an id outside the pool: the ops' invalid id, its
    output poisoned and nothing written); ``lens [N]`` live
    tokens per row (default ``T``); ``offset [N]``: the row's first token reads the window
    at columns ``offset .. offset + K - 2`` (default ``0``); ``parent [N, T]`` a tree
    (``-1``: the window). ``state_write``: ``"shift"`` (columns ``0 .. K - 2`` = the last
    ``K - 1`` inputs), ``"spec"`` (columns ``0 .. K - 3 + lens[b]`` = the window's last
    ``K - 2`` inputs followed by every live input: vLLM's / sglang's speculative layout) or
    ``"none"``. ``buffer [E, S, C, K - 1]`` receives the window after each live token at
    entry ``buffer_rows[b]`` step ``t``. Pad rows: no state read or written, zero output.
    """
    N, T, Cd = x.shape
    K1 = weight.shape[1] - 1
    dev = x.device
    live = slots != pad
    if lens is not None:
        live = live & (lens > 0)
    n_live = torch.full((N,), T, dtype=torch.long, device=dev) if lens is None else lens.long().clamp(0, T)
    if T == 1 and parent is None and buffer is None and offset is None and state_write == "shift":
        # One token from the window at column 0, shifted in place: the decode op itself.
        causal_conv1d_update(x[:, 0], conv_state[:, :, :K1], weight, bias,
                             cache_indices=torch.where(live, slots, pad), activation=activation,
                             out=out[:, 0], pad_slot_id=pad)  # fmt: skip
        return
    ok = valid_slots(slots, pad, conv_state.shape[0])
    safe = torch.where(live & ok, slots, 0)
    if offset is None:
        win = conv_state[safe, :, :K1]  # [N, C, K-1] (a copy)
        pool, idx, pid = conv_state[:, :, :K1], torch.where(live, slots, pad), pad
    else:
        cols = offset.long().clamp(min=0)[:, None] + torch.arange(K1, device=dev)[None, :]
        win = conv_state[safe[:, None], :, cols].transpose(1, 2)  # [N, C, K-1] (a copy)
        # the gathered windows are a pool of N rows: a pad row is -1 there, an invalid
        # slot an id past it (the op's invalid id)
        rows = torch.where(ok, torch.arange(N, device=dev), N)
        pool, idx, pid = win, torch.where(live, rows, -1), -1
    live = live & ok  # rows whose conv state is written
    inter = torch.empty(N, T, Cd, K1, dtype=conv_state.dtype, device=dev)
    conv_verify_update(
        x, pool, weight, bias, cache_indices=idx, inter=inter, activation=activation,
        parent=parent, num_draft=None if lens is None else n_live, out=out, pad_slot_id=pid,
    )  # fmt: skip
    if buffer is not None and buffer_rows is not None:
        cols_t = torch.arange(T, device=dev)
        alive = live[:, None] & (cols_t[None, :] < n_live[:, None]) & (buffer_rows[:, None] >= 0)
        e = buffer_rows.long()[:, None].expand(N, T).reshape(-1)
        t = cols_t[None, :].expand(N, T).reshape(-1)
        write_rows_(buffer, (e, t), inter.view(N * T, Cd, K1), alive.reshape(-1))
    if state_write == "shift":
        write_rows_(conv_state[:, :, :K1], (slots,), shifted_windows(win, x, n_live, K1), live)
    elif state_write == "spec":
        # the window's last K - 2 inputs, then every live input (K - 2 + lens[b] columns)
        width = K1 - 1 + T
        full = torch.cat([win[:, :, 1:], x.transpose(1, 2).to(win.dtype)], dim=2)
        old = conv_state[safe, :, :width]
        keep = torch.arange(width, device=dev)[None, None, :] < (K1 - 1 + n_live)[:, None, None]
        write_rows_(conv_state[:, :, :width], (slots,), torch.where(keep, full, old), live)


def silu_gate_(y: torch.Tensor, z: torch.Tensor) -> None:
    """``y *= silu(z)`` in fp32, rounded once to ``y``'s dtype."""
    y.copy_((y.float() * F.silu(z.float())).to(y.dtype))
