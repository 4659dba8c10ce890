"""The kernels' device-side fault record: ids found invalid on the device, read at sync points.

A slot id (or a draft column, a live count, a parent) that is neither the declared pad id
nor a valid value is only known on the device, so no op can refuse it before launching
without a device-to-host sync. Instead each op handles such a row inside the kernel (both
implementations): the row writes nothing, reads nothing outside the tensors, gets a NaN
("poisoned") output, and the fault is recorded in one small int64 tensor per device, the
**error record**. The caller reads it where it syncs anyway (the reference runtime when it
reads the sampled tokens, the harness when it compares) with :func:`check_errors` or
:func:`raise_if_faulted`; the hot path pays nothing but per-row scalar compares.

The record is ``int64[4]``: ``[owner, key, pad, bound]``.

* ``owner``: ``0`` while clean, else the tag (:data:`OPS` index + 1) of the first op that
  faulted. Taken by an atomic compare-and-swap from ``0``: the first faulting op in stream
  order owns the record until it is reset; faults of other ops are dropped.
* ``key``: the least fault of the owner's launches, packed so that one atomic ``min`` orders
  faults by row, then field, then value (deterministic whatever order the programs run
  in): ``row << 36 | field << 32 | (clamp(value, int32) + 2**31)``. ``INT64_MAX`` while clean.
* ``pad``, ``bound``: the pad id and the field's bound (pool slots, or ``T``) of the first
  faulting launch, for the message.

Values outside int32 are reported saturated (``>= 2147483647`` / ``<= -2147483648``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import triton
import triton.language as tl

__all__ = [
    "OPS",
    "KernelFault",
    "SlotIndexError",
    "check_errors",
    "error_record",
    "raise_if_faulted",
    "reset_errors",
]

#: ``key`` of a clean record (and of a row without a fault).
NO_FAULT = (1 << 63) - 1
_ROW_SHIFT = 36
_FIELD_SHIFT = 32
_VALUE_OFFSET = 1 << 31
_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
#: Rows a key can name (27 bits).
MAX_ROWS = 1 << 27

#: How a field's value is judged, for the message: a slot id (the pad id or ``[0, bound)``),
#: a draft column (``-1`` or ``[0, bound)``), a live count (``[0, bound]``), a parent (``-1``
#: or an earlier column), a token position (``[0, bound)``).
SLOT, COLUMN, COUNT, PARENT, POSITION = "slot", "column", "count", "parent", "position"

#: Every op that records faults: ``(name, ((field, kind), ...))``; the tag of ``OPS[i]`` is
#: ``i + 1`` and a field's id is its index.
OPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("ssm_state_update", (("state_indices", SLOT), ("dst_indices", SLOT), ("track_indices", SLOT))),
    ("causal_conv1d_update", (("cache_indices", SLOT),)),
    ("track_save", (("src_indices", SLOT), ("track_indices", SLOT))),
    ("ssm_verify_update", (("state_indices", SLOT), ("num_draft", COUNT), ("parent", PARENT))),
    ("conv_verify_update", (("cache_indices", SLOT), ("num_draft", COUNT), ("parent", PARENT))),
    (
        "spec_commit",
        (
            ("state_indices", SLOT),
            ("accepted_index", COLUMN),
            ("track_indices", SLOT),
            ("track_token", COLUMN),
        ),
    ),
    ("causal_conv1d_prefill", (("prefill_slots", SLOT),)),
    ("ssd_chunked_scan", (("prefill_slots", SLOT),)),
    ("extend_track_save", (("mamba_cache_indices", SLOT), ("mamba_track_indices", SLOT))),
    ("kv_cache_write", (("slots", SLOT), ("positions", POSITION))),
    ("decode_attention", (("slots", SLOT), ("positions", POSITION))),
)

#: Op tags, by name (``tag == OPS index + 1``).
TAG: dict[str, int] = {name: i + 1 for i, (name, _) in enumerate(OPS)}


def field_id(op: str, field: str) -> int:
    """The id of ``field`` among ``op``'s fields (its index in :data:`OPS`)."""
    return [f for f, _ in OPS[TAG[op] - 1][1]].index(field)


class SlotIndexError(IndexError, ValueError):
    """An op met an id that is neither the pad id nor valid (found on the device).

    Attributes ``op``, ``field``, ``row`` and ``value`` name the first fault; the row wrote
    nothing and its output is NaN.
    """

    def __init__(self, message: str, *, op: str, field: str, row: int, value: int) -> None:
        super().__init__(message)
        self.op = op
        self.field = field
        self.row = row
        self.value = value


@attrs.frozen
class KernelFault:
    """The first fault of an error record (:func:`check_errors`).

    Attributes
    ----------
    op, field : str
        The op and its argument that held the value.
    row : int
        The row of the op call (its index along the argument's first dim).
    value : int
        The value held (saturated to int32 when ``saturated``).
    pad, bound : int
        The pad id and the field's bound (pool slots, or ``T``) of the faulting launch.
    kind : str
        How the field is judged (slot id, draft column, live count, parent).
    saturated : bool
        The value lies outside int32; ``value`` is the int32 bound it passed.
    """

    op: str
    field: str
    row: int
    value: int
    pad: int
    bound: int
    kind: str
    saturated: bool = False

    def rule(self) -> str:
        """What the field's values must be."""
        return {
            SLOT: f"{self.pad} (pad) or in [0, {self.bound})",
            COLUMN: f"-1 or a draft column in [0, T={self.bound})",
            COUNT: f"in [0, T={self.bound}]",
            PARENT: "-1 (a root) or an earlier column (tokens topologically ordered)",
            POSITION: f"in [0, {self.bound})",
        }[self.kind]

    def message(self, where: str = "device") -> str:
        """The error message; ``where`` says how the fault was found: ``"device"`` (from the
        error record: the row wrote nothing, its output is NaN) or ``"host"`` (checked
        before launching: nothing was written)."""
        shown = str(self.value)
        if self.saturated:
            shown = f"{'>=' if self.value > 0 else '<='} {self.value}"
        tail = (
            "found on the device (the first fault since the error record was last read): "
            "the row wrote nothing and its output is NaN"
            if where == "device"
            else "nothing was written"
        )
        return f"{self.op}: `{self.field}` values must be {self.rule()}; row {self.row} holds {shown} ({tail})"

    def error(self, where: str = "device") -> SlotIndexError:
        return SlotIndexError(
            self.message(where), op=self.op, field=self.field, row=self.row, value=self.value
        )


# --------------------------------------------------------------------------- the record

# (device, record) pairs, a list rather than a dict: a record made on first use inside a
# compiled region is stored by Dynamo as a side effect, and a dict mutation there would
# make Dynamo refuse every later mapping-proxy read of the region (a class's __dict__).
_RECORDS: list[tuple[torch.device, torch.Tensor]] = []


def _lookup(d: torch.device) -> torch.Tensor | None:
    for dev, rec in _RECORDS:
        if dev == d:
            return rec
    return None


def _clean(device: torch.device) -> torch.Tensor:
    return torch.tensor([0, NO_FAULT, 0, 0], dtype=torch.int64, device=device)


def _canonical(device: torch.device | str) -> torch.device:
    d = torch.device(device)
    index: int | None = d.index  # None for a bare "cuda" (torch's stubs say int)
    if d.type == "cuda" and index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def error_record(device: torch.device | str) -> torch.Tensor:
    """The error record of ``device`` (``int64[4]``), created clean on first use.

    Ops write it from the device; read it with :func:`check_errors`. Create it before a
    CUDA-graph capture (any op call does; so does this function): a capture may not
    allocate it.
    """
    d = _canonical(device)
    rec = _lookup(d)
    if rec is None:
        if d.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"hybridmeta.kernels: the error record of {d} does not exist yet and a CUDA "
                "graph capture cannot allocate it; call hybridmeta.kernels.error_record("
                f"{str(d)!r}) (or run the step once eagerly, as a warm-up does) before capturing"
            )
        if torch.compiler.is_compiling():
            # First use inside a compiled region: the record is made by the graph and
            # stored here as one of Dynamo's side effects once the graph has run (a real
            # tensor, written by the ops of that same graph).
            rec = _clean(d)
        else:
            from torch.utils._python_dispatch import _disable_current_modes

            # Outside any dispatch mode (a graph emulation would record the fill and
            # replay it).
            with _disable_current_modes():
                rec = _clean(d)
        _RECORDS.append((d, rec))
    return rec


def record_for(t: torch.Tensor) -> torch.Tensor:
    """The record an op on ``t`` (its pool) writes: the device's; under fake tensors a fresh
    fake one (shape propagation only: nothing is recorded)."""
    if type(t) is not torch.Tensor and not torch.compiler.is_compiling():
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return torch.empty(4, dtype=torch.int64, device=t.device)
    rec = _lookup(t.device)
    return rec if rec is not None else error_record(t.device)


def _decode(owner: int, key: int, pad: int, bound: int) -> KernelFault:
    name, fields = OPS[owner - 1]
    row = key >> _ROW_SHIFT
    fid = (key >> _FIELD_SHIFT) & 0xF
    value = (key & 0xFFFFFFFF) - _VALUE_OFFSET
    field, kind = fields[fid]
    return KernelFault(
        op=name, field=field, row=row, value=value, pad=pad, bound=bound, kind=kind,
        saturated=value in (_INT32_MIN, _INT32_MAX),
    )  # fmt: skip


def check_errors(
    device: torch.device | str | None = None,
    *,
    values: Sequence[int] | None = None,
    reset: bool = True,
) -> KernelFault | None:
    """Read the error record and reset it.

    Reading the record is a device-to-host read, a sync: call it where the caller syncs
    anyway. An engine that already copies something to the host each step can copy the
    record in the same transfer (``error_record(device)``, 4 int64 values, e.g. into page-
    locked memory with ``non_blocking=True``) and pass those ``values``: then nothing is
    read from the device (a fault resets it with a device-side write, no sync).

    Parameters
    ----------
    device
        The device whose record to read; ``None``: every device that has one (the first
        fault found is returned, each faulted record is reset). Required with ``values``.
    values
        The record's 4 values as copied by the caller (see above).
    reset
        Clear the record when it holds a fault (default).

    Returns
    -------
    KernelFault or None
        The first fault since the last reset, ``None`` if there was none.
    """
    if values is not None:
        if device is None:
            raise ValueError("check_errors: `values` needs the `device` they were read from")
        owner, key, pad, bound = (int(v) for v in values)
        if owner == 0 and key == NO_FAULT:
            return None
        if reset:
            reset_errors(device)
        return _decode(owner, key, pad, bound) if 0 < owner <= len(OPS) else None
    devices = [d for d, _ in _RECORDS] if device is None else [_canonical(device)]
    found: KernelFault | None = None
    for d in devices:
        rec = _lookup(d)
        if rec is None:
            continue
        owner, key, pad, bound = (int(v) for v in rec.tolist())
        if owner == 0 and key == NO_FAULT:
            continue
        if reset:
            rec.copy_(_clean(d))
        if found is None and 0 < owner <= len(OPS) and key != NO_FAULT:
            found = _decode(owner, key, pad, bound)
    return found


def raise_if_faulted(
    device: torch.device | str | None = None, *, values: Sequence[int] | None = None
) -> None:
    """:func:`check_errors`, raising :class:`SlotIndexError` (after resetting) on a fault."""
    fault = check_errors(device, values=values)
    if fault is not None:
        raise fault.error()


def reset_errors(device: torch.device | str | None = None) -> None:
    """Clear the error record of ``device`` (``None``: every device's); no sync."""
    for d in [d for d, _ in _RECORDS] if device is None else [_canonical(device)]:
        rec = _lookup(d)
        if rec is not None:
            rec.copy_(_clean(d))


# --------------------------------------------------------------------------- torch side


def fault_keys(
    row_field_values: list[tuple[torch.Tensor, int, torch.Tensor]],
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[bs]`` int64 keys: for each row the least ``(field, value)`` among the faults given
    as ``(bad [bs] bool, field id, values [bs])``, :data:`NO_FAULT` where the row has none.
    ``rows``: the row each entry reports (default: its index).
    """
    keys: torch.Tensor | None = None
    for bad, field, values in row_field_values:
        r = (
            torch.arange(bad.shape[0], device=bad.device, dtype=torch.int64)
            if rows is None
            else rows.to(torch.int64)
        )
        v = values.to(torch.int64).clamp(_INT32_MIN, _INT32_MAX) + _VALUE_OFFSET
        k = torch.where(bad, (r << _ROW_SHIFT) | (field << _FIELD_SHIFT) | v, NO_FAULT)
        keys = k if keys is None else torch.minimum(keys, k)
    assert keys is not None
    return keys


def _bound_of(field: torch.Tensor, bounds: int | tuple[int, ...]) -> torch.Tensor | int:
    if isinstance(bounds, int):
        return bounds
    b: torch.Tensor | int = bounds[-1]
    for f in range(len(bounds) - 2, -1, -1):
        b = torch.where(field == f, bounds[f], b)
    return b


def record_(
    rec: torch.Tensor, op: str, keys: torch.Tensor, pad: int, bounds: int | tuple[int, ...]
) -> None:
    """Fold ``keys`` (:func:`fault_keys`, any shape) into the record, on the device, no sync.

    The pure-torch twin of :func:`report`: the first faulting op owns the record; its
    faults are min-reduced. ``bounds``: the fields' bound (one for all, or one per field
    id) for the message.
    """
    if keys.numel() == 0:
        return
    tag = TAG[op]
    k = keys.min()
    owner = rec[0]
    hit = k != NO_FAULT
    take = hit & ((owner == 0) | (owner == tag))
    first = hit & (owner == 0)
    bound = _bound_of((k >> _FIELD_SHIFT) & 0xF, bounds)
    new = torch.stack(
        [
            torch.where(take, tag, owner),
            torch.where(take, torch.minimum(rec[1], k), rec[1]),
            torch.where(first, pad, rec[2]),
            torch.where(first, bound, rec[3]),
        ]
    )
    rec.copy_(new)


def least_fault(
    op: str, keys: torch.Tensor, pad: int, bounds: int | tuple[int, ...]
) -> KernelFault | None:
    """The least of ``keys`` decoded (reads them: CPU tensors, or debug mode)."""
    if keys.numel() == 0:
        return None
    k = int(keys.min())
    if k == NO_FAULT:
        return None
    fid = (k >> _FIELD_SHIFT) & 0xF
    bound = bounds if isinstance(bounds, int) else bounds[min(fid, len(bounds) - 1)]
    return _decode(TAG[op], k, pad, bound)


def host_check(op: str, keys: torch.Tensor, pad: int, bounds: int | tuple[int, ...]) -> None:
    """Raise :class:`SlotIndexError` for the least of ``keys`` (CPU tensors: no sync)."""
    fault = least_fault(op, keys, pad, bounds)
    if fault is not None:
        raise fault.error("host")


# --------------------------------------------------------------------------- Triton side


@triton.jit  # type: ignore[arg-type]  # a helper returning a block; the stub types kernels
def valid_slot(s: tl.tensor, pad: tl.tensor, n_slots: tl.tensor) -> tl.tensor:
    """``0 <= s < n_slots`` and ``s`` is not the pad id (``s`` int64): the range as one
    unsigned compare (a negative ``s`` is a huge unsigned one), fewer instructions on every
    kernel's hot path than two signed compares."""
    return (s.to(tl.uint64, bitcast=True) < n_slots.to(tl.uint64)) & (s != pad)


@triton.jit  # type: ignore[arg-type]  # a helper returning a value; the stub types kernels
def fault_key(row: tl.tensor, field: tl.tensor, value: tl.tensor) -> tl.tensor:
    """The packed key of a fault of row ``row`` (the record's format: row, field id, value
    biased to unsigned 32 bits), int64. Pure arithmetic, so a kernel can compute it early
    and report it later, after its loads and stores (:func:`report_key`)."""
    zero = tl.full([], 0, tl.int64)  # any int (a Python int or a tensor) to int64
    v = tl.minimum(tl.maximum(value + zero, -2147483648), 2147483647) + 2147483648
    return ((row + zero) << 36) | ((field + zero) << 32) | v


@triton.jit(noinline=True)
def report_key(
    err_ptr: tl.tensor,
    tag: tl.constexpr,
    key: tl.tensor,
    pad: tl.tensor,
    bound: tl.tensor,
) -> None:
    """Record the fault ``key`` (:func:`fault_key`) from a kernel: the first faulting op
    takes the record (compare-and-swap), its faults are min-reduced (one atomic ``min`` of
    the packed key). Called only on a fault (a branch around the call): a clean launch
    issues no atomic. Outlined so that the hot path's code keeps nothing of it but the
    branch. Where the call sits matters: it is a barrier the compiler does not move loads
    across, so a report before a row's loads serialises them behind the slot loads (4-15%
    of the SSM and conv updates' time on the H200); most kernels report after their stores
    (docs/kernels.md, "Pad ids, invalid ids and the error record")."""
    report_key_inline(err_ptr, tag, key, pad, bound)


@triton.jit
def report_key_inline(
    err_ptr: tl.tensor,
    tag: tl.constexpr,
    key: tl.tensor,
    pad: tl.tensor,
    bound: tl.tensor,
) -> None:
    """:func:`report_key` inlined into its caller (the same record, no call). The SSM verify
    reports this way: there the outlined call cost 3-10% of the bf16 kernel's time on the
    H200 and the inlined report nothing measurable (0.99-1.02x the unchecked kernel), while
    in the SSM row walk, the conv update and the conv verify the inlined form measured the
    same or slower than the call (docs/perf_notes.md, "Round 3, third GPU session")."""
    zero = tl.full([], 0, tl.int64)
    old = tl.atomic_cas(err_ptr, zero, zero + tag)
    if (old == 0) | (old == tag):
        tl.atomic_min(err_ptr + 1, key + zero)
        if old == 0:
            tl.store(err_ptr + 2, pad + zero)
            tl.store(err_ptr + 3, bound + zero)


@triton.jit
def report(
    err_ptr: tl.tensor,
    tag: tl.constexpr,
    row: tl.tensor,
    field: tl.tensor,
    value: tl.tensor,
    pad: tl.tensor,
    bound: tl.tensor,
) -> None:
    """Record a fault of row ``row`` (int64): :func:`report_key` of its :func:`fault_key`.
    Call it after the kernel's loads and stores (see :func:`report_key`)."""
    report_key(err_ptr, tag, fault_key(row, field, value), pad, bound)
