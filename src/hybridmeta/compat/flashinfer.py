"""FlashInfer 0.7.4 drop-in: ``flashinfer.mamba.selective_state_update`` with FlashInfer's
signature and documented semantics, on hybridmeta's ops.

Single-token (``x [bs, H, P]``), multi-token (``x [bs, T, H, P]``, or ``[bs, H, P]`` with
``cache_steps >= 1``) and varlen (``x [total_tokens, H, P]`` with ``cu_seqlens``) calls;
``pad_slot_id`` (default ``-1``) marks pad rows: no state read or written, **zero** output
(FlashInfer computes the update of a zero state). Not supported, each a
``NotImplementedError`` naming it: ``state_scale`` / ``intermediate_state_scales`` (int16
block-scaled state), ``rand_seed`` (stochastic rounding), ``backend="cake"``.
``docs/compat.md`` has the full statement and the two places where FlashInfer's "simple"
multi-token kernel departs from its documentation.
"""

from __future__ import annotations

import torch

from hybridmeta.compat._common import ssm_tokens, varlen_pad, varlen_unpad_
from hybridmeta.compat.vllm import _not_supported, _ssm_params

__all__ = ["selective_state_update"]

_ALGORITHMS = ("auto", "simple", "vertical", "horizontal", "async_horizontal")


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    pad_slot_id: int = -1,
    state_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    intermediate_state_scales: torch.Tensor | None = None,
    rand_seed: torch.Tensor | None = None,
    philox_rounds: int = 10,
    cache_steps: int = 0,
    algorithm: str = "auto",
    dst_state_batch_indices: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """FlashInfer's ``selective_state_update``; returns the output (``out`` if given).

    Row ``b`` (``N`` rows: ``bs``, or ``len(cu_seqlens) - 1`` sequences of
    ``cu_seqlens[b + 1] - cu_seqlens[b]`` tokens, at most ``cache_steps``) starts from slot
    ``state_batch_indices[b, max(num_accepted_tokens[b] - 1, 0)]`` (1-D indices: ``[b]``;
    none: ``b``). States stored, unless ``disable_state_update``: with
    ``dst_state_batch_indices`` the state after token ``t`` at ``dst[b, t]`` (``[b]`` if
    1-D; ``pad_slot_id`` entries skipped); else the state after the last token at the source
    slot. ``intermediate_states_buffer [entries, cache_steps, H, P, N]`` (multi-token only;
    exclusive with ``dst_state_batch_indices``) receives the state after every token at
    entry ``intermediate_state_indices[b]`` (default: the source slot), whatever
    ``disable_state_update``. ``A [H, P, N]``, ``dt [.., H, P]``, ``D, dt_bias [H, P]``
    must be stride-0 expansions of per-head values (FlashInfer requires it too).

    Raises
    ------
    NotImplementedError
        ``state_scale``, ``intermediate_state_scales``, ``rand_seed``, ``backend="cake"``.
    ValueError
        ``intermediate_states_buffer`` with ``dst_state_batch_indices``; an unknown
        ``algorithm`` / ``backend``; varlen without ``cache_steps >= 1``.
    """
    op = "flashinfer.selective_state_update"
    if state_scale is not None or intermediate_state_scales is not None:
        raise _not_supported(op, "state_scale / intermediate_state_scales (int16 block-scaled "
                             "state)", "states are stored as fp32 / bf16 / fp16")  # fmt: skip
    if rand_seed is not None:
        raise _not_supported(op, "rand_seed (stochastic rounding of state stores)",
                             "the kernels round to nearest")  # fmt: skip
    del philox_rounds  # read only with rand_seed
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"Unknown algorithm: {algorithm}")
    if backend not in ("auto", "flashinfer", "cake"):
        raise ValueError(f"Unknown backend: {backend}")
    if backend == "cake":
        raise _not_supported(op, "backend='cake'", "an SM100 source-built FlashInfer backend")
    if intermediate_states_buffer is not None and dst_state_batch_indices is not None:
        raise ValueError("intermediate_states_buffer and dst_state_batch_indices are mutually exclusive")
    if cache_steps < 0:
        raise ValueError(f"{op}: cache_steps must be non-negative, got {cache_steps}")
    is_varlen = cu_seqlens is not None and x.dim() == 3
    is_mtp = cache_steps >= 1 and not is_varlen
    if state.dim() == 3:
        state = state.unsqueeze(1)
    output = torch.zeros_like(x) if out is None else out  # tokens of no sequence: 0

    def shape(t: torch.Tensor) -> torch.Tensor:
        if is_varlen:
            return t
        if t.dim() == 2:
            t = t.unsqueeze(1)
        return t.unsqueeze(1) if t.dim() == 3 else t  # [N, T, ...]

    x4, dt4, B4, C4, out4 = shape(x), shape(dt), shape(B), shape(C), shape(output)
    z4 = None if z is None else shape(z)
    if out4.shape != x4.shape:
        raise ValueError(f"{op}: `out` must have the shape of `x` {list(x.shape)}, got {list(output.shape)}")
    A_h, dt_h, D_h, b_h = _ssm_params(op, A, dt4, D, dt_bias)
    multi = is_varlen or x4.shape[1] > 1 or is_mtp
    dev = state.device
    if is_varlen:
        assert cu_seqlens is not None
        if cache_steps < 1:
            raise ValueError("cache_steps must be >= 1 in varlen mode (specifies max_seqlen)")
        N, T = cu_seqlens.shape[0] - 1, cache_steps
    else:
        N, T = x4.shape[:2]

    def cols(idx: torch.Tensor | None) -> torch.Tensor | None:
        if idx is None:
            return None
        if idx.shape[0] < N:
            raise ValueError(f"{op}: index tensors must have >= {N} rows, got {idx.shape[0]}")
        return (idx if idx.dim() == 2 else idx[:, None])[:N].long()

    sbi, dsbi = cols(state_batch_indices), cols(dst_state_batch_indices)
    pad = pad_slot_id if sbi is not None else -1  # passed to the ops as their pad id
    if num_accepted_tokens is not None and multi:
        if state_batch_indices is None:
            raise ValueError("state_batch_indices is required when num_accepted_tokens is provided")
        init = (num_accepted_tokens[:N].long() - 1).clamp(min=0)
        assert sbi is not None
        init = init if sbi.shape[1] > 1 else torch.zeros_like(init)
        src = sbi.gather(1, init[:, None])[:, 0]
    else:
        src = torch.arange(N, device=dev) if sbi is None else sbi[:, 0]
    token_dst = final_dst = None
    if not disable_state_update:
        if dsbi is not None:
            if multi and dsbi.shape[1] > 1:
                if dsbi.shape[1] < T:
                    raise ValueError(f"{op}: `dst_state_batch_indices` needs >= {T} columns")
                token_dst = dsbi[:, :T]
            else:  # one destination a row: every token writes it, the last one stays
                final_dst = dsbi[:, 0]
        else:
            final_dst = src
    buf = rows = None
    if intermediate_states_buffer is not None and multi:
        b = intermediate_states_buffer
        if b.dtype != state.dtype:
            raise ValueError("intermediate_states_buffer must have the same dtype as state")
        if not b.is_contiguous() or cache_steps < T:
            raise ValueError(f"{op}: `intermediate_states_buffer` must be contiguous with cache_steps >= {T}")
        buf = b.view(-1, cache_steps, *state.shape[1:])
        rows = src if intermediate_state_indices is None else intermediate_state_indices.long()
        rows = torch.where(src != pad, rows, -1)
    if not is_varlen:
        ssm_tokens(
            state, x4, dt_h, A_h, B4, C4, D=D_h, z=z4, dt_bias=b_h, dt_softplus=dt_softplus,
            src=src, token_dst=token_dst, final_dst=final_dst, buffer=buf, buffer_rows=rows,
            out=out4, pad=pad,
        )  # fmt: skip
        return output
    assert cu_seqlens is not None
    cu = cu_seqlens.long()
    lens, starts = cu.diff(), cu[:-1]
    xp, dtp = varlen_pad(x4, starts, T), varlen_pad(dt_h, starts, T)
    Bp, Cp = varlen_pad(B4, starts, T), varlen_pad(C4, starts, T)
    zp = None if z4 is None else varlen_pad(z4, starts, T)
    yp = torch.empty_like(xp)
    ssm_tokens(
        state, xp, dtp, A_h, Bp, Cp, D=D_h, z=zp, dt_bias=b_h, dt_softplus=dt_softplus,
        src=src, lens=lens, token_dst=token_dst, final_dst=final_dst, buffer=buf,
        buffer_rows=rows, out=yp, pad=pad,
    )  # fmt: skip
    varlen_unpad_(out4, yp, cu)
    return output
