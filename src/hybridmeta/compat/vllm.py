"""vLLM 0.32 drop-ins: ``selective_state_update``, ``causal_conv1d_update``,
``causal_conv1d_fn`` and ``mamba_chunk_scan_combined_varlen`` with vLLM's signatures
(names, positional order, defaults) and semantics, on hybridmeta's ops.

Peer modules: ``vllm.model_executor.layers.mamba.ops.mamba_ssm`` (the Triton
``selective_state_update``; ``ops.ssu_dispatch.selective_state_update`` has the same
parameters less the last two), ``ops.causal_conv1d`` and ``ops.ssd_combined``. vLLM 0.33
drops the prefix-cache "all" mode arguments of the two conv functions and adds
``final_states_out`` / ``final_state_indices`` to the scan: :mod:`hybridmeta.compat.vllm_v033`.

Conventions (``docs/compat.md`` has the full statement per function):

* the null block id (``null_block_id``, default ``NULL_BLOCK_ID = 0``) marks a pad row: it
  reads and writes no state and gets **zero** output (vLLM computes the update of a zero
  state for the SSM, leaves the conv rows as they were); ``-1`` is a pad id as well;
* the null slot is never written (vLLM's non-speculative SSM update writes the new state
  into a null destination of a live row; slot 0 is reserved there, so nothing reads it);
* ``A [H, P, N]``, ``dt [.., H, P]``, ``dt_bias`` and ``D [H, P]`` must be stride-0
  expansions of per-head values (what vLLM's Mamba2 mixer passes); anything else is a
  ``NotImplementedError`` naming the argument.
"""

from __future__ import annotations

import torch

from hybridmeta.compat._common import (
    activation_name,
    conv_tokens,
    per_head,
    silu_gate_,
    ssm_tokens,
    varlen_pad,
    varlen_unpad_,
)
from hybridmeta.kernels import SSMParams, causal_conv1d_prefill, ssd_chunked_scan
from hybridmeta.kernels._math import discretize
from hybridmeta.planner import plan_mixed_batch

__all__ = [
    "NULL_BLOCK_ID",
    "PAD_SLOT_ID",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "mamba_chunk_scan_combined_varlen",
    "selective_state_update",
]

NULL_BLOCK_ID = 0  # vLLM's reserved null block: the pad id of its slot indices
PAD_SLOT_ID = -1


def _not_supported(op: str, feature: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{op}: {feature} is not supported by hybridmeta.compat ({why})")


# --------------------------------------------------------------------------- SSM update


def _ssm_params(
    op: str,
    A: torch.Tensor,
    dt: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-head ``A [H]``, ``dt [.., H]``, ``D [H]``, ``dt_bias [H]`` from the peers' stride-0
    expansions (``A [H, P, N]``, ``dt [.., H, P]``, ``D, dt_bias [H, P]``)."""
    if A.dim() == 2:
        A = A.unsqueeze(0)
    if A.dim() != 3:
        raise ValueError(f"{op}: `A` must be [nheads, dim, dstate] or [dim, dstate], got {list(A.shape)}")
    A_h = per_head(op, "A", A, (1, 2))
    dt_h = per_head(op, "dt", dt, (dt.dim() - 1,))
    D_h = None
    if D is not None:
        D_h = per_head(op, "D", D.unsqueeze(0) if D.dim() == 1 else D, (1,))
    b_h = None
    if dt_bias is not None:
        b_h = per_head(op, "dt_bias", dt_bias.unsqueeze(0) if dt_bias.dim() == 1 else dt_bias, (1,))
    return A_h, dt_h, D_h, b_h


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    dst_state_batch_indices: torch.Tensor | None = None,
    null_block_id: int = NULL_BLOCK_ID,
    out: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    is_blackwell: bool = False,
    enable_stochastic_rounding: bool = False,
    cache_philox_rounds: int = 0,
) -> None:
    """vLLM's ``selective_state_update``: the SSM decode / speculative-decode update, in place.

    ``state [slots, H, P, N]`` (or ``[slots, dim, dstate]``), ``x, dt, z, out [bs, H, P]``
    (one token per row) or ``[total_tokens, H, P]`` with ``cu_seqlens [N + 1]`` (varlen: the
    tokens of sequence ``b`` are ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``, processed in
    order in one call), ``B, C [bs or total, G, N]``, ``A [H, P, N]``, ``D, dt_bias
    [H, P]`` (stride-0 expansions of per-head values). ``state_batch_indices`` ``[N]`` or
    ``[N, max_seqlen]``: the row starts from column ``max(num_accepted_tokens[b] - 1, 0)``
    (column 0 without ``num_accepted_tokens``). Writes: with ``num_accepted_tokens`` the
    state after token ``t`` goes to ``dst_state_batch_indices[b, t]`` (default: the source
    indices) unless it is the null id; without it, the state after the last token goes to
    column 0. Rows whose source is the null id are pad rows (no state, zero output);
    sequences of length 0 write nothing. ``out`` is required (written in place).

    Raises
    ------
    NotImplementedError
        ``enable_stochastic_rounding=True``; per-headdim ``A`` / ``dt`` / ``dt_bias`` / ``D``.
    ValueError
        ``out`` missing; ``num_accepted_tokens`` without 2-D ``state_batch_indices``; index
        shapes that do not match the rows.
    """
    op = "vllm.selective_state_update"
    del is_blackwell  # a launch-config hint of vLLM's kernel
    if enable_stochastic_rounding:
        raise _not_supported(op, "enable_stochastic_rounding=True (stochastic rounding of fp16 "
                             "state stores)", "the kernels round to nearest")  # fmt: skip
    del cache_philox_rounds  # only read with stochastic rounding
    if out is None:
        raise ValueError(f"{op}: `out` is required (vLLM writes the output into it in place)")
    if state.dim() == 3:
        state = state.unsqueeze(1)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(1) if t.dim() == 2 else t

    x, dt, B, C, out_v = heads(x), heads(dt), heads(B), heads(C), heads(out)
    zz = None if z is None else heads(z)
    A_h, dt_h, D_h, b_h = _ssm_params(op, A, dt, D, dt_bias)
    dev = state.device
    sbi = state_batch_indices
    dsbi = dst_state_batch_indices
    if sbi is not None and sbi.dim() == 1:
        sbi = sbi.unsqueeze(1)
    if dsbi is not None and dsbi.dim() == 1:
        dsbi = dsbi.unsqueeze(1)
    if num_accepted_tokens is not None and (state_batch_indices is None or state_batch_indices.dim() != 2):
        raise ValueError(f"{op}: `num_accepted_tokens` needs 2-D `state_batch_indices` [N, max_seqlen]")
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    for name, idx in (("state_batch_indices", sbi), ("dst_state_batch_indices", dsbi)):
        if idx is not None and idx.shape[0] < N:
            raise ValueError(f"{op}: `{name}` has {idx.shape[0]} rows, fewer than the {N} sequences")
    if num_accepted_tokens is not None and num_accepted_tokens.shape != (N,):
        raise ValueError(f"{op}: `num_accepted_tokens` must be [{N}], got {list(num_accepted_tokens.shape)}")
    if out_v.shape != x.shape:
        raise ValueError(f"{op}: `out` must have the shape of `x` {list(x.shape)}, got {list(out.shape)}")
    if sbi is None:
        src = torch.arange(N, device=dev)
    else:
        init = torch.zeros(N, dtype=torch.long, device=dev)
        if num_accepted_tokens is not None:
            init = (num_accepted_tokens.long() - 1).clamp(min=0)
        src = sbi[:N].gather(1, init[:, None])[:, 0].long()
    dst_all = (dsbi if dsbi is not None else sbi)
    dst_ours = None if dst_all is None else dst_all[:N].long()
    # the null id goes to the ops as their pad id (no index given: every row is live)
    pad = null_block_id if sbi is not None else -1
    if cu_seqlens is None:  # one token per row: the decode op with source and destination
        dst = src if dst_ours is None else dst_ours[:, 0]
        ssm_tokens(
            state, x[:, None], dt_h[:, None], A_h, B[:, None], C[:, None], D=D_h,
            z=None if zz is None else zz[:, None], dt_bias=b_h, dt_softplus=dt_softplus,
            src=src, final_dst=dst, out=out_v[:, None], pad=pad,
        )  # fmt: skip
        return
    # varlen: sequences padded to [N, T]. With num_accepted_tokens T is the index tensors'
    # columns (vLLM's contract: one destination per token); without it the lengths are
    # only in cu_seqlens: one device-to-host read.
    if num_accepted_tokens is not None:
        assert sbi is not None
        T = sbi.shape[1]
    else:
        T = max(int(cu_seqlens.diff().max()) if N else 1, 1)
    cu = cu_seqlens.long()
    lens = cu.diff()
    starts = cu[:-1]
    xp, dtp = varlen_pad(x, starts, T), varlen_pad(dt_h, starts, T)
    Bp, Cp = varlen_pad(B, starts, T), varlen_pad(C, starts, T)
    zp = None if zz is None else varlen_pad(zz, starts, T)
    yp = torch.empty_like(xp)
    if num_accepted_tokens is not None:
        assert dst_ours is not None
        if dst_ours.shape[1] < T:
            raise ValueError(f"{op}: `dst_state_batch_indices` needs >= {T} columns")
        ssm_tokens(state, xp, dtp, A_h, Bp, Cp, D=D_h, z=zp, dt_bias=b_h, dt_softplus=dt_softplus,
                   src=src, lens=lens, token_dst=dst_ours[:, :T], out=yp, pad=pad)  # fmt: skip
    else:
        final = src if dst_ours is None else dst_ours[:, 0]
        ssm_tokens(state, xp, dtp, A_h, Bp, Cp, D=D_h, z=zp, dt_bias=b_h, dt_softplus=dt_softplus,
                   src=src, lens=lens, final_dst=final, out=yp, pad=pad)  # fmt: skip
    varlen_unpad_(out_v, yp, cu)


# --------------------------------------------------------------------------- conv update


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    null_block_id: int = NULL_BLOCK_ID,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    validate_data: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's ``causal_conv1d_update``: the conv decode / speculative-decode update.

    ``x [B, dim]``, ``[B, dim, S]`` or, with ``query_start_loc [B + 1]``, ``[num_tokens, dim]``
    (varlen, ``max_query_len`` columns at most); ``conv_state [slots, dim, L]`` with
    ``L >= width - 1`` (``L >= width - 2 + S`` with ``num_accepted_tokens``);
    ``conv_state_indices [B]`` or ``[B, *]`` (column 0), the null id marking pad rows.
    Without ``num_accepted_tokens`` the row's tokens run from the window in columns
    ``0 .. width - 2`` and the window shifted by the row's length is stored there. With it
    (speculative decoding), the row's first token reads the window at columns
    ``num_accepted_tokens[b] - 1 ..`` and the state becomes the window's last
    ``width - 2`` inputs followed by all the row's inputs (columns ``0 .. width - 3 + S``).
    ``x`` is cast to the state's dtype first; returns ``out`` (default: ``x``, overwritten)
    in ``x``'s dtype. Pad rows: no state, zero output.

    Raises
    ------
    NotImplementedError
        ``block_idx_last_scheduled_token`` / ``initial_state_idx`` (prefix caching "all" mode).
    ValueError
        Bad ``activation``, ``out`` of another shape / dtype, varlen without
        ``conv_state_indices`` or ``max_query_len``, a state too short for the tokens.
    """
    op = "vllm.causal_conv1d_update"
    if block_idx_last_scheduled_token is not None or initial_state_idx is not None:
        raise _not_supported(op, "block_idx_last_scheduled_token / initial_state_idx (prefix "
                             "caching 'all' mode)", "state blocks per token block")  # fmt: skip
    del validate_data  # the checks always run
    act = activation_name(op, activation)
    orig = x.dtype
    if out is not None:
        if out.shape != x.shape:
            raise ValueError(f"`out` shape {tuple(out.shape)} must match `x` shape {tuple(x.shape)}.")
        if out.dtype != orig or out.device != x.device:
            raise ValueError("`out` must have the same dtype and device as the input `x`.")
    target = x if out is None else out
    xs = x.to(conv_state.dtype)
    K = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[2] < K - 1:
        raise ValueError(f"{op}: `conv_state` must be [slots, dim, state_len >= {K - 1}], got {list(conv_state.shape)}")
    dev = x.device
    idx = conv_state_indices
    if idx is not None and idx.dim() == 2:
        idx = idx[:, 0]
    if query_start_loc is None:
        x3 = xs.unsqueeze(1) if xs.dim() == 2 else xs.transpose(1, 2)  # [B, S, dim]
        N, T = x3.shape[:2]
        lens = None
    else:
        if idx is None:
            raise ValueError(f"{op}: `conv_state_indices` is required with `query_start_loc`")
        if max_query_len < 1:
            raise ValueError(f"{op}: `max_query_len` must be >= 1 with `query_start_loc`, got {max_query_len}")
        N, T = idx.shape[0], max_query_len
        lens = query_start_loc.long().diff()
        x3 = varlen_pad(xs, query_start_loc[:-1].long(), T)
    slots = torch.arange(N, device=dev) if idx is None else idx.long()
    if num_accepted_tokens is not None:
        if conv_state.shape[2] < K - 2 + T:
            raise ValueError(f"{op}: `conv_state` needs state_len >= width - 2 + {T} = {K - 2 + T} "
                             f"with num_accepted_tokens, got {conv_state.shape[2]}")  # fmt: skip
        if num_accepted_tokens.shape != (N,):
            raise ValueError(f"{op}: `num_accepted_tokens` must be [{N}], got {list(num_accepted_tokens.shape)}")
    y3 = torch.empty_like(x3)
    conv_tokens(
        conv_state, x3, weight, bias, activation=act, slots=slots, lens=lens,
        offset=None if num_accepted_tokens is None else num_accepted_tokens.long() - 1,
        state_write="shift" if num_accepted_tokens is None else "spec", out=y3,
        pad=null_block_id if idx is not None else -1,
    )  # fmt: skip
    if query_start_loc is None:
        target.copy_((y3[:, 0] if x.dim() == 2 else y3.transpose(1, 2)).to(orig))
    else:
        varlen_unpad_(target, y3, query_start_loc.long())
    return target


# --------------------------------------------------------------------------- conv prefill


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    null_block_id: int = NULL_BLOCK_ID,
    block_idx_first_scheduled_token: torch.Tensor | None = None,
    block_idx_last_scheduled_token: torch.Tensor | None = None,
    initial_state_idx: torch.Tensor | None = None,
    num_computed_tokens: torch.Tensor | None = None,
    block_size_to_align: int = 0,
    metadata: object = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """vLLM's ``causal_conv1d_fn``: the varlen prefill conv over continuous batching.

    ``x [dim, total_tokens]`` (channel-last: ``x.t()`` contiguous), sequence ``b`` its
    tokens ``query_start_loc[b] .. query_start_loc[b + 1] - 1``; ``cache_indices [B]``
    (default ``arange(B)``) its conv-state slot, ``has_initial_state [B]`` whether its first
    token reads the window stored there (default: none does). Every processed sequence's
    last ``width - 1`` inputs are written to columns ``0 .. width - 2`` of its slot.
    Sequences whose slot is ``null_block_id`` or ``pad_slot_id`` are pad rows (no state,
    zero output). ``x`` is cast to the state's dtype first; returns ``[dim, total_tokens]``
    in ``x``'s dtype (channel-last). ``metadata`` (vLLM's launch grid) is not read.

    One device-to-host read of ``query_start_loc``, ``cache_indices`` and
    ``has_initial_state`` (the plan is built on the host, as vLLM builds its launch grid
    when ``metadata`` is ``None``).

    Raises
    ------
    NotImplementedError
        ``block_idx_*`` / ``initial_state_idx`` / ``num_computed_tokens`` (prefix caching
        "all" mode).
    """
    op = "vllm.causal_conv1d_fn"
    if any(t is not None for t in (block_idx_first_scheduled_token, block_idx_last_scheduled_token,
                                   initial_state_idx, num_computed_tokens)):  # fmt: skip
        raise _not_supported(op, "block_idx_first/last_scheduled_token, initial_state_idx, "
                             "num_computed_tokens (prefix caching 'all' mode)",
                             "conv states per token block")  # fmt: skip
    del block_size_to_align, metadata, validate_data  # "all" mode / launch grid / checks always run
    act = activation_name(op, activation)
    orig = x.dtype
    dim, total = x.shape
    K = weight.shape[1]
    if conv_states.dim() != 3 or conv_states.shape[1] != dim or conv_states.shape[2] < K - 1:
        raise ValueError(f"{op}: `conv_states` must be [slots, {dim}, >= {K - 1}], got {list(conv_states.shape)}")
    nb = query_start_loc.shape[0] - 1
    qsl = query_start_loc.tolist()
    lens = [qsl[i + 1] - qsl[i] for i in range(nb)]
    slots = list(range(nb)) if cache_indices is None else cache_indices.tolist()
    init = [False] * nb if has_initial_state is None else [bool(v) for v in has_initial_state.tolist()]
    if len(slots) != nb or len(init) != nb:
        raise ValueError(f"{op}: `cache_indices` and `has_initial_state` must have {nb} rows")
    pads = {pad_slot_id, -1} | ({null_block_id} if null_block_id is not None else set())
    live = [b for b in range(nb) if slots[b] not in pads and lens[b] > 0]
    xs = x.to(conv_states.dtype).t()  # [total, dim]
    y = torch.zeros(total, dim, dtype=conv_states.dtype, device=x.device)
    if live:
        md = plan_mixed_batch(
            extend_lens=[lens[b] for b in live], prefix_lens=[1 if init[b] else 0 for b in live],
            slots=[slots[b] for b in live], num_decodes=0, chunk_size=max(K, 2), conv_kernel=K,
            device=x.device,
        )  # fmt: skip
        tok = torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b in live]).to(x.device)
        conv = causal_conv1d_prefill(xs.index_select(0, tok), weight, bias, md=md,
                                     conv_state=conv_states[:, :, : K - 1], activation=act)  # fmt: skip
        y.index_copy_(0, tok, conv.out)
    return y.to(orig).t()


# --------------------------------------------------------------------------- chunked scan


def mamba_chunk_scan_combined_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    cu_chunk_seqlens: torch.Tensor,
    last_chunk_indices: torch.Tensor,
    seq_idx: torch.Tensor,
    out: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """vLLM's ``mamba_chunk_scan_combined_varlen``: the Mamba2 SSD prefill scan.

    ``x, out, z [T, H, P]``, ``dt [T, H]``, ``A, dt_bias [H]``, ``B, C [T, G, N]``,
    ``D [H]`` or ``[H, P]``; sequence ``b`` is tokens ``cu_seqlens[b] .. cu_seqlens[b + 1] -
    1``, starting from ``initial_states[b]`` (zeros without it). ``dt`` is discretised as
    ``softplus(dt + dt_bias)`` (softplus optional), clamped to ``dt_limit`` unless it is
    ``(0, inf)``. Writes ``out`` in place (``(y + D x) * silu(z)``); returns the final state
    of each sequence ``[B, H, P, N]`` in ``state_dtype`` (default ``C.dtype``), or with
    ``return_intermediate_states`` the state at the end of every chunk of
    ``cu_chunk_seqlens`` ``[nchunks, H, P, N]`` (chunk ``c`` belongs to sequence
    ``seq_idx[c]``).

    One device-to-host read of ``cu_seqlens`` (and, with ``return_intermediate_states``,
    of ``cu_chunk_seqlens`` and ``seq_idx``): the chunk plan is built on the host.
    """
    op = "vllm.mamba_chunk_scan_combined_varlen"
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"{op}: `chunk_size` must be a power of 2, got {chunk_size}")
    T, H, P = x.shape
    Nst = B.shape[-1]
    nb = cu_seqlens.shape[0] - 1
    if initial_states is not None and initial_states.shape != (nb, H, P, Nst):
        raise ValueError(f"{op}: `initial_states` must be [{nb}, {H}, {P}, {Nst}], got {list(initial_states.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"{op}: `out` must be [{T}, {H}, {P}], got {list(out.shape)}")
    sdt = state_dtype if state_dtype is not None else C.dtype
    # D: per head natively; a genuine [H, P] D is added after the scan (composition)
    D_h: torch.Tensor
    D_extra: torch.Tensor | None = None
    if D is None:
        D_h = torch.zeros(H, dtype=torch.float32, device=x.device)
    elif D.dim() == 1:
        D_h = D
    elif D.shape[1] == 1 or D.stride(1) == 0:
        D_h = D[:, 0].contiguous()
    else:
        D_h, D_extra = torch.zeros(H, dtype=torch.float32, device=x.device), D
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    bias = dt_bias if dt_bias is not None else torch.zeros(H, dtype=torch.float32, device=x.device)
    if lo > 0.0 or hi < float("inf"):  # vLLM clamps only then: discretise here (composition)
        dt = discretize(dt, dt_bias, dt_softplus, (lo, hi))
        params = SSMParams(A=A, D=D_h, dt_bias=torch.zeros_like(bias, dtype=torch.float32),
                           dt_softplus=False)  # fmt: skip
    else:
        params = SSMParams(A=A, D=D_h, dt_bias=bias, dt_softplus=dt_softplus)
    pool = torch.zeros(max(nb, 1), H, P, Nst, dtype=torch.float32, device=x.device)
    if initial_states is not None and nb:
        pool[:nb].copy_(initial_states.float())
    cu = cu_seqlens.tolist()
    y = torch.zeros(T, H, P, dtype=x.dtype, device=x.device)  # tokens of no chunk: 0
    if not return_intermediate_states:
        segments = [[(b, cu[b], cu[b + 1]) for b in range(nb) if cu[b + 1] > cu[b]]]
    else:
        cc = cu_chunk_seqlens.tolist()
        si = seq_idx.tolist()
        nchunks = len(cc) - 1
        if len(si) != nchunks:
            raise ValueError(f"{op}: `seq_idx` must have {nchunks} entries (one per chunk)")
        per_seq: list[list[tuple[int, int, int]]] = [[] for _ in range(nb)]
        for c in range(nchunks):
            b = si[c]
            if not (0 <= b < nb and cu[b] <= cc[c] < cc[c + 1] <= cu[b + 1]):
                raise ValueError(f"{op}: chunk {c} [{cc[c]}, {cc[c + 1]}) is not inside sequence "
                                 f"seq_idx[{c}] = {b}")  # fmt: skip
            per_seq[b].append((c, cc[c], cc[c + 1]))
        depth = max((len(s) for s in per_seq), default=0)
        segments = [[(s[d][0], s[d][1], s[d][2]) for s in per_seq if len(s) > d] for d in range(depth)]
        seq_of_chunk = si
        states = torch.empty(nchunks, H, P, Nst, dtype=sdt, device=x.device)
    for seg in segments:  # each segment: one scan over independent token ranges
        if not seg:
            continue
        rows = [s[0] if not return_intermediate_states else seq_of_chunk[s[0]] for s in seg]
        tok = torch.cat([torch.arange(a, e) for _, a, e in seg]).to(x.device)
        has_init = initial_states is not None
        prefix = [1 if (has_init or (return_intermediate_states and s[1] > cu[r])) else 0
                  for s, r in zip(seg, rows, strict=True)]  # fmt: skip
        md = plan_mixed_batch(extend_lens=[e - a for _, a, e in seg], prefix_lens=prefix, slots=rows,
                              num_decodes=0, chunk_size=chunk_size, conv_kernel=2, device=x.device)  # fmt: skip
        scan = ssd_chunked_scan(x.index_select(0, tok), dt.index_select(0, tok), B.index_select(0, tok),
                                C.index_select(0, tok), params=params, md=md, ssm_state=pool)  # fmt: skip
        y.index_copy_(0, tok, scan.y.to(y.dtype))
        if return_intermediate_states:
            chunks = torch.tensor([s[0] for s in seg], device=x.device)
            states.index_copy_(0, chunks, pool[torch.tensor(rows, device=x.device)].to(sdt))
    if D_extra is not None:
        y.copy_((y.float() + x.float() * D_extra.float()[None]).to(y.dtype))
    if z is not None:
        silu_gate_(y, z)
    out.copy_(y)
    if return_intermediate_states:
        return states
    return pool[:nb].to(sdt)
