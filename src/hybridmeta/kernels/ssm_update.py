"""Mamba2 single-token SSM state update: Triton kernel, launcher, op, reference.

One program updates a ``[BLOCK_P, dstate]`` tile of one head of one row, in place in the
state pool (or into a separate destination slot), and writes the tile's share of the
output. Pad rows (source slot ``-1``) read no state, write no state and write zeros.
Flagged rows may also store the new state into their track slot in the same pass.

The launcher never allocates and never validates; the public op
:func:`ssm_state_update` does both, then runs the Triton kernel or the pure-torch
:func:`ssm_state_update_reference` (the op call's ``impl``). The metadata entry point
:func:`ssm_state_update_from_metadata` takes its slots from a ``Mamba2Metadata``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmeta.debug import is_debug
from hybridmeta.kernels._config import SsmLaunchConfig, ssm_launch_config
from hybridmeta.kernels._dispatch import Impl, no_output_fake, observed, on_device, resolve
from hybridmeta.kernels._math import discretize, scatter_rows_, ssm_step
from hybridmeta.kernels._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MASK_DTYPES,
    check_disjoint_writes,
    check_index_range,
    check_optional,
    check_pool,
    check_tensor,
    decode_rows,
)
from hybridmeta.model import Mamba2Metadata

__all__ = [
    "launch_ssm_update",
    "ssm_state_update",
    "ssm_state_update_from_metadata",
    "ssm_state_update_reference",
]


@triton.jit
def _ssm_update_kernel(
    state_ptr: tl.tensor,
    x_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    dt_bias_ptr: tl.tensor,
    A_ptr: tl.tensor,
    B_ptr: tl.tensor,
    C_ptr: tl.tensor,
    D_ptr: tl.tensor,
    z_ptr: tl.tensor,
    out_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    track_idx_ptr: tl.tensor,
    track_mask_ptr: tl.tensor,
    headdim: tl.tensor,
    dstate: tl.tensor,
    heads_per_group: tl.tensor,
    stride_s_slot: tl.tensor,
    stride_s_h: tl.tensor,
    stride_s_p: tl.tensor,
    stride_s_n: tl.tensor,
    stride_x_b: tl.tensor,
    stride_x_h: tl.tensor,
    stride_x_p: tl.tensor,
    stride_dt_b: tl.tensor,
    stride_dt_h: tl.tensor,
    stride_B_b: tl.tensor,
    stride_B_g: tl.tensor,
    stride_B_n: tl.tensor,
    stride_C_b: tl.tensor,
    stride_C_g: tl.tensor,
    stride_C_n: tl.tensor,
    stride_z_b: tl.tensor,
    stride_z_h: tl.tensor,
    stride_z_p: tl.tensor,
    stride_o_b: tl.tensor,
    stride_o_h: tl.tensor,
    stride_o_p: tl.tensor,
    DT_SOFTPLUS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_TRACK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    i_p = tl.program_id(0)
    # int64 from here on: slot * per-slot stride overflows int32 for large pools.
    i_b = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2).to(tl.int64)
    i_g = i_h // heads_per_group

    src = tl.load(src_ptr + i_b).to(tl.int64)
    live = src >= 0
    dst = tl.load(dst_ptr + i_b).to(tl.int64) if HAS_DST else src
    # Row predicates enter masks as a bound on the headdim offset (a pad row's bound is 0):
    # the Triton interpreter mistypes `block_mask & scalar_mask`.
    lim_read = tl.where(live, headdim, 0)
    lim_write = tl.where(dst >= 0, lim_read, 0)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP]
    o_n = tl.arange(0, BLOCK_N)  # [BN]
    m_p = o_p < headdim
    m_n = o_n < dstate
    o_s = i_h * stride_s_h + o_p[:, None] * stride_s_p + o_n[None, :] * stride_s_n  # [BP, BN]

    # Pad rows: the mask is false, so no state byte is read.
    b_s = tl.load(
        state_ptr + src * stride_s_slot + o_s,
        mask=(o_p < lim_read)[:, None] & m_n[None, :],
        other=0.0,
    ).to(tl.float32)  # [BP, BN]
    b_x = tl.load(
        x_ptr + i_b * stride_x_b + i_h * stride_x_h + o_p * stride_x_p, mask=m_p, other=0.0
    ).to(tl.float32)  # [BP]
    b_dt = tl.load(dt_ptr + i_b * stride_dt_b + i_h * stride_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(dt_bias_ptr + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        # softplus(x) equals x in fp32 above 20; the threshold also keeps exp from overflowing.
        b_dt = tl.where(b_dt <= 20.0, tl.log(1.0 + tl.exp(b_dt)), b_dt)
    b_dA = tl.exp(tl.load(A_ptr + i_h).to(tl.float32) * b_dt)
    b_B = tl.load(
        B_ptr + i_b * stride_B_b + i_g * stride_B_g + o_n * stride_B_n, mask=m_n, other=0.0
    ).to(tl.float32)  # [BN]
    b_C = tl.load(
        C_ptr + i_b * stride_C_b + i_g * stride_C_g + o_n * stride_C_n, mask=m_n, other=0.0
    ).to(tl.float32)  # [BN]

    b_s = b_s * b_dA + (b_x * b_dt)[:, None] * b_B[None, :]  # [BP, BN]
    b_o = tl.sum(b_s * b_C[None, :], axis=1)  # [BP]
    if HAS_D:
        b_o += b_x * tl.load(D_ptr + i_h).to(tl.float32)
    if HAS_Z:
        b_z = tl.load(
            z_ptr + i_b * stride_z_b + i_h * stride_z_h + o_p * stride_z_p, mask=m_p, other=0.0
        ).to(tl.float32)
        b_o *= b_z * tl.sigmoid(b_z)
    # A pad row's inputs may be garbage (even NaN): select, never multiply, to zero it.
    b_o = tl.where(live, b_o, 0.0)
    tl.store(
        out_ptr + i_b * stride_o_b + i_h * stride_o_h + o_p * stride_o_p,
        b_o.to(out_ptr.dtype.element_ty),
        mask=m_p,
    )

    b_new = b_s.to(state_ptr.dtype.element_ty)
    tl.store(
        state_ptr + dst * stride_s_slot + o_s, b_new, mask=(o_p < lim_write)[:, None] & m_n[None, :]
    )
    if HAS_TRACK:
        flag = tl.load(track_mask_ptr + i_b) != 0
        trk = tl.load(track_idx_ptr + i_b).to(tl.int64)
        lim_track = tl.where(flag, tl.where(trk >= 0, lim_read, 0), 0)
        tl.store(
            state_ptr + trk * stride_s_slot + o_s,
            b_new,
            mask=(o_p < lim_track)[:, None] & m_n[None, :],
        )


def launch_ssm_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    *,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
    config: SsmLaunchConfig | None = None,
) -> None:
    """Launch the SSM update on already validated tensors (no allocation, no checks).

    Parameters
    ----------
    state : torch.Tensor
        ``[slots, nheads, headdim, dstate]`` pool, updated in place.
    x, z, out : torch.Tensor
        ``[bs, nheads, headdim]``.
    dt : torch.Tensor
        ``[bs, nheads]``.
    A, D, dt_bias : torch.Tensor
        ``[nheads]``.
    B, C : torch.Tensor
        ``[bs, ngroups, dstate]``.
    src_indices, dst_indices, track_indices, track_mask : torch.Tensor
        ``[bs]``; ``-1`` marks a pad row (source) or "write nothing" (destination, track).
    config : SsmLaunchConfig, optional
        Tile shape and warps; the default is picked from the state dtype and shapes.
    """
    bs = x.shape[0]
    _, nheads, headdim, dstate = state.shape
    ngroups = B.shape[1]
    if bs == 0:
        return
    cfg = config if config is not None else ssm_launch_config(state.dtype, headdim, dstate)
    block_n = triton.next_power_of_2(dstate)
    z_strides = (z.stride(0), z.stride(1), z.stride(2)) if z is not None else (0, 0, 0)
    grid = (triton.cdiv(headdim, cfg.block_p), bs, nheads)
    _ssm_update_kernel[grid](
        state_ptr=state,
        x_ptr=x,
        dt_ptr=dt,
        dt_bias_ptr=dt_bias,
        A_ptr=A,
        B_ptr=B,
        C_ptr=C,
        D_ptr=D,
        z_ptr=z,
        out_ptr=out,
        src_ptr=src_indices,
        dst_ptr=dst_indices,
        track_idx_ptr=track_indices,
        track_mask_ptr=track_mask,
        headdim=headdim,
        dstate=dstate,
        heads_per_group=nheads // ngroups,
        stride_s_slot=state.stride(0),
        stride_s_h=state.stride(1),
        stride_s_p=state.stride(2),
        stride_s_n=state.stride(3),
        stride_x_b=x.stride(0),
        stride_x_h=x.stride(1),
        stride_x_p=x.stride(2),
        stride_dt_b=dt.stride(0),
        stride_dt_h=dt.stride(1),
        stride_B_b=B.stride(0),
        stride_B_g=B.stride(1),
        stride_B_n=B.stride(2),
        stride_C_b=C.stride(0),
        stride_C_g=C.stride(1),
        stride_C_n=C.stride(2),
        stride_z_b=z_strides[0],
        stride_z_h=z_strides[1],
        stride_z_p=z_strides[2],
        stride_o_b=out.stride(0),
        stride_o_h=out.stride(1),
        stride_o_p=out.stride(2),
        DT_SOFTPLUS=dt_softplus,
        HAS_DT_BIAS=dt_bias is not None,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_DST=dst_indices is not None,
        HAS_TRACK=track_indices is not None,
        BLOCK_P=cfg.block_p,
        BLOCK_N=block_n,
        num_warps=cfg.num_warps,
    )


# --------------------------------------------------------------------------- custom op


def _ssm_state_update_impl(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dst_indices: torch.Tensor | None,
    track_indices: torch.Tensor | None,
    track_mask: torch.Tensor | None,
) -> None:
    with on_device(state.device):
        launch_ssm_update(
            state, x, dt, A, B, C, out, src_indices,
            D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dst_indices=dst_indices,
            track_indices=track_indices, track_mask=track_mask,
        )  # fmt: skip


_ssm_state_update_op = torch.library.custom_op(
    "hybridmeta::ssm_state_update", _ssm_state_update_impl, mutates_args=("state", "out")
)

_ssm_state_update_op.register_fake(no_output_fake)


# --------------------------------------------------------------------------- reference


def ssm_state_update_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    out: torch.Tensor,
    src_indices: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dst_indices: torch.Tensor | None = None,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
) -> None:
    """The pure-torch SSM update: the kernel's contract, in place, on validated tensors.

    Fixed shapes and no device-to-host reads, so it captures into CUDA graphs (and the CPU
    emulation) like the kernel. Math in fp32, cast where the kernel casts: the new state to
    the pool's dtype, the output to ``out``'s.
    """
    live = src_indices >= 0  # [bs]
    safe = torch.where(live, src_indices, 0)
    s = torch.where(live[:, None, None, None], state.index_select(0, safe).float(), 0.0)
    new, y = ssm_step(s, x, discretize(dt, dt_bias, dt_softplus), A, B, C, D, z)
    out.copy_(torch.where(live[:, None, None], y, 0.0).to(out.dtype))
    dst = dst_indices if dst_indices is not None else src_indices
    scatter_rows_(state, 0, dst, new, live & (dst >= 0))
    if track_indices is not None and track_mask is not None:
        scatter_rows_(state, 0, track_indices, new, live & track_mask & (track_indices >= 0))


# --------------------------------------------------------------------------- public op


def ssm_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    state_indices: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dst_indices: torch.Tensor | None = None,
    track_indices: torch.Tensor | None = None,
    track_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """Mamba2 single-token SSM state update over a slot pool, in place.

    For each live row ``b`` (``state_indices[b] >= 0``) and head ``h`` (group
    ``g = h // (nheads // ngroups)``)::

        dt'  = softplus(dt[b, h] + dt_bias[h])          # bias / softplus optional
        s    = state[src] * exp(A[h] * dt') + dt' * x[b, h, :, None] * B[b, g, None, :]
        out  = (s @ C[b, g]) + D[h] * x[b, h]            # then * silu(z[b, h]) if z given
        state[dst] = s;  state[track[b]] = s if track_mask[b]

    Pad rows (``state_indices[b] == -1``) read and write no state and get zero output.

    Parameters
    ----------
    state : torch.Tensor
        ``[slots, nheads, headdim, dstate]``, float32 / bfloat16 / float16. Updated in place.
    x : torch.Tensor
        ``[bs, nheads, headdim]``, a float dtype.
    dt : torch.Tensor
        ``[bs, nheads]``.
    A : torch.Tensor
        ``[nheads]`` (negative decay rates).
    B, C : torch.Tensor
        ``[bs, ngroups, dstate]``; ``nheads % ngroups == 0``.
    state_indices : torch.Tensor
        ``[bs]`` int32/int64: source slot of each row, ``-1`` for a pad row.
    D, dt_bias : torch.Tensor, optional
        ``[nheads]``.
    z : torch.Tensor, optional
        ``[bs, nheads, headdim]`` gate.
    dt_softplus : bool
        Apply softplus to ``dt + dt_bias``.
    dst_indices : torch.Tensor, optional
        ``[bs]`` slot to write the new state to (default: the source slot); ``-1`` writes
        no state for that row.
    track_indices, track_mask : torch.Tensor, optional
        Both or neither. ``[bs]`` track slot and bool flag: flagged live rows also store the
        new state into their track slot in the same pass.
    out : torch.Tensor, optional
        ``[bs, nheads, headdim]`` in ``x.dtype``; allocated if not given.
    impl : {"auto", "triton", "reference"}, optional
        The implementation (default: :func:`hybridmeta.kernels.implementation`'s, else
        Triton on CUDA and the reference elsewhere).

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError, ValueError
        On any argument that breaks the rules above (message names it); in debug mode also
        on an index outside ``[-1, slots)`` or two rows writing one slot. Nothing is written.
    """
    op = "ssm_state_update"
    state = check_pool(op, "state", state, dims="[slots, nheads, headdim, dstate]")
    dev = state.device
    slots, nheads, headdim, dstate = state.shape
    x = check_tensor(op, "x", x, shape=(None, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, nheads, headdim]")  # fmt: skip
    bs = x.shape[0]
    check_tensor(
        op, "dt", dt, shape=(bs, nheads), dtypes=FLOAT_DTYPES, device=dev, dims="[bs, nheads]"
    )
    check_tensor(op, "A", A, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    B = check_tensor(op, "B", B, shape=(bs, None, dstate), dtypes=FLOAT_DTYPES, device=dev,
                     dims="[bs, ngroups, dstate]")  # fmt: skip
    ngroups = B.shape[1]
    if ngroups == 0 or nheads % ngroups != 0:
        raise ValueError(f"{op}: `B` ngroups={ngroups} must divide nheads={nheads}")
    check_tensor(op, "C", C, shape=(bs, ngroups, dstate), dtypes=FLOAT_DTYPES, device=dev,
                 dims="[bs, ngroups, dstate]")  # fmt: skip
    check_optional(op, "D", D, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev, dims="[nheads]")
    check_optional(op, "dt_bias", dt_bias, shape=(nheads,), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[nheads]")  # fmt: skip
    check_optional(op, "z", z, shape=(bs, nheads, headdim), dtypes=FLOAT_DTYPES, device=dev,
                   dims="[bs, nheads, headdim]")  # fmt: skip
    check_tensor(op, "state_indices", state_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                 dims="[bs]")  # fmt: skip
    check_optional(op, "dst_indices", dst_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if (track_indices is None) != (track_mask is None):
        raise ValueError(
            f"{op}: `track_indices` and `track_mask` must be given together or not at all"
        )
    check_optional(op, "track_indices", track_indices, shape=(bs,), dtypes=INDEX_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    check_optional(op, "track_mask", track_mask, shape=(bs,), dtypes=MASK_DTYPES, device=dev,
                   dims="[bs]")  # fmt: skip
    if out is not None:
        check_tensor(op, "out", out, shape=(bs, nheads, headdim), dtypes=(x.dtype,), device=dev,
                     dims="[bs, nheads, headdim]")  # fmt: skip
    which = resolve(op, impl, dev)
    if is_debug():
        _debug_check_ssm(op, slots, state_indices, dst_indices, track_indices, track_mask)
    if out is None:
        out = torch.empty_like(x)
    if which == "reference":
        ssm_state_update_reference(
            state, x, dt, A, B, C, out, state_indices, D=D, z=z, dt_bias=dt_bias,
            dt_softplus=dt_softplus, dst_indices=dst_indices, track_indices=track_indices,
            track_mask=track_mask,
        )  # fmt: skip
        return out
    run = torch.ops.hybridmeta.ssm_state_update if observed(state) else _ssm_state_update_impl
    run(
        state, x, dt, A, B, C, out, state_indices, D, z, dt_bias, dt_softplus,
        dst_indices, track_indices, track_mask,
    )  # fmt: skip
    return out


def _debug_check_ssm(
    op: str,
    slots: int,
    src: torch.Tensor,
    dst: torch.Tensor | None,
    track: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> None:
    check_index_range(op, "state_indices", src, slots)
    live = src >= 0
    writes: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    if dst is not None:
        check_index_range(op, "dst_indices", dst, slots)
        writes.append(("dst_indices", dst, live))
    else:
        writes.append(("state_indices", src, live))
    if track is not None and mask is not None:
        check_index_range(op, "track_indices", track, slots)
        writes.append(("track_indices", track, live & mask))
    check_disjoint_writes(op, writes, ("state_indices", src, live))


# --------------------------------------------------------------------------- metadata entry


def ssm_state_update_from_metadata(
    md: Mamba2Metadata,
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    fuse_track: bool = False,
    out: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> torch.Tensor:
    """:func:`ssm_state_update` of the decode rows of ``md`` (rows after its prefill rows).

    The slots are ``md.mamba_cache_indices`` of the decode rows. With ``fuse_track`` (and a
    forward that saves, ``md.has_mamba_track_mask``), rows flagged in ``mamba_track_mask``
    also store their new SSM state into their ``mamba_track_indices`` slot in the same pass
    (the conv state is then the caller's to save).
    """
    op = "ssm_state_update_from_metadata"
    rows = decode_rows(op, md, x.shape[0])
    track = mask = None
    if fuse_track and md.has_mamba_track_mask:
        assert md.mamba_track_indices is not None and md.mamba_track_mask is not None
        track, mask = md.mamba_track_indices[rows], md.mamba_track_mask[rows]
    return ssm_state_update(
        state, x, dt, A, B, C, state_indices=md.mamba_cache_indices[rows], D=D, z=z,
        dt_bias=dt_bias, dt_softplus=dt_softplus, track_indices=track, track_mask=mask,
        out=out, impl=impl,
    )  # fmt: skip

