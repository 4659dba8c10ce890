"""The mixed-batch planner: host description of a batch in, ``Mamba2Metadata`` out.

Everything is decided here, once per forward, from host data: no device tensor is read,
and the whole device-side plan (the forward's per-row fields and the nested
:class:`~hybridmeta.model.MixedMetadata`) is one packed, non-blocking host-to-device copy.
The metadata is built through the declared constructors only (``ForwardMetadata(...)``,
then ``Mamba2Metadata.evolve_from`` via :func:`~hybridmeta.model.prepare_decode` or
:meth:`MixedHostPlan.metadata`).

Two steps, so an engine can stage its own arrays (attention plans) in the same copy::

    hp = plan_host(extend_lens=..., prefix_lens=..., slots=..., num_decodes=..., ...)
    views = to_device_packed({**hp.arrays, **my_arrays}, device)
    md = hp.metadata(views)

or in one call: ``md = plan_mixed_batch(..., device=device)``.

The track policy (prefix cache of recurrent state), one for every implementation. A row
with ``track_mask`` set saves its conv + SSM state at the *last* absolute position ``b`` (a
positive multiple of ``track_interval``) reached by its new tokens,
``prefix < b <= prefix + extend``:

* ``b`` ends the row (every decode row that reaches a boundary; a prefill row whose
  boundary is its last token): ``mamba_track_mask`` is set for the row, and the layers
  save its final state after they ran (the decode track-save);
* ``b`` falls on the SSD scan's chunk grid, which is **global over the flattened prefill
  tokens**: the flattened position ``g`` after the boundary token satisfies
  ``g % chunk_size == 0`` and the state is the chunk state after chunk ``g // chunk_size - 1``
  (``ExtendTrackPlan.h_*``);
* otherwise the boundary is off the grid and is recomputed from the state entering its
  logical chunk plus fewer than ``chunk_size`` tokens (``ExtendTrackPlan.recompute_*``).

Rows that save record their track slot in ``mamba_track_indices``; the others hold the
null slot (``-1`` unless the forward's class declares another).

The rows come in the order the forward's source class declares (``forward_cls=``:
``ForwardMetadata``, prefill rows first, or an engine's extension declaring
``Conventions(row_order=RowOrder.DECODES_FIRST)``, vLLM's order); the prefill part of the
plan (``MixedMetadata``) covers the prefill rows and their tokens alone, whichever order.

A speculative target-verify forward (``draft_token_num`` tokens per row, every row a
verify row) is planned by :func:`plan_verify_host` / :func:`plan_verify` the same way: host
data in, one staged copy, ``prepare_target_verify`` out. Its track fields flag the rows
that *may* cross a boundary with their draft: the commit after the verify
(:func:`~hybridmeta.model.prepare_commit`) saves the boundary's state only when the
accepted tokens reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import numpy.typing as npt
import torch

from hybridmeta.core import Conventions, conventions_of, is_extension
from hybridmeta.model import (
    ChunkPlan,
    ConvWindows,
    ExtendTrackPlan,
    ForwardMetadata,
    Mamba2Metadata,
    MixedMetadata,
    prepare_decode,
    prepare_target_verify,
)
from hybridmeta.staging import pack_arrays

__all__ = [
    "BOOL_PARTS",
    "MixedHostPlan",
    "VerifyHostPlan",
    "plan_host",
    "plan_mixed_batch",
    "plan_verify",
    "plan_verify_host",
]

IntArray = npt.NDArray[np.int64]
IntLike = Sequence[int] | torch.Tensor | npt.NDArray[np.integer]
BoolLike = Sequence[bool] | torch.Tensor | npt.NDArray[np.bool_]

_V = TypeVar("_V")
_A = TypeVar("_A")

_P = "hybridmeta."  # key prefix of the planner's staged arrays
_PV = "hybridmeta.verify."  # ... of a verify plan's
_EMPTY: IntArray = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


# Keys of the staged arrays, in the order plan_host lays them out.
_ROW_NAMES = ("query_start_loc", "slots", "track_slots", "track_mask")
_PREFILL_NAMES = (
    "has_init", "chunk_start", "chunk_len", "chunk_row", "chunk_first", "token_chunk",
    "token_pos", "row_last_chunk", "phys_last_chunk", "token_conv", "final_conv", "h_rows",
    "h_chunk", "rc_rows", "rc_chunk", "rc_len", "mid_conv",
)  # fmt: skip
_ROW_KEYS = tuple(_P + n for n in _ROW_NAMES)
_VERIFY_KEYS = tuple(_PV + n for n in _ROW_NAMES)
_MIXED_KEYS = _ROW_KEYS + tuple(_P + n for n in _PREFILL_NAMES)
#: The 0/1 arrays of a plan whose metadata fields are bool masks. Staged as bool
#: (``to_device_packed(..., as_bool=BOOL_PARTS)``; ``plan_mixed_batch`` and ``plan_verify``
#: do), the metadata takes views of the staged buffer instead of one ``!= 0`` op per mask.
BOOL_PARTS: frozenset[str] = frozenset(
    {_P + "track_mask", _P + "has_init", _P + "chunk_first", _PV + "track_mask"}
)


@attrs.frozen(kw_only=True, eq=False)
class MixedHostPlan:
    """A forward planned on the host; :meth:`metadata` builds it from staged views.

    Attributes
    ----------
    arrays : dict of str to numpy array
        Every device-side array of the forward (int64), keyed ``"hybridmeta.<name>"``;
        stage them with :func:`~hybridmeta.staging.to_device_packed` (with
        ``as_bool=hybridmeta.planner.BOOL_PARTS`` the masks need no op on the device).
    num_prefills, num_decodes, num_prefill_tokens, chunk_size, conv_kernel : int
    track : bool
        Track fields are present (``track_mask`` was given).
    any_final_save : bool
        Some row saves its final state this step (``has_mamba_track_mask``).
    final_rows, h_rows, recompute_rows : tuple of int
        Which batch rows save which kind of boundary (host copies, for logs and tests).
    forward_cls : type
        The class :meth:`forward` builds (``ForwardMetadata``, or the engine's extension
        of it); its declared :class:`~hybridmeta.Conventions` laid out the rows.
    """

    arrays: dict[str, IntArray]
    num_prefills: int
    num_decodes: int
    num_prefill_tokens: int
    chunk_size: int
    conv_kernel: int
    track: bool
    any_final_save: bool
    final_rows: tuple[int, ...]
    h_rows: tuple[int, ...]
    recompute_rows: tuple[int, ...]
    forward_cls: type[ForwardMetadata] = ForwardMetadata

    def forward(self, views: Mapping[str, torch.Tensor], **engine: object) -> ForwardMetadata:
        """The forward's ``ForwardMetadata`` (a :attr:`forward_cls`) over staged ``views``
        of :attr:`arrays`.

        ``engine`` passes further fields of the engine's own (e.g.
        ``mamba_track_mask_indices``, or its extension's) through the same constructor.
        """
        return _forward(
            _staged(views, _ROW_KEYS), self.track, self.any_final_save, engine, self.forward_cls
        )

    def metadata(self, views: Mapping[str, torch.Tensor], **engine: object) -> Mamba2Metadata:
        """The forward's ``Mamba2Metadata`` over staged ``views`` of :attr:`arrays`."""
        v = _staged(views, _MIXED_KEYS if self.num_prefills else _ROW_KEYS)
        return _metadata(
            v, engine, self.num_prefills, self.num_decodes, self.num_prefill_tokens,
            self.chunk_size, self.conv_kernel, self.track, self.any_final_save,
            self.forward_cls,
        )  # fmt: skip


def _metadata(
    v: Sequence[torch.Tensor],
    engine: Mapping[str, object],
    num_prefills: int,
    num_decodes: int,
    num_prefill_tokens: int,
    chunk_size: int,
    conv_kernel: int,
    track: bool,
    any_final_save: bool,
    forward_cls: type[ForwardMetadata],
) -> Mamba2Metadata:
    """A mixed forward's ``Mamba2Metadata`` over the staged views of its plan's arrays, in
    :attr:`MixedHostPlan.arrays`' order (the masks int or bool)."""
    fwd = _forward(v[:4], track, any_final_save, engine, forward_cls)
    if not num_prefills:
        return prepare_decode(fwd)
    (has_init, chunk_start, chunk_len, chunk_row, chunk_first, token_chunk, token_pos,
     row_last_chunk, phys_last_chunk, token_conv, final_conv, h_rows, h_chunk, rc_rows,
     rc_chunk, rc_len, mid_conv) = v[4:]  # fmt: skip
    k1 = conv_kernel - 1
    mixed = MixedMetadata(
        has_initial_states=_as_bool(has_init),
        chunks=ChunkPlan(
            chunk_size=chunk_size,
            start=chunk_start,
            length=chunk_len,
            row=chunk_row,
            first=_as_bool(chunk_first),
            token_chunk=token_chunk,
            token_pos=token_pos,
            row_last_chunk=row_last_chunk,
            phys_last_chunk=phys_last_chunk,
        ),
        conv=ConvWindows(
            kernel_size=conv_kernel,
            token_windows=token_conv.view(num_prefill_tokens, conv_kernel),
            final_windows=final_conv.view(num_prefills, k1),
        ),
        track=ExtendTrackPlan(
            h_rows=h_rows,
            h_chunk=h_chunk,
            recompute_rows=rc_rows,
            recompute_chunk=rc_chunk,
            recompute_len=rc_len,
            windows=mid_conv.view(-1, k1),
        ),
    )
    return Mamba2Metadata.evolve_from(
        fwd,
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decodes=num_decodes,
        mixed=mixed,
    )


def _staged(
    views: Mapping[str, torch.Tensor],
    keys: tuple[str, ...],
    owner: str = "MixedHostPlan",
    prefix: str = _P,
) -> list[torch.Tensor]:
    """The staged views of ``keys`` (``prefix`` + name), in order."""
    if not isinstance(views, Mapping):
        raise TypeError(
            f"{owner}: views must be the mapping to_device_packed returns (names to staged "
            f"tensors), got {_type_name(views)}"
        )
    try:
        return [views[k] for k in keys]
    except KeyError:
        raise ValueError(
            f"{owner}: views must hold the staged {owner}.arrays (keys "
            f"'{prefix}<name>'); got {sorted(views)[:4]}"
        ) from None


def _as_bool(t: torch.Tensor) -> torch.Tensor:
    """A staged 0/1 array as a mask: the view itself when it was staged as bool."""
    return t if t.dtype == torch.bool else t != 0


def _forward(
    v: Sequence[torch.Tensor],
    track: bool,
    any_save: bool,
    fields: Mapping[str, object],
    forward_cls: type[ForwardMetadata],
) -> ForwardMetadata:
    """The ``ForwardMetadata`` of a staged plan (mixed or verify): offsets, slots, tracking
    (``v``: the staged ``query_start_loc``, ``slots``, ``track_slots``, ``track_mask``), as
    a ``forward_cls``: ``ForwardMetadata`` or the engine's extension of it."""
    qsl, slots, track_slots, track_mask = v
    # One constructor call for every plan and class, under the class's name: the
    # constructor mutation test (tests/test_constructor_mutations.py) finds it by that
    # name and drops each keyword in turn.
    ForwardMetadata = forward_cls
    return ForwardMetadata(
        query_start_loc=qsl,
        mamba_cache_indices=slots,
        mamba_track_indices=track_slots if track else None,
        mamba_track_mask=_as_bool(track_mask) if track else None,
        has_mamba_track_mask=any_save,
        **fields,  # type: ignore[arg-type]
    )


_OWNER = "plan_mixed_batch"  # the name planner errors give (plan_host shares the checks)
_I64_MAX = (1 << 63) - 1
_ROOT_CONVENTIONS = conventions_of(ForwardMetadata)
_ROOT_ORDER = (_ROOT_CONVENTIONS.decodes_first, _ROOT_CONVENTIONS.null_slot)


def _conventions(forward_cls: object, owner: str) -> Conventions:
    """The declared conventions of a planner's ``forward_cls``: ``ForwardMetadata`` or an
    engine's extension of it (``@metadata(extension=True)``), which the planner builds."""
    if forward_cls is ForwardMetadata:
        return _ROOT_CONVENTIONS
    if not (isinstance(forward_cls, type) and issubclass(forward_cls, ForwardMetadata)):
        raise TypeError(
            f"{owner}: forward_cls must be ForwardMetadata or an engine's extension of it "
            f"(@metadata(extension=True)), got {forward_cls!r}"
        )
    if not is_extension(forward_cls):  # an undecorated subclass is refused by name here
        raise TypeError(
            f"{owner}: forward_cls {forward_cls.__qualname__} is a derived metadata class "
            "(built only through evolve_from); the planner builds the forward's source "
            "metadata: pass ForwardMetadata or an extension of it (@metadata(extension=True))"
        )
    return conventions_of(forward_cls)


def _null_name(null: int) -> str:
    return f"the null slot {null} (Conventions.null_slot)"


def _type_name(value: object) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_int(name: str, value: object, owner: str = _OWNER) -> None:
    """Refuse anything but a plain ``int`` (``bool``, floats, numpy scalars, tensors)."""
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " (pass int(...))" if isinstance(value, (np.integer, torch.Tensor)) else ""
        raise TypeError(f"{owner}: {name} must be an int, got {_type_name(value)} {value!r}{hint}")


def _device(device: object, owner: str) -> torch.device:
    """A planner's ``device`` argument (a ``torch.device`` or its name) as a device."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"{owner}: device must be a torch.device or a str, got {_type_name(device)} "
            f"{device!r}"
        )
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{owner}: device {device!r} is not a device name ({e})") from None


def _check_host(name: str, value: torch.Tensor, owner: str = _OWNER) -> None:
    if value.device.type != "cpu":
        raise ValueError(
            f"{owner}: {name} must be host data (a sequence or a CPU tensor); "
            f"got a tensor on {value.device}: reading it would sync the stream"
        )


def _not_one_row_each(
    name: str, value: object, arr: npt.NDArray[Any] | None, what: str, owner: str
) -> Exception:
    """The error for a per-row argument that is no 1-D sequence (``arr``: what numpy made
    of it; ``None``: numpy refused it, a ragged sequence)."""
    if arr is None:
        return ValueError(
            f"{owner}: {name} must be a flat (1-D) sequence of {what}, one per row; got a "
            "nested or ragged sequence"
        )
    if arr.ndim == 0:
        return TypeError(
            f"{owner}: {name} must be a 1-D sequence of {what} (one per row), a numpy array "
            f"or a CPU tensor; got {_type_name(value)}"
        )
    return ValueError(
        f"{owner}: {name} must be 1-D (one entry per row), got shape {tuple(arr.shape)}"
    )


def _host_ints(name: str, value: IntLike, owner: str = _OWNER) -> IntArray:
    if isinstance(value, torch.Tensor):
        _check_host(name, value, owner)
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{owner}: {name} must hold integers, got {value.dtype}")
        if value.ndim != 1:
            raise ValueError(
                f"{owner}: {name} must be 1-D (one entry per row), got shape {tuple(value.shape)}"
            )
        arr: npt.NDArray[Any] = value.detach().numpy()
        listed = False
    else:
        try:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        except (ValueError, TypeError):  # ragged: numpy refuses to build it
            raise _not_one_row_each(name, value, None, "ints", owner) from None
        if arr.ndim != 1:
            raise _not_one_row_each(name, value, arr, "ints", owner)
        listed = isinstance(value, (list, tuple))
    # dtype.kind: signed integer 'i'; np.issubdtype is ~2 us a call
    if arr.dtype.kind != "i" and arr.size:
        _check_int_values(name, arr, value, owner)
    # A list or tuple was just converted: the array is ours. Anything else may share the
    # caller's memory, and the plan keeps what it returns: a copy.
    return arr.astype(np.int64, copy=not listed)


def _check_int_values(name: str, arr: npt.NDArray[Any], value: object, owner: str) -> None:
    """An array not of a signed integer dtype holds integers that fit int64, or our
    error: numpy makes Python ints past int64 unsigned, float or object arrays."""
    kind = arr.dtype.kind
    if kind == "u":
        big = np.flatnonzero(arr > _I64_MAX)
        if big.shape[0]:
            r = int(big[0])
            raise ValueError(f"{owner}: {name}[{r}] = {arr[r]} does not fit int64")
        return
    if kind == "O" or (kind == "f" and isinstance(value, (list, tuple))):
        items = arr.tolist() if kind == "O" else list(value)  # type: ignore[call-overload]
        for r, v in enumerate(items):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                if kind == "O":
                    raise ValueError(
                        f"{owner}: {name} must hold integers, got {name}[{r}] = {v!r} "
                        f"({_type_name(v)})"
                    )
                break  # a float: the dtype's message
            if not -_I64_MAX - 1 <= int(v) <= _I64_MAX:
                raise ValueError(f"{owner}: {name}[{r}] = {v} does not fit int64")
        else:
            if kind == "O":
                return  # Python ints, every one within int64
    got = "strings, dtype" if kind in "US" else "dtype"
    raise ValueError(f"{owner}: {name} must hold integers, got {got} {arr.dtype}")


def _host_bools(name: str, value: BoolLike, owner: str = _OWNER) -> npt.NDArray[np.bool_]:
    if isinstance(value, torch.Tensor):
        _check_host(name, value, owner)
        if value.dtype != torch.bool:
            raise ValueError(f"{owner}: {name} must be bool, got {value.dtype}")
        if value.ndim != 1:
            raise ValueError(
                f"{owner}: {name} must be 1-D (one entry per row), got shape {tuple(value.shape)}"
            )
        return value.detach().numpy().copy()
    try:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    except (ValueError, TypeError):  # ragged: numpy refuses to build it
        raise _not_one_row_each(name, value, None, "bools", owner) from None
    if arr.ndim != 1:
        raise _not_one_row_each(name, value, arr, "bools", owner)
    if arr.size and arr.dtype != np.bool_:
        raise ValueError(f"{owner}: {name} must be bool, got dtype {arr.dtype}")
    return arr.astype(np.bool_, copy=not isinstance(value, (list, tuple)))


def _check_config(
    chunk_size: int, track_interval: int | None, conv_kernel: int, num_decodes: int
) -> None:
    if (
        type(chunk_size) is not int
        or type(conv_kernel) is not int
        or type(num_decodes) is not int
        or (track_interval is not None and type(track_interval) is not int)
    ):
        # Some argument is not a plain int (int subclasses other than bool pass).
        _check_int("num_decodes", num_decodes)
        _check_int("chunk_size", chunk_size)
        _check_int("conv_kernel", conv_kernel)
        if track_interval is not None:
            _check_int("track_interval", track_interval)
    if chunk_size <= 0:
        raise ValueError(f"plan_mixed_batch: chunk_size must be > 0, got {chunk_size}")
    if conv_kernel < 2:
        raise ValueError(f"plan_mixed_batch: conv_kernel must be >= 2, got {conv_kernel}")
    if track_interval is not None and (track_interval <= 0 or track_interval % chunk_size):
        raise ValueError(
            f"plan_mixed_batch: track_interval ({track_interval}) must be a positive multiple "
            f"of the SSM chunk_size ({chunk_size}); a cache chunk that is not a whole number of "
            "state-grid chunks cannot index the grid (docs/background.md, index-grid confusion)"
        )


# A bound under which no index of a plan can overflow int64: values and sizes below 2**31,
# fewer than 2**20 rows and a conv width below 2**10 keep every index the plan computes
# (a row's end position, the token offsets, the chunk grid below T + 2 * chunk_size, the
# flat conv windows below (T + n + K) * K) under 2**62. Past it, _check_positions decides.
_FAST_VALUE, _FAST_ROWS, _FAST_KERNEL = 1 << 31, 1 << 20, 1 << 10


def _check_positions(
    ext: IntArray,
    pre: IntArray,
    num_decodes: int,
    chunk_size: int,
    conv_kernel: int,
    track_interval: int | None,
    decodes_first: bool = False,
) -> None:
    """The exact int64 rules (Python ints), each naming the rule: run when the cheap
    bound (``_FAST_VALUE``) fails."""
    ends = [p + e for p, e in zip(pre.tolist(), ext.tolist(), strict=True)]
    for r, end in enumerate(ends):
        if end > _I64_MAX:
            raise ValueError(
                f"plan_mixed_batch: prefix_lens[{r}] + extend_lens[{r}] = {end}: the row's "
                "positions overflow int64"
            )
    tokens = sum(ext.tolist())
    if tokens > _I64_MAX:
        raise ValueError(
            f"plan_mixed_batch: extend_lens sum to {tokens} tokens: the token offsets "
            "overflow int64"
        )
    n_pre = ext.shape[0] - num_decodes
    prefill = sum((ext[num_decodes:] if decodes_first else ext[:n_pre]).tolist())
    if (prefill + n_pre + 2 * chunk_size + conv_kernel) * (conv_kernel + 1) > _I64_MAX:
        raise ValueError(
            f"plan_mixed_batch: extend_lens hold {prefill} prefill tokens; with chunk_size "
            f"{chunk_size} and conv_kernel {conv_kernel}, the plan's chunk and conv window "
            "indices overflow int64"
        )
    if track_interval is not None and track_interval > _I64_MAX:
        raise ValueError(
            f"plan_mixed_batch: track_interval = {track_interval} does not fit int64"
        )


def _check_rows(
    extend: IntArray,
    prefix: IntArray,
    slots: IntArray,
    num_decodes: int,
    decodes_first: bool = False,
    null: int = -1,
) -> None:
    n = extend.shape[0]
    for name, arr in (("prefix_lens", prefix), ("slots", slots)):
        if arr.shape[0] != n:
            raise ValueError(
                f"plan_mixed_batch: {name} has {arr.shape[0]} rows but extend_lens has {n}"
            )
    if not 0 <= num_decodes <= n:
        raise ValueError(f"plan_mixed_batch: num_decodes must be in [0, {n}], got {num_decodes}")
    if n == 0:
        raise ValueError("plan_mixed_batch: the batch has no rows")
    d0 = 0 if decodes_first else n - num_decodes  # the first decode row
    dec = slice(d0, d0 + num_decodes)
    # Fast path: one reduction per rule; the checks below find the row only on failure.
    if (
        extend.min() >= 1
        and prefix.min() >= 0
        and slots.min() >= 0
        and (not num_decodes or (extend[dec].max() == 1 and prefix[dec].min() >= 1))
        and not _has_duplicate(slots if null < 0 else np.append(slots, null))
    ):
        return
    if (extend < 1).any():
        r = int(np.argmax(extend < 1))
        raise ValueError(
            f"plan_mixed_batch: extend_lens[{r}] = {extend[r]}; every row needs >= 1 new token"
        )
    if (prefix < 0).any():
        r = int(np.argmax(prefix < 0))
        raise ValueError(f"plan_mixed_batch: prefix_lens[{r}] = {prefix[r]} must be >= 0")
    if (extend[dec] != 1).any():
        r = d0 + int(np.argmax(extend[dec] != 1))
        where = "first (RowOrder.DECODES_FIRST)" if decodes_first else "last"
        raise ValueError(
            f"plan_mixed_batch: extend_lens[{r}] = {extend[r]} but row {r} is a decode row "
            f"(decode rows come {where} and take exactly 1 token)"
        )
    if (prefix[dec] < 1).any():
        r = d0 + int(np.argmax(prefix[dec] < 1))
        raise ValueError(
            f"plan_mixed_batch: prefix_lens[{r}] = 0 but row {r} is a decode row, which always "
            "resumes from a state"
        )
    if (slots < 0).any():
        r = int(np.argmax(slots < 0))
        raise ValueError(
            f"plan_mixed_batch: slots[{r}] = {slots[r]}; the planner takes live rows only "
            "(pad rows are added by the graph buffers)"
        )
    if null >= 0 and (slots == null).any():
        r = int(np.argmax(slots == null))
        raise ValueError(
            f"plan_mixed_batch: slots[{r}] = {null} is {_null_name(null)}, which no live row "
            "holds (pad rows carry it)"
        )
    if _has_duplicate(slots):
        raise ValueError("plan_mixed_batch: slots has a duplicate working slot")


def _check_track(
    track_mask: npt.NDArray[np.bool_],
    track_slots: IntArray,
    slots: IntArray,
    owner: str = _OWNER,
    rows: str = "extend_lens",
    null: int = -1,
) -> None:
    n = slots.shape[0]
    for name, arr in (("track_mask", track_mask), ("track_slots", track_slots)):
        if arr.shape[0] != n:
            raise ValueError(f"{owner}: {name} has {arr.shape[0]} rows but {rows} has {n}")
    tracked = track_slots[track_mask]
    if tracked.shape[0] == 0:
        return
    # Fast path: the working slots are distinct (checked first), so one sort of both finds
    # a track slot that is a working slot or another tracked row's; details only on failure.
    pool = np.concatenate((slots, tracked) if null < 0 else (slots, tracked, [null]))
    if tracked.min() >= 0 and not _has_duplicate(pool):
        return
    if (tracked < 0).any():
        r = int(np.flatnonzero(track_mask)[np.argmax(tracked < 0)])
        raise ValueError(
            f"{owner}: track_slots[{r}] = {track_slots[r]} but track_mask[{r}] is set; "
            "a tracked row needs a track slot >= 0"
        )
    if null >= 0 and (tracked == null).any():
        r = int(np.flatnonzero(track_mask)[np.argmax(tracked == null)])
        raise ValueError(
            f"{owner}: track_slots[{r}] = {null} is {_null_name(null)} but track_mask[{r}] "
            "is set; a tracked row needs a track slot of its own"
        )
    clash = _member(tracked, slots)
    if clash.any():
        r = int(np.flatnonzero(track_mask)[np.argmax(clash)])
        raise ValueError(
            f"{owner}: track_slots[{r}] = {track_slots[r]} is also a working slot of "
            "this batch; saving into it would overwrite a live state"
        )
    if _has_duplicate(tracked):
        raise ValueError(f"{owner}: two tracked rows share one track slot")


def _member(values: IntArray, pool: IntArray) -> npt.NDArray[np.bool_]:
    """``np.isin(values, pool)`` for small int arrays, by binary search (several times
    faster than ``np.isin`` at a few hundred elements)."""
    ordered = np.sort(pool)
    if ordered.shape[0] == 0:
        return np.zeros(values.shape, dtype=np.bool_)
    pos = np.minimum(np.searchsorted(ordered, values), ordered.shape[0] - 1)
    found: npt.NDArray[np.bool_] = ordered[pos] == values
    return found


def _has_duplicate(values: IntArray) -> bool:
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def _rows_ok(
    ext_min: int,
    ext_max: int,
    pre_min: int,
    ext: IntArray,
    pre: IntArray,
    slots: IntArray,
    num_decodes: int,
    track_mask: npt.NDArray[np.bool_] | None,
    track_slots: IntArray | None,
    decodes_first: bool = False,
    null: int = -1,
) -> bool:
    """Whether every rule of :func:`_check_rows` and :func:`_check_track` holds: one
    reduction per rule and one sort of the working and tracked slots together (distinct
    and >= 0 covers both checks' slot rules; ``ext_min``, ``ext_max``, ``pre_min``: the
    least and largest of ``ext`` and the least of ``pre``, any value when one is empty).
    ``False`` sends the caller to those checks, which name the rule broken."""
    n = ext.shape[0]
    if not (n and pre.shape[0] == n and slots.shape[0] == n and 0 <= num_decodes <= n):
        return False
    if ext_min < 1 or pre_min < 0:
        return False
    if num_decodes == n:  # every row a decode row (a decode step): the extremes decide
        if ext_max != 1 or pre_min < 1:
            return False
    elif num_decodes:
        dec = slice(0, num_decodes) if decodes_first else slice(n - num_decodes, n)
        if ext[dec].max() != 1 or pre[dec].min() < 1:
            return False
    if track_mask is None or track_slots is None:
        pool = slots.copy() if null < 0 else np.append(slots, null)
    elif track_mask.shape[0] != n or track_slots.shape[0] != n:
        return False
    else:
        parts = (slots, track_slots[track_mask])
        pool = np.concatenate(parts if null < 0 else (*parts, [null]))
    pool.sort()
    return bool(pool[0] >= 0) and not bool((pool[1:] == pool[:-1]).any())


def _int_rows(values: tuple[IntLike, ...]) -> IntArray | None:
    """The per-row integer inputs as one ``[len(values), bs]`` int64 array, when each is a
    list or tuple, all of one length, of integers; ``None`` otherwise (each input is then
    converted on its own, which names the one that is wrong)."""
    for v in values:
        # A sequence that starts with a bool may be all bools, which is refused by name.
        if not isinstance(v, (list, tuple)) or not v or isinstance(v[0], (bool, np.bool_)):
            return None
    try:
        arr = np.array(values)
    except (ValueError, TypeError, OverflowError):  # not of one length, ...
        return None
    # signed only: numpy makes Python ints past int64 unsigned (or objects)
    if arr.ndim != 2 or not arr.shape[1] or arr.dtype.kind != "i":
        return None
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def _try_host(convert: Callable[[str, _V], _A], name: str, value: _V) -> _A | None:
    try:
        return convert(name, value)
    except (TypeError, ValueError):  # the detailed checks raise it again, in their order
        return None


# Host constants of the plan, cached (read-only; the plan's arrays are always fresh).
_CACHE_TOKENS = 1 << 16  # longest cached iota / window template (a batch's prefill tokens)
_iota_cache: list[IntArray] = [np.zeros(0, dtype=np.int64)]
_window_cache: dict[int, IntArray] = {}
_Patch = tuple[IntArray, IntArray, IntArray, IntArray]
_patch_cache: dict[int, _Patch] = {}


def _read_only(a: IntArray) -> IntArray:
    a.flags.writeable = False
    return a


def _iota(n: int) -> IntArray:
    """``np.arange(n)`` as a read-only view of a cached array (never hand it out)."""
    cached = _iota_cache[0]
    if cached.shape[0] < n:
        if n > _CACHE_TOKENS:
            return np.arange(n, dtype=np.int64)
        grown = min(max(n, 2 * cached.shape[0], 1024), _CACHE_TOKENS)
        cached = _read_only(np.arange(grown, dtype=np.int64))
        _iota_cache[0] = cached
    return cached[:n]


def _fill_windows(out: IntArray, total: int, kernel: int) -> None:
    """Write ``[total, kernel]`` windows (flat, into ``out``) whose row ``t`` is
    ``t - k1 .. t``: every token's conv window before the patch for the rows' initial
    states, copied from a cached template."""
    cached = _window_cache.get(kernel)
    if cached is None or cached.shape[0] < total:
        grown = max(total, 1024, 2 * (0 if cached is None else cached.shape[0]))
        rows = total if total > _CACHE_TOKENS else min(grown, _CACHE_TOKENS)
        built = np.empty((rows, kernel), dtype=np.int64)
        base = np.arange(1 - kernel, rows + 1 - kernel, dtype=np.int64)
        # Column by column: numpy's broadcast over a 4-wide inner axis is several times slower.
        for c in range(kernel):
            np.add(base, c, out=built[:, c])
        if rows <= _CACHE_TOKENS:
            _window_cache[kernel] = _read_only(built)
        cached = built
    out[:] = cached.reshape(-1)[: total * kernel]


def _patch(k1: int) -> _Patch:
    """Per conv width: the (token ``j``, column ``c``) cells of a row's first ``k1`` token
    windows that read its initial state (``c < k1 - j``): ``j``, the flat offset
    ``j * (k1 + 1) + c`` and the initial-state column ``j + c``; and ``arange(k1) - k1``."""
    cached = _patch_cache.get(k1)
    if cached is None:
        j, c = np.array([(j, c) for j in range(k1) for c in range(k1 - j)], dtype=np.int64).T
        j, c = np.ascontiguousarray(j), np.ascontiguousarray(c)
        off = np.arange(k1, dtype=np.int64) - k1
        cached = (
            _read_only(j), _read_only(j * (k1 + 1) + c), _read_only(j + c), _read_only(off)
        )  # fmt: skip
        _patch_cache[k1] = cached
    return cached


def _windows(
    end: IntArray, start: IntArray, init: IntArray, off: IntArray, whole: bool
) -> IntArray:
    """``[m, k1]`` extended-input indices of the ``k1`` positions before ``end``, each in
    a row that starts at ``start``; a position before the start is column
    ``k1 - (start - q)`` of the row's initial state, which starts at ``init``. ``whole``:
    the caller knows every window lies inside its row."""
    q = end[:, None] + off
    if whole:
        return q
    return np.where(q < start[:, None], q + (init - start - off[0])[:, None], q)


class _Staging:
    """A plan packed for ``plan_mixed_batch``: one host buffer (page-locked for a GPU
    target) holding every part the metadata reads, the masks as bool bytes at its end.

    ``sizes`` splits the buffer (int64) into the parts in their packed order and the
    tail; ``bool_sizes`` splits its bytes into the head, the masks and the rest; ``order``
    picks the views of :attr:`MixedHostPlan.arrays`' order out of both splits.
    """

    __slots__ = ("bool_sizes", "host", "order", "sizes")

    def __init__(
        self,
        host: torch.Tensor,
        sizes: list[int],
        bool_sizes: list[int],
        order: tuple[int, ...],
    ) -> None:
        self.host = host
        self.sizes = sizes
        self.bool_sizes = bool_sizes
        self.order = order

    def views(self, device: torch.device) -> list[torch.Tensor]:
        """One non-blocking copy to ``device``; the views in :attr:`MixedHostPlan.arrays`'
        order (1-D; the masks bool)."""
        flat = self.host.to(device, non_blocking=True)
        every = flat.split_with_sizes(self.sizes) + flat.view(torch.bool).split_with_sizes(
            self.bool_sizes
        )
        return [every[i] for i in self.order]


def _order(packed: tuple[str, ...], masks: tuple[str, ...], names: tuple[str, ...]) -> tuple[int, ...]:
    """Positions of ``names`` in the two splits of a :class:`_Staging` buffer: the packed
    parts (then the tail), then the bytes (the head, then the masks)."""
    at = {n: i for i, n in enumerate(packed)}
    at.update({n: len(packed) + 2 + i for i, n in enumerate(masks)})
    return tuple(at[n] for n in names)


# Packed order: the small parts in one copy, then the two token-sized parts written in place.
_PACKED_ROWS = ("query_start_loc", "slots", "track_slots")
_PACKED_MIXED = _PACKED_ROWS + tuple(
    n for n in _PREFILL_NAMES if n not in ("has_init", "chunk_first", "token_pos", "token_conv")
) + ("token_pos", "token_conv")  # fmt: skip
_ORDER_ROWS = _order(_PACKED_ROWS, ("track_mask",), _ROW_NAMES)
_ORDER_MIXED = _order(
    _PACKED_MIXED, ("track_mask", "has_init", "chunk_first"), _ROW_NAMES + _PREFILL_NAMES
)


def plan_host(
    *,
    extend_lens: IntLike,
    prefix_lens: IntLike,
    slots: IntLike,
    num_decodes: int,
    chunk_size: int,
    conv_kernel: int,
    track_interval: int | None = None,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
    forward_cls: type[ForwardMetadata] = ForwardMetadata,
    track_positions: IntLike | None = None,
) -> MixedHostPlan:
    """Plan one mixed forward from host data (no device work).

    Parameters
    ----------
    extend_lens : sequence of int or CPU tensor
        ``[bs]`` new tokens per row, in the declared row order of ``forward_cls``:
        prefill rows first, then ``num_decodes`` decode rows with exactly 1 token each
        (``RowOrder.PREFILLS_FIRST``, the default), or the decode rows first
        (``RowOrder.DECODES_FIRST``, vLLM's order). Every per-row argument follows it.
    prefix_lens : sequence of int or CPU tensor
        ``[bs]`` tokens already in the row's state (> 0 means the row resumes from the
        state in its working slot).
    slots : sequence of int or CPU tensor
        ``[bs]`` working state slot of each row (``mamba_cache_indices``), distinct, >= 0,
        never the declared null slot (``Conventions.null_slot``: pad rows carry it).
    num_decodes : int
        Number of decode rows (after the prefill rows, or before them).
    chunk_size : int
        SSD scan chunk size (the state grid).
    conv_kernel : int
        Causal conv1d width ``K`` (the conv state keeps ``K - 1`` inputs).
    track_interval : int, optional
        Track every this many tokens; a positive multiple of ``chunk_size``. Required when
        ``track_mask`` is given.
    track_mask : sequence of bool or CPU tensor, optional
        ``[bs]`` rows that track: each saves its last boundary reached this step into its
        track slot.
    track_slots : sequence of int or CPU tensor, optional
        ``[bs]`` track slot of each row (ignored where ``track_mask`` is False); must not be a
        working slot of this batch. Rows that save nothing get the null slot in
        ``mamba_track_indices``.
    forward_cls : type, optional
        The forward's source metadata class the plan builds: ``ForwardMetadata`` (default)
        or the engine's extension of it (``@metadata(extension=True)``), whose declared
        :class:`~hybridmeta.Conventions` give the row order and the null slot.
    track_positions : sequence of int or CPU tensor, optional
        ``[bs]`` the absolute boundary each tracked row saves (ignored where
        ``track_mask`` is False), instead of the last one its new tokens reach: a
        multiple of ``track_interval`` with ``prefix < b <= prefix + extend`` (an engine
        whose cache wants an earlier boundary of the step: vLLM's align mode saves the
        last block boundary strictly before the row's last token). Needs ``track_mask``.

    Returns
    -------
    MixedHostPlan

    Raises
    ------
    TypeError
        An argument of the wrong type (a count that is not a plain ``int``, a per-row
        argument that is no sequence, a ``forward_cls`` that is no source class).
    ValueError
        Inconsistent configuration or rows, a per-row argument that is not 1-D, a value
        or position past int64; the message names the field and the rule.
    """
    hp = _plan(
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        slots=slots,
        num_decodes=num_decodes,
        chunk_size=chunk_size,
        conv_kernel=conv_kernel,
        track_interval=track_interval,
        track_mask=track_mask,
        track_slots=track_slots,
        device=None,
        forward_cls=forward_cls,
        track_positions=track_positions,
    )
    assert isinstance(hp, MixedHostPlan)
    return hp


def _plan(
    *,
    extend_lens: IntLike,
    prefix_lens: IntLike,
    slots: IntLike,
    num_decodes: int,
    chunk_size: int,
    conv_kernel: int,
    track_interval: int | None,
    track_mask: BoolLike | None,
    track_slots: IntLike | None,
    device: torch.device | None,
    forward_cls: type[ForwardMetadata],
    track_positions: IntLike | None = None,
    engine: Mapping[str, object] | None = None,
) -> MixedHostPlan | Mamba2Metadata:
    """:func:`plan_host`; with a ``device``, :func:`plan_mixed_batch`: the plan is packed
    for the device as it is computed (:class:`_Staging`), and no host plan is kept.

    The phases, in order: the arguments (:func:`_rows`), the track kinds
    (:func:`_track_kinds`), and for a batch with prefill rows the chunks
    (:func:`_chunks`), the conv windows (:func:`_conv_windows`), the mid-row saves
    (:func:`_mid_saves`) and the token-sized parts, written where they are staged
    (:func:`_token_parts`). A decode-only batch (the hot path of a decode step) skips
    the prefill phases: its rows have one token each, so a save is always the row's final
    token.

    The row order and the null slot are ``forward_cls``'s declared conventions. The
    per-row arrays of the forward (offsets, slots, track slots and mask) follow the batch
    rows; the prefill phases work on the prefill rows and their tokens alone (decode rows
    first: they start after the ``num_decodes`` decode tokens); the mid-row saves name
    batch rows.
    """
    if forward_cls is ForwardMetadata:
        decodes_first, null = _ROOT_ORDER
    else:
        conv = _conventions(forward_cls, _OWNER)
        decodes_first, null = conv.decodes_first, conv.null_slot
    ext, pre, slt, tmask, tslots, ext_min = _rows(
        extend_lens, prefix_lens, slots, num_decodes, chunk_size, conv_kernel,
        track_interval, track_mask, track_slots, decodes_first, null,
    )  # fmt: skip
    n_rows = ext.shape[0]
    n_pre = n_rows - num_decodes
    qsl = np.empty(n_rows + 1, dtype=np.int64)
    qsl[0] = 0
    ext.cumsum(out=qsl[1:])
    track_out, is_final, final_rows, mid_rows, rem = _track_kinds(
        ext, pre, tmask, tslots, track_interval, null,
        _track_at(ext, pre, tmask, track_positions, track_interval),
    )  # fmt: skip
    track = track_mask is not None
    if not n_pre:
        if device is not None:
            staging, _ = _pack(device, [qsl, slt, track_out], (), [is_final], _ORDER_ROWS)
            return _metadata(
                staging.views(device), engine or {}, 0, num_decodes, 0, chunk_size, conv_kernel,
                track, bool(final_rows), forward_cls,
            )  # fmt: skip
        parts: tuple[IntArray, ...] = (qsl, slt, track_out, is_final.astype(np.int64))
        return _host_plan(
            parts, 0, num_decodes, 0, chunk_size, conv_kernel, track, final_rows, _EMPTY,
            _EMPTY, forward_cls,
        )  # fmt: skip

    # The prefill rows: the first n_pre rows, or (decode rows first) the rows after the
    # num_decodes decode rows, whose tokens follow the decode rows' one token each.
    first = num_decodes if decodes_first else 0
    if first:
        pqsl, pext, ppre = qsl[first:] - first, ext[first:], pre[first:]
    else:
        pqsl, pext, ppre = qsl, ext, pre
    total = int(pqsl[n_pre])  # flattened prefill tokens
    starts, chunk_len, chunk_row, chunk_first, token_chunk, row_last_chunk, phys_last_chunk = (
        _chunks(pqsl, n_pre, total, chunk_size)
    )
    has_init = ppre[:n_pre] > 0
    # Some row is shorter than its window (a decode row is: then ask the prefill rows).
    shortest = int(pext[:n_pre].min()) if num_decodes else ext_min
    init, off, cell, value, final_conv = _conv_windows(
        pqsl, pext, n_pre, total, conv_kernel, shortest < conv_kernel - 1
    )
    h_rows, h_chunk, rc_rows, rc_chunk, rc_len, mid_conv = _mid_saves(
        pqsl, rem, mid_rows, starts, init, off, chunk_size, conv_kernel - 1, first
    )
    # The token-sized parts are written in place: into the staged buffer when there is
    # one (everything else is copied there in one pass).
    if device is not None:
        small = [qsl, slt, track_out, starts, chunk_len, chunk_row, token_chunk,
                 row_last_chunk, phys_last_chunk, final_conv, h_rows, h_chunk, rc_rows,
                 rc_chunk, rc_len, mid_conv]  # fmt: skip
        staging, (token_pos, token_conv) = _pack(
            device,
            small,
            (total, total * conv_kernel),
            [is_final, has_init, chunk_first],
            _ORDER_MIXED,
        )
        _token_parts(token_pos, token_conv, starts, chunk_len, cell, value, total, conv_kernel)
        # Planned for a device: its metadata over the staged views (no host arrays kept).
        return _metadata(
            staging.views(device), engine or {}, n_pre, num_decodes, total, chunk_size,
            conv_kernel, track, bool(final_rows), forward_cls,
        )  # fmt: skip
    token_pos = np.empty(total, dtype=np.int64)
    token_conv = np.empty(total * conv_kernel, dtype=np.int64)
    _token_parts(token_pos, token_conv, starts, chunk_len, cell, value, total, conv_kernel)
    parts = (
        qsl, slt, track_out, is_final.astype(np.int64), has_init.astype(np.int64), starts,
        chunk_len, chunk_row, chunk_first.astype(np.int64), token_chunk, token_pos,
        row_last_chunk, phys_last_chunk, token_conv, final_conv, h_rows, h_chunk, rc_rows,
        rc_chunk, rc_len, mid_conv,
    )  # fmt: skip
    return _host_plan(
        parts, n_pre, num_decodes, total, chunk_size, conv_kernel, track, final_rows, h_rows,
        rc_rows, forward_cls,
    )  # fmt: skip


def _rows(
    extend_lens: IntLike,
    prefix_lens: IntLike,
    slots: IntLike,
    num_decodes: int,
    chunk_size: int,
    conv_kernel: int,
    track_interval: int | None,
    track_mask: BoolLike | None,
    track_slots: IntLike | None,
    decodes_first: bool,
    null: int,
) -> tuple[IntArray, IntArray, IntArray, npt.NDArray[np.bool_] | None, IntArray | None, int]:
    """Phase 1, the arguments: checked and converted before anything is computed.

    Returns ``(extend, prefix, slots, track_mask, track_slots, least extend)`` as fresh
    int64 / bool host arrays (``track_mask`` and ``track_slots`` ``None`` without
    tracking). The fast path converts sequences of one length in one call and checks
    every rule in one pass (:func:`_rows_ok`); only when that fails do the detailed checks
    run, each naming the argument and the rule broken.
    """
    _check_config(chunk_size, track_interval, conv_kernel, num_decodes)
    tracking = track_mask is not None and track_slots is not None and track_interval is not None
    tslots: IntArray | None = None
    ints = _int_rows(
        (extend_lens, prefix_lens, slots, track_slots)  # type: ignore[arg-type]
        if tracking
        else (extend_lens, prefix_lens, slots)
    )
    if ints is not None:  # one conversion of sequences of one length
        ext, pre, slt = ints[0], ints[1], ints[2]
        if tracking:
            tslots = ints[3]
        # the least and the largest extend and prefix: one sort of the two rows (cheaper
        # than a min and a max reduction on the host)
        ordered = np.sort(ints[:2], axis=1)
        ext_min, pre_min = ordered[:, 0].tolist()
        ext_max, pre_max = ordered[:, -1].tolist()
    else:
        ext = _host_ints("extend_lens", extend_lens)
        pre = _host_ints("prefix_lens", prefix_lens)
        slt = _host_ints("slots", slots)
        ext_min = int(ext.min()) if ext.shape[0] else 0
        pre_min = int(pre.min()) if pre.shape[0] else 0
        ext_max = int(ext.max()) if ext.shape[0] else 0
        pre_max = int(pre.max()) if pre.shape[0] else 0
    tmask: npt.NDArray[np.bool_] | None = None
    # Every index the plan computes surely fits int64 (comparisons only; the exact rules
    # of _check_positions decide when this bound fails).
    ok = (
        ext_max < _FAST_VALUE
        and pre_max < _FAST_VALUE
        and ext.shape[0] < _FAST_ROWS
        and chunk_size < _FAST_VALUE
        and conv_kernel < _FAST_KERNEL
        and (track_interval is None or track_interval < _FAST_VALUE)
    )
    if track_mask is None:
        ok = ok and track_slots is None
        ok = ok and _rows_ok(
            ext_min, ext_max, pre_min, ext, pre, slt, num_decodes, None, None, decodes_first,
            null,
        )  # fmt: skip
    elif tracking:
        tmask = _try_host(_host_bools, "track_mask", track_mask)
        if tslots is None:
            tslots = _try_host(_host_ints, "track_slots", track_slots)  # type: ignore[arg-type]
        ok = ok and tmask is not None and tslots is not None
        ok = ok and _rows_ok(
            ext_min, ext_max, pre_min, ext, pre, slt, num_decodes, tmask, tslots, decodes_first,
            null,
        )  # fmt: skip
    else:
        ok = False
    if not ok:
        # Some rule is broken (or the cheap int64 bound failed): the checks in their
        # order, each naming its rule.
        _check_rows(ext, pre, slt, num_decodes, decodes_first, null)
        if track_mask is None:
            if track_slots is not None:
                raise ValueError("plan_mixed_batch: track_slots given without track_mask")
        else:
            if track_slots is None:
                raise ValueError("plan_mixed_batch: track_mask given without track_slots")
            if track_interval is None:
                raise ValueError("plan_mixed_batch: track_mask given without track_interval")
            tmask = _host_bools("track_mask", track_mask)
            tslots = _host_ints("track_slots", track_slots)
            _check_track(tmask, tslots, slt, null=null)
        _check_positions(
            ext, pre, num_decodes, chunk_size, conv_kernel, track_interval, decodes_first
        )
    return ext, pre, slt, tmask, tslots, ext_min


def _track_kinds(
    ext: IntArray,
    pre: IntArray,
    tmask: npt.NDArray[np.bool_] | None,
    tslots: IntArray | None,
    track_interval: int | None,
    null: int,
    at: IntArray | None = None,
) -> tuple[IntArray, npt.NDArray[np.bool_], tuple[int, ...], IntArray, IntArray]:
    """Phase 2, the track kinds: which rows save their last boundary, and how.

    Returns ``(track_slots, is_final, final_rows, mid_rows, rem)``: each row's track slot
    where it saves (``null``, the declared null slot, elsewhere: ``mamba_track_indices``),
    the batch rows whose boundary
    ends them (``mamba_track_mask``; as a tuple too), the rows whose boundary falls inside
    their new tokens (prefill rows only: decode rows have one token), and each row's
    ``(prefix + extend) % track_interval``. A row's last boundary
    ``b = (prefix + extend) - rem`` comes after its first ``extend - rem`` new tokens:
    reached when that is > 0, the row's end when ``rem == 0``. ``at``: each row's
    boundary given by the caller (:func:`_track_at`, checked), instead of its last.
    """
    if tmask is None or tslots is None or track_interval is None:
        n_rows = ext.shape[0]
        no_save = np.full(n_rows, null, dtype=np.int64)
        return no_save, np.zeros(n_rows, dtype=np.bool_), (), _EMPTY, _EMPTY
    rem = (pre + ext) % track_interval if at is None else pre + ext - at
    saves = tmask & (ext > rem)
    is_final = saves & (rem == 0)
    track_out = np.where(saves, tslots, null)
    final_rows = tuple(is_final.nonzero()[0].tolist())
    mid_rows = (saves ^ is_final).nonzero()[0]  # only prefill rows: decode rows have 1 token
    return track_out, is_final, final_rows, mid_rows, rem


def _track_at(
    ext: IntArray,
    pre: IntArray,
    tmask: npt.NDArray[np.bool_] | None,
    track_positions: IntLike | None,
    track_interval: int | None,
) -> IntArray | None:
    """The caller's boundary of each row (``track_positions``), checked: ``None`` without
    them. A tracked row's boundary is a multiple of ``track_interval`` that its new
    tokens reach, ``prefix < b <= prefix + extend``; an untracked row's is ignored (it
    gets its row's end, where it saves nothing)."""
    if track_positions is None:
        return None
    if tmask is None or track_interval is None:
        raise ValueError("plan_mixed_batch: track_positions given without track_mask")
    at = _host_ints("track_positions", track_positions)
    n = ext.shape[0]
    if at.shape[0] != n:
        raise ValueError(
            f"plan_mixed_batch: track_positions has {at.shape[0]} rows but extend_lens has {n}"
        )
    end = pre + ext
    bad = tmask & ((at <= pre) | (at > end) | (at % track_interval != 0))
    if bad.any():
        r = int(np.argmax(bad))
        raise ValueError(
            f"plan_mixed_batch: track_positions[{r}] = {int(at[r])} but row {r} is tracked "
            f"over tokens {int(pre[r])}..{int(end[r])}: a boundary must be a multiple of "
            f"track_interval ({track_interval}) with prefix < b <= prefix + extend"
        )
    out: IntArray = np.where(tmask, at, end)
    return out


def _chunks(
    qsl: IntArray, n_pre: int, total: int, chunk_size: int
) -> tuple[IntArray, IntArray, IntArray, npt.NDArray[np.bool_], IntArray, IntArray, IntArray]:
    """Phase 3, the logical chunks of the flattened prefill tokens (:class:`ChunkPlan`).

    Returns ``(start, length, row, first, token_chunk, row_last_chunk, phys_last_chunk)``
    (``token_pos`` is token-sized: :func:`_token_parts` writes it). A new logical chunk
    begins at every physical chunk start and every row start (the rule of
    :func:`hybridmeta.chunks.logical_chunk_starts`). Every prefill row has a token, so
    every row start lies inside the tokens and the ones off the grid are new.
    """
    L = chunk_size
    row_start = qsl[:n_pre]
    row_end = qsl[1 : n_pre + 1]
    n_phys = -(-total // L)
    grid = np.arange(0, (n_phys + 1) * L, L, dtype=np.int64)
    grid[-1] = total  # [0, L, .., (n_phys - 1) L, total]: the physical chunk edges
    edges = grid
    if n_pre > 1:
        off_grid = row_start[row_start % L != 0]
        if off_grid.shape[0]:
            edges = np.concatenate((grid, off_grid))
            edges.sort()
    starts = edges[:-1]
    chunk_len = edges[1:] - starts
    # Row of each chunk: the last row starting at or before it (rows have >= 1 token).
    chunk_row = row_end.searchsorted(starts, "right")
    # A chunk is its row's first when it starts where its row starts.
    chunk_first = starts == row_start[chunk_row]
    token_chunk = _iota(starts.shape[0]).repeat(chunk_len)
    row_last_chunk = starts.searchsorted(row_end) - 1
    phys_last_chunk = starts.searchsorted(grid[1:]) - 1
    return starts, chunk_len, chunk_row, chunk_first, token_chunk, row_last_chunk, phys_last_chunk


def _conv_windows(
    qsl: IntArray, ext: IntArray, n_pre: int, total: int, conv_kernel: int, short: bool
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray]:
    """Phase 4, the conv windows over the extended input (:class:`ConvWindows`): the
    prefill tokens, then each row's ``K-1`` initial inputs from index ``init[r]``.

    Token ``t`` reads ``t-(K-1) .. t``, where the first ``K-1`` tokens of a row read its
    initial state; a row's final window is its last ``K-1`` inputs. Returns ``(init, off,
    cell, value, final_windows)``: the token windows are the template of
    :func:`_fill_windows` with ``value`` put at the flat ``cell`` s that reach before
    their row (:func:`_token_parts` writes them); ``short``: some prefill row is shorter
    than ``K-1`` tokens.
    """
    k1 = conv_kernel - 1
    row_start = qsl[:n_pre]
    row_end = qsl[1 : n_pre + 1]
    init = _iota(n_pre) * k1 + total
    patch_j, patch_flat, patch_col, off = _patch(k1)
    cell = (row_start * conv_kernel)[:, None] + patch_flat
    value = init[:, None] + patch_col
    if short:
        inside = ext[:n_pre, None] > patch_j
        cell, value = cell[inside], value[inside]
    final_conv = _windows(row_end, row_start, init, off, not short).reshape(-1)
    return init, off, cell, value, final_conv


def _mid_saves(
    pqsl: IntArray,
    rem: IntArray,
    mid_rows: IntArray,
    starts: IntArray,
    init: IntArray,
    off: IntArray,
    chunk_size: int,
    k1: int,
    first: int,
) -> tuple[IntArray, IntArray, IntArray, IntArray, IntArray, IntArray]:
    """Phase 5, the mid-row saves (:class:`ExtendTrackPlan`): each boundary inside a
    prefill row's new tokens, on the chunk grid (the chunk's end state, ``h``) or
    recomputed from the state entering its logical chunk.

    Returns ``(h_rows, h_chunk, recompute_rows, recompute_chunk, recompute_len,
    windows)``, the conv windows flat. Rows on the grid first, then the others, each in
    row order. ``mid_rows`` and the rows returned are batch rows, ``pqsl`` the prefill
    rows' offsets among the prefill tokens; the first prefill row is batch row ``first``.
    """
    if not mid_rows.shape[0]:
        return _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY
    prow = mid_rows - first if first else mid_rows  # their prefill rows
    # g: flattened prefill position after the boundary token (on the grid: g % L == 0).
    g = pqsl[prow + 1] - rem[mid_rows]
    off_grid_save = (g % chunk_size) != 0
    order = off_grid_save.argsort(kind="stable")
    rows, g = prow[order], g[order]
    n_h = rows.shape[0] - int(np.count_nonzero(off_grid_save))
    # The logical chunk holding the boundary token (on the grid: the physical chunk's
    # last, whose end state is the boundary's).
    chunk = starts.searchsorted(g - 1, "right") - 1
    rc_chunk = chunk[n_h:]
    rc_len = g[n_h:] - starts[rc_chunk]
    mid_start = pqsl[rows]
    whole = bool((g - mid_start).min() >= k1)
    mid_conv = _windows(g, mid_start, init[rows], off, whole).reshape(-1)
    if first:
        rows = rows + first  # batch rows
    return rows[:n_h], chunk[:n_h], rows[n_h:], rc_chunk, rc_len, mid_conv


def _token_parts(
    token_pos: IntArray,
    token_conv: IntArray,
    starts: IntArray,
    chunk_len: IntArray,
    cell: IntArray,
    value: IntArray,
    total: int,
    conv_kernel: int,
) -> None:
    """Phase 6, the token-sized parts, written in place (into the staged buffer, or host
    arrays): each token's position in its logical chunk and its conv window."""
    np.subtract(_iota(total), starts.repeat(chunk_len), out=token_pos)
    _fill_windows(token_conv, total, conv_kernel)
    token_conv.put(cell, value)


def _host_plan(
    parts: tuple[IntArray, ...],
    n_pre: int,
    num_decodes: int,
    total: int,
    chunk_size: int,
    conv_kernel: int,
    track: bool,
    final_rows: tuple[int, ...],
    h_rows: IntArray,
    rc_rows: IntArray,
    forward_cls: type[ForwardMetadata],
) -> MixedHostPlan:
    """The :class:`MixedHostPlan` of ``parts`` (:attr:`MixedHostPlan.arrays`' order)."""
    return MixedHostPlan(
        arrays=dict(zip(_MIXED_KEYS if n_pre else _ROW_KEYS, parts, strict=True)),
        num_prefills=n_pre,
        num_decodes=num_decodes,
        num_prefill_tokens=total,
        chunk_size=chunk_size,
        conv_kernel=conv_kernel,
        track=track,
        any_final_save=bool(final_rows),
        final_rows=final_rows,
        h_rows=tuple(h_rows.tolist()),
        recompute_rows=tuple(rc_rows.tolist()),
        forward_cls=forward_cls,
    )


def _pack(
    device: torch.device,
    small: list[IntArray],
    big: tuple[int, ...],
    masks: list[npt.NDArray[np.bool_]],
    order: tuple[int, ...],
) -> tuple[_Staging, list[IntArray]]:
    """The staging buffer of a plan: ``small`` copied in one pass, room for the ``big``
    parts (returned, to be written in place), then ``masks`` as bytes."""
    sizes = [a.shape[0] for a in small]
    n_small = sum(sizes)
    n_int = n_small + sum(big)
    mask_sizes = [m.shape[0] for m in masks]
    n_bool = sum(mask_sizes)
    words = -(-n_bool // 8)
    if device.type == "cuda":  # page-locked: the copy is truly asynchronous
        host = torch.empty(n_int + words, dtype=torch.int64, pin_memory=True)
        buf = host.numpy()
    else:
        buf = np.empty(n_int + words, dtype=np.int64)
        host = torch.from_numpy(buf)
    np.concatenate(small, out=buf[:n_small])
    out = []
    at = n_small
    for size in big:
        out.append(buf[at : at + size])
        at += size
    np.concatenate(masks, out=buf.view(np.bool_)[8 * n_int : 8 * n_int + n_bool])
    sizes += [*big, words]
    staging = _Staging(host, sizes, [8 * n_int, *mask_sizes, 8 * words - n_bool], order)
    return staging, out


def plan_mixed_batch(
    *,
    extend_lens: IntLike,
    prefix_lens: IntLike,
    slots: IntLike,
    num_decodes: int,
    chunk_size: int,
    conv_kernel: int,
    track_interval: int | None = None,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
    device: torch.device | str = "cpu",
    forward_cls: type[ForwardMetadata] = ForwardMetadata,
    track_positions: IntLike | None = None,
    engine: Mapping[str, object] | None = None,
) -> Mamba2Metadata:
    """:func:`plan_host`, then one staged copy to ``device``: the forward's metadata.

    Parameters are those of :func:`plan_host`, plus the ``device`` of the metadata and
    ``engine``: further fields of the forward (``forward_cls``'s own, an extension's),
    passed through its constructor with the planned ones (as
    :meth:`MixedHostPlan.metadata` takes them).
    """
    dev = _device(device, "plan_mixed_batch")
    md = _plan(
        extend_lens=extend_lens,
        prefix_lens=prefix_lens,
        slots=slots,
        num_decodes=num_decodes,
        chunk_size=chunk_size,
        conv_kernel=conv_kernel,
        track_interval=track_interval,
        track_mask=track_mask,
        track_slots=track_slots,
        device=dev,
        forward_cls=forward_cls,
        track_positions=track_positions,
        engine=engine,
    )
    assert isinstance(md, Mamba2Metadata)
    return md


@attrs.frozen(kw_only=True, eq=False)
class VerifyHostPlan:
    """A target-verify forward planned on the host; :meth:`metadata` builds it from staged
    views.

    Attributes
    ----------
    arrays : dict of str to numpy array
        The forward's per-row arrays (int64), keyed ``"hybridmeta.verify.<name>"``; stage
        them with :func:`~hybridmeta.staging.to_device_packed`, with the engine's own.
    num_rows, draft_token_num : int
    track : bool
        Track fields are present (``track_mask`` was given).
    any_track : bool
        Some row may cross a boundary (``has_mamba_track_mask``).
    forward_cls : type
        The class :meth:`forward` builds (``ForwardMetadata``, or the engine's extension).
    """

    arrays: dict[str, IntArray]
    num_rows: int
    draft_token_num: int
    track: bool
    any_track: bool
    forward_cls: type[ForwardMetadata] = ForwardMetadata

    def forward(self, views: Mapping[str, torch.Tensor], **engine: object) -> ForwardMetadata:
        """The verify forward's ``ForwardMetadata`` over staged ``views`` of :attr:`arrays`.

        ``engine`` passes further ``ForwardMetadata`` fields (a tree:
        ``retrieve_parent_token``, ``retrieve_next_token``, ``retrieve_next_sibling``, each
        ``[num_rows, draft_token_num]``) through the same constructor.
        """
        return self._forward(_staged(views, _VERIFY_KEYS, "VerifyHostPlan", _PV), engine)

    def metadata(self, views: Mapping[str, torch.Tensor], **engine: object) -> Mamba2Metadata:
        """The verify forward's ``Mamba2Metadata`` (:func:`~hybridmeta.model.prepare_target_verify`)."""
        return prepare_target_verify(self.forward(views, **engine))

    def _forward(
        self, v: Sequence[torch.Tensor], engine: Mapping[str, object]
    ) -> ForwardMetadata:
        fields = {"is_target_verify": True, "draft_token_num": self.draft_token_num, **engine}
        return _forward(v, self.track, self.any_track, fields, self.forward_cls)


def plan_verify_host(
    *,
    slots: IntLike,
    draft_token_num: int,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
    forward_cls: type[ForwardMetadata] = ForwardMetadata,
) -> VerifyHostPlan:
    """Plan a speculative target-verify forward from host data (no device work).

    Parameters
    ----------
    slots : sequence of int or CPU tensor
        ``[bs]`` working slot of each row (distinct, >= 0); every row verifies
        ``draft_token_num`` tokens.
    draft_token_num : int
        Tokens per row (the pending token and its draft), ``>= 1``.
    track_mask, track_slots : optional
        ``[bs]`` rows that may cross a track boundary with their tokens, and the track slot
        each reserved (not a working slot of this batch). The commit decides from the
        accepted tokens whether (and from which column) the boundary is saved.
    forward_cls : type, optional
        ``ForwardMetadata`` (default) or the engine's extension of it; its declared null
        slot is what rows without a track slot hold, and what no row may hold as its
        working or reserved track slot (a verify forward has no prefill rows: the row
        order does not matter).

    Raises
    ------
    TypeError
        An argument of the wrong type.
    ValueError
        The message names the argument and the rule.
    """
    owner = "plan_verify"
    null = _conventions(forward_cls, owner).null_slot
    _check_int("draft_token_num", draft_token_num, owner)
    if draft_token_num < 1:
        raise ValueError(f"plan_verify: draft_token_num must be an int >= 1, got {draft_token_num}")
    slt = _host_ints("slots", slots, owner)
    n = slt.shape[0]
    if n == 0:
        raise ValueError("plan_verify: the batch has no rows")
    if n * draft_token_num > _I64_MAX:
        raise ValueError(
            f"plan_verify: {n} rows of draft_token_num = {draft_token_num} tokens: the token "
            "offsets overflow int64"
        )
    if (slt < 0).any() or _has_duplicate(slt):
        raise ValueError("plan_verify: slots must be distinct working slots >= 0 (live rows only)")
    if null >= 0 and (slt == null).any():
        r = int(np.argmax(slt == null))
        raise ValueError(
            f"plan_verify: slots[{r}] = {null} is {_null_name(null)}, which no live row holds"
        )
    if (track_mask is None) != (track_slots is None):
        raise ValueError("plan_verify: track_mask and track_slots are given together")
    tmask = np.zeros(n, dtype=np.bool_)
    tslots = np.full(n, null, dtype=np.int64)
    if track_mask is not None and track_slots is not None:
        tmask = _host_bools("track_mask", track_mask, owner)
        tslots = _host_ints("track_slots", track_slots, owner)
        _check_track(tmask, tslots, slt, owner, "slots", null)
    arrays = {
        "query_start_loc": np.arange(n + 1, dtype=np.int64) * draft_token_num,
        "slots": slt,
        "track_slots": np.where(tmask, tslots, null),
        "track_mask": tmask.astype(np.int64),
    }
    return VerifyHostPlan(
        arrays={_PV + k: a for k, a in arrays.items()},
        num_rows=n,
        draft_token_num=draft_token_num,
        track=track_mask is not None,
        any_track=bool(tmask.any()),
        forward_cls=forward_cls,
    )


def plan_verify(
    *,
    slots: IntLike,
    draft_token_num: int,
    track_mask: BoolLike | None = None,
    track_slots: IntLike | None = None,
    device: torch.device | str = "cpu",
    forward_cls: type[ForwardMetadata] = ForwardMetadata,
    **engine: object,
) -> Mamba2Metadata:
    """:func:`plan_verify_host`, then one staged copy to ``device``: the verify forward's
    metadata (``engine``: further ``ForwardMetadata`` fields, e.g. a tree)."""
    dev = _device(device, "plan_verify")
    hp = plan_verify_host(
        slots=slots,
        draft_token_num=draft_token_num,
        track_mask=track_mask,
        track_slots=track_slots,
        forward_cls=forward_cls,
    )
    views = pack_arrays(list(hp.arrays.values()), dev, as_bool=[k in BOOL_PARTS for k in hp.arrays])
    return prepare_target_verify(hp._forward(views, engine))
