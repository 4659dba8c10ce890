"""sglang 0.5.23 drop-ins: ``selective_state_update`` (its Triton SSM update, multi-token,
intermediate states, EAGLE trees) and ``causal_conv1d_update`` (its Triton conv update,
``sglang.kernels.ops.mamba.causal_conv1d_triton``) with sglang's signatures and semantics,
on hybridmeta's ops.

Peer modules: ``sglang.kernels.ops.mamba.triton_ops.mamba_ssm`` (``ssu_dispatch`` has the
same parameters less the last two) and ``sglang.kernels.ops.mamba.causal_conv1d_triton``.
Pad rows carry ``pad_slot_id`` (default ``-1``): no state read or written, **zero**
output (sglang computes the update of a zero state for the SSM and leaves the conv output
rows uninitialised). ``docs/compat.md`` has the full statement.
"""

from __future__ import annotations

import torch

from hybridmeta.compat._common import (
    activation_name,
    conv_tokens,
    sibling_parents,
    ssm_tokens,
)
from hybridmeta.compat.vllm import _not_supported, _ssm_params

__all__ = ["PAD_SLOT_ID", "causal_conv1d_update", "selective_state_update"]

PAD_SLOT_ID = -1


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    out: torch.Tensor | None = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    cache_steps: int | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    enable_stochastic_rounding: bool = False,
    cache_philox_rounds: int = 0,
) -> None:
    """sglang's ``selective_state_update``: ``T`` tokens per row from the slot
    ``state_batch_indices[b]`` (default ``b``), in place.

    ``x, dt, z, out [bs, H, P]`` or ``[bs, T, H, P]``, ``B, C [bs, (T,) G, N]``,
    ``A [H, P, N]``, ``D, dt_bias [H, P]`` (stride-0 expansions of per-head values). The
    state after the last token goes back to the row's slot unless
    ``disable_state_update``. With ``intermediate_states_buffer`` (contiguous,
    ``[entries, cache_steps, H, P, N]`` in the state's dtype) the state after token ``t``
    is stored at entry ``intermediate_state_indices[b]`` (default: the row's slot) step
    ``t``. ``retrieve_parent_token [bs, T]`` (with the buffer): token ``t >= 1`` continues
    from token ``retrieve_parent_token[b, t]`` if that is in ``[0, T)``, else from token
    ``t - 1``. Pad rows (``pad_slot_id``): nothing stored, zero output.

    Raises
    ------
    NotImplementedError
        ``enable_stochastic_rounding=True``; per-headdim ``A`` / ``dt`` / ``dt_bias`` / ``D``;
        a buffer of another dtype than the state.
    ValueError
        ``out`` missing; a buffer without ``cache_steps >= T`` or not contiguous.
    """
    op = "sglang.selective_state_update"
    if cache_philox_rounds < 0:
        raise ValueError("cache_philox_rounds must be non-negative.")
    if enable_stochastic_rounding:
        raise _not_supported(op, "enable_stochastic_rounding=True (stochastic rounding of fp16 "
                             "state stores)", "the kernels round to nearest")  # fmt: skip
    if out is None:
        raise ValueError(f"{op}: `out` is required (sglang writes the output into it in place)")
    if state.dim() == 3:
        state = state.unsqueeze(1)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # -> [bs, T, heads-or-groups, ...]
        if t.dim() == 2:
            t = t.unsqueeze(1)
        return t.unsqueeze(1) if t.dim() == 3 else t

    x4, dt4, B4, C4, out4 = tokens(x), tokens(dt), tokens(B), tokens(C), tokens(out)
    z4 = None if z is None else tokens(z)
    if out4.shape != x4.shape:
        raise ValueError(f"{op}: `out` must have the shape of `x` {list(x.shape)}, got {list(out.shape)}")
    A_h, dt_h, D_h, b_h = _ssm_params(op, A, dt4, D, dt_bias)
    bs, T = x4.shape[:2]
    dev = state.device
    if state_batch_indices is not None and state_batch_indices.shape != (bs,):
        raise ValueError(f"{op}: `state_batch_indices` must be [{bs}], got {list(state_batch_indices.shape)}")
    src = (torch.arange(bs, device=dev) if state_batch_indices is None
           else state_batch_indices.long())  # fmt: skip
    pad = pad_slot_id if state_batch_indices is not None else -1
    buf = rows = parent = None
    if intermediate_states_buffer is not None:
        b = intermediate_states_buffer
        if b.dtype != state.dtype:
            raise _not_supported(op, f"an intermediate_states_buffer of dtype {b.dtype} with a "
                                 f"{state.dtype} state", "intermediate states are stored in the "
                                 "state's dtype")  # fmt: skip
        if cache_steps is None or cache_steps < T:
            raise ValueError(f"{op}: `cache_steps` must be >= T = {T} with an intermediate_states_buffer, got {cache_steps}")
        if not b.is_contiguous():
            raise ValueError(f"{op}: `intermediate_states_buffer` must be contiguous")
        per = cache_steps * state[0].numel()
        if b.numel() % per:
            raise ValueError(f"{op}: `intermediate_states_buffer` of {b.numel()} elements is not "
                             f"[entries, cache_steps={cache_steps}, {', '.join(map(str, state.shape[1:]))}]")  # fmt: skip
        buf = b.view(-1, cache_steps, *state.shape[1:])
        rows = src if intermediate_state_indices is None else intermediate_state_indices.long()
        rows = torch.where(src != pad, rows, -1)
        if retrieve_parent_token is not None and T > 1:
            p = retrieve_parent_token[:, :T].long()
            t = torch.arange(T, device=dev)[None, :]
            parent = torch.where((p >= 0) & (p < T), p, t - 1)
            parent[:, 0] = -1
    ssm_tokens(
        state, x4, dt_h, A_h, B4, C4, D=D_h, z=z4, dt_bias=b_h, dt_softplus=dt_softplus,
        src=src, parent=parent, final_dst=None if disable_state_update else src,
        buffer=buf, buffer_rows=rows, out=out4, pad=pad,
    )  # fmt: skip


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accept_tokens: torch.Tensor | None = None,
    intermediate_conv_window: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    retrieve_next_token: torch.Tensor | None = None,
    retrieve_next_sibling: torch.Tensor | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata: object = None,
    validate_data: bool = False,
) -> torch.Tensor:
    """sglang's Triton ``causal_conv1d_update``: ``S`` tokens per row; returns a new ``out``.

    ``x [bs, dim]`` or ``[bs, dim, S]``, ``conv_state [slots, dim, L]`` (``L >= width - 1``),
    row ``b`` in slot ``conv_state_indices[b]`` (default ``b``). Without
    ``num_accept_tokens`` the tokens run from the window in columns ``0 .. width - 2`` and
    the window shifted by ``S`` is stored there (also for a tree: the shift is along the
    token order). With it, the first token reads the window at columns
    ``num_accept_tokens[b] - 1 ..`` and the state becomes the window's last ``width - 2``
    inputs followed by the ``S`` inputs. ``intermediate_conv_window [entries, S, dim,
    width - 1]`` (any strides) receives the window after each token at entry
    ``intermediate_state_indices[b]`` (default ``b``). A tree (``retrieve_next_token``,
    ``retrieve_next_sibling`` and ``retrieve_parent_token``, each ``[bs, S]``): each
    token's window follows its ancestors; the parents are written into
    ``retrieve_parent_token`` (token 0: 0). Pad rows: nothing stored, zero output.

    Raises
    ------
    NotImplementedError
        ``cache_seqlens`` (circular-buffer conv state; sglang's Triton kernel ignores it).
    """
    op = "sglang.causal_conv1d_update"
    if cache_seqlens is not None:
        raise _not_supported(op, "cache_seqlens (a circular-buffer conv state)",
                             "sglang's Triton kernel ignores it; its CUDA kernel implements it")  # fmt: skip
    del metadata, validate_data
    act = activation_name(op, activation)
    x3 = x.unsqueeze(-1) if x.dim() == 2 else x  # [bs, dim, S]
    bs, _, S = x3.shape
    K = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[2] < K - 1:
        raise ValueError(f"{op}: `conv_state` must be [slots, dim, state_len >= {K - 1}], got {list(conv_state.shape)}")
    if num_accept_tokens is not None and conv_state.shape[2] < K - 2 + S:
        raise ValueError(f"{op}: `conv_state` needs state_len >= width - 2 + {S} with num_accept_tokens")
    dev = x.device
    slots = (torch.arange(bs, device=dev) if conv_state_indices is None
             else conv_state_indices.long())  # fmt: skip
    pad = pad_slot_id if conv_state_indices is not None else -1
    parent = par = None
    if retrieve_next_token is not None:
        if retrieve_next_sibling is None or retrieve_parent_token is None:
            raise ValueError(f"{op}: a tree needs retrieve_next_token, retrieve_next_sibling and "
                             "retrieve_parent_token")  # fmt: skip
        par = sibling_parents(retrieve_next_token, retrieve_next_sibling, S)
        parent = par.clone()
        parent[:, 0] = -1
    rows = None
    if intermediate_conv_window is not None:
        rows = (torch.arange(bs, device=dev) if intermediate_state_indices is None
                else intermediate_state_indices.long())  # fmt: skip
        rows = torch.where(slots != pad, rows, -1)
    xs = x3.transpose(1, 2)  # [bs, S, dim]
    y = torch.empty_like(xs)
    conv_tokens(
        conv_state, xs, weight, bias, activation=act, slots=slots,
        offset=None if num_accept_tokens is None else num_accept_tokens.long() - 1,
        parent=parent, state_write="shift" if num_accept_tokens is None else "spec",
        buffer=intermediate_conv_window, buffer_rows=rows, out=y, pad=pad,
    )  # fmt: skip
    if par is not None and retrieve_parent_token is not None:
        dst = retrieve_parent_token[:, :S]
        dst.copy_(torch.where((slots != pad)[:, None], par.to(dst.dtype), dst))
    out = y.transpose(1, 2)
    return out.squeeze(-1) if x.dim() == 2 else out
