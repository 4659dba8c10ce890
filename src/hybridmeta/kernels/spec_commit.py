"""Speculative-decoding commit: accepted token's state -> working slot (and track slot), all layers.

After verify, each row's intermediate buffers hold the SSM state and conv window after
every draft token. The commit copies, for every layer of the layer-major pools in one
launch, the blocks of the row's last accepted token into its working slot and, when the
accepted tokens cross a prefix-cache track boundary, the blocks of exactly the boundary
token into the row's track slot. A fixed number of programs walks the rows (a runtime
loop bound, never specialised) and shares out the ``layers x chunks`` copy work, as
:mod:`hybridmeta.kernels.track_save` does.

This module holds the Triton kernel, its launcher, the ``torch.library`` op, the public
function :func:`spec_commit`, its metadata entry :func:`spec_commit_from_metadata` (slots,
track mask and verdict from a :class:`~hybridmeta.model.SpecCommitMetadata`), the device
helper :func:`spec_track_token` (which boundary token, if any) and the pure-torch
:func:`spec_commit_reference`.
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
    NO_FAULT,
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
from hybridmeta.model import SpecCommitMetadata

__all__ = [
    "launch_spec_commit",
    "spec_commit",
    "spec_commit_from_metadata",
    "spec_commit_reference",
    "spec_track_token",
]


@triton.jit
def _copy_layers(
    dst_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_off: tl.tensor,
    src_off: tl.tensor,
    stride_dst_l: tl.tensor,
    stride_src_l: tl.tensor,
    num_layers: tl.tensor,
    numel: tl.tensor,
    pid: tl.tensor,
    nprog: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    """This program's share of ``dst[l, dst_off:+numel] = src[l, src_off:+numel]`` for all l."""
    o = tl.arange(0, BLOCK)
    n_chunks = tl.cdiv(numel, BLOCK)
    for j in tl.range(pid, num_layers * n_chunks, nprog):
        i_l = (j // n_chunks).to(tl.int64)
        offs = (j - i_l * n_chunks) * BLOCK + o  # [BLOCK] within the block
        m = offs < numel
        v = tl.load(src_ptr + i_l * stride_src_l + src_off + offs, mask=m)
        tl.store(dst_ptr + i_l * stride_dst_l + dst_off + offs, v, mask=m)


_OP = "spec_commit"
_TAG: tl.constexpr = tl.constexpr(TAG[_OP])


@triton.jit(do_not_specialize=["bs", "T", "pad_id", "n_slots"])
def _spec_commit_kernel(
    ssm_ptr: tl.tensor,
    conv_ptr: tl.tensor,
    issm_ptr: tl.tensor,
    iconv_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    acc_ptr: tl.tensor,
    trk_ptr: tl.tensor,
    trk_mask_ptr: tl.tensor,
    trk_tok_ptr: tl.tensor,
    err_ptr: tl.tensor,
    bs: tl.tensor,
    T: tl.tensor,
    pad_id: tl.tensor,
    n_slots: tl.tensor,
    num_layers: tl.tensor,
    ssm_numel: tl.tensor,
    conv_numel: tl.tensor,
    stride_ssm_l: tl.tensor,
    stride_ssm_slot: tl.tensor,
    stride_conv_l: tl.tensor,
    stride_conv_slot: tl.tensor,
    stride_issm_l: tl.tensor,
    stride_issm_b: tl.tensor,
    stride_issm_t: tl.tensor,
    stride_iconv_l: tl.tensor,
    stride_iconv_b: tl.tensor,
    stride_iconv_t: tl.tensor,
    HAS_TRACK: tl.constexpr,
    SSM_BLOCK: tl.constexpr,
    CONV_BLOCK: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    zero = tl.full([], 0, tl.int64)
    for b in tl.range(0, bs):
        # int64: row * per-row stride of the intermediate buffers overflows int32.
        b64 = zero + b
        slot = tl.load(slot_ptr + b64).to(tl.int64)
        slot_ok = valid_slot(slot, pad_id, n_slots)
        # The token to commit: -1 commits nothing. A row whose working slot, accepted
        # column, (flagged) track slot or boundary column is invalid commits nothing at all
        # (not the working slot, not the track slot) and is recorded.
        tok = tl.load(acc_ptr + b64).to(tl.int64)
        bad_s = (slot != pad_id) & (slot_ok == 0)
        bad_a = slot_ok & ((tok < -1) | (tok >= T))
        bad = bad_s | bad_a
        if HAS_TRACK:
            flag = tl.load(trk_mask_ptr + b64) != 0
            trk = tl.load(trk_ptr + b64).to(tl.int64)
            ttok = tl.load(trk_tok_ptr + b64).to(tl.int64)
            trk_ok = valid_slot(trk, pad_id, n_slots)
            on = slot_ok & flag
            bad_t = on & (trk != pad_id) & (trk_ok == 0)
            bad_k = on & trk_ok & ((ttok < -1) | (ttok >= T))
            bad = bad | bad_t | bad_k
        if bad & (pid == 0):
            if HAS_TRACK:
                field = tl.where(bad_s, 0, tl.where(bad_a, 1, tl.where(bad_t, 2, 3)))
                value = tl.where(bad_s, slot, tl.where(bad_a, tok, tl.where(bad_t, trk, ttok)))
            else:
                field = tl.where(bad_s, 0, 1)
                value = tl.where(bad_s, slot, tok)
            bound = tl.where((field == 0) | (field == 2), n_slots, T)
            report(err_ptr, _TAG, b64, field, value, pad_id, bound)
        live = slot_ok & (bad == 0)
        tok = tl.where(live, tok, -1)
        if tok >= 0:
            _copy_layers(
                ssm_ptr, issm_ptr, slot * stride_ssm_slot,
                b64 * stride_issm_b + tok * stride_issm_t, stride_ssm_l, stride_issm_l,
                num_layers, ssm_numel, pid, nprog, SSM_BLOCK,
            )  # fmt: skip
            _copy_layers(
                conv_ptr, iconv_ptr, slot * stride_conv_slot,
                b64 * stride_iconv_b + tok * stride_iconv_t, stride_conv_l, stride_iconv_l,
                num_layers, conv_numel, pid, nprog, CONV_BLOCK,
            )  # fmt: skip
        if HAS_TRACK:
            ttok = tl.where(live & flag & trk_ok, ttok, -1)
            if ttok >= 0:
                _copy_layers(
                    ssm_ptr, issm_ptr, trk * stride_ssm_slot,
                    b64 * stride_issm_b + ttok * stride_issm_t, stride_ssm_l, stride_issm_l,
                    num_layers, ssm_numel, pid, nprog, SSM_BLOCK,
                )  # fmt: skip
                _copy_layers(
                    conv_ptr, iconv_ptr, trk * stride_conv_slot,
                    b64 * stride_iconv_b + ttok * stride_iconv_t, stride_conv_l, stride_iconv_l,
                    num_layers, conv_numel, pid, nprog, CONV_BLOCK,
                )  # fmt: skip


def launch_spec_commit(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    inter_conv: torch.Tensor,
    inter_ssm: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_index: torch.Tensor,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    track_token: torch.Tensor | None,
    *,
    config: CopyLaunchConfig | None = None,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """Launch the commit on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    conv_pool, ssm_pool : torch.Tensor
        ``[layers, slots, conv_dim, k - 1]`` and ``[layers, slots, nheads, headdim, dstate]``,
        each ``[layer, slot]`` block dense; written.
    inter_conv, inter_ssm : torch.Tensor
        ``[layers, bs, T, ...]`` with the same trailing shapes, each block dense; read.
    state_indices, accepted_index : torch.Tensor
        ``[bs]`` working slot (``pad_slot_id`` pad) and token to commit (``-1`` none).
    track_indices, track_mask, track_token : torch.Tensor or None
        ``[bs]`` track slot (``pad_slot_id`` none), flag and boundary token (``-1`` none);
        all or none.
    config : CopyLaunchConfig, optional
        Copy step and program count; default from the device and dtype.
    pad_slot_id : int
        The pad id (int32).
    errors : torch.Tensor, optional
        The error record (default: the device's).
    """
    bs = state_indices.shape[0]
    num_layers, _, T = inter_ssm.shape[:3]
    if bs == 0:
        return
    err = errors if errors is not None else record_for(ssm_pool)
    # From the shapes: no layers or no slots still checks the rows' ids.
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
    launchable(_spec_commit_kernel, ssm_pool.device)[grid](
        ssm_ptr=ssm_pool,
        conv_ptr=conv_pool,
        issm_ptr=inter_ssm,
        iconv_ptr=inter_conv,
        slot_ptr=state_indices,
        acc_ptr=accepted_index,
        trk_ptr=track_indices,
        trk_mask_ptr=track_mask,
        trk_tok_ptr=track_token,
        err_ptr=err,
        bs=bs,
        T=T,
        pad_id=pad_slot_id,
        n_slots=ssm_pool.shape[1],
        num_layers=num_layers,
        ssm_numel=ssm_numel,
        conv_numel=conv_numel,
        stride_ssm_l=ssm_pool.stride(0),
        stride_ssm_slot=ssm_pool.stride(1),
        stride_conv_l=conv_pool.stride(0),
        stride_conv_slot=conv_pool.stride(1),
        stride_issm_l=inter_ssm.stride(0),
        stride_issm_b=inter_ssm.stride(1),
        stride_issm_t=inter_ssm.stride(2),
        stride_iconv_l=inter_conv.stride(0),
        stride_iconv_b=inter_conv.stride(1),
        stride_iconv_t=inter_conv.stride(2),
        HAS_TRACK=track_indices is not None,
        SSM_BLOCK=ssm_block,
        CONV_BLOCK=conv_block,
        num_warps=cfg.num_warps,
    )


# --------------------------------------------------------------------------- custom op


def _spec_commit_impl(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    inter_conv: torch.Tensor,
    inter_ssm: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_index: torch.Tensor,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    track_token: torch.Tensor | None,
    pad_slot_id: int,
    errors: torch.Tensor,
) -> None:
    with on_device(ssm_pool.device):
        launch_spec_commit(
            conv_pool, ssm_pool, inter_conv, inter_ssm, state_indices, accepted_index,
            track_indices, track_mask, track_token, pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip


_spec_commit_op = torch.library.custom_op(
    "hybridmeta::spec_commit",
    _spec_commit_impl,
    mutates_args=("conv_pool", "ssm_pool", "errors"),
)

_spec_commit_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- public op


def spec_commit(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    inter_conv: torch.Tensor,
    inter_ssm: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    accepted_index: torch.Tensor,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
    track_token: torch.Tensor | None = None,
    impl: Impl | None = None,
    pad_slot_id: int = -1,
) -> None:
    """Commit the verified draft: copy accepted states into the working and track slots.

    One launch covers every layer of the layer-major pools. For each row ``b`` with a
    valid working slot ``s = state_indices[b]``::

        a = accepted_index[b]                # last accepted draft column, -1: none accepted
        if a >= 0:
            ssm_pool[:, s]  = inter_ssm[:, b, a];   conv_pool[:, s] = inter_conv[:, b, a]
        k = track_token[b]                   # boundary column, -1: no boundary crossed
        if track_mask[b] and k >= 0 and track_indices[b] != pad_slot_id:
            ssm_pool[:, track_indices[b]] = inter_ssm[:, b, k];   (conv likewise)

    For a chain ``accepted_index = num_accepted - 1``; for a tree it is the column of the
    accepted path's last token. ``accepted_index == -1`` leaves the working slot unchanged.
    :func:`spec_track_token` computes ``track_token`` from the sequence lengths. Pad rows
    (``state_indices[b] == pad_slot_id``) do nothing. Copies are exact (same dtype both
    sides). A valid slot is ``0 <= id < slots`` and ``id != pad_slot_id``. A row holding an
    invalid working slot, an ``accepted_index`` outside ``[-1, T)`` (e.g. the count passed
    for the index), or, when flagged, an invalid track slot or a ``track_token`` outside
    ``[-1, T)`` commits nothing (neither slot) and the fault goes to the device's error
    record (:func:`hybridmeta.kernels.check_errors`); with CPU index tensors (outside a
    graph capture) or in debug mode the op raises
    :class:`~hybridmeta.kernels.SlotIndexError` instead, before writing.

    Parameters
    ----------
    conv_pool : torch.Tensor
        ``[layers, slots, conv_dim, k - 1]``; each ``[layer, slot]`` block contiguous.
    ssm_pool : torch.Tensor
        ``[layers, slots, nheads, headdim, dstate]``; each ``[layer, slot]`` block contiguous.
    inter_conv : torch.Tensor
        ``[layers, bs, T, conv_dim, k - 1]`` in ``conv_pool.dtype``, each block contiguous
        (the per-layer ``inter`` buffers :func:`conv_verify_update` filled).
    inter_ssm : torch.Tensor
        ``[layers, bs, T, nheads, headdim, dstate]`` in ``ssm_pool.dtype``, each block
        contiguous (what :func:`ssm_verify_update` filled).
    state_indices : torch.Tensor
        ``[bs]`` int32/int64 working slot of each row; ``pad_slot_id`` for a pad row.
    accepted_index : torch.Tensor
        ``[bs]`` int32/int64 in ``[-1, T)``.
    track_indices, track_mask, track_token : torch.Tensor, optional
        All three or none. ``[bs]`` track slot (int; ``pad_slot_id``: none), flag (bool)
        and boundary column in ``[-1, T)`` (int).
    pad_slot_id : int
        The pad id (int32; default ``-1``).

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (the message names it), including a
        pool that aliases itself. Nothing is written.
    SlotIndexError
        An invalid slot or column, when they can be read without a sync or in debug mode
        (which also refuses two rows writing one slot). Nothing is written.
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
    check_tensor(op, "state_indices", state_indices, shape=(None,), dtypes=INDEX_DTYPES,
                 device=dev, dims="[bs]")  # fmt: skip
    bs = state_indices.shape[0]
    check_rows(op, bs)
    check_tensor(op, "inter_ssm", inter_ssm, shape=(layers, bs, None, *ssm_pool.shape[2:]),
                 dtypes=(ssm_pool.dtype,), device=dev,
                 dims="[layers, bs, T, nheads, headdim, dstate]")  # fmt: skip
    T = inter_ssm.shape[2]
    check_tensor(op, "inter_conv", inter_conv, shape=(layers, bs, T, *conv_pool.shape[2:]),
                 dtypes=(conv_pool.dtype,), device=dev,
                 dims="[layers, bs, T, conv_dim, k - 1]")  # fmt: skip
    check_slot_contiguous(op, "inter_ssm", inter_ssm, 3)
    check_slot_contiguous(op, "inter_conv", inter_conv, 3)
    check_tensor(op, "accepted_index", accepted_index, shape=(bs,), dtypes=INDEX_DTYPES,
                 device=dev, dims="[bs]")  # fmt: skip
    given = [t is not None for t in (track_indices, track_mask, track_token)]
    if any(given) and not all(given):
        raise ValueError(
            f"{op}: `track_indices`, `track_mask` and `track_token` must be given together "
            "or not at all"
        )
    if track_indices is not None:
        check_tensor(op, "track_indices", track_indices, shape=(bs,), dtypes=INDEX_DTYPES,
                     device=dev, dims="[bs]")  # fmt: skip
        check_tensor(op, "track_mask", track_mask, shape=(bs,), dtypes=MASK_DTYPES, device=dev,
                     dims="[bs]")  # fmt: skip
        check_tensor(op, "track_token", track_token, shape=(bs,), dtypes=INDEX_DTYPES,
                     device=dev, dims="[bs]")  # fmt: skip
    which = resolve(op, impl, dev)
    seen = observed(ssm_pool)
    if is_debug() or (not seen and dev.type == "cpu"):
        _check_commit_ids(
            op, slots, pad_slot_id, T, state_indices, accepted_index, track_indices,
            track_mask, track_token,
        )  # fmt: skip
    errors = record_for(ssm_pool)
    if which == "reference":
        spec_commit_reference(
            conv_pool, ssm_pool, inter_conv, inter_ssm, state_indices, accepted_index,
            track_indices, track_mask, track_token, pad_slot_id=pad_slot_id, errors=errors,
        )  # fmt: skip
        return
    run = torch.ops.hybridmeta.spec_commit if seen else _spec_commit_impl
    run(conv_pool, ssm_pool, inter_conv, inter_ssm, state_indices, accepted_index, track_indices,
        track_mask, track_token, pad_slot_id, errors)  # fmt: skip


def spec_commit_from_metadata(
    cmd: SpecCommitMetadata,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    inter_conv: torch.Tensor,
    inter_ssm: torch.Tensor,
    *,
    impl: Impl | None = None,
) -> None:
    """:func:`spec_commit` of the rows of a verified draft, everything it indexes by from ``cmd``.

    Working slots ``cmd.mamba_cache_indices``, verdict ``cmd.accepted_index``; when
    ``cmd.has_mamba_track_mask`` (a host flag, decided without reading the mask) the rows
    flagged in ``cmd.mamba_track_mask`` also save the state of column ``cmd.track_token``
    into ``cmd.mamba_track_indices``. ``inter_conv`` / ``inter_ssm`` are the intermediate
    states the verify wrote (state storage, like the pools): ``[layers, bs, T, ...]`` with
    ``T = cmd.draft_token_num``.

    Raises
    ------
    TypeError
        ``cmd`` is not a :class:`~hybridmeta.model.SpecCommitMetadata`.
    ValueError
        The intermediate buffers do not have ``cmd.draft_token_num`` draft columns; then
        every check of :func:`spec_commit`. Nothing is written.
    """
    op = "spec_commit_from_metadata"
    if not isinstance(cmd, SpecCommitMetadata):
        raise TypeError(
            f"{op}: `cmd` must be a SpecCommitMetadata (SpecCommitMetadata.evolve_from("
            f"verify_md, accepted_index=..., track_token=...)), got {type(cmd).__qualname__}"
        )
    for name, t in (("inter_conv", inter_conv), ("inter_ssm", inter_ssm)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3 or t.shape[2] != cmd.draft_token_num:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{op}: `{name}` must be [layers, bs, T, ...] with T = draft_token_num = "
                f"{cmd.draft_token_num}, got {got}"
            )
    track = mask = token = None
    if cmd.has_mamba_track_mask:
        track, mask, token = cmd.mamba_track_indices, cmd.mamba_track_mask, cmd.track_token
    spec_commit(
        conv_pool, ssm_pool, inter_conv, inter_ssm, state_indices=cmd.mamba_cache_indices,
        accepted_index=cmd.accepted_index, track_indices=track, track_mask=mask,
        track_token=token, impl=impl, pad_slot_id=pad_slot_of(cmd),
    )  # fmt: skip


def commit_faults(
    slots: int,
    pad: int,
    T: int,
    src: torch.Tensor,
    acc: torch.Tensor,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
    token: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A commit's rows judged as the kernel judges them, in torch (no sync).

    Returns ``(keys, commit, track_commit)``: the per-row fault keys (fields: working slot,
    accepted column, track slot, boundary column), the rows that copy their accepted
    column into the working slot and those that copy their boundary column into the
    track slot (``None`` without track fields). A row with any fault copies nothing.
    """
    src_pad, src_ok = slot_kinds(src, slots, pad)
    a = acc.long()
    faults = [(~src_pad & ~src_ok, 0, src), (src_ok & ((a < -1) | (a >= T)), 1, a)]
    trk_ok: torch.Tensor | None = None
    k: torch.Tensor | None = None
    if track is not None and mask is not None and token is not None:
        trk_pad, trk_ok = slot_kinds(track, slots, pad)
        k = token.long()
        on = src_ok & mask
        faults.append((on & ~trk_pad & ~trk_ok, 2, track))
        faults.append((on & trk_ok & ((k < -1) | (k >= T)), 3, k))
        trk_ok = on & trk_ok
    keys = fault_keys(faults)
    live = src_ok & (keys == NO_FAULT)
    commit = live & (a >= 0)
    if trk_ok is None or k is None:
        return keys, commit, None
    return keys, commit, live & trk_ok & (k >= 0)


def _check_commit_ids(
    op: str,
    slots: int,
    pad: int,
    T: int,
    src: torch.Tensor,
    acc: torch.Tensor,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
    token: torch.Tensor | None,
) -> None:
    """Host check of a commit's ids (reads them: CPU tensors, or debug mode): the kernel's
    rules, raised as :class:`SlotIndexError`, then two rows writing one slot
    (``ValueError``; only the intermediate buffers are read, so that is the one hazard)."""
    keys, commit, track_commit = commit_faults(slots, pad, T, src, acc, track, mask, token)
    host_check(op, keys, pad, (slots, T, slots, T))
    writes = [("state_indices", src, commit)]
    if track is not None and track_commit is not None:
        writes.append(("track_indices", track, track_commit))
    check_disjoint_writes(op, writes, None)


def spec_track_token(
    seq_lens: torch.Tensor,
    num_accepted: torch.Tensor,
    interval: int,
    *,
    path: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draft column whose state lands on a prefix-cache track boundary, ``-1`` for none.

    A row with ``seq_lens[b]`` tokens in its working state before verify and
    ``num_accepted[b]`` accepted draft tokens crosses the boundary ``m * interval`` when
    ``seq_lens[b] < m * interval <= seq_lens[b] + num_accepted[b]``; the state at that
    boundary is the one after accepted token ``j = m * interval - seq_lens[b] - 1`` (0-based
    along the accepted path). If several boundaries are crossed (only when more than
    ``interval`` tokens are accepted), the last one is taken. Pure torch on the inputs'
    device, no host sync.

    Parameters
    ----------
    seq_lens, num_accepted : torch.Tensor
        ``[bs]`` integer tensors (``num_accepted`` in ``[0, T]``).
    interval : int
        Track interval, ``> 0``.
    path : torch.Tensor, optional
        ``[bs, T]`` accepted path of a tree: ``path[b, j]`` is the draft column of the
        ``j``-th accepted token. Without it (a chain) the column is ``j`` itself.

    Returns
    -------
    torch.Tensor
        ``[bs]`` int64 ``track_token`` for :func:`spec_commit`.
    """
    if interval <= 0:
        raise ValueError(f"spec_track_token: `interval` must be > 0, got {interval}")
    start = seq_lens.to(torch.int64)
    end = start + num_accepted.to(torch.int64)
    boundary = torch.div(end, interval, rounding_mode="floor") * interval  # last one <= end
    j = torch.where(boundary > start, boundary - start - 1, -1)
    if path is None:
        return j
    col = path.to(torch.int64).gather(1, j.clamp(min=0)[:, None])[:, 0]
    return torch.where(j >= 0, col, -1)


# --------------------------------------------------------------------------- reference


def spec_commit_reference(
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    inter_conv: torch.Tensor,
    inter_ssm: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_index: torch.Tensor,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
    track_token: torch.Tensor | None = None,
    *,
    pad_slot_id: int = -1,
    errors: torch.Tensor | None = None,
) -> None:
    """The pure-torch commit, in place: the accepted (and boundary) blocks copied into the
    working (and track) slots of every layer. Fixed shapes, no device-to-host reads. A row
    with an invalid id or column commits nothing and is recorded in ``errors`` (default:
    the device's record), as the kernel does."""
    T = inter_ssm.shape[2]
    slots = ssm_pool.shape[1]
    keys, commit, track_commit = commit_faults(
        slots, pad_slot_id, T, state_indices, accepted_index, track_indices, track_mask,
        track_token,
    )  # fmt: skip
    rows = torch.arange(state_indices.shape[0], device=state_indices.device)
    writes = [(state_indices, accepted_index.long(), commit)]
    if track_indices is not None and track_token is not None and track_commit is not None:
        writes.append((track_indices, track_token.long(), track_commit))
    if T:
        for idx, cols, write in writes:
            for pool, inter in ((conv_pool, inter_conv), (ssm_pool, inter_ssm)):
                values = inter[:, rows, cols.clamp(0, T - 1)].movedim(1, 0)  # [bs, layers, ...]
                scatter_rows_(pool, 1, idx, values, write)
    record_(
        errors if errors is not None else record_for(ssm_pool), _OP, keys, pad_slot_id,
        (slots, T, slots, T),
    )  # fmt: skip
