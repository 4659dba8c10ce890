"""The Mamba2 metadata model of a hybrid backend.

``ForwardMetadata`` is what the engine's scheduler produces for one forward.
``Mamba2Metadata`` derives from it and is built only through
``Mamba2Metadata.evolve_from`` (here: :func:`prepare_decode`,
:func:`prepare_target_verify`, :func:`prepare_mixed`), so every ``ForwardMetadata`` field
reaches the Mamba2 layers, including ones added later.

Names follow sglang's ``ForwardMetadata`` / ``Mamba2Metadata`` so engine developers
recognise them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridmeta.chunks import chunk_indices_offsets
from hybridmeta.core import BOOL, INDEX, Pad, field, metadata, tensor_field
from hybridmeta.staging import to_device_packed

__all__ = [
    "ForwardMetadata",
    "Mamba2Metadata",
    "MixedMetadata",
    "prepare_decode",
    "prepare_mixed",
    "prepare_target_verify",
]

_PAD_SLOT = Pad.value(-1)


@metadata
class ForwardMetadata:
    """Per-forward metadata of a hybrid Mamba2 backend (the source of ``Mamba2Metadata``).

    Rows are request rows of the batch: prefill rows first, decode rows last. Slot ids are
    physical state-pool slots; pad rows carry ``-1``.
    """

    query_start_loc: torch.Tensor = tensor_field(
        rows="batch+1",
        dtypes=INDEX,
        pad=Pad.CUMULATIVE,
        doc="[bs + 1] token offsets of each row; padded rows have length zero.",
    )
    mamba_cache_indices: torch.Tensor = tensor_field(
        rows="batch", dtypes=INDEX, pad=_PAD_SLOT, doc="[bs] working state slot of each row."
    )
    mamba_track_indices: torch.Tensor | None = tensor_field(
        rows="batch",
        dtypes=INDEX,
        pad=_PAD_SLOT,
        default=None,
        doc="[bs] track (prefix-cache) slot of each row, -1 where none.",
    )
    mamba_track_mask: torch.Tensor | None = tensor_field(
        rows="batch",
        dtypes=BOOL,
        pad=Pad.value(False),
        default=None,
        doc="[bs] rows whose state is saved into their track slot this step.",
    )
    retrieve_next_token: torch.Tensor | None = tensor_field(
        rows="batch",
        dtypes=INDEX,
        pad=_PAD_SLOT,
        ndim=2,
        default=None,
        doc="[bs, draft_token_num] speculative tree: first child of each draft token.",
    )
    retrieve_next_sibling: torch.Tensor | None = tensor_field(
        rows="batch",
        dtypes=INDEX,
        pad=_PAD_SLOT,
        ndim=2,
        default=None,
        doc="[bs, draft_token_num] speculative tree: next sibling of each draft token.",
    )
    retrieve_parent_token: torch.Tensor | None = tensor_field(
        rows="batch",
        dtypes=INDEX,
        pad=_PAD_SLOT,
        ndim=2,
        default=None,
        doc="[bs, draft_token_num] speculative tree: parent of each draft token.",
    )
    track_conv_indices: torch.Tensor | None = tensor_field(
        dtypes=INDEX, default=None, doc="Extend track plan: conv windows to save."
    )
    track_ssm_h_src: torch.Tensor | None = tensor_field(
        dtypes=INDEX, default=None, doc="Extend track plan: chunk-state grid positions to save."
    )
    track_ssm_h_dst: torch.Tensor | None = tensor_field(
        dtypes=INDEX, default=None, doc="Extend track plan: track slots of ``track_ssm_h_src``."
    )
    track_ssm_final_src: torch.Tensor | None = tensor_field(
        dtypes=INDEX,
        default=None,
        doc="Extend track plan: working slots whose final state is saved.",
    )
    track_ssm_final_dst: torch.Tensor | None = tensor_field(
        dtypes=INDEX, default=None, doc="Extend track plan: track slots of ``track_ssm_final_src``."
    )
    is_target_verify: bool = field(default=False, doc="Speculative target-verify forward.")
    draft_token_num: int = field(default=1, doc="Tokens per row in target verify (1 otherwise).")
    has_mamba_track_mask: bool = field(
        default=False,
        doc="Host-side: whether any row tracks this step (decided without reading the mask).",
    )
    mamba_track_mask_indices: torch.Tensor | None = tensor_field(
        dtypes=INDEX, default=None, doc="Indices of the rows set in ``mamba_track_mask``."
    )
    conv_states_mask_indices: torch.Tensor | None = tensor_field(
        dtypes=INDEX, default=None, doc="Rows whose conv state is saved this step."
    )

    def __validate__(self) -> None:
        if self.draft_token_num < 1:
            raise ValueError(
                f"ForwardMetadata.draft_token_num must be >= 1, got {self.draft_token_num}"
            )
        if self.has_mamba_track_mask and (
            self.mamba_track_mask is None or self.mamba_track_indices is None
        ):
            raise ValueError(
                "ForwardMetadata.has_mamba_track_mask is True, so mamba_track_mask and "
                "mamba_track_indices are required"
            )
        for src, dst in (
            ("track_ssm_h_src", "track_ssm_h_dst"),
            ("track_ssm_final_src", "track_ssm_final_dst"),
        ):
            a, b = getattr(self, src), getattr(self, dst)
            if (a is None) != (b is None):
                raise ValueError(
                    f"ForwardMetadata.{src} and {dst} are given together or not at all"
                )
            if a is not None and a.shape[0] != b.shape[0]:
                raise ValueError(
                    f"ForwardMetadata.{dst} has {b.shape[0]} entries but {src} has {a.shape[0]}"
                )
        for name in ("retrieve_next_token", "retrieve_next_sibling", "retrieve_parent_token"):
            t = getattr(self, name)
            if t is not None and t.shape[1] != self.draft_token_num:
                raise ValueError(
                    f"ForwardMetadata.{name} has {t.shape[1]} columns but draft_token_num is "
                    f"{self.draft_token_num}"
                )

    def __validate_debug__(self) -> None:
        # Reads device values: runs only in debug mode (hybridmeta.debug).
        qsl = self.query_start_loc
        if qsl.numel() and int(qsl[0]) != 0:
            raise ValueError(f"ForwardMetadata.query_start_loc must start at 0, got {int(qsl[0])}")
        if bool((qsl[1:] < qsl[:-1]).any()):
            raise ValueError("ForwardMetadata.query_start_loc must be non-decreasing")
        idx = self.mamba_cache_indices
        if bool((idx < -1).any()):
            raise ValueError(
                "ForwardMetadata.mamba_cache_indices must be >= -1 (-1 marks a pad row)"
            )
        live = idx[idx >= 0]
        if live.numel() != torch.unique(live).numel():
            raise ValueError("ForwardMetadata.mamba_cache_indices has a duplicate live slot")
        if self.mamba_track_indices is not None and self.mamba_track_mask is not None:
            m = self.mamba_track_mask
            if bool((self.mamba_track_indices[m] < 0).any()):
                raise ValueError(
                    "ForwardMetadata.mamba_track_indices must be a slot (>= 0) where mamba_track_mask is set"
                )
            if bool((self.mamba_track_indices[m] == idx[m]).any()):
                raise ValueError(
                    "ForwardMetadata.mamba_track_indices equals the working slot of a tracked row"
                )


@metadata
class MixedMetadata:
    """Prefill-side plan of a mixed batch (the prefill rows only)."""

    has_initial_states: torch.Tensor = tensor_field(
        rows="prefills", dtypes=BOOL, doc="[num_prefills] rows resuming from a saved state."
    )
    prep_initial_states: bool = field(
        doc="Host-side: whether any prefill row has an initial state."
    )
    chunk_size: int = field(doc="Physical chunk size of the SSD scan.")
    seq_idx: torch.Tensor = tensor_field(
        rows="prefill_tokens", dtypes=INDEX, doc="[num_prefill_tokens] row of each token."
    )
    chunk_indices: torch.Tensor = tensor_field(
        rows="chunks",
        dtypes=INDEX,
        doc="[num_logical_chunks] physical chunk of each logical chunk.",
    )
    chunk_offsets: torch.Tensor = tensor_field(
        rows="chunks", dtypes=INDEX, doc="[num_logical_chunks] start offset inside it."
    )
    extend_seq_lens_cpu: tuple[int, ...] = field(doc="Host copy of the extend lengths.")

    def __validate__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"MixedMetadata.chunk_size must be > 0, got {self.chunk_size}")
        if len(self.extend_seq_lens_cpu) != self.has_initial_states.shape[0]:
            raise ValueError(
                f"MixedMetadata.extend_seq_lens_cpu has {len(self.extend_seq_lens_cpu)} rows but "
                f"has_initial_states has {self.has_initial_states.shape[0]}"
            )
        if sum(self.extend_seq_lens_cpu) != self.seq_idx.shape[0]:
            raise ValueError(
                f"MixedMetadata.seq_idx has {self.seq_idx.shape[0]} tokens but "
                f"extend_seq_lens_cpu sums to {sum(self.extend_seq_lens_cpu)}"
            )


@metadata
class Mamba2Metadata(ForwardMetadata):
    """What the Mamba2 layers of one forward read. Built only through ``evolve_from``."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    mixed: MixedMetadata | None

    def __validate__(self) -> None:
        ForwardMetadata.__validate__(self)
        rows = self.mamba_cache_indices.shape[0]
        if self.num_prefills < 0 or self.num_decodes < 0:
            raise ValueError(
                "Mamba2Metadata.num_prefills and num_decodes must be >= 0, got "
                f"{self.num_prefills} and {self.num_decodes}"
            )
        if self.num_prefills + self.num_decodes != rows:
            raise ValueError(
                f"Mamba2Metadata.num_prefills + num_decodes = {self.num_prefills + self.num_decodes} "
                f"but mamba_cache_indices has {rows} rows"
            )
        if (self.mixed is None) != (self.num_prefills == 0):
            raise ValueError(
                "Mamba2Metadata.mixed must be given exactly when num_prefills > 0 "
                f"(num_prefills={self.num_prefills}, mixed={'None' if self.mixed is None else 'set'})"
            )
        if self.mixed is not None:
            if len(self.mixed.extend_seq_lens_cpu) != self.num_prefills:
                raise ValueError(
                    f"Mamba2Metadata.mixed covers {len(self.mixed.extend_seq_lens_cpu)} prefill "
                    f"rows but num_prefills is {self.num_prefills}"
                )
            if self.mixed.seq_idx.shape[0] != self.num_prefill_tokens:
                raise ValueError(
                    f"Mamba2Metadata.num_prefill_tokens is {self.num_prefill_tokens} but "
                    f"mixed.seq_idx has {self.mixed.seq_idx.shape[0]} tokens"
                )
            if self.mixed.seq_idx.device != self.mamba_cache_indices.device:
                raise ValueError(
                    "Mamba2Metadata.mixed must be on the device of mamba_cache_indices "
                    f"({self.mamba_cache_indices.device}), got {self.mixed.seq_idx.device}"
                )
        elif self.num_prefill_tokens != 0:
            raise ValueError(
                f"Mamba2Metadata.num_prefill_tokens must be 0 without prefill rows, got "
                f"{self.num_prefill_tokens}"
            )


def prepare_decode(fwd: ForwardMetadata) -> Mamba2Metadata:
    """Metadata of a decode-only forward (every row is a decode row, pad rows included)."""
    if fwd.is_target_verify:
        raise ValueError(
            "prepare_decode: ForwardMetadata.is_target_verify is set; use prepare_target_verify"
        )
    return Mamba2Metadata.evolve_from(
        fwd,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=fwd.mamba_cache_indices.shape[0],
        mixed=None,
    )


def prepare_target_verify(fwd: ForwardMetadata) -> Mamba2Metadata:
    """Metadata of a speculative target-verify forward (``draft_token_num`` tokens per row)."""
    if not fwd.is_target_verify:
        raise ValueError("prepare_target_verify: ForwardMetadata.is_target_verify must be set")
    return Mamba2Metadata.evolve_from(
        fwd,
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=fwd.mamba_cache_indices.shape[0],
        mixed=None,
    )


def prepare_mixed(
    fwd: ForwardMetadata,
    *,
    extend_seq_lens_cpu: Sequence[int],
    extend_prefix_lens_cpu: Sequence[int],
    chunk_size: int,
) -> Mamba2Metadata:
    """Metadata of a mixed forward: ``len(extend_seq_lens_cpu)`` prefill rows first, decode
    rows after them.

    Everything is derived from host data (no device read): ``seq_idx``,
    ``has_initial_states`` (prefix length > 0), ``prep_initial_states`` and the logical chunk
    plan are built on the CPU and copied to ``fwd``'s device. The extend track plan travels
    in ``fwd`` itself (``track_ssm_*``, ``track_conv_indices``) like every other field.
    """
    num_prefills = len(extend_seq_lens_cpu)
    if len(extend_prefix_lens_cpu) != num_prefills:
        raise ValueError(
            f"prepare_mixed: extend_prefix_lens_cpu has {len(extend_prefix_lens_cpu)} rows but "
            f"extend_seq_lens_cpu has {num_prefills}"
        )
    if num_prefills == 0:
        raise ValueError("prepare_mixed: no prefill rows; use prepare_decode")
    if any(n <= 0 for n in extend_seq_lens_cpu):
        raise ValueError("prepare_mixed: extend_seq_lens_cpu must be > 0 for every prefill row")
    if any(p < 0 for p in extend_prefix_lens_cpu):
        raise ValueError("prepare_mixed: extend_prefix_lens_cpu must be >= 0")
    rows = fwd.mamba_cache_indices.shape[0]
    if num_prefills > rows:
        raise ValueError(
            f"prepare_mixed: extend_seq_lens_cpu has {num_prefills} prefill rows but "
            f"ForwardMetadata.mamba_cache_indices has only {rows} rows"
        )
    device = fwd.mamba_cache_indices.device
    lens = torch.tensor(list(extend_seq_lens_cpu), dtype=torch.int64)
    qsl = torch.zeros(num_prefills + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=qsl[1:])
    indices, offsets = chunk_indices_offsets(qsl, chunk_size)
    num_tokens = int(qsl[-1])
    has_init = [p > 0 for p in extend_prefix_lens_cpu]
    staged = to_device_packed(
        {
            "seq_idx": torch.repeat_interleave(torch.arange(num_prefills), lens),
            "chunk_indices": indices,
            "chunk_offsets": offsets,
            "has_initial_states": torch.tensor(has_init),
        },
        device,
        dtype=torch.int32,
    )
    mixed = MixedMetadata(
        has_initial_states=staged["has_initial_states"].bool(),
        prep_initial_states=any(has_init),
        chunk_size=chunk_size,
        seq_idx=staged["seq_idx"],
        chunk_indices=staged["chunk_indices"],
        chunk_offsets=staged["chunk_offsets"],
        extend_seq_lens_cpu=tuple(int(n) for n in extend_seq_lens_cpu),
    )
    return Mamba2Metadata.evolve_from(
        fwd,
        num_prefills=num_prefills,
        num_prefill_tokens=num_tokens,
        num_decodes=rows - num_prefills,
        mixed=mixed,
    )
