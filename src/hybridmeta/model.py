"""The Mamba2 metadata model of a hybrid backend: the one carrier.

``ForwardMetadata`` is what the engine's scheduler produces for one forward.
``Mamba2Metadata`` derives from it and is built only through
``Mamba2Metadata.evolve_from`` (here: :func:`prepare_decode`, :func:`prepare_target_verify`
and the mixed-batch planner, :mod:`hybridmeta.planner`), so every ``ForwardMetadata``
field reaches the Mamba2 layers, including ones added later (likewise
:class:`SpecCommitMetadata`, through :func:`prepare_commit`). Every tensor and flag a
Mamba2 entry point reads (prefill scan, prefill conv, extend track-save, decode update,
conv update, decode track-save, verify) arrives inside one ``Mamba2Metadata``; the
prefill-side plan is its nested :class:`MixedMetadata`, itself three nested plans
(:class:`ChunkPlan`, :class:`ConvWindows`, :class:`ExtendTrackPlan`). The commit after a
speculative verify reads :class:`SpecCommitMetadata`, derived in turn from the verify
forward's ``Mamba2Metadata`` (``SpecCommitMetadata.evolve_from(verify_md, ...)``).

Names follow sglang's ``ForwardMetadata`` / ``Mamba2Metadata`` so engine developers
recognise them.
"""

from __future__ import annotations

import torch

from hybridmeta.core import (
    BATCH,
    BOOL,
    CHUNKS,
    INDEX,
    PHYSICAL_CHUNKS,
    PREFILL_TOKENS,
    PREFILLS,
    Conventions,
    Dim,
    Pad,
    Role,
    conventions_of,
    field,
    metadata,
    tensor_field,
)

__all__ = [
    "ChunkPlan",
    "ConvWindows",
    "ExtendTrackPlan",
    "ForwardMetadata",
    "Mamba2Metadata",
    "MixedMetadata",
    "SpecCommitMetadata",
    "prepare_commit",
    "prepare_decode",
    "prepare_target_verify",
]

_PAD_SLOT = Pad.value(-1)
#: Boundaries saved mid-row this forward (extend track plan).
TRACK_MID: Dim = Dim("track_mid")


@metadata
class ForwardMetadata:
    """Per-forward metadata of a hybrid Mamba2 backend (the source of ``Mamba2Metadata``).

    Rows are request rows of the batch: prefill rows first, decode rows last, pad rows
    (graph buckets) after them. Slot ids are state-pool slots (virtual ids of a slot table
    where :class:`~hybridmeta.graphs.StaticBuffers` translates them); pad rows carry
    ``-1``.
    """

    query_start_loc: torch.Tensor = tensor_field(
        rows=BATCH + 1,
        dtypes=INDEX,
        pad=Pad.CUMULATIVE,
        role=Role.ENGINE_ONLY,
        doc="[bs + 1] token offsets of each row; padded rows have length zero. The Mamba2 "
        "entry points take their token layout from the planned metadata (host counts, "
        "chunk and window plans); the offsets travel for the engine's attention.",
    )
    mamba_cache_indices: torch.Tensor = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        role=Role.WORKING_SLOT,
        doc="[bs] working state slot of each row (the null slot, -1 unless the class "
        "declares another: pad row).",
    )
    mamba_track_indices: torch.Tensor | None = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        role=Role.TRACK_SLOT,
        default=None,
        doc="[bs] track (prefix-cache) slot of each row, the null slot where none.",
    )
    mamba_track_mask: torch.Tensor | None = tensor_field(
        rows=BATCH,
        dtypes=BOOL,
        pad=Pad.value(False),
        role=Role.TRACK_MASK,
        default=None,
        doc="[bs] rows whose state at the end of this forward is saved into their track "
        "slot (a decode row reaching a boundary, a prefill row whose boundary ends it). "
        "Boundaries inside a prefill row are the extend track plan's.",
    )
    has_mamba_track_mask: bool = field(
        default=False,
        role=Role.SUBSUMED_FLAG,
        governs=("mamba_track_mask", "mamba_track_indices"),
        required_when_set=True,
        doc="Host-side: whether any row saves its state this step (decided without reading "
        "the mask). Must be stated whenever the track fields are given.",
    )
    is_target_verify: bool = field(
        default=False,
        governs=("retrieve_parent_token",),
        doc="Speculative target-verify forward (draft_token_num tokens per row).",
    )
    draft_token_num: int = field(default=1, doc="Tokens per row in target verify (1 otherwise).")
    retrieve_parent_token: torch.Tensor | None = tensor_field(
        rows=BATCH,
        cols="draft_token_num",
        dtypes=INDEX,
        pad=_PAD_SLOT,
        default=None,
        doc="[bs, draft_token_num] speculative tree: parent of each draft token (-1: the "
        "root, whose parent state is the working slot). None: each row's drafts are a chain.",
    )
    retrieve_next_token: torch.Tensor | None = tensor_field(
        rows=BATCH,
        cols="draft_token_num",
        dtypes=INDEX,
        pad=_PAD_SLOT,
        role=Role.ENGINE_ONLY,
        default=None,
        doc="[bs, draft_token_num] speculative tree: first child of each draft token (the "
        "engine's acceptance walk).",
    )
    retrieve_next_sibling: torch.Tensor | None = tensor_field(
        rows=BATCH,
        cols="draft_token_num",
        dtypes=INDEX,
        pad=_PAD_SLOT,
        role=Role.ENGINE_ONLY,
        default=None,
        doc="[bs, draft_token_num] speculative tree: next sibling of each draft token (the "
        "engine's acceptance walk).",
    )
    mamba_track_mask_indices: torch.Tensor | None = tensor_field(
        dtypes=INDEX,
        role=Role.ENGINE_ONLY,
        default=None,
        doc="Indices of the rows set in ``mamba_track_mask`` (the engine's bookkeeping).",
    )
    conv_states_mask_indices: torch.Tensor | None = tensor_field(
        dtypes=INDEX,
        role=Role.ENGINE_ONLY,
        default=None,
        doc="Rows whose conv state the engine saves (the engine's bookkeeping).",
    )

    def __validate__(self) -> None:
        if self.draft_token_num < 1:
            raise ValueError(
                f"ForwardMetadata.draft_token_num must be >= 1, got {self.draft_token_num}"
            )
        if self.draft_token_num > 1 and not self.is_target_verify:
            raise ValueError(
                f"ForwardMetadata.draft_token_num is {self.draft_token_num} but is_target_verify "
                "is False: only a verify forward has several tokens per row"
            )


@metadata
class ChunkPlan:
    """Logical chunks of the chunked SSD scan over the flattened prefill tokens.

    The scan's chunk grid is global over the flattened tokens of the prefill rows; a new
    logical chunk starts at every physical chunk boundary and at every row start.
    """

    chunk_size: int = field(doc="Physical chunk size of the SSD scan (the state grid).")
    start: torch.Tensor = tensor_field(
        rows=CHUNKS, dtypes=INDEX, doc="[num_logical_chunks] first flattened token."
    )
    length: torch.Tensor = tensor_field(
        rows=CHUNKS, dtypes=INDEX, doc="[num_logical_chunks] tokens in the chunk."
    )
    row: torch.Tensor = tensor_field(
        rows=CHUNKS, dtypes=INDEX, doc="[num_logical_chunks] prefill row of the chunk."
    )
    first: torch.Tensor = tensor_field(
        rows=CHUNKS, dtypes=BOOL, doc="[num_logical_chunks] the chunk opens its row."
    )
    token_chunk: torch.Tensor = tensor_field(
        rows=PREFILL_TOKENS, dtypes=INDEX, doc="[num_prefill_tokens] logical chunk of each token."
    )
    token_pos: torch.Tensor = tensor_field(
        rows=PREFILL_TOKENS, dtypes=INDEX, doc="[num_prefill_tokens] position in that chunk."
    )
    row_last_chunk: torch.Tensor = tensor_field(
        rows=PREFILLS, dtypes=INDEX, doc="[num_prefills] logical chunk holding the row's last token."
    )
    phys_last_chunk: torch.Tensor = tensor_field(
        rows=PHYSICAL_CHUNKS,
        dtypes=INDEX,
        doc="[num_physical_chunks] last logical chunk of each physical chunk.",
    )

    def __validate__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"ChunkPlan.chunk_size must be > 0, got {self.chunk_size}")

    @property
    def num_logical(self) -> int:
        """Number of logical chunks (host-side: a shape)."""
        return int(self.start.shape[0])


@metadata
class ConvWindows:
    """Gather plan of the prefill causal conv1d over the *extended* input.

    The extended input is the flattened prefill tokens followed by every prefill row's
    initial conv state (``K - 1`` columns each, zeros where the row has none): index
    ``i < T`` is token ``i``; ``T + r * (K - 1) + c`` is column ``c`` (oldest first) of
    prefill row ``r``'s initial state. A window that reaches back before a row's first new
    token reads that row's saved inputs, never a neighbour's tokens.
    """

    kernel_size: int = field(doc="Conv width K (the conv state keeps K - 1 inputs).")
    token_windows: torch.Tensor = tensor_field(
        rows=PREFILL_TOKENS,
        cols="kernel_size",
        dtypes=INDEX,
        doc="[num_prefill_tokens, K] extended-input indices of each token's window.",
    )
    final_windows: torch.Tensor = tensor_field(
        rows=PREFILLS,
        dtypes=INDEX,
        ndim=2,
        doc="[num_prefills, K - 1] extended-input indices of each row's final conv state.",
    )

    def __validate__(self) -> None:
        if self.kernel_size < 2:
            raise ValueError(f"ConvWindows.kernel_size must be >= 2, got {self.kernel_size}")
        if self.final_windows.shape[1] != self.kernel_size - 1:
            raise ValueError(
                f"ConvWindows.final_windows has {self.final_windows.shape[1]} columns but "
                f"kernel_size - 1 = {self.kernel_size - 1}"
            )


@metadata
class ExtendTrackPlan:
    """Track boundaries *inside* prefill rows (the prefix cache of recurrent state).

    A boundary that ends its row is saved like a decode row's, by the forward's
    ``mamba_track_mask`` after the layers ran. A boundary inside a row is saved from the
    scan: on the scan's global chunk grid its state is a chunk state (``h_*``), off the
    grid it is recomputed from the state entering its logical chunk (``recompute_*``). Each
    entry names its batch row; the slots come from the forward's ``mamba_track_indices``.
    """

    h_rows: torch.Tensor = tensor_field(
        dtypes=INDEX, doc="[n_h] batch rows whose boundary lies on the chunk grid."
    )
    h_chunk: torch.Tensor = tensor_field(
        dtypes=INDEX, doc="[n_h] logical chunk whose end is that boundary."
    )
    recompute_rows: torch.Tensor = tensor_field(
        dtypes=INDEX, doc="[n_rc] batch rows whose boundary lies off the grid."
    )
    recompute_chunk: torch.Tensor = tensor_field(
        dtypes=INDEX, doc="[n_rc] logical chunk holding the boundary."
    )
    recompute_len: torch.Tensor = tensor_field(
        dtypes=INDEX, doc="[n_rc] tokens of that chunk before the boundary (1 .. chunk - 1)."
    )
    windows: torch.Tensor = tensor_field(
        rows=TRACK_MID,
        dtypes=INDEX,
        ndim=2,
        doc="[n_h + n_rc, K - 1] extended-input indices of each boundary's conv window "
        "(h entries first, then recompute entries).",
    )

    def __validate__(self) -> None:
        n_h, n_rc = self.h_rows.shape[0], self.recompute_rows.shape[0]
        if self.h_chunk.shape[0] != n_h:
            raise ValueError(
                f"ExtendTrackPlan.h_chunk has {self.h_chunk.shape[0]} entries but h_rows has {n_h}"
            )
        for name in ("recompute_chunk", "recompute_len"):
            if getattr(self, name).shape[0] != n_rc:
                raise ValueError(
                    f"ExtendTrackPlan.{name} has {getattr(self, name).shape[0]} entries but "
                    f"recompute_rows has {n_rc}"
                )
        if self.windows.shape[0] != n_h + n_rc:
            raise ValueError(
                f"ExtendTrackPlan.windows has {self.windows.shape[0]} rows but there are "
                f"{n_h + n_rc} mid-row boundaries"
            )

    @property
    def num_h(self) -> int:
        """Boundaries on the grid (host-side: a shape)."""
        return int(self.h_rows.shape[0])

    @property
    def num_recompute(self) -> int:
        """Boundaries off the grid (host-side: a shape)."""
        return int(self.recompute_rows.shape[0])


@metadata
class MixedMetadata:
    """Prefill-side plan of a mixed forward (the prefill rows only)."""

    has_initial_states: torch.Tensor = tensor_field(
        rows=PREFILLS,
        dtypes=BOOL,
        pad=Pad.value(False),
        doc="[num_prefills] rows resuming from the state in their working slot.",
    )
    chunks: ChunkPlan = field(doc="The chunked scan's logical chunks.")
    conv: ConvWindows = field(doc="The prefill conv's windows.")
    track: ExtendTrackPlan = field(doc="Track boundaries inside prefill rows.")

    def __validate__(self) -> None:
        r = self.has_initial_states.shape[0]
        if self.chunks.row_last_chunk.shape[0] != r or self.conv.final_windows.shape[0] != r:
            raise ValueError(
                f"MixedMetadata: chunks / conv plan {self.chunks.row_last_chunk.shape[0]} / "
                f"{self.conv.final_windows.shape[0]} prefill rows but has_initial_states has {r}"
            )
        t = self.chunks.token_chunk.shape[0]
        if self.conv.token_windows.shape[0] != t:
            raise ValueError(
                f"MixedMetadata.conv plans {self.conv.token_windows.shape[0]} tokens but "
                f"chunks plans {t}"
            )
        if self.track.windows.shape[1:] != self.conv.final_windows.shape[1:]:
            raise ValueError(
                "MixedMetadata.track.windows must have kernel_size - 1 = "
                f"{self.conv.kernel_size - 1} columns, got {tuple(self.track.windows.shape)}"
            )
        dev = self.has_initial_states.device
        for name, t_ in (("chunks", self.chunks.start), ("conv", self.conv.token_windows),
                         ("track", self.track.windows)):  # fmt: skip
            if t_.device != dev:
                raise ValueError(
                    f"MixedMetadata.{name} must be on {dev} (has_initial_states'), got {t_.device}"
                )

    @property
    def num_prefills(self) -> int:
        return int(self.has_initial_states.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.chunks.token_chunk.shape[0])


@metadata
class Mamba2Metadata(ForwardMetadata):
    """What the Mamba2 layers of one forward read. Built only through ``evolve_from``."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    mixed: MixedMetadata | None

    def __validate__(self) -> None:
        # (ForwardMetadata's own hook runs first: every class's hook runs, bases first)
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
        if self.is_target_verify and self.num_prefills:
            raise ValueError(
                f"Mamba2Metadata.num_prefills must be 0 in a target-verify forward, got "
                f"{self.num_prefills}"
            )
        if (self.mixed is None) != (self.num_prefills == 0):
            raise ValueError(
                "Mamba2Metadata.mixed must be given exactly when num_prefills > 0 "
                f"(num_prefills={self.num_prefills}, mixed={'None' if self.mixed is None else 'set'})"
            )
        if self.mixed is not None:
            if self.mixed.num_prefills != self.num_prefills:
                raise ValueError(
                    f"Mamba2Metadata.mixed covers {self.mixed.num_prefills} prefill rows but "
                    f"num_prefills is {self.num_prefills}"
                )
            if self.mixed.num_tokens != self.num_prefill_tokens:
                raise ValueError(
                    f"Mamba2Metadata.num_prefill_tokens is {self.num_prefill_tokens} but mixed "
                    f"plans {self.mixed.num_tokens} tokens"
                )
            dev = self.mamba_cache_indices.device
            if self.mixed.has_initial_states.device != dev:
                raise ValueError(
                    f"Mamba2Metadata.mixed must be on the device of mamba_cache_indices ({dev}), "
                    f"got {self.mixed.has_initial_states.device}"
                )
        elif self.num_prefill_tokens != 0:
            raise ValueError(
                f"Mamba2Metadata.num_prefill_tokens must be 0 without prefill rows, got "
                f"{self.num_prefill_tokens}"
            )

    @property
    def conventions(self) -> Conventions:
        """The engine's declared row order and null slot (:class:`Conventions`)."""
        return conventions_of(self)

    @property
    def prefill_slots(self) -> torch.Tensor:
        """``[num_prefills]`` working slots of the prefill rows (a view, no copy)."""
        return self.mamba_cache_indices[self.prefill_rows()]

    def prefill_rows(self) -> slice:
        """The prefill rows, in the declared row order (``Conventions.row_order``)."""
        if conventions_of(self).decodes_first:
            return slice(self.num_decodes, self.num_decodes + self.num_prefills)
        return slice(0, self.num_prefills)

    def decode_rows(self) -> slice:
        """The decode rows, in the declared row order: after the prefill rows (hybridmeta,
        sglang), or first (vLLM, ``RowOrder.DECODES_FIRST``)."""
        if conventions_of(self).decodes_first:
            return slice(0, self.num_decodes)
        return slice(self.num_prefills, self.num_prefills + self.num_decodes)

    def prefill_tokens(self) -> slice:
        """The prefill rows' tokens among the forward's tokens (``T`` tokens per decode row
        in a verify forward, one otherwise), in the declared row order."""
        if conventions_of(self).decodes_first:
            start = self.num_decodes * self.draft_token_num
            return slice(start, start + self.num_prefill_tokens)
        return slice(0, self.num_prefill_tokens)

    def decode_tokens(self) -> slice:
        """The decode rows' tokens among the forward's tokens, in the declared row order."""
        n = self.num_decodes * self.draft_token_num
        if conventions_of(self).decodes_first:
            return slice(0, n)
        return slice(self.num_prefill_tokens, self.num_prefill_tokens + n)


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


@metadata
class SpecCommitMetadata(Mamba2Metadata):
    """What the commit after a speculative target-verify forward reads.

    Built only through ``SpecCommitMetadata.evolve_from(verify_md, accepted_index=...,
    track_token=...)`` from the verify forward's metadata (:func:`prepare_target_verify`),
    so the working and track slots, the track mask, ``has_mamba_track_mask`` and
    ``draft_token_num`` the commit reads are the ones the verify read. The two per-row
    fields it adds are the engine's verdict on the draft, computed on the device after the
    verify (acceptance, then :func:`hybridmeta.kernels.spec_track_token`); both are
    required (no default can stand in for a verdict) and both are padded with ``-1``
    (nothing to commit) in the pad rows of a graph bucket.
    """

    accepted_index: torch.Tensor = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=Pad.value(-1),
        doc="[bs] draft column of each row's last accepted token, in [-1, draft_token_num) "
        "(-1: none accepted, the working slot keeps its state). A chain of num_accepted "
        "tokens: num_accepted - 1; a tree: the column of the accepted path's last token.",
    )
    track_token: torch.Tensor = tensor_field(
        rows=BATCH,
        dtypes=INDEX,
        pad=Pad.value(-1),
        doc="[bs] draft column whose state lands exactly on a prefix-cache track boundary "
        "(-1: no boundary crossed by the accepted tokens). Read only when "
        "has_mamba_track_mask is set, for rows flagged in mamba_track_mask.",
    )

    def __validate__(self) -> None:
        if not self.is_target_verify:
            raise ValueError(
                "SpecCommitMetadata.is_target_verify must be set: a commit follows a "
                "target-verify forward (evolve it from prepare_target_verify's metadata)"
            )

    def __validate_debug__(self) -> None:
        # Debug mode only (reads device values): the verdict's columns index the draft. An
        # accepted_index of T (the count passed for the index) would silently skip the row.
        T = self.draft_token_num
        checks: list[tuple[str, torch.Tensor, torch.Tensor | None]] = [
            ("accepted_index", self.accepted_index, None)
        ]
        if self.has_mamba_track_mask and self.mamba_track_mask is not None:
            # track_token is read only for the flagged rows of a tracking step
            checks.append(("track_token", self.track_token, self.mamba_track_mask.bool()))
        for name, cols, rows in checks:
            bad = (cols < -1) | (cols >= T)
            if rows is not None:
                bad &= rows
            if bool(bad.any()):
                r = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"SpecCommitMetadata.{name} row {r} holds {int(cols[r])}: must be -1 "
                    f"(none) or a draft column in [0, draft_token_num={T})"
                )


def prepare_commit(
    verify: Mamba2Metadata, *, accepted_index: torch.Tensor, track_token: torch.Tensor
) -> SpecCommitMetadata:
    """Metadata of the commit after a target-verify forward (``verify``: its metadata).

    ``accepted_index`` and ``track_token`` are the engine's ``[bs]`` verdict (see
    :class:`SpecCommitMetadata`); everything else is the verify's.
    """
    return SpecCommitMetadata.evolve_from(
        verify, accepted_index=accepted_index, track_token=track_token
    )
