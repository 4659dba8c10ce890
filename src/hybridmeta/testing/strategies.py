"""Hypothesis strategies for testing an engine's Mamba2 decode path.

* :func:`batches`: one step's rows (``bs <= max_bs``): working slots, track slots and
  track mask, prefill/decode mixes, pad rows and draft trees; drawn element by element so
  Hypothesis shrinks them to the smallest failing batch.
* :func:`tail_fills` / :func:`fill_tail`: what a stale tail of a static buffer holds (NaN,
  huge values, zeros, the previous step's values, other requests' slots).
* :func:`metadata_instances`: valid instances of any ``@hybridmeta.metadata`` class, drawn
  from its field declarations.
* :func:`draft_trees`: speculative-decoding token trees in the ``retrieve_*`` layout.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from hypothesis import strategies as st

from hybridmeta.testing import _schema

__all__ = [
    "Batch",
    "DraftTree",
    "TailFill",
    "batches",
    "draft_trees",
    "fill_tail",
    "metadata_instances",
    "tail_fills",
]


# --------------------------------------------------------------------------- draft trees


@dataclass(frozen=True)
class DraftTree:
    """A draft token tree of ``k`` tokens in sglang's ``retrieve_*`` layout.

    Token 0 is the root (the last verified token). ``parent[i] < i`` for ``i > 0``;
    ``next_token[i]`` is the first child of ``i`` and ``next_sibling[i]`` the next child of
    ``parent[i]``; ``-1`` where there is none.
    """

    parent: tuple[int, ...]
    next_token: tuple[int, ...]
    next_sibling: tuple[int, ...]

    @property
    def k(self) -> int:
        return len(self.parent)


@st.composite
def draft_trees(draw: st.DrawFn, k: int) -> DraftTree:
    """A random tree of ``k >= 1`` draft tokens (a chain shrinks to the simplest)."""
    if k < 1:
        raise ValueError(f"draft_trees: k must be >= 1, got {k}")
    parent = [-1] + [i - 1 - draw(st.integers(0, i - 1)) for i in range(1, k)]
    next_token = [-1] * k
    next_sibling = [-1] * k
    last_child: dict[int, int] = {}
    for i in range(1, k):
        p = parent[i]
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            next_token[p] = i
        last_child[p] = i
    return DraftTree(tuple(parent), tuple(next_token), tuple(next_sibling))


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    """The rows of one forward, in physical slot ids (prefill rows first, decodes last).

    Attributes
    ----------
    slots : tuple of int
        Working state slot of each row; ``-1`` marks a pad row inside the batch. Live
        slots are distinct.
    track_slots : tuple of int
        Track (prefix-cache) slot of each row, or ``-1``. Flagged rows have distinct track
        slots, disjoint from every working slot; an unflagged row may carry any slot,
        another row's included (it must not be written).
    track_mask : tuple of bool
        Rows whose new state is saved into their track slot.
    extend_lens : tuple of int
        New tokens of each row: ``draft_token_num`` for a decode row.
    num_prefills : int
        The first ``num_prefills`` rows are prefill (extend) rows.
    draft_token_num : int
        Tokens per decode row (``> 1``: speculative target verify).
    draft_trees : tuple of DraftTree, or None
        One tree per row when ``draft_token_num > 1``.
    seed : int
        Seed for the step's float inputs.
    """

    slots: tuple[int, ...]
    track_slots: tuple[int, ...]
    track_mask: tuple[bool, ...]
    extend_lens: tuple[int, ...]
    num_prefills: int = 0
    draft_token_num: int = 1
    draft_trees: tuple[DraftTree, ...] | None = None
    seed: int = 0

    @property
    def bs(self) -> int:
        """Rows of the batch (pad rows included)."""
        return len(self.slots)

    @property
    def num_decodes(self) -> int:
        return self.bs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def query_start_loc(self) -> tuple[int, ...]:
        """``[bs + 1]`` token offsets of the rows."""
        out = [0]
        for n in self.extend_lens:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def has_track(self) -> bool:
        """Whether any live row saves its state this step (the host-side flag)."""
        return len(self.tracked_rows()) > 0  # (row indices: any() would miss row 0)

    def live_rows(self) -> tuple[int, ...]:
        """Rows with a working slot (not pad rows)."""
        return tuple(i for i, s in enumerate(self.slots) if s >= 0)

    def tracked_rows(self) -> tuple[int, ...]:
        """Live rows that save their new state into their track slot."""
        return tuple(
            i
            for i, (s, t, m) in enumerate(zip(self.slots, self.track_slots, self.track_mask, strict=True))
            if m and s >= 0 and t >= 0
        )

    def addressed(self) -> dict[int, str]:
        """Every slot a correct step may write, with the row that owns it."""
        out = {s: f"working slot of row {i}" for i, s in enumerate(self.slots) if s >= 0}
        for i in self.tracked_rows():
            out[self.track_slots[i]] = f"track slot of row {i}"
        return out

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        # Hypothesis prints falsifying examples with this (one line, the fields that matter).
        p.text(repr(self))

    def __repr__(self) -> str:
        parts = [
            f"bs={self.bs}",
            f"slots={self.slots}",
            f"track_slots={self.track_slots}",
            f"track_mask={self.track_mask}",
        ]
        if self.num_prefills:
            parts += [f"num_prefills={self.num_prefills}", f"extend_lens={self.extend_lens}"]
        if self.draft_token_num > 1:
            parts += [f"draft_token_num={self.draft_token_num}", f"draft_trees={self.draft_trees}"]
        parts.append(f"seed={self.seed}")
        return f"Batch({', '.join(parts)})"


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    max_bs: int,
    num_slots: int,
    min_bs: int = 1,
    prefills: bool = False,
    max_extend: int = 8,
    pad_rows: bool = False,
    track: bool = True,
    draft_token_num: int | st.SearchStrategy[int] = 1,
) -> Batch:
    """One forward's rows.

    Parameters
    ----------
    max_bs, min_bs : int
        Bounds of ``bs`` (rows, pad rows included).
    num_slots : int
        Slots of the state pool; at least ``2 * max_bs`` when ``track`` (working and
        flagged track slots are disjoint), else ``max_bs``.
    prefills : bool
        Draw prefill/decode mixes (prefill rows first, ``1..max_extend`` tokens each).
        Otherwise every row is a decode row.
    pad_rows : bool
        Let rows carry the pad slot ``-1`` among live rows.
    track : bool
        Draw track slots and mask (otherwise every row has ``-1`` and ``False``).
    draft_token_num : int or strategy
        Tokens per decode row; above 1 every row also gets a :class:`DraftTree`.
    """
    need = 2 * max_bs if track else max_bs
    if num_slots < need:
        raise ValueError(f"batches: num_slots={num_slots} < {need} (2 * max_bs with track)")
    if not 1 <= min_bs <= max_bs:
        raise ValueError(f"batches: need 1 <= min_bs <= max_bs, got {min_bs}, {max_bs}")
    bs = draw(st.integers(min_bs, max_bs), label="bs")
    k = draw(draft_token_num) if isinstance(draft_token_num, st.SearchStrategy) else draft_token_num
    if k < 1:
        raise ValueError(f"batches: draft_token_num must be >= 1, got {k}")
    # Slots shrink towards 0, 1, 2, ...: draw distinct slots as a shrinkable unique list.
    picked = draw(
        st.lists(
            st.integers(0, num_slots - 1), min_size=2 * bs if track else bs,
            max_size=2 * bs if track else bs, unique=True,
        )
    )  # fmt: skip
    pads = draw(st.lists(st.booleans(), min_size=bs, max_size=bs)) if pad_rows else [False] * bs
    slots = tuple(-1 if p else s for s, p in zip(picked[:bs], pads, strict=True))
    if track:
        mask = tuple(draw(st.lists(st.booleans(), min_size=bs, max_size=bs)))
        track_slots_l: list[int] = []
        for i in range(bs):
            if mask[i]:
                track_slots_l.append(picked[bs + i])
            else:
                # Unflagged: none, its own spare slot, or any slot at all (never written).
                choice = draw(st.integers(0, 2))
                track_slots_l.append(
                    -1 if choice == 0 else picked[bs + i] if choice == 1
                    else draw(st.integers(0, num_slots - 1))
                )  # fmt: skip
        track_slots = tuple(track_slots_l)
    else:
        mask, track_slots = (False,) * bs, (-1,) * bs
    num_prefills = draw(st.integers(0, bs)) if prefills else 0
    lens = tuple(
        draw(st.integers(1, max_extend)) if i < num_prefills else k for i in range(bs)
    )
    trees = tuple(draw(draft_trees(k)) for _ in range(bs)) if k > 1 else None
    return Batch(
        slots=slots,
        track_slots=track_slots,
        track_mask=mask,
        extend_lens=lens,
        num_prefills=num_prefills,
        draft_token_num=k,
        draft_trees=trees,
        seed=draw(st.integers(0, 2**16), label="seed"),
    )


# --------------------------------------------------------------------------- stale tails


class TailFill(enum.Enum):
    """What the rows of a static buffer past the live prefix hold before a step.

    ====================  ===================  ===================  ===============
    fill                  float buffers        index buffers        bool buffers
    ====================  ===================  ===================  ===============
    ``ZEROS``             0                    0 (slot 0)           False
    ``PREVIOUS``          the previous step's values, untouched
    ``NAN``               NaN                  other slots          True
    ``HUGE``              dtype max            the last slot        True
    ``OTHER_SLOTS``       random normal        random slots         random
    ====================  ===================  ===================  ===============

    A fresh ``torch.zeros`` buffer is ``ZEROS`` (the seed defect read slot 0 from it);
    index buffers never get out-of-range values, so a defect shows up as a wrong slot
    written rather than a crash.
    """

    ZEROS = "zeros"
    PREVIOUS = "previous"
    NAN = "nan"
    HUGE = "huge"
    OTHER_SLOTS = "other_slots"


def tail_fills() -> st.SearchStrategy[TailFill]:
    """Any :class:`TailFill` (shrinks towards ``ZEROS``)."""
    return st.sampled_from(list(TailFill))


def fill_tail(t: torch.Tensor, fill: TailFill, *, num_slots: int, seed: int = 0) -> None:
    """Overwrite ``t`` (the stale rows of a static buffer) in place with ``fill``."""
    if t.numel() == 0 or fill is TailFill.PREVIOUS:
        return
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(t.shape)
    if t.dtype == torch.bool:
        if fill is TailFill.ZEROS:
            v = torch.zeros(shape, dtype=torch.bool)
        elif fill is TailFill.OTHER_SLOTS:
            v = torch.rand(shape, generator=gen) < 0.5
        else:
            v = torch.ones(shape, dtype=torch.bool)
    elif t.is_floating_point():
        if fill is TailFill.ZEROS:
            v = torch.zeros(shape)
        elif fill is TailFill.NAN:
            v = torch.full(shape, float("nan"))
        elif fill is TailFill.HUGE:
            v = torch.full(shape, torch.finfo(t.dtype).max)
        else:
            v = torch.randn(shape, generator=gen)
    else:
        if fill is TailFill.ZEROS:
            v = torch.zeros(shape, dtype=torch.int64)
        elif fill is TailFill.HUGE:
            v = torch.full(shape, max(num_slots - 1, 0), dtype=torch.int64)
        else:
            v = torch.randint(0, max(num_slots, 1), shape, generator=gen)
    t.copy_(v.to(device=t.device, dtype=t.dtype))


# --------------------------------------------------------------------------- metadata

#: A per-field value: a strategy, or a function of the values drawn so far (fields by name
#: and rows symbols such as ``"batch"``) returning one.
FieldValue: TypeAlias = (
    "st.SearchStrategy[Any] | Callable[[Mapping[str, Any]], st.SearchStrategy[Any]]"
)


def _int_tensor(
    draw: st.DrawFn, shape: tuple[int, ...], low: int, high: int, dtype: torch.dtype
) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    vals = draw(st.lists(st.integers(low, high), min_size=n, max_size=n))
    return torch.tensor(vals, dtype=torch.int64).reshape(shape).to(dtype)


def _draw_tensor(
    draw: st.DrawFn, f: _schema.FieldInfo, shape: tuple[int, ...], num_slots: int
) -> torch.Tensor:
    dtypes = f.dtypes if f.dtypes else (torch.float32,)
    dtype = draw(st.sampled_from(dtypes))
    if dtype == torch.bool:
        return _int_tensor(draw, shape, 0, 1, torch.int64).to(torch.bool)
    if dtype.is_floating_point:
        n = 1
        for d in shape:
            n *= d
        vals = draw(st.lists(st.floats(-4, 4, width=16), min_size=n, max_size=n))
        return torch.tensor(vals, dtype=torch.float32).reshape(shape).to(dtype)
    if f.cumulative and len(shape) == 1:
        lens = draw(st.lists(st.integers(0, 4), min_size=max(shape[0] - 1, 0),
                             max_size=max(shape[0] - 1, 0)))  # fmt: skip
        out = [0]
        for n in lens:
            out.append(out[-1] + n)
        return torch.tensor(out[: shape[0]], dtype=dtype)
    # Slot ids in [0, num_slots), and -1 where that is the declared pad (the class's null
    # slot): under a reserved null slot such as vLLM's 0, -1 is no slot at all.
    low = -1 if f.is_slot and f.pad_value == -1 else 0
    return _int_tensor(draw, shape, low, num_slots - 1, dtype)


def _non_tensor_strategy(tp: Any) -> st.SearchStrategy[Any] | None:
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(1, 4)
    if tp is float:
        return st.floats(-4, 4)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = _non_tensor_strategy(args[0])
        return None if inner is None else st.lists(inner, max_size=4).map(tuple)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _non_tensor_strategy(rest[0])
            return st.none() if inner is None else st.one_of(st.none(), inner)
    return None


@st.composite
def metadata_instances(
    draw: st.DrawFn,
    cls: type,
    *,
    max_bs: int = 4,
    max_rows: int = 6,
    num_slots: int = 16,
    device: torch.device | str = "cpu",
    values: Mapping[str, FieldValue] | None = None,
    cols: Mapping[str, str | int] | None = None,
    localns: Mapping[str, Any] | None = None,
) -> Any:
    """A valid instance of the ``@hybridmeta.metadata`` class ``cls``, from its declarations.

    Each rows symbol gets one drawn length (``batch`` in ``[1, max_bs]``, any other in
    ``[0, max_rows]``) shared by every field that declares it; slot fields get slot ids in
    ``[0, num_slots)`` and ``-1`` where that is their declared pad (not under conventions
    that reserve a null slot, such as vLLM's 0), offsets arrays non-decreasing offsets from
    0, masks booleans. Optional fields are all present, all absent, or each drawn.
    Non-tensor fields are drawn from their annotation (``bool``, ``int``, ``float``,
    optionals and tuples of those). A derived class is built from a drawn source instance
    through its ``evolve_from``.

    Parameters
    ----------
    values : mapping of str to strategy or callable, optional
        Per-field strategies overriding the declarations; a callable receives the values
        drawn so far (and the rows symbols) and returns a strategy. Required for fields
        whose annotation is not drawable (nested metadata, for instance).
    cols : mapping of str to str or int, optional
        Dimension 1 of 2-D fields: an int field's name or a constant (overrides what the
        declaration says; by default all 2-D fields share one drawn width).
    localns : mapping of str to object, optional
        Names for string annotations the class's module does not define at run time
        (``if TYPE_CHECKING:`` imports). A non-tensor field whose annotation cannot be
        evaluated is an error naming it, unless ``values`` covers it.

    Instances the class's own validation rejects are discarded (``hypothesis.reject``).
    """
    from hypothesis import reject

    overrides = dict(values or {})
    col_map = dict(cols or {})
    src, derived_names = _schema.derivation(cls)
    if src is not None:
        source = draw(
            metadata_instances(
                src, max_bs=max_bs, max_rows=max_rows, num_slots=num_slots, device=device,
                values={k: v for k, v in overrides.items() if k not in derived_names},
                cols=col_map, localns=localns,
            )
        )  # fmt: skip
        drawn: dict[str, Any] = {f.name: getattr(source, f.name) for f in _schema.fields(src)}
        drawn.update(_rows_symbols(source, src))
        kwargs = _draw_fields(draw, cls, derived_names, drawn, overrides, col_map, num_slots,
                              max_bs, max_rows, device, localns)  # fmt: skip
        try:
            return cls.evolve_from(source, **kwargs)  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            reject()
    names = tuple(f.name for f in _schema.fields(cls))
    kwargs = _draw_fields(draw, cls, names, {}, overrides, col_map, num_slots, max_bs, max_rows,
                          device, localns)  # fmt: skip
    try:
        return cls(**kwargs)
    except ValueError:
        reject()


def _rows_symbols(obj: object, cls: type) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in _schema.fields(cls):
        v = getattr(obj, f.name)
        if f.rows is not None and isinstance(v, torch.Tensor) and f.rows.symbol not in out:
            out[f.rows.symbol] = int(v.shape[0]) - f.rows.offset
    return out


def _draw_fields(
    draw: st.DrawFn,
    cls: type,
    names: tuple[str, ...],
    drawn: dict[str, Any],
    overrides: Mapping[str, FieldValue],
    col_map: Mapping[str, str | int],
    num_slots: int,
    max_bs: int,
    max_rows: int,
    device: torch.device | str,
    localns: Mapping[str, Any] | None,
) -> dict[str, Any]:
    infos = {f.name: f for f in _schema.fields(cls)}
    hints, unresolved = _schema.type_hints(cls, localns)
    bad = {
        n: h for n, h in unresolved.items()
        if n in names and n in infos and not infos[n].is_tensor and n not in overrides
    }  # fmt: skip
    if bad:
        raise _schema.unresolved_hints_error(f"metadata_instances({cls.__qualname__})", cls, bad)
    presence = draw(st.sampled_from(["all", "none", "each"]), label="optional fields")
    width = draw(st.integers(1, 3), label="columns")
    kwargs: dict[str, Any] = {}

    def value_of(name: str) -> st.SearchStrategy[Any] | None:
        v = overrides.get(name)
        if v is None:
            return None
        return v if isinstance(v, st.SearchStrategy) else v({**drawn, **kwargs})

    # Governed optional fields are present or absent together (decided with their flag).
    group_present: dict[str, bool] = {}

    def decide_group(flag: _schema.FieldInfo, value: object) -> None:
        if not flag.governs:
            return
        if value and flag.required_when_set:
            present = True
        elif presence == "each":
            present = draw(st.booleans(), label=f"{flag.name} governs")
        else:
            present = presence == "all"
        group_present.update(dict.fromkeys(flag.governs, present))

    # Non-tensor fields first: a 2-D tensor's width may name one of them.
    ordered = sorted(names, key=lambda n: infos[n].is_tensor)
    for name in ordered:
        f = infos[name]
        forced = value_of(name)
        if forced is not None:
            kwargs[name] = draw(forced, label=name)
            decide_group(f, kwargs[name])
            continue
        if not f.is_tensor:
            strat = _non_tensor_strategy(hints.get(name))
            if strat is None:
                raise TypeError(
                    f"metadata_instances({cls.__qualname__}): cannot draw field {name!r} "
                    f"(annotation {hints.get(name)!r}); pass values={{{name!r}: strategy}}"
                )
            kwargs[name] = draw(strat, label=name)
            decide_group(f, kwargs[name])
            continue
        if name in group_present:
            absent = not group_present[name]
        else:
            absent = f.optional and (
                presence == "none" or (presence == "each" and draw(st.booleans()))
            )
        if absent:
            kwargs[name] = None
            continue
        if f.rows is None:
            n0 = drawn.setdefault("<free>", draw(st.integers(0, max_rows), label="free rows"))
        else:
            sym = f.rows.symbol
            if sym not in drawn:
                lo, hi = (1, max_bs) if sym == "batch" else (0, max_rows)
                drawn[sym] = draw(st.integers(lo, hi), label=f"rows {sym}")
            n0 = drawn[sym] + f.rows.offset
        shape: tuple[int, ...] = (n0,)
        if f.ndim is not None and f.ndim >= 2:
            c = col_map.get(name, f.cols)
            cw = kwargs.get(c, drawn.get(c)) if isinstance(c, str) else c
            w = cw if isinstance(cw, int) and not isinstance(cw, bool) else width
            shape = (n0, w) + (1,) * (f.ndim - 2)
        kwargs[name] = _draw_tensor(draw, f, shape, num_slots).to(device)
    return kwargs
