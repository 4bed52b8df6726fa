"""Pins are references that outlive requests; ``evict`` frees only unreferenced pages."""

from __future__ import annotations

import pytest

from chunkstore.events import CacheEvent, EventKind
from chunkstore.hashing import Namespace, pack_tokens, page_keys, root_key
from workers.engine.kv_pool import KVPool

NS = Namespace("m")
TOKENS = list(range(12))


def _cached_pool(num_pages: int = 4) -> tuple[KVPool, list[int], list[bytes]]:
    """A pool holding three cached, unreferenced pages of ``TOKENS``."""
    pool = KVPool(num_pages, 4)
    keys = page_keys(TOKENS, 4, NS)
    pages = pool.allocate(3)
    for i, (page, key) in enumerate(zip(pages, keys, strict=True)):
        page_tokens = pack_tokens(TOKENS[i * 4 : (i + 1) * 4])
        pool.publish(page, key, page_tokens, keys[i - 1] if i else root_key(NS))
    pool.release(pages)
    pool.drain_events()
    return pool, pages, keys


def test_pinned_page_is_never_evicted_and_pins_nest():
    pool, pages, keys = _cached_pool()
    pool.pin(pages[:1])
    pool.pin(pages[:1])
    assert pool.num_pinned == 1 and pool.pin_count(pages[0]) == 2
    assert pool.num_available == 3
    assert pool.allocate(4) is None
    taken = pool.allocate(3)  # evicts every cached page but the pinned one
    assert pages[0] not in taken
    assert pool.match_chain(root_key(NS), pack_tokens(TOKENS), 4) == pages[:1]
    pool.release(taken)
    pool.unpin(pages[:1])
    assert pool.num_pinned == 1 and pool.num_available == 3  # one pin left
    pool.unpin(pages[:1])
    assert pool.num_pinned == 0 and pool.num_available == 4
    assert pool.ref_count(pages[0]) == 0


def test_pin_of_a_page_in_use_outlives_the_request():
    pool, pages, _ = _cached_pool()
    pool.acquire(pages[:1])  # a running request's hit
    pool.pin(pages[:1])
    pool.release(pages[:1])
    assert pool.ref_count(pages[0]) == 1 and pool.num_available == 3
    pool.unpin(pages[:1])
    assert pool.ref_count(pages[0]) == 0 and pool.num_available == 4


def test_pin_and_unpin_are_atomic():
    pool, pages, _ = _cached_pool()
    free = next(p for p in range(4) if p not in pages)
    with pytest.raises(ValueError, match="free"):
        pool.pin([pages[0], free])
    assert pool.num_pinned == 0 and pool.pin_count(pages[0]) == 0
    pool.pin(pages[:1])
    with pytest.raises(ValueError, match="unpinned more often"):
        pool.unpin([pages[0], pages[0]])
    assert pool.pin_count(pages[0]) == 1


def test_evict_frees_only_unreferenced_pages_and_emits_removed():
    pool, pages, keys = _cached_pool()
    pool.pin(pages[:1])
    pool.acquire(pages[1:2])
    assert pool.evict(pages) == [keys[2]]
    assert pool.drain_events() == [_removed([keys[2]])]
    assert set(pool.cached_keys()) == set(keys[:2])
    assert pool.evict(pages) == [] and pool.drain_events() == []  # nothing left to drop
    pool.unpin(pages[:1])
    pool.release(pages[1:2])
    assert pool.evict(pages) == [keys[0], keys[1]]
    assert pool.cached_keys() == [] and pool.num_available == 4


def _removed(keys: list[bytes]) -> CacheEvent:
    return CacheEvent(EventKind.REMOVED, tuple(keys))
