"""Static CUDA-graph buffers that only ever hand out the refreshed prefix.

A captured decode graph reads its metadata from buffers at fixed addresses. The buffers are
allocated once for ``max_bs`` rows; a step with ``bs`` live rows, replayed by the graph of
bucket ``B >= bs``, needs rows ``[0:bs)`` to hold the step's values and rows ``[bs:B)`` to
hold padding that makes the kernels do nothing. Rows ``[B:max_bs)`` must never be read.

A speculative target-verify forward has a second bucket dimension: ``T`` draft columns
per row. A bucket is then ``(B, T)``: fields with declared columns (``cols=``, e.g.
``retrieve_parent_token``) are ``[max_bs, max_draft]`` buffers handed out as ``[:B, :T]``
views, per-token inputs (``TOKENS`` rows) have ``B * T`` rows laid out row after row,
offsets have ``T`` tokens per live row. A step with ``t <= T`` live columns has its
columns ``[t:T)`` padded as its pad rows are, from the declarations.

:class:`StaticBuffers` is declared from the metadata classes themselves: one buffer per
per-row field of :class:`~hybridmeta.model.ForwardMetadata` (``rows`` ``BATCH`` or
``BATCH + 1``), padded with the field's declared :class:`~hybridmeta.core.PadRule`. A new
per-row field gets its buffer with no change here. :meth:`StaticBuffers.refresh` writes the
live rows and the pad in place and returns :class:`~hybridmeta.model.Mamba2Metadata` whose
tensors are views of exactly ``B`` rows; the raw buffers are never handed out, which makes
the stale-tail defect (a kernel handed the whole ``max_bs`` buffer, slicing ``[-n:]``,
sglang #32555) unrepresentable through this API.

Everything here follows the declarations (:func:`hybridmeta.core.fields_of`): which fields
are buffered (per-row ``BATCH`` rows), their pad (``PadRule``), their trailing columns
(``cols``, and the host field that counts them: the draft dimension), which carry slot ids
and which of those are translated (``Role``), which host flag a captured value subsumes
(``Role.SUBSUMED_FLAG``), which optional fields a pad can stand in for. A new per-row field
of ``ForwardMetadata``, or of a class derived from ``Mamba2Metadata`` (the commit's
``SpecCommitMetadata``: ``metadata_class=``), needs no edit here. Virtual-to-physical slot translation happens in
exactly one place, :meth:`StaticBuffers._translate`, for the fields whose role is
translated (``Role.WORKING_SLOT``).

Checks before anything is written: structure always (shapes, dtypes, devices, host
values); the slot rules of a live step (ids in range, no pad in a live row's working
slot, distinct physical working slots, a flagged row's track slot present, distinct and
never a working slot) always when the step's values live on the host (CPU buffers: no
sync), on a GPU in debug mode; every other declared value rule
(:func:`hybridmeta.core.check_values`, on *physical* ids after translation, the step
class's ``__validate_debug__``) and NaN inputs in debug mode. The slot table is copied and
checked (slots, no pad, no duplicate) at construction.

:attr:`StaticBuffers.refreshed_bucket` is the bucket whose rows the buffers hold whole (the
last refresh or pad of it); :class:`~hybridmeta.graphs.GraphRunner` replays no other.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from hybridmeta.core import (
    BATCH,
    INDEX,
    TOKENS,
    Dim,
    FieldSpec,
    Role,
    _compile,
    _hooks,
    check_values,
    fields_of,
    is_extension,
    source_of,
)
from hybridmeta.debug import is_debug
from hybridmeta.graphs.capture import canonical_device
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, prepare_decode, prepare_target_verify

__all__ = [
    "Bucket",
    "InputSpec",
    "StaticBuffers",
    "bucket_for",
    "default_buckets",
]

#: A captured shape: ``(B, T)``, request rows and draft columns per row.
Bucket = tuple[int, int]

#: Bound on cached refresh plans (one per bs, t, bucket and optional-field presence).
_MAX_PLANS: Final = 8192


def default_buckets(max_bs: int) -> tuple[int, ...]:
    """Powers of two up to ``max_bs``, plus ``max_bs`` itself."""
    if max_bs <= 0:
        raise ValueError(f"default_buckets: max_bs must be > 0, got {max_bs}")
    out = [1]
    while out[-1] * 2 < max_bs:
        out.append(out[-1] * 2)
    if out[-1] != max_bs:
        out.append(max_bs)
    return tuple(out)


@attrs.frozen
class InputSpec:
    """A static per-row (or per-token) input of a captured step, e.g. hidden states.

    Attributes
    ----------
    shape : tuple of int
        Trailing shape of one row.
    dtype : torch.dtype
        Required dtype of the live input.
    rows : Dim
        ``BATCH`` (one row per request) or ``TOKENS`` (``T`` per request: ``B * T`` rows,
        row after row).
    pad : int, float or bool
        Value written into padded rows and padded draft columns (defined input for their
        outputs).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Dim = BATCH
    pad: int | float | bool = 0

    def __attrs_post_init__(self) -> None:
        if self.rows not in (BATCH, TOKENS):
            raise ValueError(f"InputSpec.rows must be BATCH or TOKENS, got {self.rows!r}")


def _pad_of(spec: FieldSpec) -> int:
    """The id a pad row carries in a slot field: the field's declared pad value."""
    assert spec.pad is not None and isinstance(spec.pad.value, int), spec
    return int(spec.pad.value)


def _err(name: str, rule: str) -> ValueError:
    return ValueError(f"StaticBuffers.refresh: {name} {rule}")


_BYTE: Final = torch.uint8

#: Up to this many rows the host-side slot check runs on Python lists (each numpy call
#: costs more than the whole check on a short list), past it on numpy arrays.
_LIST_ROWS: Final = 32

# A live destination of a refresh: (is_input, name, shape the source is viewed as or None).
_Live = tuple[bool, str, tuple[int, ...] | None]


class _CopyGroup:
    """One ``torch._foreach_copy_`` of a refresh: every destination of one dtype.

    ``dsts`` are fixed views of the static buffers: first the live rows of the fields named
    in ``live``, in order, then the padded rows and columns, whose sources ``pads`` are
    fixed views of constant pad tensors. Only the live sources change per step.
    """

    __slots__ = ("dsts", "live", "pads")

    def __init__(self) -> None:
        self.dsts: list[torch.Tensor] = []
        self.live: list[_Live] = []
        self.pads: list[torch.Tensor] = []


class _Plan:
    """Everything a refresh of ``bs`` rows of ``t`` columns into bucket ``(B, T)`` writes.

    ``groups`` holds one copy group per dtype. When there are several, ``merged`` is the
    same copies as one group of byte views (``torch.uint8``): one ``_foreach_copy_`` (one
    launch on a GPU) instead of one per dtype. A refresh uses ``merged`` whenever every live
    source can be viewed as bytes (its last dimension of stride 1), else ``groups``. The
    byte copy is exact: every source has its buffer's dtype (checked before writing).
    """

    __slots__ = ("groups", "merged", "translate")

    def __init__(self) -> None:
        self.groups: list[_CopyGroup] = []
        self.merged: _CopyGroup | None = None
        # (field, destination view) of the virtual -> physical translation.
        self.translate: list[tuple[str, torch.Tensor]] = []


def _merge(groups: list[_CopyGroup]) -> _CopyGroup | None:
    """The copies of ``groups`` (one per dtype) as one group of byte views, or ``None``
    when a destination has no byte view (a strided last dimension)."""
    merged = _CopyGroup()
    try:
        for group in groups:  # the live destinations first, then the pads
            merged.live += group.live
            merged.dsts += [d.view(_BYTE) for d in group.dsts[: len(group.live)]]
        for group in groups:
            merged.dsts += [d.view(_BYTE) for d in group.dsts[len(group.live) :]]
            merged.pads += [p.view(_BYTE) for p in group.pads]
    except RuntimeError:
        return None
    return merged


def _chain(metadata_class: type) -> tuple[type, ...]:
    """The metadata classes from ``Mamba2Metadata`` down to ``metadata_class``."""
    chain: list[type] = []
    cls: type | None = metadata_class
    while cls is not None and cls is not Mamba2Metadata:
        chain.append(cls)
        cls = source_of(cls)
    if cls is None:
        raise ValueError(
            f"StaticBuffers: metadata_class must be Mamba2Metadata or a class derived from it, "
            f"got {metadata_class.__qualname__}"
        )
    return (Mamba2Metadata, *reversed(chain))


class StaticBuffers:
    """Static metadata and input buffers of a decode (or target-verify) CUDA-graph runner.

    Parameters
    ----------
    max_bs : int
        Largest batch (request rows) any captured graph serves. Buffers of ``BATCH``
        fields have ``max_bs`` rows, ``query_start_loc`` has ``max_bs + 1``, fields with
        draft columns ``max_draft`` columns, per-token inputs ``max_bs * max_draft`` rows.
    num_slots : int
        Size of the state pool: live slot ids must lie in ``[0, num_slots)``; at most the
        number of ids ``index_dtype`` can name (``2**31`` for int32, ``2**63`` for int64).
    device : torch.device or str
        Device of the buffers; live tensors must be on it.
    max_draft : int
        Widest draft bucket ``T`` (the column-count host field, ``draft_token_num``, is a
        bucket dimension, not a frozen value). ``1`` for decode; a target-verify forward
        (``static={"is_target_verify": True}``) may have more.
    metadata_class : type
        ``Mamba2Metadata`` (default) or a class derived from it whose added fields are all
        per-row tensors (``SpecCommitMetadata``): they are buffered too, and each step is
        then a live instance of that class (``metadata_class.evolve_from(...)`` of the
        step's rows).
    optional_fields : collection of str, optional
        Optional per-row fields to buffer (default: every one whose ``None`` a pad can stand
        for: ``Role.ENGINE_ONLY`` fields, slot fields and track masks, whose pad means
        "nothing", and fields governed by a ``Role.SUBSUMED_FLAG``).
        A step that sets an optional field not buffered here is refused, so no field is
        silently dropped. A buffered field that a step leaves ``None`` is padded over the
        whole bucket if a pad can stand for its ``None``; any other buffered field (a
        tree, ``retrieve_parent_token``: ``None`` means chains, a pad ``-1`` would mean
        roots) must be given by every step.
    static : mapping of str to object
        Values of the non-tensor ``ForwardMetadata`` fields fixed at capture (default: the
        declared defaults, and ``True`` for a ``Role.SUBSUMED_FLAG`` whose governed fields
        are all buffered). A step whose host values differ is refused: the graph would not
        do what the step asks; a subsumed flag captured ``True`` also serves ``False``.
        The column-count field is not static (see ``max_draft``).
    index_dtype : torch.dtype
        Dtype of the index buffers (live index tensors must match it exactly).
    inputs : mapping of str to InputSpec
        Static step inputs (hidden states, ...), refreshed and padded with the metadata.
    slot_table : torch.Tensor, optional
        ``[num_virtual]`` map from virtual slot ids (request-pool indices) to physical state
        slots. When given, the translated slot fields (``Role.WORKING_SLOT``) of a step
        hold virtual ids.
    source : type
        The step's class: ``ForwardMetadata`` (default) or an engine's extension of it
        (``@metadata(extension=True)``). Its own per-row fields are buffered from their
        declarations like the root's (dtype, pad; slot fields pad with the class's declared
        null slot), its host fields are frozen like the root's (``static``), and each bucket's
        metadata is ``Mamba2Metadata.evolve_from`` of an instance of it (the generated
        specialisation, carrying the engine's fields). With ``metadata_class`` other than
        ``Mamba2Metadata`` only the default is supported.
    """

    def __init__(
        self,
        *,
        max_bs: int,
        num_slots: int,
        device: torch.device | str,
        max_draft: int = 1,
        metadata_class: type[Mamba2Metadata] = Mamba2Metadata,
        optional_fields: Collection[str] | None = None,
        static: Mapping[str, object] | None = None,
        index_dtype: torch.dtype = torch.int64,
        inputs: Mapping[str, InputSpec] | None = None,
        slot_table: torch.Tensor | None = None,
        source: type[ForwardMetadata] = ForwardMetadata,
    ) -> None:
        if not (
            isinstance(source, type)
            and issubclass(source, ForwardMetadata)
            and (source is ForwardMetadata or is_extension(source))
        ):
            raise ValueError(
                f"StaticBuffers: source must be ForwardMetadata or an extension of it "
                f"(@metadata(extension=True)), got {source!r}"
            )
        if source is not ForwardMetadata and metadata_class is not Mamba2Metadata:
            raise ValueError(
                f"StaticBuffers: source={source.__qualname__} is supported with "
                f"metadata_class=Mamba2Metadata only, got {metadata_class.__qualname__}"
            )
        if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs <= 0:
            raise ValueError(f"StaticBuffers: max_bs must be an int > 0, got {max_bs!r}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"StaticBuffers: num_slots must be an int > 0, got {num_slots!r}")
        if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft <= 0:
            raise ValueError(f"StaticBuffers: max_draft must be an int > 0, got {max_draft!r}")
        if index_dtype not in INDEX:
            raise ValueError(
                f"StaticBuffers: index_dtype must be int32 or int64, got {index_dtype}"
            )
        id_limit = torch.iinfo(index_dtype).max + 1
        if num_slots > id_limit:
            # Every slot must have an id; the step checks also rely on it (ids + 1 viewed
            # as unsigned stay below num_slots + 1 only then).
            raise ValueError(
                f"StaticBuffers: num_slots must be <= {id_limit} for {index_dtype} ids "
                f"(slots 0 to {id_limit - 1}), got {num_slots}"
            )
        self.max_bs = max_bs
        self.max_draft = max_draft
        self.num_slots = num_slots
        self.device = _usable_device(device)
        self.index_dtype = index_dtype
        self.metadata_class = metadata_class
        self._chain = _chain(metadata_class)
        self.source = source
        self._step_class: type[ForwardMetadata] = (
            source if metadata_class is Mamba2Metadata else metadata_class
        )

        root = fields_of(source)
        # Mamba2Metadata's own fields are computed from the rows (prepare_decode /
        # prepare_target_verify); fields added below it must be per-row tensors.
        computed = {s.name for s in fields_of(Mamba2Metadata)}
        added = tuple(s for s in fields_of(metadata_class) if s.name not in computed)
        for s in added:
            if not s.per_row:
                raise ValueError(
                    f"StaticBuffers: {s.owner}.{s.name} is not a per-row tensor field; a "
                    "class derived from Mamba2Metadata can be buffered only if every field it "
                    "adds is one"
                )
        specs = root + added
        by_name = {s.name: s for s in specs}
        col_fields = sorted({s.cols for s in specs if s.cols is not None})
        if len(col_fields) > 1:
            raise ValueError(
                f"StaticBuffers: one draft dimension is supported, the fields declare columns "
                f"from {col_fields}"
            )
        self._col_field: str | None = col_fields[0] if col_fields else None
        if self._col_field is None and max_draft != 1:
            raise ValueError("StaticBuffers: max_draft > 1 but no field declares columns")
        subsumed = {s.name for s in specs if s.role is Role.SUBSUMED_FLAG}
        # Optional fields whose None a pad can stand for: no layer reads them
        # (ENGINE_ONLY), their pad means "nothing" by their role (a slot field's -1, a
        # track mask's False), or a subsumed flag masks their work off when they are None.
        # A DATA field's pad is a value (a tree's -1 is a root, its None a chain): never.
        padded_none = (
            {g for s in specs if s.role is Role.SUBSUMED_FLAG for g in s.governs}
            | {s.name for s in specs if s.role is Role.ENGINE_ONLY}
            | {s.name for s in specs if s.role.is_slot or s.role is Role.TRACK_MASK}
        )
        if optional_fields is None:
            optional_fields = tuple(
                s.name for s in specs if s.per_row and s.optional and s.name in padded_none
            )
        for name in optional_fields:
            spec = by_name.get(name)
            if spec is None or not spec.per_row or not spec.optional:
                raise ValueError(
                    f"StaticBuffers: optional_fields entry {name!r} is not an optional per-row "
                    f"field of {metadata_class.__qualname__}"
                )
        self._buffered: tuple[FieldSpec, ...] = tuple(
            s for s in specs if s.per_row and (not s.optional or s.name in optional_fields)
        )
        self._static = self._static_values(root, dict(static or {}), self._buffered)
        self.is_target_verify = bool(self._static["is_target_verify"])
        self.max_tokens = max_bs * max_draft
        self._subsumed = frozenset(subsumed)
        self._translated = tuple(s.name for s in self._buffered if s.role.translated)
        # Buffered optional fields whose None no pad can stand for: every step gives them.
        self._required_present = tuple(
            s.name for s in self._buffered if s.optional and s.name not in padded_none
        )

        self._inputs: dict[str, InputSpec] = dict(inputs or {})
        for name in self._inputs:
            if name in by_name:
                raise ValueError(f"StaticBuffers: input {name!r} collides with a metadata field")

        self._buffers: dict[str, torch.Tensor] = {}
        # Constant pad sources, so padding joins the refresh's foreach copies.
        self._pad_src: dict[str, torch.Tensor] = {}
        self._cumulative: dict[tuple[str, int], torch.Tensor] = {}
        for spec in self._buffered:
            self._allocate_field(spec)
        for name, ispec in self._inputs.items():
            self._buffers[name] = torch.full(
                (self.rows_of(name, (max_bs, max_draft)), *ispec.shape),
                ispec.pad,
                dtype=ispec.dtype,
                device=self.device,
            )
            self._pad_src[name] = self._buffers[name].clone()

        # The slot table is copied (device and host) and checked once: changing the caller's
        # tensor later changes nothing here.
        self._slot_table: torch.Tensor | None = None
        self._table_host: npt.NDArray[np.int64] | None = None
        if slot_table is not None:
            self._slot_table, self._table_host = self._check_slot_table(slot_table)
        self._optional = tuple(s.name for s in self._buffered if s.optional)
        # A field governed by a Role.SUBSUMED_FLAG is used only when the step's flag is set:
        # with the flag off, its rows are padded (the captured graph, captured with the flag
        # on, masks its work per row, so it must see the pad, never the step's values).
        self._gates = {g: s.name for s in specs if s.role is Role.SUBSUMED_FLAG for g in s.governs}
        # Flat tuples for the per-step checks (host time per step matters).
        self._static_items = tuple(self._static.items())
        self._unbuffered_names = tuple(
            s.name for s in specs if s.is_tensor and s not in self._buffered
        )
        self._field_dtypes = tuple((s.name, self._buffers[s.name].dtype) for s in self._buffered)
        # Step values are host data when the buffers live on the CPU: their slot rules are
        # checked every step (no sync). On a GPU they are device data: debug mode only.
        self._host_values = self.device.type == "cpu"
        self._step_check = self._make_step_check()
        self._slot_check = self._make_slot_check()
        # The bucket whose rows [0:B) the buffers hold completely (a refresh or pad_all of
        # it was the last write); None while a write is under way or after one failed.
        self._held: Bucket | None = None
        self._plans: dict[tuple[int, int, int, int, tuple[bool, ...]], _Plan] = {}
        self._views: dict[Bucket, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._metadata: dict[Bucket, Mamba2Metadata] = {}
        # Build the widest bucket's metadata once: a configuration the declarations refuse
        # (max_draft > 1 without is_target_verify, ...) fails here, not at capture.
        self._construct((1, max_draft))

    # ------------------------------------------------------------------ construction

    def _static_values(
        self,
        host_specs: tuple[FieldSpec, ...],
        given: dict[str, object],
        buffered: tuple[FieldSpec, ...],
    ) -> dict[str, object]:
        host = [s for s in host_specs if not s.is_tensor]
        unknown = set(given) - {s.name for s in host}
        if unknown:
            raise ValueError(
                f"StaticBuffers: static names non-tensor {self.source.__qualname__} fields only; unknown "
                f"{sorted(unknown)} (known: {[s.name for s in host]})"
            )
        if self._col_field is not None and self._col_field in given:
            raise ValueError(
                f"StaticBuffers: static {self._col_field!r}: draft columns are a bucket "
                "dimension of the buffers, not a frozen value; pass max_draft (the widest "
                "bucket) and capture one graph per draft length"
            )
        names = {b.name for b in buffered}
        out: dict[str, object] = {}
        for spec in host:
            if spec.name == self._col_field:
                continue
            if spec.name in given:
                out[spec.name] = given[spec.name]
            elif spec.role is Role.SUBSUMED_FLAG:
                # Capture the masked work whenever every field it governs is buffered: a
                # step that does nothing then runs it with every row masked off.
                out[spec.name] = bool(spec.governs) and set(spec.governs) <= names
            elif spec.default is attrs.NOTHING:
                raise ValueError(f"StaticBuffers: static must give {spec.name!r} (no default)")
            else:
                out[spec.name] = spec.default
        return out

    def _allocate_field(self, spec: FieldSpec) -> None:
        assert spec.pad is not None  # per-row fields always declare one (core checks)
        # index_dtype for index fields; otherwise the field's first declared dtype.
        if spec.dtypes is None or self.index_dtype in spec.dtypes:
            dtype = self.index_dtype
        else:
            dtype = spec.dtypes[0]
        rows = self.rows_of(spec.name, (self.max_bs, self.max_draft))
        if spec.cols is not None:
            trailing: tuple[int, ...] = (self.max_draft,)
        elif spec.ndim is not None and spec.ndim > 1:
            raise ValueError(
                f"StaticBuffers: per-row field {spec.name!r} has {spec.ndim} dimensions but "
                "declares no cols: its buffer shape is unknown"
            )
        else:
            trailing = ()
        if spec.role.translated and trailing:
            raise ValueError(
                f"StaticBuffers: translated slot field {spec.name!r} must have one slot per row"
            )
        fill = 0 if spec.pad.value is None else spec.pad.value
        buf = torch.full((rows, *trailing), fill, dtype=dtype, device=self.device)
        self._buffers[spec.name] = buf
        if spec.pad.value is not None:
            self._pad_src[spec.name] = buf.clone()

    def _cumulative_table(self, name: str, T: int) -> torch.Tensor:
        # Row b of the table is a whole padded offsets array for b live rows of T tokens
        # each: table[b, i] = min(i, b) * T.
        table = self._cumulative.get((name, T))
        if table is None:
            rows = self._buffers[name].shape[0]
            # On the buffers' device, whatever torch's default device is.
            i = torch.arange(rows, dtype=self._buffers[name].dtype, device=self.device)
            table = torch.minimum(i[None, :], i[:, None]) * T
            self._cumulative[(name, T)] = table
        return table

    def _check_slot_table(self, table: object) -> tuple[torch.Tensor, npt.NDArray[np.int64]]:
        """Validate the virtual -> physical table and return private copies of it (on the
        buffers' device, and on the host for the host-side slot checks). Setup time, not
        the hot path: reading the table once is acceptable."""
        if (
            not isinstance(table, torch.Tensor)
            or table.dim() != 1
            or table.dtype != self.index_dtype
            or table.device != self.device
        ):
            got = (
                f"{tuple(table.shape)} {table.dtype} on {table.device}"
                if isinstance(table, torch.Tensor)
                else type(table).__name__
            )
            raise ValueError(
                f"StaticBuffers: slot_table must be a 1-D {self.index_dtype} tensor on "
                f"{self.device}, got {got}"
            )
        (spec,) = (s for s in self._buffered if s.role.translated)
        null = _pad_of(spec)
        host = table.detach().cpu().numpy().astype(np.int64)  # a copy, never the caller's
        bad = np.flatnonzero((host < 0) | (host >= self.num_slots) | (host == null))
        if bad.shape[0]:
            v = int(bad[0])
            raise ValueError(
                f"StaticBuffers: slot_table maps to slots outside [0, {self.num_slots}) or to "
                f"the pad {null}: virtual slot {v} maps to {int(host[v])} (every entry must "
                f"be a state slot in [0, {self.num_slots}) other than the pad)"
            )
        order = np.argsort(host, kind="stable")
        same = np.flatnonzero(host[order][1:] == host[order][:-1])
        if same.shape[0]:
            a, b = int(order[same[0]]), int(order[same[0] + 1])
            raise ValueError(
                f"StaticBuffers: slot_table has a duplicate entry: virtual slots {a} and {b} "
                f"both map to physical slot {int(host[a])} (two requests would update one "
                "state)"
            )
        host.flags.writeable = False
        return table.detach().clone(), host

    # ------------------------------------------------------------------ properties

    @property
    def field_names(self) -> tuple[str, ...]:
        """Names of the buffered metadata fields."""
        return tuple(s.name for s in self._buffered)

    @property
    def input_names(self) -> tuple[str, ...]:
        """Names of the static step inputs."""
        return tuple(self._inputs)

    @property
    def static(self) -> Mapping[str, object]:
        """Host-side metadata values fixed at capture."""
        return dict(self._static)

    @property
    def refreshed_bucket(self) -> Bucket | None:
        """The bucket ``(B, T)`` whose rows the buffers hold completely: the bucket of the
        last :meth:`refresh` or :meth:`pad_all` (``None`` before the first, after a write
        that failed, or once :meth:`poison_` overwrote its rows). Only that bucket's graph
        may be replayed: any other reads rows another step left behind
        (:class:`~hybridmeta.graphs.GraphRunner` refuses it)."""
        return self._held

    def key(self, bucket: int | Bucket) -> Bucket:
        """``(B, T)`` of a bucket; a bare ``B`` is ``(B, max_draft)``."""
        if isinstance(bucket, tuple):
            rows, cols = bucket
            return (int(rows), int(cols))
        return (int(bucket), self.max_draft)

    def draft_columns(self, step: ForwardMetadata) -> int:
        """Draft columns ``t`` of a step (its column-count field; 1 without one)."""
        if self._col_field is None:
            return 1
        t = getattr(step, self._col_field)
        assert isinstance(t, int)
        return t

    def rows_of(self, name: str, bucket: int | Bucket) -> int:
        """Rows of ``name``'s view for ``bucket``: ``B``, ``B + 1`` or ``B * T`` (per token)."""
        rows, cols = self.key(bucket)
        ispec = self._inputs.get(name)
        if ispec is not None:
            return rows * cols if ispec.rows == TOKENS else rows
        spec = next(s for s in self._buffered if s.name == name)
        assert spec.rows is not None
        return spec.rows.of(rows)

    # ------------------------------------------------------------------ the step path

    def refresh(
        self,
        step: ForwardMetadata,
        bucket: int | Bucket,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> Mamba2Metadata:
        """Write one step's live rows and the pad in place; return bucket-sized metadata.

        Parameters
        ----------
        step : ForwardMetadata
            The step's live rows (``bs`` of them, ``t`` draft columns), on this buffer's
            device, index dtype ``index_dtype``; an instance of ``metadata_class`` when that
            is a class derived from ``Mamba2Metadata``. Translated slot fields
            (``Role.WORKING_SLOT``) hold virtual ids when a slot table was given.
        bucket : int or (int, int)
            Captured shape ``(B, T)``, ``bs <= B <= max_bs`` and ``t <= T <= max_draft``
            (a bare ``B``: ``T = max_draft``). Columns ``[t:T)`` of live rows are padded
            like pad rows (pad values of the declarations and the inputs; offsets give each
            live row ``T`` tokens).
        inputs : mapping of str to torch.Tensor, optional
            Live rows of the declared static inputs (every one required if any are declared;
            per-token inputs have ``bs * t`` rows).

        Returns
        -------
        Mamba2Metadata
            Decode (or target-verify, or ``metadata_class``) metadata whose tensors are
            views of exactly ``B`` (``B + 1``) rows and ``T`` columns of the static buffers.

        Raises
        ------
        ValueError
            Naming the field and the rule, before anything is written. The slot rules
            (ranges, a pad id in a live row's working slot, duplicate physical working
            slots, a flagged row without a track slot, two flagged rows saving into one
            slot, a save onto a working slot) are checked always on CPU buffers and in
            debug mode on a GPU (a device read); the other declared value rules
            (:func:`hybridmeta.core.check_values`: offsets; the step class's
            ``__validate_debug__``: a commit's draft columns) and NaN inputs in debug
            mode only.

        A field governed by a ``Role.SUBSUMED_FLAG`` that the step sets while its flag is
        off (``has_mamba_track_mask=False`` beside a track mask) is padded, as the eager
        ops ignore it: the graph, captured with the flag on, would act on its rows.
        """
        key = self.key(bucket)
        live_inputs = inputs if inputs is not None else {}
        bs, t, present = self._validate(step, key, live_inputs)
        self._held = None  # until every row of the bucket is written
        self._write_live(step, bs, t, key, live_inputs, present)
        md = self._build(key)
        self._held = key
        return md

    def pad_all(self, bucket: int | Bucket) -> Mamba2Metadata:
        """Fill rows ``[0:B)`` with padding (capture and warm-up: kernels do nothing)."""
        key = self.key(bucket)
        self._check_bucket(key, 1, 1)
        plan = self._plan(0, key[1], key, (False,) * len(self._optional))
        self._held = None
        for group in plan.groups if plan.merged is None else (plan.merged,):
            torch._foreach_copy_(group.dsts, group.pads)
        md = self._build(key)
        self._held = key
        return md

    def views(self, bucket: int | Bucket) -> dict[str, torch.Tensor]:
        """Views of exactly the bucket's rows of the static inputs (what a step reads)."""
        key = self.key(bucket)
        self._check_bucket(key, 1, 1)
        return dict(self._bucket_views(key)[1])

    def poison_(self, start: int, fill: Callable[[str, torch.Tensor], None]) -> None:
        """Testing aid: let ``fill(name, tail)`` overwrite rows past ``start`` of each buffer.

        ``tail`` is rows ``[start:)`` of a ``BATCH`` buffer (all ``max_draft`` columns of a
        field with columns), ``[start + 1:)`` of a ``BATCH + 1`` buffer and
        ``[start * max_draft:)`` of a per-token input. Used by tests that poison everything
        past the refreshed prefix (NaN, other requests' slots) and check that nothing
        captured reads it; ``start = 0`` poisons every buffer but row 0 of a ``BATCH + 1``
        buffer (``query_start_loc[0]``, always 0: every refresh and pad writes it). To
        compare every byte, use :meth:`snapshot`.
        """
        if not 0 <= start <= self.max_bs:
            raise ValueError(f"StaticBuffers.poison_: start must be in [0, {self.max_bs}]")
        if self._held is not None and start < self._held[0]:
            self._held = None  # the rows of the bucket last written are overwritten
        for name, buf in self._buffers.items():
            off = self.rows_of(name, (start, self.max_draft))
            fill(name, buf[off:])

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Testing aid: a copy of every static buffer, whole (every row and column, past
        any bucket too), by name. Writes nothing (unlike :meth:`poison_`, it keeps
        :attr:`refreshed_bucket`); compare two snapshots to show a refusal wrote nothing."""
        return {name: buf.clone() for name, buf in self._buffers.items()}

    # ------------------------------------------------------------------ internals

    def _check_bucket(self, key: Bucket, bs: int, t: int) -> None:
        rows, cols = key
        if not bs <= rows <= self.max_bs:
            raise _err(
                "bucket", f"must satisfy bs <= bucket <= max_bs ({bs} <= {rows} <= {self.max_bs})"
            )
        if not t <= cols <= self.max_draft:
            raise _err(
                "bucket",
                f"draft columns must satisfy {self._col_field or 'draft'} <= T <= max_draft "
                f"({t} <= {cols} <= {self.max_draft})",
            )

    def _validate(
        self, step: ForwardMetadata, key: Bucket, inputs: Mapping[str, torch.Tensor]
    ) -> tuple[int, int, tuple[bool, ...]]:
        """``(bs, t, present)`` of a step that passes every check (``present``: which
        optional buffered fields it sets); raises naming the field and the rule."""
        checked = self._step_check(step, *key)
        if checked is None:  # some structural rule is broken: the checks that name it
            checked = self._validate_step(step, key)
        bs, t, _ = checked
        if self._inputs or inputs:
            self._validate_inputs(inputs, bs, t)
        debug = is_debug()
        if (debug or self._host_values) and not self._slot_check(step, checked[2]):
            # Host-known values (CPU buffers) cost no sync to check; on a GPU, debug only.
            # The fast check failed: the one-by-one checks name the field, row and rule.
            self._validate_slots(step, checked[2])
        if debug:
            self._validate_values(step, t, inputs)
        return checked

    def _validate_step(
        self, step: ForwardMetadata, key: Bucket
    ) -> tuple[int, int, tuple[bool, ...]]:
        """The structural checks of a step, one by one (:meth:`_make_step_check` is the
        same rules in one generated expression, without the messages)."""
        if type(step) is not self._step_class:
            raise TypeError(
                f"StaticBuffers.refresh: step must be a {self._step_class.__qualname__}, got "
                f"{type(step).__qualname__}"
            )
        if isinstance(step, Mamba2Metadata) and step.num_prefills:
            raise _err(
                "num_prefills",
                f"is {step.num_prefills}; graphs capture decode and verify rows only",
            )
        bs = int(step.mamba_cache_indices.shape[0])
        if bs <= 0:
            raise _err("mamba_cache_indices", f"must have bs > 0 live rows, got {bs}")
        if bs > self.max_bs:
            raise _err("mamba_cache_indices", f"has bs={bs} rows, more than max_bs={self.max_bs}")
        t = self.draft_columns(step)
        self._check_bucket(key, bs, t)
        for name, captured in self._static_items:
            live = getattr(step, name)
            if live == captured or (name in self._subsumed and captured and not live):
                continue
            raise _err(
                name,
                f"is {live!r} but the graphs were captured with {captured!r}; host values are "
                "frozen at capture (use a StaticBuffers/runner built for this value)",
            )
        for name in self._unbuffered_names:
            if getattr(step, name) is not None:
                raise _err(
                    name,
                    "is set but is not a static buffer of this graph; a captured step would "
                    "silently ignore it",
                )
        for name in self._required_present:
            if getattr(step, name) is None:
                raise _err(
                    name,
                    "is None but the graphs were captured reading it; its pad cannot stand for "
                    "None (build buffers without it, optional_fields, for steps that omit it)",
                )
        # The core checked ndim, per-row lengths and one device for every field on
        # construction; what is left is this buffer's device and each field's exact dtype.
        dev = step.mamba_cache_indices.device
        if dev != self.device:
            raise _err(
                "mamba_cache_indices",
                f"must be on {self.device} (the static buffers' device), got {dev}",
            )
        for name, dtype in self._field_dtypes:
            tensor = getattr(step, name)
            if tensor is not None and tensor.dtype is not dtype:
                raise _err(
                    name, f"must have dtype {dtype} (the static buffer's), got {tensor.dtype}"
                )
        return bs, t, self._present(step)

    def _present(self, step: ForwardMetadata) -> tuple[bool, ...]:
        """Which optional buffered fields the step uses: set, and (for a field governed by
        a subsumed flag) with the step's flag on."""
        return tuple(
            getattr(step, n) is not None
            and (n not in self._gates or bool(getattr(step, self._gates[n])))
            for n in self._optional
        )

    def _make_step_check(
        self,
    ) -> Callable[[ForwardMetadata, int, int], tuple[int, int, tuple[bool, ...]] | None]:
        """Generate ``step_check(step, B, T)``: :meth:`_validate_step`'s rules for this
        buffer as straight-line code (host time per step is the budget), returning
        ``(bs, t, present)``, or ``None`` when a rule is broken (the caller then runs
        :meth:`_validate_step`, which names it). Read it with ``inspect.getsource``."""
        ns: dict[str, Any] = {"_Cls": self._step_class, "_dev": self.device}
        lines = [
            "def step_check(step, rows, cols):",
            "    if step.__class__ is not _Cls:",
            "        return None",
        ]
        if issubclass(self._step_class, Mamba2Metadata):
            lines += ["    if step.num_prefills:", "        return None"]
        lines += [
            "    v = step.mamba_cache_indices",
            "    bs = v.shape[0]",
            f"    if not 0 < bs <= rows <= {self.max_bs}:",
            "        return None",
        ]
        if self._col_field is None:
            lines.append("    t = 1")
        else:
            lines += [
                f"    t = step.{self._col_field}",
                "    if not isinstance(t, int):",
                "        return None",
            ]
        lines += [f"    if not t <= cols <= {self.max_draft}:", "        return None"]
        for i, (name, captured) in enumerate(self._static_items):
            ns[f"_c{i}"] = captured
            accept = f"_x == _c{i}"
            if name in self._subsumed and captured:
                accept += " or not _x"  # a captured True also serves a False step
            lines += [f"    _x = step.{name}", f"    if not ({accept}):", "        return None"]
        for name in self._unbuffered_names:
            lines += [f"    if step.{name} is not None:", "        return None"]
        for name in self._required_present:
            lines += [f"    if step.{name} is None:", "        return None"]
        lines += ["    if v.device != _dev:", "        return None"]
        for i, (name, dtype) in enumerate(self._field_dtypes):
            ns[f"_dt{i}"] = dtype
            lines += [
                f"    _x = step.{name}",
                f"    if _x is not None and _x.dtype is not _dt{i}:",
                "        return None",
            ]
        present = "".join(
            f"bool(step.{self._gates[n]}) and step.{n} is not None, "
            if n in self._gates
            else f"step.{n} is not None, "
            for n in self._optional
        )
        lines.append(f"    return bs, t, ({present})")
        return _compile(StaticBuffers, "step_check", lines, ns)

    def _validate_inputs(self, inputs: Mapping[str, torch.Tensor], bs: int, t: int) -> None:
        missing = set(self._inputs) - set(inputs)
        extra = set(inputs) - set(self._inputs)
        if missing or extra:
            raise _err(
                "inputs",
                f"must name exactly {sorted(self._inputs)}; missing "
                f"{sorted(missing)}, unknown {sorted(extra)}",
            )
        for name, tensor in inputs.items():
            if not isinstance(tensor, torch.Tensor):
                raise _err(f"input {name}", f"must be a torch.Tensor, got {type(tensor).__name__}")
            rows = self.rows_of(name, (bs, t))
            if tensor.dim() == 0:
                raise _err(
                    f"input {name}",
                    f"must have a leading row dimension ({rows} rows), got a 0-d tensor",
                )
            if tensor.shape[0] != rows:
                per = f"bs={bs}" if rows == bs else f"bs={bs} x t={t}"
                raise _err(f"input {name}", f"must have {rows} rows ({per}), got {tensor.shape[0]}")
            self._check_tensor(f"input {name}", tensor, self._buffers[name])

    def _check_tensor(self, name: str, t: torch.Tensor, buf: torch.Tensor) -> None:
        if t.dtype != buf.dtype:
            raise _err(name, f"must have dtype {buf.dtype} (the static buffer's), got {t.dtype}")
        if t.device != buf.device:
            raise _err(
                name, f"must be on {buf.device} (the static buffer's device), got {t.device}"
            )
        if t.shape[1:] != buf.shape[1:]:
            raise _err(
                name, f"must have trailing shape {tuple(buf.shape[1:])}, got {tuple(t.shape[1:])}"
            )

    def _slot_roles(
        self,
    ) -> tuple[FieldSpec | None, FieldSpec | None, FieldSpec | None, tuple[FieldSpec, ...]]:
        """The buffered working-slot, track-slot and track-mask fields (at most one of each
        per class, the core's rule) and every other slot field, from the declarations."""
        by_role = {s.role: s for s in self._buffered}
        others = tuple(
            s for s in self._buffered if s.role.is_slot and s.role is not Role.WORKING_SLOT
            and s.role is not Role.TRACK_SLOT
        )  # fmt: skip
        return (
            by_role.get(Role.WORKING_SLOT),
            by_role.get(Role.TRACK_SLOT),
            by_role.get(Role.TRACK_MASK),
            others,
        )

    def _make_slot_check(
        self, list_rows: int = _LIST_ROWS
    ) -> Callable[[ForwardMetadata, tuple[bool, ...]], bool]:
        """Generate ``slot_check(step, present) -> bool``: the slot rules of a live step on
        host copies of its ids (CPU tensors; a device read, debug mode only, on a GPU), as
        straight-line code from the declarations (no loop over fields): on Python lists up
        to ``list_rows`` rows, past them on numpy arrays (no loop over rows; one sort
        bounds the ids and finds a repeat). ``False`` when a rule is broken;
        :meth:`_validate_slots` then names it. The rules:

        * the working slot of every row (every row of a step is live) is a slot in
          ``[0, num_slots)`` other than its field's pad; with a slot table, a virtual slot
          in ``[0, len(slot_table))`` (the table has no pad entry);
        * every other slot field holds its pad or a slot in ``[0, num_slots)``;
        * a row flagged in the track mask has a track slot (not the pad);
        * the physical working slots and the flagged rows' track slots are all distinct:
          no two rows update one state, no two flagged rows save into one slot, and no save
          lands on a row's working slot (it would overwrite that row's live state).

        Read it with ``inspect.getsource``."""
        work, track, mask, others = self._slot_roles()
        if work is None or work.optional:  # the row count's field: always set
            raise AssertionError("StaticBuffers: the working slot field must be required")
        n = self.num_slots
        table = self._table_host
        # Ids viewed as unsigned: a negative id becomes huge, so one max bounds both ends.
        unsigned = np.uint64 if self.index_dtype == torch.int64 else np.uint32
        ns: dict[str, Any] = {
            "_np": np, "_nz": np.count_nonzero, "_table": table, "_U": unsigned,
            "_table_list": table.tolist() if table is not None else None,
        }  # fmt: skip

        def fetch(spec: FieldSpec, var: str, conv: str, indent: str) -> list[str]:
            # A field's ids; None when an optional field is unused (present[i] false).
            if spec.optional:
                i = self._optional.index(spec.name)
                return [f"{indent}{var} = step.{spec.name}{conv} if present[{i}] else None"]
            return [f"{indent}{var} = step.{spec.name}{conv}"]

        def body(lists: bool, ind: str) -> list[str]:
            """The rules on Python lists (few rows: each numpy call costs more than a
            short list) or on numpy arrays (no loop over rows). ``_a`` collects the ids
            that must be distinct slots in [0, n) with no pad among them: every physical
            working slot, then every flagged row's track slot."""
            conv = ".tolist()" if lists else ".numpy()" if self._host_values else ".cpu().numpy()"

            def fail_if(cond: str, at: str) -> list[str]:
                return [f"{at}if {cond}:", f"{at}    return False"]

            def has(var: str, value: int) -> str:
                return f"{value} in {var}" if lists else f"_nz({var} == {value})"

            def allowed(var: str, spec: FieldSpec, at: str) -> list[str]:
                # {pad} | [0, n): one bound check when that set is an interval [lo, n)
                pad = _pad_of(spec)
                if -1 <= pad < n:
                    lo = min(pad, 0)
                    if lists:
                        return fail_if(f"min({var}) < {lo} or max({var}) >= {n}", at)
                    shifted = f"({var} + {-lo})" if lo else var
                    return fail_if(f"{shifted}.view(_U).max() >= {n - lo}", at)
                if lists:
                    return fail_if(f"any(x != {pad} and not 0 <= x < {n} for x in {var})", at)
                return fail_if(f"_nz(({var} != {pad}) & (({var} < 0) | ({var} >= {n})))", at)

            out = fetch(work, "_w", conv, ind)
            if table is not None:
                # virtual ids in [0, len(table)); the table's entries are slots, none a pad
                v = table.shape[0]
                if lists:
                    out += fail_if(f"min(_w) < 0 or max(_w) >= {v}", ind)
                    out.append(f"{ind}_a = [_table_list[x] for x in _w]")
                else:
                    out += fail_if(f"_w.view(_U).max() >= {v}", ind)
                    out.append(f"{ind}_a = _table[_w]")
            else:
                out.append(f"{ind}_a = _w")
                if 0 <= _pad_of(work) < n:  # a pad inside the pool: not a live row's slot
                    out += fail_if(has("_w", _pad_of(work)), ind)
            for i, spec in enumerate(others):
                out += fetch(spec, f"_o{i}", conv, ind)
                out.append(f"{ind}if _o{i} is not None:")
                out += allowed(f"_o{i}", spec, ind + "    ")
            if track is not None:
                out += fetch(track, "_t", conv, ind)
                out.append(f"{ind}if _t is not None:")
                out += allowed("_t", track, ind + "    ")
                if mask is not None:
                    at = ind + "        "
                    out += fetch(mask, "_m", conv, ind + "    ")
                    out.append(f"{ind}    if _m is not None:")
                    if lists:
                        out.append(f"{at}_tr = [x for x, k in zip(_t, _m) if k]")
                    else:
                        out.append(f"{at}_tr = _t[_m]")
                    if 0 <= _pad_of(track) < n:
                        out += fail_if(has("_tr", _pad_of(track)), at)
                    out.append(
                        f"{at}_a = _a + _tr" if lists else f"{at}_a = _np.concatenate((_a, _tr))"
                    )
            if lists:
                out.append(
                    f"{ind}return min(_a) >= 0 and max(_a) < {n} and len(set(_a)) == len(_a)"
                )
            else:
                out += [
                    f"{ind}_a = _np.sort(_a)",  # a copy: never reorder the step's own ids
                    f"{ind}return not (_a[0] < 0 or _a[-1] >= {n} or _nz(_a[1:] == _a[:-1]))",
                ]
            return out

        lines = [
            "def slot_check(step, present):",
            f"    if step.{work.name}.shape[0] <= {list_rows}:",
            *body(True, "        "),
            *body(False, "    "),
        ]
        return _compile(StaticBuffers, "slot_check", lines, ns)

    def _validate_slots(self, step: ForwardMetadata, present: tuple[bool, ...]) -> None:
        """The rules of :meth:`_make_slot_check`, one by one, naming the field, the row and
        the value. Reads values: host data, or debug mode. Runs only when the fast check
        failed, so it must raise."""
        work, track, mask, others = self._slot_roles()
        used = dict(zip(self._optional, present, strict=True))

        def ids(spec: FieldSpec | None) -> npt.NDArray[Any] | None:
            if spec is None or not used.get(spec.name, True):
                return None
            return np.asarray(getattr(step, spec.name).detach().cpu())

        n = self.num_slots
        phys = None
        table = self._table_host
        through = " (physical, through the slot table)" if table is not None else ""
        w = ids(work)
        if work is not None and w is not None:
            pad = _pad_of(work)
            if table is not None:
                bad = np.flatnonzero((w < 0) | (w >= table.shape[0]))
                if bad.shape[0]:
                    r = int(bad[0])
                    what = f"the pad {pad} in a live row" if w[r] == pad else "a value"
                    raise _err(
                        work.name,
                        f"row {r} holds {int(w[r])} ({what}): not a virtual slot (slot-table "
                        f"index) in [0, {table.shape[0]}); every row of a step is live and "
                        "the slot table has no pad entry",
                    )
                phys = table[w]
            else:
                bad = np.flatnonzero((w < 0) | (w >= n) | (w == pad))
                if bad.shape[0]:
                    r = int(bad[0])
                    if w[r] == pad:
                        rule = (
                            f"holds the pad {pad} in live row {r}: every row of a step is "
                            f"live and needs a slot in [0, {n}) (pad rows are the buffers' "
                            "business)"
                        )
                    else:
                        rule = f"row {r} holds {int(w[r])}: not a slot in [0, {n})"
                    raise _err(work.name, rule)
                phys = w
        for spec in (*others, *((track,) if track is not None else ())):
            v = ids(spec)
            if v is None:
                continue
            pad = _pad_of(spec)
            bad = np.flatnonzero((v != pad) & ((v < 0) | (v >= n)))
            if bad.shape[0]:
                r = int(bad[0])
                raise _err(
                    spec.name, f"row {r} holds {int(v[r])}: not {pad} (pad) nor a slot in [0, {n})"
                )
        if phys is not None:
            assert work is not None
            order = np.argsort(phys, kind="stable")
            same = np.flatnonzero(phys[order][1:] == phys[order][:-1])
            if same.shape[0]:
                a, b = int(order[same[0]]), int(order[same[0] + 1])
                raise _err(
                    work.name,
                    f"rows {a} and {b} hold the same slot {int(phys[a])}{through}: two rows "
                    "would update one state",
                )
        t = ids(track)
        m = ids(mask)
        if track is not None and mask is not None and t is not None and m is not None:
            pad = _pad_of(track)
            flagged: list[int] = np.flatnonzero(m).tolist()
            for row in flagged:  # the failure path only: name the first broken rule
                if t[row] == pad:
                    raise _err(
                        track.name,
                        f"row {row} is {pad} (none) but {mask.name} flags it: a flagged "
                        "row needs a track slot",
                    )
            seen: dict[int, int] = {}
            for row in flagged:
                s = int(t[row])
                if s in seen:
                    raise _err(
                        track.name,
                        f"rows {seen[s]} and {row}, both flagged in {mask.name}, save into "
                        f"the same track slot {s}",
                    )
                seen[s] = row
            if phys is not None:
                assert work is not None
                owner = {int(s): i for i, s in enumerate(phys)}
                for row in flagged:
                    j = owner.get(int(t[row]))
                    if j is not None:
                        whose = (
                            f"its own {work.name}" if j == row else f"the {work.name} of row {j}"
                        )
                        raise _err(
                            track.name,
                            f"row {row} (flagged in {mask.name}) saves into slot "
                            f"{int(t[row])}, {whose}{through}: the save would overwrite live "
                            "state",
                        )
        raise AssertionError(  # the generated check and these rules disagree: a bug here
            f"StaticBuffers.refresh: the slot check refused the step but no rule names why "
            f"(step {step!r})"
        )

    def _validate_values(
        self, step: ForwardMetadata, t: int, inputs: Mapping[str, torch.Tensor]
    ) -> None:
        # Debug mode only: every check here reads device values (a sync on a GPU). They run
        # on physical ids (the slot table applied to a copy), before anything is written.
        physical: dict[str, torch.Tensor] = {}
        if self._slot_table is not None:
            for name in self._translated:
                physical[name] = self._slot_table.index_select(0, getattr(step, name))
        check_values(
            step,
            num_slots=self.num_slots,
            live=True,
            physical=True,
            overrides=physical,
            where=f"StaticBuffers.refresh: {type(step).__qualname__}",
        )
        # The step classes' own debug rules (a commit's draft columns in [-1, T), ...):
        # every class's __validate_debug__ hook, bases first, as on construction.
        for hook in _hooks(self._step_class, "__validate_debug__"):
            try:
                hook(step)
            except ValueError as e:
                raise ValueError(f"StaticBuffers.refresh: {e}") from e
        qsl = step.query_start_loc
        if bool(((qsl[1:] - qsl[:-1]) != t).any()):
            raise _err("query_start_loc", f"must give every row {t} token(s)")
        for name, tensor in inputs.items():
            if tensor.is_floating_point() and bool(tensor.isnan().any()):
                raise _err(f"input {name}", "holds NaN in a live row")

    def _write_live(
        self,
        step: ForwardMetadata,
        bs: int,
        t: int,
        key: Bucket,
        inputs: Mapping[str, torch.Tensor],
        present: tuple[bool, ...],
    ) -> None:
        plan = self._plan(bs, t, key, present)
        merged = plan.merged
        if merged is not None:
            # Every dtype in one dispatcher call (one launch): host time per step is the
            # budget here. A source whose last dimension is strided has no byte view; then
            # the copies go per dtype below (nothing was written yet).
            try:
                srcs = [
                    (inputs[n] if is_input else getattr(step, n)).view(_BYTE)
                    if shape is None
                    else (inputs[n] if is_input else getattr(step, n)).reshape(shape).view(_BYTE)
                    for is_input, n, shape in merged.live
                ]
            except RuntimeError:
                pass
            else:
                torch._foreach_copy_(merged.dsts, srcs + merged.pads)
                self._translate(step, plan)
                return
        for group in plan.groups:
            srcs = []
            for is_input, n, shape in group.live:
                src = inputs[n] if is_input else getattr(step, n)
                srcs.append(src if shape is None else src.reshape(shape))
            if len(group.dsts) == 1:  # one copy: no list to build and check
                group.dsts[0].copy_(srcs[0] if srcs else group.pads[0])
                continue
            # One dispatcher call per dtype: host time per step is the budget here.
            torch._foreach_copy_(group.dsts, srcs + group.pads)
        self._translate(step, plan)

    def _translate(self, step: ForwardMetadata, plan: _Plan) -> None:
        table = self._slot_table
        for name, dst in plan.translate:
            assert table is not None  # a plan translates only when a table was given
            # The single virtual -> physical translation point: a lookup in the 1-D table.
            # int64 ids through a gather: 2-3 us less host time per call than index_select's
            # out= path on the H200 host (7.6 against 9.2-11.4 us, probe_host_ops.py).
            # int32 ids, which not every torch's gather takes as an index: index_select.
            if dst.dtype is torch.int64:
                torch.gather(table, 0, getattr(step, name), out=dst)
            else:
                torch.index_select(table, 0, getattr(step, name), out=dst)

    def _plan(self, bs: int, t: int, key: Bucket, present: tuple[bool, ...]) -> _Plan:
        plan = self._plans.get((bs, t, *key, present))
        return plan if plan is not None else self._make_plan(bs, t, key, present)

    def _make_plan(self, bs: int, t: int, key: Bucket, present: tuple[bool, ...]) -> _Plan:
        """Views to write for ``bs`` live rows of ``t`` columns in bucket ``(B, T)``
        (``bs == 0``: all padding)."""
        B, T = key
        plan = _Plan()
        groups: dict[torch.dtype, _CopyGroup] = {}
        pads: list[tuple[torch.Tensor, torch.Tensor]] = []
        is_present = dict(zip(self._optional, present, strict=True))

        def live(entry: _Live, dst: torch.Tensor) -> None:
            group = groups.setdefault(dst.dtype, _CopyGroup())
            group.dsts.append(dst)
            group.live.append(entry)

        for spec in self._buffered:
            buf = self._buffers[spec.name]
            n = bs if is_present.get(spec.name, True) else 0
            if spec.pad is not None and spec.pad.cumulative:
                # Offsets: live rows copied when their layout is the bucket's (t == T), else
                # the table row of n live rows of T tokens (padded columns are tokens too).
                table = self._cumulative_table(spec.name, T)
                start = n + 1 if n and t == T else 0
                if start:
                    live((False, spec.name, None), buf[:start])
                pads.append((buf[start : B + 1], table[n, start : B + 1]))
                continue
            pad = self._pad_src[spec.name]
            if spec.cols is not None:
                if n:
                    live((False, spec.name, None), buf[:n, :t])
                    pads.append((buf[:n, t:T], pad[:n, t:T]))
                pads.append((buf[n:B, :T], pad[n:B, :T]))
                continue
            if n and spec.role.translated and self._slot_table is not None:
                plan.translate.append((spec.name, buf[:n]))
            elif n:
                live((False, spec.name, None), buf[:n])
            pads.append((buf[n:B], pad[n:B]))
        for name, ispec in self._inputs.items():
            buf, pad = self._buffers[name], self._pad_src[name]
            if ispec.rows != TOKENS or t == T:
                n, rows = self.rows_of(name, (bs, T)), self.rows_of(name, key)
                if n:
                    live((True, name, None), buf[:n])
                pads.append((buf[n:rows], pad[n:rows]))
                continue
            # Per-token input with padded columns: the bucket's [B, T] grid of tokens.
            grid = buf[: B * T].view(B, T, *ispec.shape)
            pgrid = pad[: B * T].view(B, T, *ispec.shape)
            if bs:
                live((True, name, (bs, t, *ispec.shape)), grid[:bs, :t])
                pads.append((grid[:bs, t:], pgrid[:bs, t:]))
            pads.append((grid[bs:], pgrid[bs:]))
        for dst, src in pads:
            if dst.numel():
                group = groups.setdefault(dst.dtype, _CopyGroup())
                group.dsts.append(dst)
                group.pads.append(src)
        plan.groups = list(groups.values())  # a group exists only once it has a destination
        if len(plan.groups) > 1:
            plan.merged = _merge(plan.groups)
        if len(self._plans) >= _MAX_PLANS:  # a runner needs max_bs * max_draft * 4 at most
            self._plans.clear()
        self._plans[(bs, t, *key, present)] = plan
        return plan

    def _bucket_views(self, key: Bucket) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # The same view objects every step: a graph captured on them sees the same storage.
        cached = self._views.get(key)
        if cached is None:
            cols = key[1]
            fields = {}
            for s in self._buffered:
                view = self._buffers[s.name][: self.rows_of(s.name, key)]
                fields[s.name] = view[:, :cols] if s.cols is not None else view
            ins = {n: self._buffers[n][: self.rows_of(n, key)] for n in self._inputs}
            cached = (fields, ins)
            self._views[key] = cached
        return cached

    def _build(self, key: Bucket) -> Mamba2Metadata:
        # The metadata of a bucket holds the same views and the same frozen host values at
        # every step, so the object built (through evolve_from) at capture is returned again.
        # Debug mode rebuilds it, so the core's value checks see the refreshed rows.
        cached = self._metadata.get(key)
        if cached is not None and not is_debug():
            return cached
        md = self._construct(key)
        self._metadata[key] = md
        return md

    def _construct(self, bucket: int | Bucket) -> Mamba2Metadata:
        key = self.key(bucket)
        fields, _ = self._bucket_views(key)
        kwargs: dict[str, Any] = dict(self._static)
        if self._col_field is not None:
            kwargs[self._col_field] = key[1]
        own = [set(self._added_names(cls)) for cls in self._chain[1:]]
        derived = set().union(*own) if own else set()
        kwargs.update({n: v for n, v in fields.items() if n not in derived})
        fwd = self.source(**kwargs)
        md = prepare_target_verify(fwd) if self.is_target_verify else prepare_decode(fwd)
        for cls, names in zip(self._chain[1:], own, strict=True):
            md = cls.evolve_from(md, **{n: fields[n] for n in names})  # type: ignore[attr-defined]
        return md

    @staticmethod
    def _added_names(cls: type) -> tuple[str, ...]:
        source = source_of(cls)
        assert source is not None
        have = {s.name for s in fields_of(source)}
        return tuple(s.name for s in fields_of(cls) if s.name not in have)


def _usable_device(device: torch.device | str) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"StaticBuffers: device {d} was asked for but CUDA is not available on this "
            "machine (use device='cpu': graphs are then emulated)"
        )
    return canonical_device(d)


def bucket_for(buckets: Sequence[int], bs: int) -> int:
    """Smallest bucket ``>= bs`` (``buckets`` sorted ascending)."""
    i = bisect.bisect_left(buckets, bs)
    if i == len(buckets):
        raise ValueError(f"bucket_for: bs={bs} exceeds the largest captured bucket {buckets[-1]}")
    return buckets[i]
