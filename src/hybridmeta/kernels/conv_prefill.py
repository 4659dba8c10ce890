"""Prefill causal conv1d over the flattened variable-length batch, with initial states.

Each token's window is gathered from the *extended* input: the flattened prefill tokens
followed by every prefill row's initial conv state (``K - 1`` columns, zeros where the
row has none), so a window that reaches back before a row's first new token reads that
row's saved inputs and never a neighbour's tokens. The indices are planned on the host
and arrive in the forward's metadata (``md.mixed.conv``,
:class:`~hybridmeta.model.ConvWindows`); here there is no loop over rows and no sync.

One implementation, in torch (gathers and a K-tap sum; no Triton kernel yet): it is this
op's reference too.

Slots (``md.prefill_slots``, the pad id the metadata's declared null slot): a row whose slot
is the pad id reads no initial state and writes none back; a row whose slot is neither the
pad id nor in ``[0, slots)`` reads and writes nothing, its initial window is NaN (so are its
outputs that reach into it) and the fault goes to the device's error record
(:mod:`hybridmeta.kernels._errors`); with CPU tensors (nothing to sync) or in debug mode the
op raises :class:`~hybridmeta.kernels.SlotIndexError` before writing.

The conv is the ``torch.library`` op ``hybridmeta::causal_conv1d_prefill`` (the plan's
tensors as arguments, ``conv_state`` and the error record declared mutated, a fake that
gives the outputs' shapes), so ``torch.compile`` sees one opaque op whatever the plan's
shapes; the public function checks the arguments before it and wraps the op's two tensors
into :class:`ConvPrefillOutput` after it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridmeta.debug import is_debug
from hybridmeta.kernels._dispatch import observed
from hybridmeta.kernels._errors import NO_FAULT, host_check, record_, record_for
from hybridmeta.kernels._math import index_copy_rows_
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    check_optional,
    check_pool,
    check_slots,
    check_tensor,
    pad_slot_of,
    prefill_slot_faults,
)
from hybridmeta.model import Mamba2Metadata

_OP = "causal_conv1d_prefill"

__all__ = ["ConvPrefillOutput", "causal_conv1d_prefill", "extended_conv_input"]


class ConvPrefillOutput(NamedTuple):
    """Result of :func:`causal_conv1d_prefill` (a named tuple: ``torch.compile`` builds it).

    Attributes
    ----------
    out : torch.Tensor
        ``[T, conv_dim]`` activations, the input's dtype.
    init_windows : torch.Tensor
        ``[num_prefills, K-1, conv_dim]`` the initial conv states read (zeros where a row
        has none), oldest input first; the track-save needs them after the pool was
        overwritten with the final windows.
    """

    out: torch.Tensor
    init_windows: torch.Tensor


def extended_conv_input(xbc: torch.Tensor, init_windows: torch.Tensor) -> torch.Tensor:
    """``[T + num_prefills * (K-1), conv_dim]``: tokens, then each row's initial window."""
    return torch.cat([xbc, init_windows.reshape(-1, xbc.shape[1]).to(xbc.dtype)])


def causal_conv1d_prefill(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    md: Mamba2Metadata,
    conv_state: torch.Tensor,
    activation: str | None = "silu",
) -> ConvPrefillOutput:
    """Causal depthwise conv1d of the prefill rows, resuming from their conv states.

    Parameters
    ----------
    xbc : torch.Tensor
        ``[T, conv_dim]`` prefill inputs (rows concatenated in plan order).
    weight : torch.Tensor
        ``[conv_dim, K]`` with ``K == plan.conv_kernel``.
    bias : torch.Tensor or None
        ``[conv_dim]``.
    md : Mamba2Metadata
        The forward's metadata; ``md.mixed.conv`` holds the windows.
    conv_state : torch.Tensor
        ``[num_slots, conv_dim, K-1]`` pool, oldest input first. Rows with an initial state
        read it from their working slot; every prefill row's last ``K-1`` inputs are written
        back there (in place).
    activation : {"silu", None}

    Returns
    -------
    ConvPrefillOutput

    Raises
    ------
    TypeError, ValueError
        A bad argument (the message names it), including a pool of a non-float dtype, on
        another device or aliasing itself, or parameters of the wrong length. Nothing is
        written.
    SlotIndexError
        A prefill slot that is neither the pad id nor in ``[0, slots)``, when the slots can
        be read without a sync (CPU tensors outside a graph capture) or in debug mode.
        Nothing is written.
    """
    if not isinstance(xbc, torch.Tensor) or xbc.dim() != 2:
        raise ValueError(
            f"causal_conv1d_prefill: xbc must be [T, conv_dim], got "
            f"{tuple(xbc.shape) if isinstance(xbc, torch.Tensor) else type(xbc).__name__}"
        )
    T, dim = xbc.shape
    mixed = md.mixed
    if mixed is None:
        raise ValueError("causal_conv1d_prefill: the metadata has no prefill rows (mixed is None)")
    K = mixed.conv.kernel_size
    if md.num_prefill_tokens != T:
        raise ValueError(
            f"causal_conv1d_prefill: xbc has {T} tokens but the metadata has "
            f"{md.num_prefill_tokens} prefill tokens"
        )
    if weight.shape != (dim, K):
        raise ValueError(
            f"causal_conv1d_prefill: weight must be [conv_dim, K] = {(dim, K)}, got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"causal_conv1d_prefill: bias must be [{dim}], got {tuple(bias.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (dim, K - 1):
        raise ValueError(
            f"causal_conv1d_prefill: conv_state must be [slots, conv_dim, K-1] = [*, {dim}, {K - 1}], "
            f"got {tuple(conv_state.shape)}"
        )
    if activation not in ("silu", None):
        raise ValueError(
            f"causal_conv1d_prefill: activation must be 'silu' or None, got {activation!r}"
        )
    conv_state = check_pool(_OP, "conv_state", conv_state, dims="[slots, conv_dim, K - 1]")
    dev = conv_state.device
    num_slots = conv_state.shape[0]
    check_slots(_OP, "conv_state", num_slots)
    check_tensor(_OP, "xbc", xbc, shape=(T, dim), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[T, conv_dim]")  # fmt: skip
    check_tensor(_OP, "weight", weight, shape=(dim, K), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[conv_dim, K]")  # fmt: skip
    check_optional(_OP, "bias", bias, shape=(dim,), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[conv_dim]")  # fmt: skip
    slots = md.prefill_slots
    if slots.device != dev:
        raise ValueError(
            f"{_OP}: the metadata's slots must be on the pool's device {dev}, got {slots.device}"
        )
    pad = pad_slot_of(md)
    if is_debug() or (dev.type == "cpu" and not observed(conv_state)):
        keys, _, _ = prefill_slot_faults(num_slots, pad, slots)
        host_check(_OP, keys, pad, num_slots)

    run = torch.ops.hybridmeta.causal_conv1d_prefill if observed(conv_state) else _conv_prefill_impl
    out, init = run(
        xbc, weight, bias, conv_state, slots, mixed.has_initial_states,
        mixed.conv.token_windows, mixed.conv.final_windows, activation == "silu", pad,
        record_for(conv_state),
    )  # fmt: skip
    return ConvPrefillOutput(out=out, init_windows=init)


# --------------------------------------------------------------------------- custom op


def _conv_prefill_impl(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    has_initial_states: torch.Tensor,
    token_windows: torch.Tensor,
    final_windows: torch.Tensor,
    silu: bool,
    pad: int,
    errors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv on checked arguments: ``(out [T, dim], init_windows [R, K-1, dim])``."""
    T, dim = xbc.shape
    num_slots = conv_state.shape[0]
    keys, read, write = prefill_slot_faults(num_slots, pad, slots)
    if num_slots:
        init = conv_state.index_select(0, torch.where(read, slots, 0))  # [R, dim, K-1]
    else:
        init = conv_state.new_zeros(slots.shape[0], dim, conv_state.shape[2])
    init = torch.where((read & has_initial_states)[:, None, None], init, 0)
    # A row with an invalid slot starts from a NaN window (its outputs that reach into it
    # are NaN); it writes nothing back.
    init = torch.where((keys != NO_FAULT)[:, None, None], float("nan"), init)
    init = init.transpose(1, 2).contiguous()  # [R, K-1, dim]
    ext = extended_conv_input(xbc, init)  # [T + R*(K-1), dim]
    w = weight.float()
    acc = torch.zeros(T, dim, dtype=torch.float32, device=xbc.device)
    if bias is not None:
        acc = acc + bias.float()
    for k in range(token_windows.shape[1]):  # K taps (a constant, not a loop over rows)
        acc = acc + ext.index_select(0, token_windows[:, k]).float() * w[:, k]
    out = F.silu(acc) if silu else acc
    final = ext[final_windows]  # [R, K-1, dim]
    index_copy_rows_(conv_state, slots, final.transpose(1, 2), write)
    record_(errors, _OP, keys, pad, num_slots)
    return out.to(xbc.dtype), init


def _conv_prefill_fake(
    xbc: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    has_initial_states: torch.Tensor,
    token_windows: torch.Tensor,
    final_windows: torch.Tensor,
    silu: bool,
    pad: int,
    errors: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, dim = xbc.shape
    init = conv_state.new_empty(slots.shape[0], conv_state.shape[2], dim)
    return xbc.new_empty(T, dim), init


_conv_prefill_op = torch.library.custom_op(
    "hybridmeta::causal_conv1d_prefill",
    _conv_prefill_impl,
    mutates_args=("conv_state", "errors"),
)
_conv_prefill_op.register_fake(_conv_prefill_fake)
