"""Prefix cache bookkeeping: boundaries only, LRU eviction, pinning, no leaked slots."""

from __future__ import annotations

import pytest

from hybridmeta.runtime.prefix_cache import PrefixCache
from hybridmeta.runtime.state import OutOfSlotsError, SlotAllocator


def _cache(n: int = 2) -> PrefixCache:
    return PrefixCache(SlotAllocator(10, n, "track"), interval=4)


def test_lookup_finds_the_longest_cached_boundary_below_the_limit() -> None:
    c = _cache(3)
    for key in [(1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8)]:
        slot = c.reserve(key)
        assert slot is not None
        c.commit(key, slot)
    c.end_step()
    toks = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert c.lookup(toks, max_boundary=8) == (8, 11)
    assert c.lookup(toks, max_boundary=7) == (4, 10)
    assert c.lookup((1, 2, 3, 5, 5), max_boundary=4) is None
    assert (c.hits, c.lookups) == (2, 3)


def test_only_boundaries_and_new_keys_are_reserved() -> None:
    c = _cache()
    assert c.reserve((1, 2, 3)) is None  # not a multiple of the interval
    assert c.reserve(()) is None
    slot = c.reserve((1, 2, 3, 4))
    assert slot is not None
    # the same key twice in one step (two identical prompts) gets one slot, not a leak
    assert c.reserve((1, 2, 3, 4)) is None
    c.commit((1, 2, 3, 4), slot)
    c.end_step()
    assert c.reserve((1, 2, 3, 4)) is None  # already cached
    assert len(c) == 1
    assert len(c.slots.used) == 1


def test_eviction_is_lru_and_spares_slots_pinned_in_this_step() -> None:
    c = _cache(2)
    a, b = (1, 1, 1, 1), (2, 2, 2, 2)
    for key in (a, b):
        s = c.reserve(key)
        assert s is not None
        c.commit(key, s)
    c.end_step()
    assert c.lookup(a, max_boundary=4) is not None  # a is now most recently used
    s = c.reserve((3, 3, 3, 3))
    assert s is not None
    assert c.evictions == 1
    assert b not in c and a in c
    # every slot is pinned or the only other entry; reserving again evicts a, then nothing
    s2 = c.reserve((4, 4, 4, 4))
    assert s2 is not None and a not in c
    assert c.reserve((5, 5, 5, 5)) is None
    c.end_step()  # uncommitted reservations are freed
    assert len(c) == 0
    assert c.slots.num_free == 2


def test_commit_needs_a_reservation() -> None:
    c = _cache()
    with pytest.raises(ValueError, match="was not reserved in this step"):
        c.commit((1, 2, 3, 4), 10)


def test_slot_allocator_refuses_double_free_and_exhaustion() -> None:
    s = SlotAllocator(1, 1, "working")
    slot = s.allocate()
    with pytest.raises(OutOfSlotsError, match="no free working slot"):
        s.allocate()
    s.free(slot)
    with pytest.raises(ValueError, match="working slot 1 is not allocated"):
        s.free(slot)
