"""Argument checks shared by the public kernel ops.

Every check reads shapes, dtypes, strides and devices only (no device values), so it is
safe on the hot path and under CUDA-graph capture. Errors name the op, the argument and
the rule that failed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence

import torch

from hybridmeta.core import conventions_of
from hybridmeta.kernels._errors import MAX_ROWS, fault_keys
from hybridmeta.model import Mamba2Metadata

FLOAT_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
STATE_DTYPES: frozenset[torch.dtype] = FLOAT_DTYPES
INDEX_DTYPES: frozenset[torch.dtype] = frozenset({torch.int32, torch.int64})
MASK_DTYPES: frozenset[torch.dtype] = frozenset({torch.bool})
#: ``dt_limit`` of an op call that gives none: every value passes through.
NO_DT_LIMIT: tuple[float, float] = (float("-inf"), float("inf"))


def _names(dtypes: Collection[torch.dtype]) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    shape: Sequence[int | None],
    dtypes: Collection[torch.dtype],
    device: torch.device,
    dims: str,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given shape (``None`` = any), dtype and device.

    ``dims`` names the axes for the message, e.g. ``"[bs, nheads, headdim]"``. A 1-D
    argument (slot ids, masks, per-head or per-channel parameters) must be contiguous: the
    kernels take no stride for them and read entry ``i`` at offset ``i``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor {dims}, got {type(t).__name__}")
    if t.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(t.shape, shape, strict=True)
    ):
        want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{op}: `{name}` must have shape {dims} = {want_s}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: `{name}` must have dtype {_names(dtypes)}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{op}: `{name}` must be on the state's device {device}, got {t.device}")
    if t.dim() == 1 and not t.is_contiguous():
        raise ValueError(f"{op}: `{name}` must be contiguous, got strides {list(t.stride())}")
    return t


def check_pool(op: str, name: str, t: object, *, dims: str) -> torch.Tensor:
    """Check a state pool: a tensor with one axis per name in ``dims``, of a state dtype,
    whose elements do not alias (:func:`check_no_alias`).

    The pool is checked first; its device is the one every other argument must share.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims.count(",") + 1:
        raise ValueError(f"{op}: `{name}` must have shape {dims}, got {list(t.shape)}")
    if t.dtype not in STATE_DTYPES:
        raise TypeError(f"{op}: `{name}` must have dtype {_names(STATE_DTYPES)}, got {t.dtype}")
    check_no_alias(op, name, t)
    return t


def check_slots(op: str, name: str, slots: int) -> None:
    """A pool's slot count must fit int32 (the kernels compare ids with it as an int32)."""
    if slots > PAD_MAX:
        raise ValueError(f"{op}: `{name}` has {slots} slots, more than 2**31 - 1")


def check_rows(op: str, bs: int) -> None:
    """An op's rows must fit the error record's row field (``2**27``)."""
    if bs >= MAX_ROWS:
        raise ValueError(f"{op}: bs={bs} rows is more than one call takes (< {MAX_ROWS})")


def check_optional(
    op: str,
    name: str,
    t: object,
    *,
    shape: Sequence[int | None],
    dtypes: Collection[torch.dtype],
    device: torch.device,
    dims: str,
) -> torch.Tensor | None:
    """:func:`check_tensor` for an argument that may be ``None``."""
    if t is None:
        return None
    return check_tensor(op, name, t, shape=shape, dtypes=dtypes, device=device, dims=dims)


def check_dt_limit(op: str, dt_limit: object) -> tuple[float, float]:
    """``dt_limit``: ``None`` (no clamp) or ``(lo, hi)``, two real numbers with a finite
    ``lo >= 0`` and ``lo <= hi`` (``hi`` may be ``inf``).

    A discretised ``dt`` is a softplus, never negative, so a negative ``lo`` is a mistake
    (a sign or a log-space value); ``lo = inf`` would turn every decay into ``exp(-inf)``
    and every input into ``inf * x``: NaN in the pool.
    """
    if dt_limit is None:
        return NO_DT_LIMIT
    if (
        not isinstance(dt_limit, tuple | list)
        or len(dt_limit) != 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in dt_limit)
    ):
        raise ValueError(
            f"{op}: `dt_limit` must be None or a pair (lo, hi) of real numbers, got {dt_limit!r}"
        )
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if not math.isfinite(lo) or lo < 0:
        raise ValueError(
            f"{op}: `dt_limit` must have a finite lo >= 0 (a discretised dt is never negative), "
            f"got ({lo}, {hi})"
        )
    if not lo <= hi:  # also refuses NaN
        raise ValueError(f"{op}: `dt_limit` must have lo <= hi (and no NaN), got ({lo}, {hi})")
    return lo, hi


def check_slot_contiguous(op: str, name: str, t: torch.Tensor, lead: int) -> None:
    """Require the dims after the first ``lead`` ones to be densely packed (one block per slot)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:]), strict=True):
        if size != 1 and stride != expected:
            raise ValueError(
                f"{op}: `{name}` must be contiguous within each slot (dims {lead}.. densely "
                f"packed), got shape {list(t.shape)} strides {list(t.stride())}"
            )
        expected *= size


#: The least and greatest pad id (the kernels take it as an int32).
PAD_MIN, PAD_MAX = -(1 << 31), (1 << 31) - 1


def check_pad_slot_id(op: str, pad: object) -> int:
    """``pad_slot_id``: a plain ``int`` in int32 (``-1`` ours and sglang's, ``0`` vLLM's)."""
    if type(pad) is not int or not PAD_MIN <= pad <= PAD_MAX:
        raise ValueError(
            f"{op}: `pad_slot_id` must be an int in int32 (-1, or a reserved null slot such as "
            f"vLLM's 0), got {pad!r}"
        )
    return pad


def _non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    # Insertion sort by stride with plain comparisons (Dynamo cannot trace sorted() over
    # symbolic strides; comparisons just guard).
    dims: list[tuple[int, int]] = []
    for n, st in zip(shape, strides, strict=True):
        if n > 1:
            i = len(dims)
            while i > 0 and dims[i - 1][0] > st:
                i -= 1
            dims.insert(i, (st, n))
    extent = 1  # elements spanned by the dims so far, plus one
    for st, n in dims:
        if st < extent:
            return False
        extent += (n - 1) * st
    return True


#: Whether no two elements of a tensor of this shape and strides share memory: dims of size
#: 1 do not matter; sorted by stride, each dim's stride must reach past the extent of the
#: dims below it (so a stride-0 / expanded dim of size > 1, or a slot stride smaller than
#: one slot's extent, overlaps). Cached (a pool's layout repeats every call; torch.Size and
#: stride tuples hash as they are); under Dynamo the function itself is traced.
non_overlapping = functools.lru_cache(maxsize=1024)(_non_overlapping)


def check_no_alias(op: str, name: str, t: torch.Tensor) -> None:
    """Refuse state storage whose elements alias (two slots, or two cells, one address)."""
    if not non_overlapping(t.shape, t.stride()):
        raise ValueError(
            f"{op}: `{name}` must not alias itself (no stride-0 / expanded dim, each slot's "
            f"stride at least one slot's extent), got shape {list(t.shape)} strides "
            f"{list(t.stride())}; pass a real buffer (e.g. `.contiguous()`)"
        )


def check_index_range(
    op: str, name: str, idx: torch.Tensor, slots: int, pad_slot_id: int = -1
) -> None:
    """Debug-mode check (syncs): every index is the pad id or a slot in ``[0, slots)``."""
    bad = (idx != pad_slot_id) & ((idx < 0) | (idx >= slots))
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{op}: `{name}` values must be {pad_slot_id} (pad) or in [0, {slots}); row "
            f"{first} holds {int(idx[first])}"
        )


def slot_kinds(
    idx: torch.Tensor, slots: int, pad_slot_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pad, valid)`` ``[bs]`` masks: ``idx == pad_slot_id``; ``0 <= idx < slots`` and not
    the pad id. A row that is neither holds an invalid id."""
    pad = idx == pad_slot_id
    valid = (idx >= 0) & (idx < slots) & ~pad
    return pad, valid


def prefill_slot_faults(
    slots: int, pad: int, idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill's working slots judged (no sync): ``(keys, read, write)``, the per-row
    fault keys and the rows that may read an initial state / write their final state (a
    valid slot: not the pad id, not invalid)."""
    pad_rows, ok = slot_kinds(idx, slots, pad)
    return fault_keys([(~pad_rows & ~ok, 0, idx)]), ok, ok


def check_disjoint_writes(
    op: str,
    writes: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
    reads: tuple[str, torch.Tensor, torch.Tensor] | None,
) -> None:
    """No two rows write one slot; no row writes a slot another reads (reads the ids: host
    tensors, or debug mode on a device, where it syncs).

    ``writes`` and ``reads`` are ``(name, slots, active)`` triples, one slot per row;
    ``active`` marks the rows that really write (read) their slot (valid ids only: pad rows,
    "none" entries and unflagged rows are not active). A row may write the slot it reads
    itself (an in-place update). A clean step is judged by :func:`_collides` (this runs on
    every call with host ids); the loop below only words the refusal.
    """
    if not _collides(writes, reads):
        return
    owner: dict[int, tuple[str, int]] = {}
    for name, slots, active in writes:
        for row, (slot, on) in enumerate(zip(slots.tolist(), active.tolist(), strict=True)):
            if not on:
                continue
            if slot in owner:
                prev_name, prev_row = owner[slot]
                raise ValueError(
                    f"{op}: slot {slot} is written twice: by `{prev_name}` of row {prev_row} "
                    f"and `{name}` of row {row}; written slots must be distinct"
                )
            owner[slot] = (name, row)
    if reads is None:
        return
    rname, rslots, ractive = reads
    for row, (slot, on) in enumerate(zip(rslots.tolist(), ractive.tolist(), strict=True)):
        if on and slot in owner and owner[slot][1] != row:
            wname, wrow = owner[slot]
            raise ValueError(
                f"{op}: slot {slot} is read by `{rname}` of row {row} and written by "
                f"`{wname}` of row {wrow}; a row may not write a slot another row reads"
            )


def _collides(
    writes: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
    reads: tuple[str, torch.Tensor, torch.Tensor] | None,
) -> bool:
    """Whether :func:`check_disjoint_writes` would refuse: a slot written twice, or a slot
    one row reads and another writes. One ``tolist`` per tensor and C-level comprehensions
    (a few times faster than the wording loop, and no torch op's fixed cost per call)."""
    slots: list[int] = []
    rows: list[int] = []
    for _, s, a in writes:
        sl = s.tolist()
        on = [r for r, x in enumerate(a.tolist()) if x]
        slots += [sl[r] for r in on]
        rows += on
    owner = dict(zip(slots, rows, strict=True))
    if len(owner) != len(slots):
        return True
    if reads is None or not owner:
        return False
    sl = reads[1].tolist()
    return any(owner.get(sl[r], r) != r for r, x in enumerate(reads[2].tolist()) if x)


def pad_slot_of(md: object) -> int:
    """The pad id of the metadata's slot fields: its declared null slot
    (:func:`hybridmeta.core.conventions_of`)."""
    return conventions_of(md).null_slot


def decode_rows(op: str, md: Mamba2Metadata, bs: int) -> slice:
    """The decode rows of ``md`` (after its prefill rows), checked against ``bs`` inputs."""
    if md.is_target_verify:
        raise ValueError(
            f"{op}: the metadata is a target-verify forward (draft_token_num="
            f"{md.draft_token_num}); verify rows take the verify ops"
        )
    if md.num_decodes != bs:
        raise ValueError(
            f"{op}: the metadata has {md.num_decodes} decode rows but the inputs have "
            f"bs={bs}; pass the decode rows' inputs (their live [bs] views)"
        )
    return md.decode_rows()


def verify_rows(op: str, md: Mamba2Metadata, x: object) -> None:
    """Check that ``md`` is a target-verify forward whose rows and draft columns are ``x``'s.

    ``x`` is the op's ``[bs, T, ...]`` input: ``bs`` must be the metadata's rows (a verify
    forward has no prefill rows) and ``T`` its ``draft_token_num``.
    """
    if not md.is_target_verify:
        raise ValueError(
            f"{op}: the metadata is not a target-verify forward (is_target_verify is False); "
            "build it with prepare_target_verify, or run decode rows through the decode ops"
        )
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise TypeError(
            f"{op}: `x` must be a [bs, T, ...] torch.Tensor (T = draft_token_num), got "
            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else list(x.shape)}"
        )
    bs, T = x.shape[:2]
    if md.num_decodes != bs:
        raise ValueError(
            f"{op}: the metadata has {md.num_decodes} verify rows but `x` has bs={bs}; pass "
            "the rows' inputs (their live [bs, T] views)"
        )
    if md.draft_token_num != T:
        raise ValueError(
            f"{op}: the metadata has draft_token_num={md.draft_token_num} but `x` has T={T} "
            "draft columns"
        )
