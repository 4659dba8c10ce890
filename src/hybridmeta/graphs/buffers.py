"""Static CUDA-graph buffers that only ever hand out the refreshed prefix.

A captured decode graph reads its metadata from buffers at fixed addresses. The buffers are
allocated once for ``max_bs`` rows; a step with ``bs`` live rows, replayed by the graph of
bucket ``B >= bs``, needs rows ``[0:bs)`` to hold the step's values and rows ``[bs:B)`` to
hold padding that makes the kernels do nothing. Rows ``[B:max_bs)`` must never be read.

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
(``cols``), which carry slot ids and which of those are translated (``Role``), which host
flag a captured value subsumes (``Role.SUBSUMED_FLAG``). A new per-row field of
``ForwardMetadata`` needs no edit here. Virtual-to-physical slot translation happens in
exactly one place, :meth:`StaticBuffers._write_live`, for the fields whose role is
translated (``Role.WORKING_SLOT``).

Checks before anything is written: structure always (shapes, dtypes, devices, host
values); slot ranges always when the step's values live on the host (CPU buffers: the
bound costs no sync), on a GPU in debug mode; every declared value rule
(:func:`hybridmeta.core.check_values`, on *physical* ids after translation) and NaN inputs
in debug mode.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

import attrs
import torch

from hybridmeta.core import BATCH, INDEX, TOKENS, Dim, FieldSpec, Role, check_values, fields_of
from hybridmeta.debug import is_debug
from hybridmeta.graphs.capture import canonical_device
from hybridmeta.model import ForwardMetadata, Mamba2Metadata, prepare_decode, prepare_target_verify

__all__ = [
    "InputSpec",
    "StaticBuffers",
    "bucket_for",
    "default_buckets",
]

#: Bound on cached refresh plans (one per bs, bucket and optional-field presence).
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
    rows : str
        ``BATCH`` (one row per request) or ``TOKENS`` (``draft_token_num`` per request).
    pad : int, float or bool
        Value written into padded rows (defined input for the pad rows' outputs).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Dim = BATCH
    pad: int | float | bool = 0

    def __attrs_post_init__(self) -> None:
        if self.rows not in (BATCH, TOKENS):
            raise ValueError(f"InputSpec.rows must be BATCH or TOKENS, got {self.rows!r}")


def _err(name: str, rule: str) -> ValueError:
    return ValueError(f"StaticBuffers.refresh: {name} {rule}")


class _CopyGroup:
    """One ``torch._foreach_copy_`` of a refresh: every destination of one dtype.

    ``dsts`` are fixed views of the static buffers: first the live rows of the fields named
    in ``live`` (``(is_input, name)``), in order, then the padded rows, whose sources
    ``pads`` are fixed views of constant pad tensors. Only the live sources change per step.
    """

    __slots__ = ("dsts", "live", "pads")

    def __init__(self) -> None:
        self.dsts: list[torch.Tensor] = []
        self.live: list[tuple[bool, str]] = []
        self.pads: list[torch.Tensor] = []


class _Plan:
    """Everything a refresh of ``bs`` rows into bucket ``B`` writes, as cached views."""

    __slots__ = ("groups", "translate")

    def __init__(self) -> None:
        self.groups: list[_CopyGroup] = []
        # (field, destination view) of the virtual -> physical translation.
        self.translate: list[tuple[str, torch.Tensor]] = []


class StaticBuffers:
    """Static metadata and input buffers of a decode CUDA-graph runner.

    Parameters
    ----------
    max_bs : int
        Largest batch (request rows) any captured graph serves. Buffers of ``BATCH``
        fields have ``max_bs`` rows, ``query_start_loc`` has ``max_bs + 1``, per-token
        inputs have ``max_bs * draft_token_num``.
    num_slots : int
        Size of the state pool: live slot ids must lie in ``[0, num_slots)``.
    device : torch.device or str
        Device of the buffers; live tensors must be on it.
    optional_fields : collection of str, optional
        Optional per-row ``ForwardMetadata`` fields to buffer (default: every one). A step
        that sets an optional per-row field not buffered here is refused, so no field is
        silently dropped; a buffered optional field that a step leaves ``None`` is padded
        over the whole bucket.
    static : mapping of str to object
        Values of the non-tensor ``ForwardMetadata`` fields fixed at capture (default: the
        declared defaults, and ``True`` for a ``Role.SUBSUMED_FLAG`` whose governed fields
        are all buffered). A step whose host values differ is refused: the graph would not
        do what the step asks; a subsumed flag captured ``True`` also serves ``False``.
    index_dtype : torch.dtype
        Dtype of the index buffers (live index tensors must match it exactly).
    inputs : mapping of str to InputSpec
        Static step inputs (hidden states, ...), refreshed and padded with the metadata.
    slot_table : torch.Tensor, optional
        ``[num_virtual]`` map from virtual slot ids (request-pool indices) to physical state
        slots. When given, the translated slot fields (``Role.WORKING_SLOT``) of a step
        hold virtual ids.
    """

    def __init__(
        self,
        *,
        max_bs: int,
        num_slots: int,
        device: torch.device | str,
        optional_fields: Collection[str] | None = None,
        static: Mapping[str, object] | None = None,
        index_dtype: torch.dtype = torch.int64,
        inputs: Mapping[str, InputSpec] | None = None,
        slot_table: torch.Tensor | None = None,
    ) -> None:
        if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs <= 0:
            raise ValueError(f"StaticBuffers: max_bs must be an int > 0, got {max_bs!r}")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"StaticBuffers: num_slots must be an int > 0, got {num_slots!r}")
        if index_dtype not in INDEX:
            raise ValueError(
                f"StaticBuffers: index_dtype must be int32 or int64, got {index_dtype}"
            )
        self.max_bs = max_bs
        self.num_slots = num_slots
        self.device = _usable_device(device)
        self.index_dtype = index_dtype

        specs = fields_of(ForwardMetadata)
        by_name = {s.name: s for s in specs}
        if optional_fields is None:
            optional_fields = tuple(s.name for s in specs if s.per_row and s.optional)
        for name in optional_fields:
            spec = by_name.get(name)
            if spec is None or not spec.per_row or not spec.optional:
                raise ValueError(
                    f"StaticBuffers: optional_fields entry {name!r} is not an optional per-row "
                    "field of ForwardMetadata"
                )
        self._buffered: tuple[FieldSpec, ...] = tuple(
            s for s in specs if s.per_row and (not s.optional or s.name in optional_fields)
        )
        self._static = self._static_values(specs, dict(static or {}), self._buffered)
        draft = self._static["draft_token_num"]
        if isinstance(draft, bool) or not isinstance(draft, int) or draft < 1:
            raise ValueError(
                f"StaticBuffers: static draft_token_num must be an int >= 1, got {draft!r}"
            )
        self.draft_token_num = draft
        self.is_target_verify = bool(self._static["is_target_verify"])
        self.max_tokens = max_bs * self.draft_token_num
        self._subsumed = frozenset(s.name for s in specs if s.role is Role.SUBSUMED_FLAG)
        self._translated = tuple(s.name for s in self._buffered if s.role.translated)

        self._inputs: dict[str, InputSpec] = dict(inputs or {})
        # rows_of(name, b) = b * scale + extra, for every buffer (read per step for inputs).
        self._row_rule: dict[str, tuple[int, int]] = {
            s.name: (1, s.rows.offset if s.rows is not None else 0) for s in self._buffered
        }
        for name, ispec in self._inputs.items():
            if name in self._row_rule:
                raise ValueError(f"StaticBuffers: input {name!r} collides with a metadata field")
            self._row_rule[name] = (1 if ispec.rows == BATCH else self.draft_token_num, 0)

        self._buffers: dict[str, torch.Tensor] = {}
        # Constant pad sources, so padding joins the refresh's foreach copies.
        self._pad_src: dict[str, torch.Tensor] = {}
        for spec in self._buffered:
            self._allocate_field(spec)
        for name, ispec in self._inputs.items():
            self._buffers[name] = torch.full(
                (self.rows_of(name, max_bs), *ispec.shape),
                ispec.pad,
                dtype=ispec.dtype,
                device=self.device,
            )
            self._pad_src[name] = self._buffers[name].clone()

        self._slot_table: torch.Tensor | None = None
        if slot_table is not None:
            self._slot_table = self._check_slot_table(slot_table)
        self._optional = tuple(s.name for s in self._buffered if s.optional)
        # Flat tuples for the per-step checks (host time per step matters).
        self._static_items = tuple(self._static.items())
        self._unbuffered_names = tuple(
            s.name for s in specs if s.is_tensor and s not in self._buffered
        )
        self._field_dtypes = tuple((s.name, self._buffers[s.name].dtype) for s in self._buffered)
        self._plans: dict[tuple[int, int, tuple[bool, ...]], _Plan] = {}
        self._views: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._metadata: dict[int, Mamba2Metadata] = {}

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _static_values(
        specs: tuple[FieldSpec, ...],
        given: dict[str, object],
        buffered: tuple[FieldSpec, ...],
    ) -> dict[str, object]:
        host = [s for s in specs if not s.is_tensor]
        unknown = set(given) - {s.name for s in host}
        if unknown:
            raise ValueError(
                f"StaticBuffers: static names non-tensor ForwardMetadata fields only; unknown "
                f"{sorted(unknown)} (known: {[s.name for s in host]})"
            )
        names = {b.name for b in buffered}
        out: dict[str, object] = {}
        for spec in host:
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
        rows = self.rows_of(spec.name, self.max_bs)
        trailing = self._trailing(spec)
        fill = 0 if spec.pad.value is None else spec.pad.value
        buf = torch.full((rows, *trailing), fill, dtype=dtype, device=self.device)
        self._buffers[spec.name] = buf
        if spec.pad.value is not None:
            self._pad_src[spec.name] = buf.clone()
        else:
            # Cumulative: row b of the table is a whole padded offsets array for bs = b
            # decode rows of draft_token_num tokens: table[b, i] = min(i, b) * draft.
            i = torch.arange(rows, dtype=dtype)
            table = torch.minimum(i[None, :], i[:, None]) * self.draft_token_num
            self._pad_src[spec.name] = table.to(self.device)

    def _trailing(self, spec: FieldSpec) -> tuple[int, ...]:
        if spec.cols is not None:
            cols = self._static[spec.cols]
            assert isinstance(cols, int)
            return (cols,)
        if spec.ndim is not None and spec.ndim > 1:
            raise ValueError(
                f"StaticBuffers: per-row field {spec.name!r} has {spec.ndim} dimensions but "
                "declares no cols: its buffer shape is unknown"
            )
        return ()

    def _check_slot_table(self, table: torch.Tensor) -> torch.Tensor:
        # Setup time, not the hot path: reading the table once is acceptable.
        if table.dim() != 1 or table.dtype != self.index_dtype or table.device != self.device:
            raise ValueError(
                f"StaticBuffers: slot_table must be 1-D {self.index_dtype} on {self.device}, got "
                f"{tuple(table.shape)} {table.dtype} on {table.device}"
            )
        if table.numel() and bool(((table < 0) | (table >= self.num_slots)).any()):
            raise ValueError(
                f"StaticBuffers: slot_table maps to slots outside [0, {self.num_slots})"
            )
        return table

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

    def rows_of(self, name: str, bucket: int) -> int:
        """Rows of ``name``'s view for ``bucket`` (``B``, ``B + 1`` or ``B * draft_token_num``)."""
        scale, extra = self._row_rule[name]
        return bucket * scale + extra

    # ------------------------------------------------------------------ the step path

    def refresh(
        self,
        step: ForwardMetadata,
        bucket: int,
        inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> Mamba2Metadata:
        """Write one step's live rows and the pad in place; return bucket-sized metadata.

        Parameters
        ----------
        step : ForwardMetadata
            The step's live rows (``bs`` of them), on this buffer's device, index dtype
            ``index_dtype``. Translated slot fields (``Role.WORKING_SLOT``) hold virtual ids
            when a slot table was given.
        bucket : int
            Captured batch size ``B``, ``bs <= B <= max_bs``.
        inputs : mapping of str to torch.Tensor, optional
            Live rows of the declared static inputs (every one required if any are declared).

        Returns
        -------
        Mamba2Metadata
            Decode (or target-verify) metadata whose tensors are views of exactly ``B``
            (``B + 1``) rows of the static buffers.

        Raises
        ------
        ValueError
            Naming the field and the rule, before anything is written. Slot ranges are
            checked always on CPU buffers and in debug mode on a GPU (a device read); the
            declared value rules (:func:`hybridmeta.core.check_values` on physical ids:
            duplicates, pad values in live rows, track slots that are working slots,
            offsets) and NaN inputs in debug mode only.
        """
        live_inputs = inputs if inputs is not None else {}
        bs = self._validate(step, bucket, live_inputs)
        self._write_live(step, bs, bucket, live_inputs)
        return self._build(bucket)

    def pad_all(self, bucket: int) -> Mamba2Metadata:
        """Fill rows ``[0:B)`` with padding (capture and warm-up: kernels do nothing)."""
        self._check_bucket(bucket, 1)
        plan = self._plan(0, bucket, (False,) * len(self._optional))
        for group in plan.groups:
            torch._foreach_copy_(group.dsts, group.pads)
        return self._build(bucket)

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        """Views of exactly the bucket's rows of the static inputs (what a step reads)."""
        self._check_bucket(bucket, 1)
        return dict(self._bucket_views(bucket)[1])

    def poison_(self, start: int, fill: Callable[[str, torch.Tensor], None]) -> None:
        """Testing aid: let ``fill(name, tail)`` overwrite rows past ``start`` of each buffer.

        ``tail`` is rows ``[start:)`` of a ``BATCH`` buffer, ``[start + 1:)`` of a
        ``BATCH + 1`` buffer and ``[start * draft_token_num:)`` of a per-token input. Used
        by tests that poison everything past the refreshed prefix (NaN, other requests'
        slots) and check that nothing captured reads it.
        """
        if not 0 <= start <= self.max_bs:
            raise ValueError(f"StaticBuffers.poison_: start must be in [0, {self.max_bs}]")
        for name, buf in self._buffers.items():
            off = self.rows_of(name, start)
            fill(name, buf[off:])

    # ------------------------------------------------------------------ internals

    def _check_bucket(self, bucket: int, bs: int) -> None:
        if not bs <= bucket <= self.max_bs:
            raise _err(
                "bucket", f"must satisfy bs <= bucket <= max_bs ({bs} <= {bucket} <= {self.max_bs})"
            )

    def _validate(
        self, step: ForwardMetadata, bucket: int, inputs: Mapping[str, torch.Tensor]
    ) -> int:
        if type(step) is not ForwardMetadata:
            raise TypeError(
                f"StaticBuffers.refresh: step must be a ForwardMetadata, got {type(step).__qualname__}"
            )
        bs = int(step.mamba_cache_indices.shape[0])
        if bs <= 0:
            raise _err("mamba_cache_indices", f"must have bs > 0 live rows, got {bs}")
        if bs > self.max_bs:
            raise _err("mamba_cache_indices", f"has bs={bs} rows, more than max_bs={self.max_bs}")
        self._check_bucket(bucket, bs)
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
                    "is set but is not a static buffer of this graph (it has no per-row rows); "
                    "a captured step would silently ignore it",
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
            t = getattr(step, name)
            if t is not None and t.dtype is not dtype:
                raise _err(name, f"must have dtype {dtype} (the static buffer's), got {t.dtype}")
        if self._inputs or inputs:
            self._validate_inputs(inputs, bs)
        debug = is_debug()
        if debug or self.device.type == "cpu":
            # Host-known values (CPU buffers) cost no sync to bound; on a GPU, debug only.
            self._validate_ranges(step)
        if debug:
            self._validate_values(step, inputs)
        return bs

    def _validate_inputs(self, inputs: Mapping[str, torch.Tensor], bs: int) -> None:
        missing = set(self._inputs) - set(inputs)
        extra = set(inputs) - set(self._inputs)
        if missing or extra:
            raise _err(
                "inputs",
                f"must name exactly {sorted(self._inputs)}; missing "
                f"{sorted(missing)}, unknown {sorted(extra)}",
            )
        for name, t in inputs.items():
            if not isinstance(t, torch.Tensor):
                raise _err(f"input {name}", f"must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() == 0:
                raise _err(
                    f"input {name}",
                    f"must have a leading row dimension ({self.rows_of(name, bs)} rows), got a "
                    "0-d tensor",
                )
            rows = self.rows_of(name, bs)
            if t.shape[0] != rows:
                raise _err(f"input {name}", f"must have {rows} rows (bs={bs}), got {t.shape[0]}")
            self._check_tensor(f"input {name}", t, self._buffers[name])

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

    def _validate_ranges(self, step: ForwardMetadata) -> None:
        """Every slot field in range: ``[0, num_slots)`` or the pad, translated fields in
        ``[0, len(slot_table))``. Reads values: host data, or debug mode."""
        for spec in self._buffered:
            t = getattr(step, spec.name)
            if t is None or not spec.role.is_slot:
                continue
            virtual = spec.role.translated and self._slot_table is not None
            bound = self._slot_table.shape[0] if self._slot_table is not None and virtual else self.num_slots
            bad = (t < -1) | (t >= bound)
            if bool(bad.any()):
                r = int(bad.nonzero()[0, 0])
                kind = "virtual slot (slot-table index)" if virtual else "slot"
                raise _err(
                    spec.name,
                    f"row {r} holds {int(t[r])}: not -1 (pad) nor a {kind} in [0, {bound})",
                )

    def _validate_values(self, step: ForwardMetadata, inputs: Mapping[str, torch.Tensor]) -> None:
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
            where="StaticBuffers.refresh: ForwardMetadata",
        )
        qsl = step.query_start_loc
        if bool(((qsl[1:] - qsl[:-1]) != self.draft_token_num).any()):
            raise _err(
                "query_start_loc", f"must give every row {self.draft_token_num} token(s)"
            )
        for name, t in inputs.items():
            if t.is_floating_point() and bool(t.isnan().any()):
                raise _err(f"input {name}", "holds NaN in a live row")

    def _write_live(
        self, step: ForwardMetadata, bs: int, bucket: int, inputs: Mapping[str, torch.Tensor]
    ) -> None:
        plan = self._plan(bs, bucket, tuple(getattr(step, n) is not None for n in self._optional))
        for group in plan.groups:
            srcs = [inputs[n] if is_input else getattr(step, n) for is_input, n in group.live]
            # One dispatcher call per dtype: host time per step is the budget here.
            torch._foreach_copy_(group.dsts, srcs + group.pads)
        table = self._slot_table
        for name, dst in plan.translate:
            assert table is not None  # a plan translates only when a table was given
            # The single virtual -> physical translation point.
            torch.index_select(table, 0, getattr(step, name), out=dst)

    def _plan(self, bs: int, bucket: int, present: tuple[bool, ...]) -> _Plan:
        plan = self._plans.get((bs, bucket, present))
        return plan if plan is not None else self._make_plan(bs, bucket, present)

    def _make_plan(self, bs: int, bucket: int, present: tuple[bool, ...]) -> _Plan:
        """Views to write for ``bs`` live rows in bucket ``B`` (``bs == 0``: all padding)."""
        plan = _Plan()
        groups: dict[torch.dtype, _CopyGroup] = {}
        pads: list[tuple[torch.Tensor, torch.Tensor]] = []
        is_present = dict(zip(self._optional, present, strict=True))

        def live(is_input: bool, name: str, dst: torch.Tensor) -> None:
            group = groups.setdefault(dst.dtype, _CopyGroup())
            group.dsts.append(dst)
            group.live.append((is_input, name))

        for spec in self._buffered:
            buf, pad = self._buffers[spec.name], self._pad_src[spec.name]
            n = bs if is_present.get(spec.name, True) else 0
            if spec.pad is not None and spec.pad.cumulative:  # offsets: the table row of bs
                start = n + 1 if n else 0
                if n:
                    live(False, spec.name, buf[:start])
                pads.append((buf[start : bucket + 1], pad[n, start : bucket + 1]))
                continue
            if n and spec.role.translated and self._slot_table is not None:
                plan.translate.append((spec.name, buf[:n]))
            elif n:
                live(False, spec.name, buf[:n])
            pads.append((buf[n:bucket], pad[n:bucket]))
        for name in self._inputs:
            buf, pad = self._buffers[name], self._pad_src[name]
            n, rows = self.rows_of(name, bs), self.rows_of(name, bucket)
            if n:
                live(True, name, buf[:n])
            pads.append((buf[n:rows], pad[n:rows]))
        for dst, src in pads:
            if dst.shape[0]:
                group = groups.setdefault(dst.dtype, _CopyGroup())
                group.dsts.append(dst)
                group.pads.append(src)
        plan.groups = list(groups.values())  # a group exists only once it has a destination
        if len(self._plans) >= _MAX_PLANS:  # a runner needs max_bs * 4 at most
            self._plans.clear()
        self._plans[(bs, bucket, present)] = plan
        return plan

    def _bucket_views(self, bucket: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # The same view objects every step: a graph captured on them sees the same storage.
        cached = self._views.get(bucket)
        if cached is None:
            fields = {
                s.name: self._buffers[s.name][: self.rows_of(s.name, bucket)]
                for s in self._buffered
            }
            ins = {n: self._buffers[n][: self.rows_of(n, bucket)] for n in self._inputs}
            cached = (fields, ins)
            self._views[bucket] = cached
        return cached

    def _build(self, bucket: int) -> Mamba2Metadata:
        # The metadata of a bucket holds the same views and the same frozen host values at
        # every step, so the object built (through evolve_from) at capture is returned again.
        # Debug mode rebuilds it, so the core's value checks see the refreshed rows.
        cached = self._metadata.get(bucket)
        if cached is not None and not is_debug():
            return cached
        md = self._construct(bucket)
        self._metadata[bucket] = md
        return md

    def _construct(self, bucket: int) -> Mamba2Metadata:
        fields, _ = self._bucket_views(bucket)
        kwargs: dict[str, Any] = dict(self._static)
        kwargs.update(fields)
        fwd = ForwardMetadata(**kwargs)
        if self.is_target_verify:
            return prepare_target_verify(fwd)
        return prepare_decode(fwd)


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
