"""Prefix-cache track-save: copy conv + SSM state of flagged rows, all layers, one launch.

The public op :func:`track_save` validates, then runs the kernel or the pure-torch
:func:`track_save_reference`; :func:`track_save_from_metadata` is the forward's
end-of-layers save of every row flagged in ``mamba_track_mask``.


The pools are layer-major (``[layers, slots, ...]``). A fixed number of programs walks the
rows; for each flagged live row the programs share out the ``layers x chunks`` copy work
of both pools. The grid depends on the pool shapes only, never on ``bs`` (a runtime loop
bound, not specialised), so a new batch size neither recompiles nor changes the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import CopyLaunchConfig, cdiv, copy_launch_config, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, on_device, resolve
from hybridmeta.kernels._math import scatter_rows_
from hybridmeta.kernels._validate import (
    INDEX_DTYPES,
    MASK_DTYPES,
    STATE_DTYPES,
    check_disjoint_writes,
    check_index_range,
    check_pool,
    check_slot_contiguous,
    check_tensor,
)
from hybridmeta.model import Mamba2Metadata

__all__ = ["launch_track_save", "track_save", "track_save_from_metadata", "track_save_reference"]


@triton.jit(do_not_specialize=["bs"])
def _track_save_kernel(
    ssm_ptr: tl.tensor,
    conv_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    mask_ptr: tl.tensor,
    bs: tl.tensor,
    num_layers: tl.tensor,
    ssm_numel: tl.tensor,
    conv_numel: tl.tensor,
    stride_ssm_l: tl.tensor,
    stride_ssm_slot: tl.tensor,
    stride_conv_l: tl.tensor,
    stride_conv_slot: tl.tensor,
    SSM_BLOCK: tl.constexpr,
    CONV_BLOCK: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    o_s = tl.arange(0, SSM_BLOCK)
    o_c = tl.arange(0, CONV_BLOCK)
    n_ssm = tl.cdiv(ssm_numel, SSM_BLOCK)  # chunks per layer slot
    n_conv = tl.cdiv(conv_numel, CONV_BLOCK)
    for b in tl.range(0, bs):
        flag = tl.load(mask_ptr + b) != 0
        src = tl.load(src_ptr + b).to(tl.int64)
        dst = tl.load(dst_ptr + b).to(tl.int64)
        # One comparison, not `a & b & c` of scalars (the interpreter mistypes those).
        if tl.where(flag, tl.minimum(src, dst), -1) >= 0:
            for j in tl.range(pid, num_layers * n_ssm, nprog):
                i_l = j // n_ssm
                offs = (j - i_l * n_ssm) * SSM_BLOCK + o_s  # [SB] within the slot
                base = ssm_ptr + i_l.to(tl.int64) * stride_ssm_l
                m = offs < ssm_numel
                v = tl.load(base + src * stride_ssm_slot + offs, mask=m)
                tl.store(base + dst * stride_ssm_slot + offs, v, mask=m)
            for j in tl.range(pid, num_layers * n_conv, nprog):
                i_l = j // n_conv
                offs = (j - i_l * n_conv) * CONV_BLOCK + o_c  # [CB]
                base = conv_ptr + i_l.to(tl.int64) * stride_conv_l
                m = offs < conv_numel
                v = tl.load(base + src * stride_conv_slot + offs, mask=m)
                tl.store(base + dst * stride_conv_slot + offs, v, mask=m)


def launch_track_save(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
    *,
    config: CopyLaunchConfig | None = None,
) -> None:
    """Launch track-save on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    conv_pool : torch.Tensor
        ``[layers, slots, conv_dim, k - 1]``; each ``[layer, slot]`` block contiguous.
    ssm_pool : torch.Tensor
        ``[layers, slots, nheads, headdim, dstate]``; each ``[layer, slot]`` block contiguous.
    src_indices, track_indices : torch.Tensor
        ``[bs]`` working slot and track slot of each row; ``-1`` skips the row.
    track_mask : torch.Tensor
        ``[bs]`` bool: rows to copy.
    config : CopyLaunchConfig, optional
        Copy step and program count; default from the device and dtype.
    """
    bs = src_indices.shape[0]
    num_layers = ssm_pool.shape[0]
    if bs == 0 or num_layers == 0:
        return
    ssm_numel = ssm_pool[0, 0].numel()
    conv_numel = conv_pool[0, 0].numel()
    cfg = (
        config
        if config is not None
        else copy_launch_config(ssm_pool.device, ssm_pool.element_size())
    )
    ssm_block = min(cfg.block, pow2_ceil(ssm_numel))
    conv_block = min(
        cfg.block * ssm_pool.element_size() // conv_pool.element_size(),
        pow2_ceil(conv_numel),
    )
    work = num_layers * cdiv(ssm_numel, ssm_block)
    grid = (max(1, min(cfg.max_programs, work)),)
    launchable(_track_save_kernel, ssm_pool.device)[grid](
        ssm_ptr=ssm_pool,
        conv_ptr=conv_pool,
        src_ptr=src_indices,
        dst_ptr=track_indices,
        mask_ptr=track_mask,
        bs=bs,
        num_layers=num_layers,
        ssm_numel=ssm_numel,
        conv_numel=conv_numel,
        stride_ssm_l=ssm_pool.stride(0),
        stride_ssm_slot=ssm_pool.stride(1),
        stride_conv_l=conv_pool.stride(0),
        stride_conv_slot=conv_pool.stride(1),
        SSM_BLOCK=ssm_block,
        CONV_BLOCK=conv_block,
        num_warps=cfg.num_warps,
    )


# --------------------------------------------------------------------------- custom op


def _track_save_impl(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
) -> None:
    with on_device(ssm_pool.device):
        launch_track_save(conv_pool, ssm_pool, src_indices, track_indices, track_mask)


_track_save_op = torch.library.custom_op(
    "hybridmeta::track_save", _track_save_impl, mutates_args=("conv_pool", "ssm_pool")
)

_track_save_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- reference


def track_save_reference(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
) -> None:
    """The pure-torch track-save, in place: flagged rows' slots copied, every layer.

    A row is copied when its mask is set and both its source and track slot are ``>= 0``.
    Fixed shapes, no device-to-host reads.
    """
    rows = track_mask & (src_indices >= 0) & (track_indices >= 0)
    safe = torch.where(rows, src_indices, 0)
    for pool in (conv_pool, ssm_pool):
        values = pool.index_select(1, safe).movedim(1, 0)  # [bs, layers, ...]
        scatter_rows_(pool, 1, track_indices, values, rows)


# --------------------------------------------------------------------------- public op


def track_save(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    *,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
    impl: Impl | None = None,
) -> None:
    """Copy conv and SSM state of every layer from each flagged row's slot to its track slot.

    One launch covers all layers of both layer-major pools. Rows whose mask is false, or
    whose source or track slot is ``-1``, are skipped.

    Parameters
    ----------
    conv_pool : torch.Tensor
        ``[layers, slots, conv_dim, k - 1]``; each ``[layer, slot]`` block contiguous.
    ssm_pool : torch.Tensor
        ``[layers, slots, nheads, headdim, dstate]``; each ``[layer, slot]`` block contiguous.
    src_indices, track_indices : torch.Tensor
        ``[bs]`` int32/int64: working slot and track slot of each row.
    track_mask : torch.Tensor
        ``[bs]`` bool: rows to copy.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (see :func:`hybridmeta.kernels.implementation`).
    """
    op = "track_save"
    ssm_pool = check_pool(op, "ssm_pool", ssm_pool, dims="[layers, slots, nheads, headdim, dstate]")
    dev = ssm_pool.device
    layers, slots = ssm_pool.shape[:2]
    check_tensor(op, "conv_pool", conv_pool, shape=(layers, slots, None, None), dtypes=STATE_DTYPES,
                 device=dev, dims="[layers, slots, conv_dim, k - 1]")  # fmt: skip
    check_slot_contiguous(op, "ssm_pool", ssm_pool, 2)
    check_slot_contiguous(op, "conv_pool", conv_pool, 2)
    check_tensor(op, "src_indices", src_indices, shape=(None,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    bs = src_indices.shape[0]
    check_tensor(op, "track_indices", track_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    check_tensor(
        op, "track_mask", track_mask, shape=(bs,), dtypes=MASK_DTYPES, device=dev, dims="[bs]"
    )
    which = resolve(op, impl, dev)
    if is_debug():
        check_index_range(op, "src_indices", src_indices, slots)
        check_index_range(op, "track_indices", track_indices, slots)
        active = track_mask & (src_indices >= 0)
        check_disjoint_writes(
            op, [("track_indices", track_indices, active)], ("src_indices", src_indices, active)
        )
    if which == "reference":
        track_save_reference(conv_pool, ssm_pool, src_indices, track_indices, track_mask)
        return
    run = torch.ops.hybridmeta.track_save if observed(ssm_pool) else _track_save_impl
    run(conv_pool, ssm_pool, src_indices, track_indices, track_mask)


def track_save_from_metadata(
    md: Mamba2Metadata,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    *,
    impl: Impl | None = None,
) -> None:
    """Save the state of every row flagged in ``md.mamba_track_mask``, all layers.

    Run once after the forward's layers: a flagged row's working slot then holds its state
    at the boundary (a decode row's new token, a prefill row's last token). Does nothing
    when ``md.has_mamba_track_mask`` is false (a host flag: no device read). Refuses a
    target-verify forward, whose boundaries the commit saves.
    """
    if md.is_target_verify:
        raise ValueError(
            "track_save_from_metadata: the metadata is a target-verify forward; its working "
            "slots still hold the state before the draft, so its boundaries are saved by the "
            "commit (spec_commit_from_metadata), from the verified token's intermediate state"
        )
    if not md.has_mamba_track_mask:
        return
    assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
    track_save(
        conv_pool, ssm_pool, src_indices=md.mamba_cache_indices,
        track_indices=md.mamba_track_indices, track_mask=md.mamba_track_mask, impl=impl,
    )  # fmt: skip
