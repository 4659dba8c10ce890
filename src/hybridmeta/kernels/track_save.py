"""Prefix-cache track-save: copy conv + SSM state of flagged rows, all layers, one launch.

The public op :func:`track_save` validates, then runs the kernel or the pure-torch
:func:`track_save_reference`; :func:`track_save_from_metadata` is the forward's
end-of-layers save of every row flagged in ``mamba_track_mask``.


The pools are layer-major (``[layers, slots, ...]``). A fixed number of programs walks the
rows; for each flagged live row the programs share out the ``layers x chunks`` copy work
of both pools. The grid depends on the pool shapes only, never on ``bs`` (a runtime loop
bound, not specialised), so a new batch size neither recompiles nor changes the launch.

Only flagged rows are looked at. A flagged row whose working slot is the pad id copies
nothing (a pad row), as does one whose track slot is the pad id ("none"); a flagged row
holding any other id outside ``[0, slots)`` copies nothing and sets the device's error
record (:mod:`hybridmeta.kernels._errors`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybridmeta._interpret import launchable
from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import CopyLaunchConfig, cdiv, copy_launch_config, pow2_ceil
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, on_device, resolve
from hybridmeta.kernels._errors import (
    TAG,
    fault_keys,
    host_check,
    record_,
    record_for,
    report,
    valid_slot,
)
from hybridmeta.kernels._math import scatter_rows_
from hybridmeta.kernels._validate import (
    INDEX_DTYPES,
    MASK_DTYPES,
    STATE_DTYPES,
    check_disjoint_writes,
    check_no_alias,
    check_pad_slot_id,
    check_pool,
    check_rows,
    check_slot_contiguous,
    check_slots,
    check_tensor,
    pad_slot_of,
    slot_kinds,
)
from hybridmeta.model import Mamba2Metadata

__all__ = ["launch_track_save", "track_save", "track_save_from_metadata", "track_save_reference"]


_OP = "track_save"
_TAG: tl.constexpr = tl.constexpr(TAG[_OP])


@triton.jit(do_not_specialize=["bs", "pad_id", "n_slots"])
def _track_save_kernel(
    ssm_ptr: tl.tensor,
    conv_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    mask_ptr: tl.tensor,
    err_ptr: tl.tensor,
    bs: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
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
    # The least flagged row holding an id that is neither the pad id nor a valid slot (it
    # copies nothing): reported once, after the loop. An unflagged row costs what it did
    # before the checks (its ids are loaded, not judged); docs/perf_notes.md.
    first_bad = bs
    for b in tl.range(0, bs):
        flag = tl.load(mask_ptr + b)
        src = tl.load(src_ptr + b).to(tl.int64)
        dst = tl.load(dst_ptr + b).to(tl.int64)
        if flag != 0:
            src_ok = valid_slot(src, pad_id, n_slots)
            dst_ok = valid_slot(dst, pad_id, n_slots)
            bad = ((src != pad_id) & (src_ok == 0)) | (src_ok & (dst != pad_id) & (dst_ok == 0))
            first_bad = tl.minimum(first_bad, tl.where(bad, b, bs))
            # One comparison, not `a & b` of scalars (the interpreter mistypes those).
            if tl.where(src_ok & dst_ok, 1, 0) > 0:
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
    if (first_bad < bs) & (pid == 0):
        src = tl.load(src_ptr + first_bad).to(tl.int64)
        dst = tl.load(dst_ptr + first_bad).to(tl.int64)
        bad_src = (src != pad_id) & (valid_slot(src, pad_id, n_slots) == 0)
        report(
            err_ptr, _TAG, first_bad, tl.where(bad_src, 0, 1), tl.where(bad_src, src, dst),
            pad_id, n_slots,
        )  # fmt: skip


def launch_track_save(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
    *,
    config: CopyLaunchConfig | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch track-save on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    conv_pool : torch.Tensor
        ``[layers, slots, conv_dim, k - 1]``; each ``[layer, slot]`` block contiguous.
    ssm_pool : torch.Tensor
        ``[layers, slots, nheads, headdim, dstate]``; each ``[layer, slot]`` block contiguous.
    src_indices, track_indices : torch.Tensor
        ``[bs]`` working slot and track slot of each row; ``pad_slot_id`` skips the row,
        another id outside ``[0, slots)`` of a flagged row is a fault (recorded in
        ``errors``, nothing copied).
    track_mask : torch.Tensor
        ``[bs]`` bool: rows to copy.
    config : CopyLaunchConfig, optional
        Copy step and program count; default from the device and dtype.
    pad_slot_id : int
        The pad id (int32).
    errors : torch.Tensor, optional
        The error record (default: the device's).
    """
    bs = src_indices.shape[0]
    num_layers, n_slots = ssm_pool.shape[:2]
    if bs == 0:
        return
    err = errors if errors is not None else record_for(ssm_pool)
    # From the shapes: a pool of no layers or no slots still checks its rows' ids.
    ssm_numel = math.prod(ssm_pool.shape[2:])
    conv_numel = math.prod(conv_pool.shape[2:])
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
        err_ptr=err,
        bs=bs,
        pad_id=pad_slot_id,
        n_slots=n_slots,
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
    pad_slot_id: int,
    errors: torch.Tensor,
) -> None:
    with on_device(ssm_pool.device):
        launch_track_save(
            conv_pool, ssm_pool, src_indices, track_indices, track_mask,
            pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip


_track_save_op = torch.library.custom_op(
    "hybridmeta::track_save",
    _track_save_impl,
    mutates_args=("conv_pool", "ssm_pool", "errors"),
)

_track_save_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- reference


def track_save_reference(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
    *,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """The pure-torch track-save, in place: flagged rows' slots copied, every layer.

    A row is copied when its mask is set and both its source and track slot are valid;
    a flagged row with an id that is neither the pad id nor valid copies nothing and is
    recorded in ``errors`` (default: the device's record), as the kernel does. Fixed
    shapes, no device-to-host reads.
    """
    slots = ssm_pool.shape[1]
    keys, rows = track_faults(slots, pad_slot_id, src_indices, track_indices, track_mask)
    if slots:
        safe = torch.where(rows, src_indices, 0)
        for pool in (conv_pool, ssm_pool):
            values = pool.index_select(1, safe).movedim(1, 0)  # [bs, layers, ...]
            scatter_rows_(pool, 1, track_indices, values, rows)
    record_(errors if errors is not None else record_for(ssm_pool), _OP, keys, pad_slot_id, slots)


def track_faults(
    slots: int, pad: int, src: torch.Tensor, track: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, copy)``: the flagged rows' fault keys and the rows that copy (no sync)."""
    src_pad, src_ok = slot_kinds(src, slots, pad)
    trk_pad, trk_ok = slot_kinds(track, slots, pad)
    keys = fault_keys(
        [(mask & ~src_pad & ~src_ok, 0, src), (mask & src_ok & ~trk_pad & ~trk_ok, 1, track)]
    )
    return keys, mask & src_ok & trk_ok


# --------------------------------------------------------------------------- public op


def track_save(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    *,
    src_indices: torch.Tensor,
    track_indices: torch.Tensor,
    track_mask: torch.Tensor,
    impl: Impl | None = None,
    pad_slot_id: int = -1,
) -> None:
    """Copy conv and SSM state of every layer from each flagged row's slot to its track slot.

    One launch covers all layers of both layer-major pools. Rows whose mask is false, or
    whose source or track slot is ``pad_slot_id``, are skipped. A valid slot is
    ``0 <= id < slots`` and ``id != pad_slot_id``; a flagged row holding any other id
    copies nothing and the fault goes to the device's error record
    (:func:`hybridmeta.kernels.check_errors`); with CPU index tensors (outside a graph
    capture) or in debug mode the op raises :class:`~hybridmeta.kernels.SlotIndexError`
    instead, before writing.

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
    pad_slot_id : int
        The pad id (int32; default ``-1``), also the "none" of ``track_indices``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above, including a pool that aliases itself.
    SlotIndexError
        An invalid id, when the ids can be read without a sync or in debug mode (which
        also refuses two rows writing one slot, or a row writing a slot another reads).
        Nothing is written.
    """
    op = _OP
    check_pad_slot_id(op, pad_slot_id)
    ssm_pool = check_pool(op, "ssm_pool", ssm_pool, dims="[layers, slots, nheads, headdim, dstate]")
    dev = ssm_pool.device
    layers, slots = ssm_pool.shape[:2]
    check_slots(op, "ssm_pool", slots)
    check_tensor(op, "conv_pool", conv_pool, shape=(layers, slots, None, None), dtypes=STATE_DTYPES,
                 device=dev, dims="[layers, slots, conv_dim, k - 1]")  # fmt: skip
    check_no_alias(op, "conv_pool", conv_pool)
    check_slot_contiguous(op, "ssm_pool", ssm_pool, 2)
    check_slot_contiguous(op, "conv_pool", conv_pool, 2)
    check_tensor(op, "src_indices", src_indices, shape=(None,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    bs = src_indices.shape[0]
    check_rows(op, bs)
    check_tensor(op, "track_indices", track_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    check_tensor(
        op, "track_mask", track_mask, shape=(bs,), dtypes=MASK_DTYPES, device=dev, dims="[bs]"
    )
    which = resolve(op, impl, dev)
    seen = observed(ssm_pool)
    if is_debug() or (not seen and dev.type == "cpu"):
        keys, copy = track_faults(slots, pad_slot_id, src_indices, track_indices, track_mask)
        host_check(op, keys, pad_slot_id, slots)
        if is_debug():
            check_disjoint_writes(
                op, [("track_indices", track_indices, copy)], ("src_indices", src_indices, copy)
            )
    errors = record_for(ssm_pool)
    if which == "reference":
        track_save_reference(
            conv_pool, ssm_pool, src_indices, track_indices, track_mask,
            pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip
        return
    run = torch.ops.hybridmeta.track_save if seen else _track_save_impl
    run(conv_pool, ssm_pool, src_indices, track_indices, track_mask, pad_slot_id, errors)


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
        pad_slot_id=pad_slot_of(md),
    )  # fmt: skip
