"""What vLLM hands its Mamba2 metadata builder, declared once, and its one translation.

:class:`VllmMamba2Step` is the hybridmeta description of one forward as vLLM's scheduler
describes it to the Mamba2 builder (``CommonAttentionMetadata`` plus the Mamba-specific
inputs the builder derives from it). It is an **extension** of hybridmeta's
``ForwardMetadata`` (``@metadata(extension=True)``) that declares vLLM's conventions on
the class (:data:`VLLM_CONVENTIONS`): rows in vLLM's order (decode rows first, then the
prefill rows) and ``NULL_BLOCK_ID = 0`` as the null slot that pad rows and "no slot"
carry. Its own fields are vLLM's (the 2-D state blocks of each row, sequence lengths,
computed-token counts, the align-mode checkpoint blocks and offsets, accepted-token
counts).

:func:`mamba2_metadata` is the one place where that step becomes the ``Mamba2Metadata``
the hybridmeta ops read: ``Mamba2Metadata.evolve_from`` of a ``VllmMamba2Step`` (through
``prepare_decode`` or the planner), so the result is a ``Mamba2Metadata[VllmMamba2Step]``
that carries every vLLM field to the layer and honours vLLM's row order and null slot in
every op. It imports nothing from vLLM, so it is tested and benchmarked without a vLLM
install.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from hybridmeta.core import (
    BATCH,
    INDEX,
    Conventions,
    Pad,
    Role,
    RowOrder,
    field,
    fields_of,
    metadata,
    tensor_field,
)
from hybridmeta.graphs.buffers import InputSpec, StaticBuffers
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, prepare_decode
from hybridmeta.planner import BOOL_PARTS, plan_host, plan_mixed_batch
from hybridmeta.staging import to_device_packed

__all__ = [
    "NULL_BLOCK_ID",
    "VLLM_CONVENTIONS",
    "DecodeGraphBuffers",
    "VllmDecodeForward",
    "VllmMamba2Step",
    "check_speculative",
    "decode_rows",
    "mamba2_metadata",
]

#: vLLM's null block (``vllm.v1.attention.backends.utils.NULL_BLOCK_ID``): pad rows and
#: "no slot" carry it; the block is reserved and never written.
NULL_BLOCK_ID = 0

#: vLLM's conventions, declared on :class:`VllmMamba2Step` and inherited by every
#: metadata built from it: decode rows first, ``NULL_BLOCK_ID`` as the null slot.
VLLM_CONVENTIONS = Conventions(row_order=RowOrder.DECODES_FIRST, null_slot=NULL_BLOCK_ID)


@metadata(extension=True, conventions=VLLM_CONVENTIONS)
class VllmMamba2Step(ForwardMetadata):
    """One forward as vLLM's scheduler hands it to the Mamba2 metadata builder.

    Rows in vLLM's order: ``num_decode_rows`` decode rows first (one token each; with
    speculative decoding ``1 ..  1 + num_spec`` tokens each, ``num_accepted_tokens``
    given), then the prefill rows. Slot ids are state-cache block ids; ``0`` (``NULL_BLOCK_ID``) is the
    null slot. ``query_start_loc`` is vLLM's; ``mamba_cache_indices`` (the working slot
    the ops read and write) is column 0 of ``state_indices``, the running state block.

    The device tensors are vLLM's own (no copy); the host fields are what vLLM's builder
    also reads on the host (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``, the
    prefill checkpoint offsets), so the plan needs no device read.
    """

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
        ndim=2,
        role=Role.SLOT,
        doc="[bs, 1 + num_spec] state-cache blocks of each row (align mode: the block "
        "table's last 1 + num_spec blocks of the request, mamba_get_block_table_tensor); "
        "column 0 is the running state (mamba_cache_indices). 0: null.",
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
        role=Role.SLOT,
        default=None,
        doc="[bs] align-mode prefix cache: the block receiving the row's mid-prefill "
        "checkpoint state (vLLM's MambaPrefillCheckpointMetadata.state_indices), the null "
        "slot where the row has none. Decode rows hold it.",
    )
    num_accepted_tokens: torch.Tensor | None = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=Pad.value(1),
        default=None,
        doc="[bs] speculative decoding: tokens accepted last step (bonus included, >= 1); "
        "the row's running state is column num_accepted - 1 of state_indices.",
    )
    num_decode_rows: int = field(doc="Decode rows (the first rows).")
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
        if self.query_lens.ndim != 1 or self.computed_lens.shape != (n,):
            raise ValueError(
                f"VllmMamba2Step.computed_lens has {len(self.computed_lens)} rows but "
                f"query_lens has {n}"
            )
        if n != self.mamba_cache_indices.shape[0]:
            raise ValueError(
                f"VllmMamba2Step.query_lens has {n} rows but the step has "
                f"{self.mamba_cache_indices.shape[0]}"
            )
        if not 0 <= self.num_decode_rows <= n:
            raise ValueError(
                f"VllmMamba2Step.num_decode_rows must be in [0, {n}], got {self.num_decode_rows}"
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


@metadata(extension=True, conventions=VLLM_CONVENTIONS)
class VllmDecodeForward(ForwardMetadata):
    """A decode step of vLLM's FULL-graph path as :class:`DecodeGraphBuffers` buffers it:
    the offsets and working slots only (no host field a step would change), with vLLM's
    conventions, so the graph's pad rows carry ``NULL_BLOCK_ID`` as vLLM's own persistent
    buffers do."""


#: The fields vLLM's step adds to ``ForwardMetadata``: the planner's forward carries them.
_ROOT_FIELDS = frozenset(f.name for f in fields_of(ForwardMetadata))
_VLLM_FIELDS = tuple(s.name for s in fields_of(VllmMamba2Step) if s.name not in _ROOT_FIELDS)


def check_speculative(method: object, num_spec: int, mamba_cache_mode: str) -> None:
    """Refuse, in one line at engine start, a speculative configuration the plugin does not
    serve: any method but ``ngram`` (a draft model's own layers are not checked here), and
    ``ngram`` with align-mode prefix caching (vLLM's checkpoints inside a speculative step
    are not planned). No speculation (``num_spec == 0``) passes."""
    if not num_spec:
        return
    align = mamba_cache_mode == "align"
    if method != "ngram" or align:
        raise NotImplementedError(
            "hybridmeta vLLM plugin: speculative decoding is served for the 'ngram' method "
            f"without prefix caching only (got method {method!r}"
            f"{', align-mode prefix caching' if align else ''}; docs/vllm.md)"
        )


def decode_rows(
    query_lens: npt.NDArray[np.int64],
    computed_lens: npt.NDArray[np.int64],
    threshold: int = 1,
    prefilling: npt.NDArray[np.bool_] | None = None,
) -> int:
    """How many leading rows are decode rows: at most ``threshold`` new tokens (``1``, or
    ``1 + num_spec`` with speculative decoding) on top of a state.

    vLLM's batch reorder puts decodes first; a one-token *first* chunk of a prompt has no
    state and is a prefill row, and so is a short chunk of a prompt still prefilling
    (``prefilling``, vLLM's ``is_prefilling``) unless it is one token on a state (as in
    vLLM's own builder).
    """
    is_decode = (query_lens >= 1) & (query_lens <= threshold) & (computed_lens > 0)
    if prefilling is not None:
        is_decode &= ~prefilling | (query_lens == 1)
    if is_decode.all():
        return int(is_decode.shape[0])
    return int(is_decode.argmin())


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


def _track_rows(step: VllmMamba2Step) -> dict[str, Any]:
    """The planner's track arguments for vLLM's prefill checkpoints (none without any).

    vLLM's align mode saves one checkpoint per prefill row, at the last block boundary
    strictly before the row's last token (``computed + offset``); the planner takes that
    position per row (``track_positions``), so a row whose end is itself a boundary saves
    the earlier one, as vLLM asks.
    """
    offsets = step.checkpoint_offsets
    if offsets is None or step.checkpoint_slots is None or not any(offsets):
        return {}
    off = np.asarray(offsets, dtype=np.int64)
    mask = off > 0
    return {
        "track_interval": step.checkpoint_interval,
        "track_mask": mask,
        "track_slots": _host_slots(step.checkpoint_slots),
        "track_positions": step.computed_lens + off,
    }


class DecodeGraphBuffers:
    """The persistent decode buffers of vLLM's FULL CUDA-graph path, from ``StaticBuffers``.

    vLLM's own builder keeps persistent ``[max_bs, 1 + num_spec]`` state-index buffers and
    pads them with ``NULL_BLOCK_ID``; here every per-row field the decode ops read is a
    static buffer generated from the declarations, refreshed in place for each step and
    handed out as views of exactly the bucket's rows (no stale tail reaches a kernel).
    The buffered step is a :class:`VllmDecodeForward` (``StaticBuffers(source=...)``): its
    pad rows carry vLLM's null block ``0``, which every op takes as its pad id (they read
    and write no state).

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
            source=VllmDecodeForward,
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
        if step.num_decode_rows != step.query_lens.shape[0]:
            raise ValueError(
                f"DecodeGraphBuffers.refresh: the step has "
                f"{step.query_lens.shape[0] - step.num_decode_rows} prefill rows; vLLM captures "
                "decode-only graphs"
            )
        # A decode row's block boundary is vLLM's block copy, not a layer save: the
        # buffered fields are the offsets and the working slots.
        fwd = VllmDecodeForward(
            query_start_loc=step.query_start_loc, mamba_cache_indices=step.mamba_cache_indices
        )
        return self.buffers.refresh(fwd, bucket, inputs)


def mamba2_metadata(step: VllmMamba2Step) -> Mamba2Metadata:
    """The ``Mamba2Metadata`` of one vLLM forward: the one translation point.

    A decode step (the hot path) is ``prepare_decode(step)``: vLLM's own tensors, no plan
    and no host copy. With speculative decoding (``num_accepted_tokens`` given) the
    decode rows carry ``1 .. 1 + num_spec`` tokens each, which the planner's decode rows
    cannot: the prefill rows are planned alone (:func:`_spec_metadata`). A step with prefill rows is planned in vLLM's row order (the
    step's class declares it) with align-mode checkpoints as the planner's track rows at
    vLLM's positions, and the planned forward carries every field of the step. Either way
    the result is ``Mamba2Metadata.evolve_from`` of a :class:`VllmMamba2Step`.

    Raises
    ------
    ValueError
        The step breaks a rule of the planner (the message names it).
    """
    if step.num_decode_rows == step.query_lens.shape[0]:
        return prepare_decode(step)
    if step.num_accepted_tokens is not None:
        return _spec_metadata(step)
    return plan_mixed_batch(
        extend_lens=step.query_lens,
        prefix_lens=step.computed_lens,
        slots=_host_slots(step.mamba_cache_indices),
        num_decodes=step.num_decode_rows,
        chunk_size=step.chunk_size,
        conv_kernel=step.conv_kernel,
        device=step.query_start_loc.device,
        forward_cls=type(step),
        engine={name: getattr(step, name) for name in _VLLM_FIELDS},
        **_track_rows(step),
    )


def _spec_metadata(step: VllmMamba2Step) -> Mamba2Metadata:
    """A speculative step with prefill rows: the prefill rows planned on their own (their
    plan, ``MixedMetadata``, covers the prefill rows and their tokens alone), then
    ``Mamba2Metadata.evolve_from(step, ...)`` over every row of the step.

    The decode rows' tokens are the first ``num_decode_tokens`` (varlen: the metadata's
    ``decode_tokens()`` assumes one token a decode row, docs/vllm_api_needs.md item 9);
    the layer reads them, their blocks and accepted counts from the metadata's vLLM
    fields. Align-mode checkpoints are not served with speculative decoding (the builder
    refuses the pair at engine start).
    """
    if step.checkpoint_offsets is not None and any(step.checkpoint_offsets):
        raise NotImplementedError(
            "mamba2_metadata: align-mode checkpoints with speculative decoding are not served "
            "yet (docs/vllm.md, 'Not supported yet')"
        )
    nd = step.num_decode_rows
    hp = plan_host(
        extend_lens=step.query_lens[nd:],
        prefix_lens=step.computed_lens[nd:],
        slots=_host_slots(step.mamba_cache_indices[nd:]),
        num_decodes=0,
        chunk_size=step.chunk_size,
        conv_kernel=step.conv_kernel,
    )
    views = to_device_packed(hp.arrays, step.query_start_loc.device, as_bool=BOOL_PARTS)
    mixed = hp.metadata(views).mixed
    return Mamba2Metadata.evolve_from(
        step,
        num_prefills=hp.num_prefills,
        num_prefill_tokens=hp.num_prefill_tokens,
        num_decodes=nd,
        mixed=mixed,
    )
