"""Prefix cache for recurrent state: token prefixes at track boundaries -> track slots.

An entry maps the exact token prefix ``tokens[:b]`` (``b`` a multiple of the track
interval) to a track slot holding the model state after those ``b`` tokens: conv + SSM
state of every Mamba layer and the attention KV of positions ``[0, b)``. Entries are
evicted least recently used first; slots reserved in the current step are pinned so a
step never overwrites a snapshot it is still writing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hybridmeta.runtime.state import SlotAllocator

__all__ = ["PrefixCache"]


class PrefixCache:
    """LRU map from token prefixes at track boundaries to track slots."""

    def __init__(self, slots: SlotAllocator, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"PrefixCache: interval must be >= 1, got {interval}")
        self.slots = slots
        self.interval = interval
        self._entries: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._pinned: set[int] = set()
        self._pending: set[tuple[int, ...]] = set()  # keys reserved in this step
        self.lookups = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> tuple[tuple[int, ...], ...]:
        """The cached prefixes, least recently used first."""
        return tuple(self._entries)

    def lookup(self, tokens: Sequence[int], *, max_boundary: int) -> tuple[int, int] | None:
        """Longest cached boundary ``b <= max_boundary`` with ``tokens[:b]`` cached.

        Returns ``(b, track_slot)`` or ``None``; counts a lookup and, if found, a hit.
        """
        self.lookups += 1
        b = (min(max_boundary, len(tokens)) // self.interval) * self.interval
        while b > 0:
            key = tuple(tokens[:b])
            slot = self._entries.get(key)
            if slot is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return b, slot
            b -= self.interval
        return None

    def reserve(self, key: tuple[int, ...]) -> int | None:
        """A track slot to write the state after ``key`` into, or ``None``.

        ``None`` when ``key`` is already cached or reserved in this step, its length is not
        a boundary, or every slot is pinned by this step. The slot is pinned until :meth:`end_step`; the entry
        becomes visible with :meth:`commit` once the step has written the state.
        """
        if not key or len(key) % self.interval or key in self._entries or key in self._pending:
            return None
        if self.slots.num_free == 0:
            victim = next((k for k, s in self._entries.items() if s not in self._pinned), None)
            if victim is None:
                return None
            self.slots.free(self._entries.pop(victim))
            self.evictions += 1
        slot = self.slots.allocate()
        self._pinned.add(slot)
        self._pending.add(key)
        return slot

    def commit(self, key: tuple[int, ...], slot: int) -> None:
        """Publish a reserved slot under ``key`` (after its state was written)."""
        if slot not in self._pinned:
            raise ValueError(f"PrefixCache.commit: slot {slot} was not reserved in this step")
        self._entries[key] = slot

    def end_step(self) -> None:
        """Unpin this step's slots; reserved but uncommitted slots are freed."""
        committed = set(self._entries.values())
        for slot in self._pinned - committed:
            self.slots.free(slot)
        self._pinned.clear()
        self._pending.clear()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0
