"""What vLLM hands its Mamba2 metadata builder, declared once, and its one translation.

:class:`VllmMamba2Step` is the hybridmeta description of one forward as vLLM's scheduler
describes it to the Mamba2 builder (``CommonAttentionMetadata`` plus the Mamba-specific
inputs the builder derives from it): its rows are in **vLLM's** order (decode rows
first, then prefill rows) and its slot ids are vLLM's state-cache block ids, with
``NULL_BLOCK_ID = 0`` as the null/pad slot (:data:`VLLM_CONVENTIONS`).

:func:`mamba2_metadata` is the one place where that description becomes the
``Mamba2Metadata`` the hybridmeta ops read. It imports nothing from vLLM, so it is tested
and benchmarked without a vLLM install.

Interim note (see ``docs/vllm_api_needs.md``): until ``@metadata(extension=True)``,
``Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=0)`` and a planner that takes
decode-first batches land on ``main``, the translation reorders the rows (prefill rows
first, the order the planner takes today) and returns a plain ``Mamba2Metadata``; the
vLLM-only fields travel in :class:`VllmMamba2Step`, which the builder hands to the mixer
beside it (:class:`VllmForward`). Both switches are local to this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from hybridmeta.core import BATCH, INDEX, Pad, Role, field, metadata, tensor_field
from hybridmeta.graphs.buffers import InputSpec, StaticBuffers
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, prepare_decode
from hybridmeta.planner import plan_mixed_batch

__all__ = [
    "NULL_BLOCK_ID",
    "VLLM_CONVENTIONS",
    "DecodeGraphBuffers",
    "TrackRuleError",
    "VllmForward",
    "VllmMamba2Step",
    "decode_rows",
    "mamba2_metadata",
    "row_order",
]

#: vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``): pad rows and
#: "no slot" carry it; the block is reserved and never written.
NULL_BLOCK_ID = 0

#: vLLM's conventions, as the schema states them (``RowOrder.DECODES_FIRST``,
#: ``null_slot=0`` once ``hybridmeta.core.Conventions`` exists).
VLLM_CONVENTIONS = {"row_order": "decodes_first", "null_slot": NULL_BLOCK_ID}

_NULL = Pad.value(NULL_BLOCK_ID)


@metadata
class VllmMamba2Step:
    """One forward as vLLM's scheduler hands it to the Mamba2 metadata builder.

    Rows in vLLM's order: ``num_decodes`` decode rows first (one token each, or
    ``1 + num_spec`` with speculative decoding), then the prefill rows. Slot ids are
    state-cache block ids; ``0`` (``NULL_BLOCK_ID``) is the null slot.

    The device tensors are vLLM's own (no copy); the host fields are what vLLM's builder
    also reads on the host (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``, the
    prefill checkpoint offsets), so the plan needs no device read.
    """

    query_start_loc: torch.Tensor = tensor_field(
        rows=BATCH + 1,
        dtypes=INDEX,
        pad=Pad.CUMULATIVE,
        role=Role.ENGINE_ONLY,
        doc="[bs + 1] vLLM's query_start_loc (token offsets, decode rows first).",
    )
    seq_lens: torch.Tensor = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=Pad.value(0),
        role=Role.ENGINE_ONLY,
        doc="[bs] tokens of each request after this step (vLLM's seq_lens).",
    )
    state_indices: torch.Tensor = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=_NULL,
        ndim=2,
        doc="[bs, 1 + num_spec] state-cache blocks of each row (align mode: the block "
        "table's last 1 + num_spec blocks of the request, mamba_get_block_table_tensor); "
        "column 0 is the running state. 0: null.",
    )
    num_computed_tokens: torch.Tensor = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=Pad.value(0),
        role=Role.ENGINE_ONLY,
        doc="[bs] tokens already in each row's state (seq_lens - query lens).",
    )
    checkpoint_slots: torch.Tensor | None = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=_NULL,
        default=None,
        doc="[bs] align-mode prefix cache: the block receiving the row's mid-prefill "
        "checkpoint state (vLLM's MambaPrefillCheckpointMetadata.state_indices), 0 where "
        "the row has none. Decode rows hold 0.",
    )
    num_accepted_tokens: torch.Tensor | None = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=Pad.value(1),
        role=Role.ENGINE_ONLY,
        default=None,
        doc="[bs] speculative decoding: tokens accepted last step (bonus included, >= 1); "
        "the row's running state is column num_accepted - 1 of state_indices.",
    )
    num_decodes: int = field(doc="Decode rows (the first rows).")
    num_decode_tokens: int = field(doc="Tokens of the decode rows.")
    query_lens: npt.NDArray[np.int64] = field(doc="Host: [bs] new tokens of each row.")
    computed_lens: npt.NDArray[np.int64] = field(
        doc="Host: [bs] tokens already in each row's state."
    )
    checkpoint_offsets: tuple[int, ...] | None = field(
        default=None,
        doc="Host: align mode, the checkpoint's offset into each row's query (0: none); "
        "given together with checkpoint_slots.",
    )
    chunk_size: int = field(doc="The model's SSD chunk size.")
    conv_kernel: int = field(doc="Conv width K.")
    checkpoint_interval: int = field(
        default=0,
        doc="Align mode: the mamba state block size (the checkpoint grid); 0 without "
        "prefix caching.",
    )

    def __validate__(self) -> None:
        n = self.query_lens.shape[0]
        if self.computed_lens.shape != (n,) or self.query_lens.ndim != 1:
            raise ValueError(
                f"VllmMamba2Step.computed_lens has {len(self.computed_lens)} rows but "
                f"query_lens has {n}"
            )
        if not 0 <= self.num_decodes <= n:
            raise ValueError(
                f"VllmMamba2Step.num_decodes must be in [0, {n}], got {self.num_decodes}"
            )
        if (self.checkpoint_offsets is None) != (self.checkpoint_slots is None):
            raise ValueError(
                "VllmMamba2Step.checkpoint_offsets and checkpoint_slots are given together"
            )
        if self.checkpoint_offsets is not None and len(self.checkpoint_offsets) != n:
            raise ValueError(
                f"VllmMamba2Step.checkpoint_offsets has {len(self.checkpoint_offsets)} rows "
                f"but the step has {n}"
            )
        if self.checkpoint_offsets is not None and self.checkpoint_interval <= 0:
            raise ValueError(
                "VllmMamba2Step.checkpoint_interval must be > 0 when checkpoints are given"
            )

    @property
    def num_rows(self) -> int:
        return int(self.query_lens.shape[0])

    @property
    def num_prefills(self) -> int:
        return self.num_rows - self.num_decodes


@attrs.frozen(kw_only=True, eq=False)
class VllmForward:
    """What the plugin's builder hands every Mamba2 layer for one forward: the metadata
    the ops read (``md``, rows in its own order) and the step it was built from."""

    md: Mamba2Metadata
    step: VllmMamba2Step


class TrackRuleError(NotImplementedError):
    """vLLM asks for a checkpoint position the planner's track rule cannot express yet."""


def decode_rows(query_lens: npt.NDArray[np.int64], computed_lens: npt.NDArray[np.int64]) -> int:
    """How many leading rows are decode rows: one new token on top of a state.

    vLLM's batch reorder puts decodes first; a one-token *first* chunk of a prompt has no
    state and is a prefill row (as in vLLM's own builder).
    """
    is_decode = (query_lens == 1) & (computed_lens > 0)
    if is_decode.all():
        return int(is_decode.shape[0])
    return int(is_decode.argmin())


def row_order(step: VllmMamba2Step) -> npt.NDArray[np.int64] | None:
    """``[bs]`` the vLLM row of each metadata row (interim: prefill rows first); ``None``
    where that is the identity (a batch of decode rows only, or of prefill rows only)."""
    n, d = step.num_rows, step.num_decodes
    if d in (0, n):
        return None
    return np.concatenate((np.arange(d, n), np.arange(0, d))).astype(np.int64)


def _host_slots(t: torch.Tensor) -> npt.NDArray[np.int64]:
    # The slots of a CPU step are host data already; a device step would need the
    # planner to take device slots (docs/vllm_api_needs.md, item 4).
    if t.device.type != "cpu":
        raise NotImplementedError(
            "mamba2_metadata: slot ids on a device need the planner's device-slot input "
            "(docs/vllm_api_needs.md); this build plans from host slots"
        )
    out: npt.NDArray[np.int64] = t.numpy().astype(np.int64, copy=False)
    return out


def _track_rows(
    step: VllmMamba2Step, order: Sequence[int]
) -> tuple[list[bool], list[int]] | None:
    """The planner's track rows for vLLM's prefill checkpoints, or None without any."""
    if step.checkpoint_offsets is None or step.checkpoint_slots is None:
        return None
    offsets = step.checkpoint_offsets
    if not any(offsets):
        return None
    interval = step.checkpoint_interval
    slots = _host_slots(step.checkpoint_slots)
    mask: list[bool] = []
    track: list[int] = []
    for r in order:
        off = offsets[r]
        if off <= 0:
            mask.append(False)
            track.append(-1)
            continue
        pre, ext = int(step.computed_lens[r]), int(step.query_lens[r])
        want = pre + off  # vLLM's checkpoint position (absolute)
        # The planner saves the last multiple of the interval reached by the row.
        got = (pre + ext) // interval * interval
        if want != got:
            raise TrackRuleError(
                f"mamba2_metadata: vLLM asks row {r} (tokens {pre}..{pre + ext}) for the "
                f"state at {want}, but the planner's track rule saves the last boundary "
                f"{got}; needs the planner's explicit track positions "
                "(docs/vllm_api_needs.md, item 3)"
            )
        mask.append(True)
        track.append(int(slots[r]))
    return mask, track


def _decode_forward(step: VllmMamba2Step) -> ForwardMetadata:
    # A decode step (the hot path): vLLM's own tensors, no plan and no host copy. In align
    # mode a decode row's block boundary is vLLM's block copy, not a layer save.
    return ForwardMetadata(
        query_start_loc=step.query_start_loc, mamba_cache_indices=step.state_indices[:, 0]
    )


class DecodeGraphBuffers:
    """The persistent decode buffers of vLLM's FULL CUDA-graph path, from ``StaticBuffers``.

    vLLM's own builder keeps persistent ``[max_bs, 1 + num_spec]`` state-index buffers and
    pads them with ``NULL_BLOCK_ID``; here every per-row field the decode ops read is a
    static buffer generated from the declarations, refreshed in place for each step and
    handed out as views of exactly the bucket's rows (no stale tail reaches a kernel; pad
    rows carry hybridmeta's pad ``-1`` and write no state).

    Parameters
    ----------
    max_bs : int
        vLLM's largest decode graph (``decode_cudagraph_max_bs``).
    num_slots : int
        Blocks of the state cache (slot ids ``< num_slots``).
    device : torch.device or str
    inputs : mapping of str to InputSpec, optional
        Static per-row inputs refreshed with the metadata (tests; vLLM owns its inputs).
    """

    def __init__(
        self,
        *,
        max_bs: int,
        num_slots: int,
        device: torch.device | str,
        inputs: dict[str, InputSpec] | None = None,
    ) -> None:
        self.buffers = StaticBuffers(
            max_bs=max_bs,
            num_slots=num_slots,
            device=device,
            index_dtype=torch.int32,
            optional_fields=(),  # a decode row saves nothing: no track fields
            inputs=inputs,
        )

    def capture(self, bucket: int) -> Mamba2Metadata:
        """Metadata of a bucket with every row padded (capture and warm-up)."""
        return self.buffers.pad_all(bucket)

    def refresh(
        self,
        step: VllmMamba2Step,
        bucket: int,
        inputs: dict[str, torch.Tensor] | None = None,
    ) -> Mamba2Metadata:
        """Write a decode step's rows (and the pad up to ``bucket``); bucket-row views."""
        if step.num_prefills:
            raise ValueError(
                f"DecodeGraphBuffers.refresh: the step has {step.num_prefills} prefill rows; "
                "vLLM captures decode-only graphs"
            )
        return self.buffers.refresh(_decode_forward(step), bucket, inputs)


def mamba2_metadata(step: VllmMamba2Step) -> Mamba2Metadata:
    """The ``Mamba2Metadata`` of one vLLM forward: the one translation point.

    vLLM's rows are reordered once here (interim: prefill rows first); the working slot
    of each row is column 0 of ``state_indices`` (the running state; speculative
    decoding's other columns are not served yet); align-mode checkpoints become the
    planner's track rows with ``track_interval = checkpoint_interval``.

    Raises
    ------
    ValueError
        The step breaks a rule of the planner (the message names it).
    TrackRuleError
        A checkpoint position the planner's rule cannot express (interim).
    """
    if step.num_prefills == 0:
        return prepare_decode(_decode_forward(step))
    order = row_order(step)
    slots = _host_slots(step.state_indices[:, 0])
    ext, pre = step.query_lens, step.computed_lens
    if order is not None:
        slots, ext, pre = slots[order], ext[order], pre[order]
    track = _track_rows(step, order.tolist() if order is not None else range(step.num_rows))
    return plan_mixed_batch(
        extend_lens=ext,
        prefix_lens=pre,
        slots=slots,
        num_decodes=step.num_decodes,
        chunk_size=step.chunk_size,
        conv_kernel=step.conv_kernel,
        track_interval=step.checkpoint_interval if track is not None else None,
        track_mask=track[0] if track is not None else None,
        track_slots=track[1] if track is not None else None,
        device=step.query_start_loc.device,
    )
