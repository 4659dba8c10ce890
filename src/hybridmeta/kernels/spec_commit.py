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


@triton.jit(do_not_specialize=["bs", "T"])
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
    bs: tl.tensor,
    T: tl.tensor,
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
        # Token to commit, -1 for none: a pad row (slot -1), nothing accepted (-1), or an
        # index past T (memory-safe; debug mode refuses it). Chained `where`, not `a & b`
        # of scalars (the interpreter mistypes those).
        tok = tl.load(acc_ptr + b64).to(tl.int64)
        tok = tl.where(slot >= 0, tok, -1)
        tok = tl.where(tok < T, tok, -1)
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
            flag = tl.load(trk_mask_ptr + b64) != 0
            trk = tl.load(trk_ptr + b64).to(tl.int64)
            ttok = tl.load(trk_tok_ptr + b64).to(tl.int64)
            ttok = tl.where(flag, ttok, -1)
            ttok = tl.where(slot >= 0, ttok, -1)
            ttok = tl.where(trk >= 0, ttok, -1)
            ttok = tl.where(ttok < T, ttok, -1)
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
        ``[bs]`` working slot (``-1`` pad) and token to commit (``-1`` none).
    track_indices, track_mask, track_token : torch.Tensor or None
        ``[bs]`` track slot, flag and boundary token (``-1`` none); all or none.
    config : CopyLaunchConfig, optional
        Copy step and program count; default from the device and dtype.
    """
    bs = state_indices.shape[0]
    num_layers, _, T = inter_ssm.shape[:3]
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
        bs=bs,
        T=T,
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
) -> None:
    with on_device(ssm_pool.device):
        launch_spec_commit(
            conv_pool, ssm_pool, inter_conv, inter_ssm, state_indices, accepted_index,
            track_indices, track_mask, track_token,
        )  # fmt: skip


_spec_commit_op = torch.library.custom_op(
    "hybridmeta::spec_commit", _spec_commit_impl, mutates_args=("conv_pool", "ssm_pool")
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
) -> None:
    """Commit the verified draft: copy accepted states into the working and track slots.

    One launch covers every layer of the layer-major pools. For each row ``b`` with
    working slot ``s = state_indices[b] >= 0``::

        a = accepted_index[b]                # last accepted draft column, -1: none accepted
        if a >= 0:
            ssm_pool[:, s]  = inter_ssm[:, b, a];   conv_pool[:, s] = inter_conv[:, b, a]
        k = track_token[b]                   # boundary column, -1: no boundary crossed
        if track_mask[b] and k >= 0 and track_indices[b] >= 0:
            ssm_pool[:, track_indices[b]] = inter_ssm[:, b, k];   (conv likewise)

    For a chain ``accepted_index = num_accepted - 1``; for a tree it is the column of the
    accepted path's last token. ``accepted_index == -1`` leaves the working slot unchanged.
    :func:`spec_track_token` computes ``track_token`` from the sequence lengths. Pad rows
    (``state_indices[b] == -1``) do nothing. Copies are exact (same dtype both sides).

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
        ``[bs]`` int32/int64 working slot of each row; ``-1`` for a pad row.
    accepted_index : torch.Tensor
        ``[bs]`` int32/int64 in ``[-1, T)``.
    track_indices, track_mask, track_token : torch.Tensor, optional
        All three or none. ``[bs]`` track slot (int), flag (bool) and boundary column in
        ``[-1, T)`` (int).

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (the message names it); in debug mode
        also on a slot outside ``[-1, slots)``, a column outside ``[-1, T)``, or two rows
        writing one slot. Nothing is written.
    """
    op = "spec_commit"
    ssm_pool = check_pool(op, "ssm_pool", ssm_pool, dims="[layers, slots, nheads, headdim, dstate]")
    dev = ssm_pool.device
    layers, slots = ssm_pool.shape[:2]
    check_tensor(op, "conv_pool", conv_pool, shape=(layers, slots, None, None), dtypes=STATE_DTYPES,
                 device=dev, dims="[layers, slots, conv_dim, k - 1]")  # fmt: skip
    check_slot_contiguous(op, "ssm_pool", ssm_pool, 2)
    check_slot_contiguous(op, "conv_pool", conv_pool, 2)
    check_tensor(op, "state_indices", state_indices, shape=(None,), dtypes=INDEX_DTYPES,
                 device=dev, dims="[bs]")  # fmt: skip
    bs = state_indices.shape[0]
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
    if is_debug():
        _debug_check_commit(
            op, slots, T, state_indices, accepted_index, track_indices, track_mask, track_token
        )
    if which == "reference":
        spec_commit_reference(
            conv_pool, ssm_pool, inter_conv, inter_ssm, state_indices, accepted_index,
            track_indices, track_mask, track_token,
        )  # fmt: skip
        return
    run = torch.ops.hybridmeta.spec_commit if observed(ssm_pool) else _spec_commit_impl
    run(conv_pool, ssm_pool, inter_conv, inter_ssm, state_indices, accepted_index, track_indices,
        track_mask, track_token)  # fmt: skip


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
        track_token=token, impl=impl,
    )  # fmt: skip


def _check_columns(op: str, name: str, cols: torch.Tensor, active: torch.Tensor, T: int) -> None:
    bad = active & ((cols < -1) | (cols >= T))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{op}: `{name}` values must be -1 or a draft column in [0, T={T}); row {row} "
            f"holds {int(cols[row])}"
        )


def _debug_check_commit(
    op: str,
    slots: int,
    T: int,
    src: torch.Tensor,
    acc: torch.Tensor,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
    token: torch.Tensor | None,
) -> None:
    check_index_range(op, "state_indices", src, slots)
    live = src >= 0
    _check_columns(op, "accepted_index", acc, live, T)
    writes = [("state_indices", src, live & (acc >= 0))]
    if track is not None and mask is not None and token is not None:
        check_index_range(op, "track_indices", track, slots)
        flagged = live & mask
        _check_columns(op, "track_token", token, flagged, T)
        writes.append(("track_indices", track, flagged & (token >= 0)))
    # Only the intermediate buffers are read, so the one hazard is two rows writing one slot.
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
) -> None:
    """The pure-torch commit, in place: the accepted (and boundary) blocks copied into the
    working (and track) slots of every layer. Fixed shapes, no device-to-host reads."""
    T = inter_ssm.shape[2]
    live = state_indices >= 0
    rows = torch.arange(state_indices.shape[0], device=state_indices.device)
    acc = accepted_index.long()
    ok = live & (acc >= 0) & (acc < T)
    writes = [(state_indices, acc, ok)]
    if track_indices is not None and track_mask is not None and track_token is not None:
        tok = track_token.long()
        tr = live & track_mask.bool() & (track_indices >= 0) & (tok >= 0) & (tok < T)
        writes.append((track_indices, tok, tr))
    for slots, cols, write in writes:
        for pool, inter in ((conv_pool, inter_conv), (ssm_pool, inter_ssm)):
            values = inter[:, rows, cols.clamp(0, T - 1)].movedim(1, 0)  # [bs, layers, ...]
            scatter_rows_(pool, 1, slots, values, write)
