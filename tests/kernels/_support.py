"""Shared helpers of the kernel tests: the tolerance table, NaN-filled allocation, checks,
and functional wrappers of the ops' in-place references (new tensors, inputs untouched)."""

from __future__ import annotations

from typing import Any

import torch

from hybridmeta.kernels import (
    causal_conv1d_update_reference,
    conv_verify_update_reference,
    spec_commit_reference,
    ssm_state_update_reference,
    ssm_verify_update_reference,
    track_save_reference,
)

# The one table of tolerances, keyed by the dtype of the tensor compared
# (mamba_ssm / causal-conv1d conventions). fp32: kernel and reference sum the dstate (<= 128)
# products of `out` and the conv window in different orders, and exp/softplus may differ by
# an ulp: |err| <= n * 2**-24 * sum|terms| ~ 128 * 6e-8 * 10 ~ 1e-4 in the worst case, inside
# 1e-3 + 3e-4 |ref|. bf16/fp16: one rounding step (2**-8 / 2**-11 relative) of values up
# to ~10, plus the fp32 error above.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (3e-4, 1e-3),
    torch.float16: (1e-3, 5e-3),
    torch.bfloat16: (1e-2, 5e-2),
}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def nan_empty(*shape: int, dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    """A fresh allocation filled with NaN (reading unwritten memory then shows)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Compare with the tolerance of ``expected.dtype``; NaN never passes."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert not bool(torch.isnan(actual).any()), f"{what}: NaN in result"
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_slots_bitwise(
    actual: torch.Tensor, original: torch.Tensor, untouched: torch.Tensor, what: str
) -> None:
    """Slots listed in ``untouched`` (along dim 0) must be bit-identical to ``original``."""
    if untouched.numel() == 0:
        return
    assert torch.equal(bits(actual[untouched]), bits(original[untouched])), (
        f"{what}: a slot no live row references changed"
    )


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as the 1-D ``t`` in a non-contiguous view (stride 2)."""
    return t.repeat_interleave(2)[::2]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (any layout), for bit-exact comparisons (NaN == NaN)."""
    # A fresh buffer: `.contiguous()` may keep an odd stride on size-1 dims.
    dense = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    return dense.view(torch.uint8)


def compiled_count(kernel: Any) -> int:
    """Number of compiled variants of a ``triton.jit`` kernel (GPU only)."""
    caches = kernel.device_caches
    return sum(len(entry[0]) for entry in caches.values())


def ssm_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    src_indices: torch.Tensor,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM update reference on copies: ``(new_state, out)``."""
    new = state.clone()
    out = torch.empty_like(x)
    ssm_state_update_reference(new, x, dt, A, B, C, out, src_indices, **kw)
    return new, out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slot_indices: torch.Tensor,
    *,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv update reference on copies: ``(new_conv_state, out)``."""
    new = conv_state.clone()
    out = torch.empty_like(x)
    causal_conv1d_update_reference(x, new, weight, bias, out, slot_indices, silu=silu)
    return new, out


def track_save_ref(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The track-save reference on copies: ``(new_conv_pool, new_ssm_pool)``."""
    conv, ssm = conv_pool.clone(), ssm_pool.clone()
    track_save_reference(conv, ssm, src_indices, track_indices, track_mask)
    return conv, ssm


def ssm_verify_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    inter: torch.Tensor,
    state_indices: torch.Tensor,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify reference on copies: ``(new_inter, out)``."""
    new = inter.clone()
    out = torch.empty_like(x)
    ssm_verify_update_reference(state, x, dt, A, B, C, out, new, state_indices, **kw)
    return new, out


def conv_verify_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    inter: torch.Tensor,
    cache_indices: torch.Tensor,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv verify reference on copies: ``(new_inter, out)``."""
    new = inter.clone()
    out = torch.empty_like(x)
    conv_verify_update_reference(x, conv_state, weight, bias, out, new, cache_indices, **kw)
    return new, out


def spec_commit_ref(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    *args: Any,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The commit reference on copies: ``(new_conv_pool, new_ssm_pool)``."""
    conv, ssm = conv_pool.clone(), ssm_pool.clone()
    spec_commit_reference(conv, ssm, *args, **kw)
    return conv, ssm
