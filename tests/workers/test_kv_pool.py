from __future__ import annotations

import pytest

from chunkstore.events import EventKind
from chunkstore.hashing import Namespace, pack_tokens, page_keys, root_key
from workers.engine.kv_pool import KVPool

NS = Namespace("m")


ROOT = root_key(NS)


def _keys(tokens, page_size=4):
    return page_keys(tokens, page_size, NS)


def _publish_chain(pool, pages, tokens):
    """Publish ``pages`` as the full 4-token pages of ``tokens``, in chain order."""
    keys = _keys(tokens)
    for i, (page, key) in enumerate(zip(pages, keys, strict=False)):
        page_tokens = pack_tokens(tokens[i * 4 : (i + 1) * 4])
        assert pool.publish(page, key, page_tokens, keys[i - 1] if i else ROOT)
    return keys


def test_allocate_release_and_states():
    pool = KVPool(4, 4)
    pages = pool.allocate(3)
    assert pages is not None and len(set(pages)) == 3
    assert pool.num_available == 1
    assert pool.allocate(2) is None and pool.num_available == 1  # no partial allocation
    pool.release(pages)
    assert pool.num_available == 4
    with pytest.raises(ValueError, match="released more often"):
        pool.release(pages[:1])


def test_publish_match_verifies_tokens_and_evicts_lru():
    pool = KVPool(3, 4)
    tokens = list(range(12))
    pages = pool.allocate(3)
    keys = _publish_chain(pool, pages, tokens)
    pool.release(pages)
    assert pool.match_chain(ROOT, pack_tokens(tokens), 3) == pages
    # other tokens after the same parent are not a hit
    assert pool.match_chain(ROOT, pack_tokens([99, 99, 99, 99]), 1) == []
    stored = [e for e in pool.drain_events() if e.kind is EventKind.STORED]
    assert [k for e in stored for k in e.keys] == keys
    assert len(stored) == 1  # three pages stored in a row: one event
    # allocating evicts least recently used first: release order was tail first
    new = pool.allocate(1)
    assert new == [pages[0]] or new == [pages[2]]
    removed = pool.drain_events()
    assert removed[0].kind is EventKind.REMOVED and len(removed[0].keys) == 1


def test_tail_pages_evicted_before_head():
    pool = KVPool(3, 4)
    tokens = list(range(12))
    pages = pool.allocate(3)
    _publish_chain(pool, pages, tokens)
    pool.release(pages)
    assert pool.allocate(1) == [pages[2]]
    assert pool.match_chain(ROOT, pack_tokens(tokens), 3) == pages[:2]


def test_pages_released_cold_are_evicted_first_tail_first_until_used_again():
    """An older chain released as usual outlives a newer one released cold from its
    second page: the cold pages go first (tail first), then the usual LRU order; a
    hit on a cold page makes it as recent as any."""
    pool = KVPool(6, 4)
    old_pages, new_pages = pool.allocate(3), pool.allocate(3)
    _publish_chain(pool, old_pages, list(range(12)))
    _publish_chain(pool, new_pages, list(range(100, 112)))
    pool.release(old_pages)
    pool.release(new_pages, cold_from=1)  # its first page was a hit: released as usual
    assert pool.allocate(1) == [new_pages[2]]
    assert pool.allocate(1) == [new_pages[1]]
    assert pool.allocate(1) == [old_pages[2]]  # then least recently used first
    assert pool.match_chain(ROOT, pack_tokens(list(range(100, 112))), 3) == new_pages[:1]

    pool = KVPool(4, 4)
    old_pages, new_pages = pool.allocate(2), pool.allocate(2)
    _publish_chain(pool, old_pages, list(range(8)))
    _publish_chain(pool, new_pages, list(range(100, 108)))
    pool.release(old_pages)
    pool.release(new_pages, cold_from=0)
    pool.acquire(new_pages)  # used again: released as usual, it is the most recent
    pool.release(new_pages)
    assert pool.allocate(2) == [old_pages[1], old_pages[0]]
    with pytest.raises(ValueError, match="released more often"):
        pool.release(new_pages, cold_from=0)


def test_duplicate_key_keeps_first_page_and_acquire_protects():
    pool = KVPool(4, 4)
    key = _keys([1, 2, 3, 4])[0]
    a, b = pool.allocate(2)
    assert pool.publish(a, key, pack_tokens([1, 2, 3, 4]), ROOT)
    assert not pool.publish(b, key, pack_tokens([1, 2, 3, 4]), ROOT)
    pool.release([a, b])
    assert pool.num_available == 4
    pool.acquire([a])  # a hit takes a reference: no longer evictable
    assert pool.allocate(4) is None
    assert pool.allocate(3) is not None


def test_clear_forgets_keys_and_emits_cleared():
    pool = KVPool(2, 4)
    key = _keys([1, 2, 3, 4])[0]
    (a,) = pool.allocate(1)
    pool.publish(a, key, pack_tokens([1, 2, 3, 4]), ROOT)
    pool.release([a])
    pool.clear()
    assert pool.cached_keys() == []
    assert pool.match_chain(ROOT, pack_tokens([1, 2, 3, 4]), 1) == []
    assert pool.drain_events()[-1].kind is EventKind.CLEARED
    assert pool.num_available == 2


def test_publish_rejects_partial_or_unused_pages():
    pool = KVPool(2, 4)
    key = _keys([1, 2, 3, 4])[0]
    with pytest.raises(ValueError, match="in use"):
        pool.publish(0, key, pack_tokens([1, 2, 3, 4]), ROOT)
    (a,) = pool.allocate(1)
    with pytest.raises(ValueError, match="full pages"):
        pool.publish(a, key, pack_tokens([1, 2]), ROOT)


def test_chain_match_through_eviction_and_clear():
    """``match_chain`` (no hashing) finds the longest cached prefix, the pages the chain
    keys name, stopping at a page whose tokens differ, at an evicted page, and finding
    nothing after ``clear`` or under another namespace."""
    pool = KVPool(6, 4)
    tokens = list(range(100, 124))  # six full pages
    pages = pool.allocate(6)
    keys = _publish_chain(pool, pages, tokens)
    pool.release(pages)
    packed = pack_tokens(tokens)
    assert pool.match_chain(ROOT, packed, 6) == pages
    assert pool.keys_of(pages) == keys
    assert pool.match_chain(ROOT, packed, 4) == pages[:4]  # max_pages bounds it
    assert pool.match_chain(ROOT, packed[:-1], 6) == pages[:5]  # a partial page: no match
    assert pool.match_chain(keys[1], packed[8 * 4 :], 6) == pages[2:]  # from a parent
    other = tokens[:13] + [7] + tokens[14:]  # page 3 differs by one token
    assert pool.match_chain(ROOT, pack_tokens(other), 6) == pages[:3]
    assert pool.match_chain(root_key(Namespace("m", "tenant")), packed, 6) == []
    pool.evict([pages[2]])  # the chain breaks there, as it does for keys
    assert pool.match_chain(ROOT, packed, 6) == pages[:2]
    # the evicted page, republished with other tokens, is found by those only
    (again,) = pool.allocate(1)  # the only free page
    assert again == pages[2]
    other_keys = _keys(other)
    assert pool.publish(again, other_keys[3], pack_tokens(other[12:16]), other_keys[2])
    assert pool.match_chain(ROOT, packed, 6) == pages[:2]
    pool.clear()
    assert pool.match_chain(ROOT, packed, 6) == []


def _entries(pool, names, pages_each=1):
    """Store one entry per name, ``pages_each`` pages (4 tokens a page) each."""
    stored = {}
    for name in names:
        key = name.encode().ljust(32, b"\0")
        assert pool.store_entry(key, pool.allocate(pages_each), 4 * pages_each)
        stored[name] = pool.entry(key)
    return stored


def _evicted(pool) -> list[bytes]:
    events = pool.drain_events()
    return [k.rstrip(b"\0") for e in events if e.kind is EventKind.ENTRY_REMOVED for k in e.keys]


def test_entries_are_evicted_by_value_then_recency():
    """An entry placed often outlives entries placed less; among equals the least
    recently used goes first."""
    pool = KVPool(4, 4)
    entries = _entries(pool, "abcd")
    for name, hits in (("a", 2), ("b", 1), ("d", 1)):
        for _ in range(hits):
            pool.note_hit(entries[name])
    pool.drain_events()
    pages = [pool.allocate(1) for _ in range(3)]
    assert _evicted(pool) == [b"c", b"b", b"d"]  # c never placed; b before d (older)
    assert pool.entry(entries["a"].key) is entries["a"]
    for page in pages:
        pool.release(page)


def test_an_entry_not_placed_for_long_is_overtaken_by_the_clock():
    """Evictions raise the pool's clock to what they evicted: entries stored later
    start above it, so a once-popular entry left unplaced goes before them."""
    pool = KVPool(3, 4)
    old = _entries(pool, "o")["o"]
    pool.note_hit(old)  # priority 2, clock 0
    for name in "xyz":
        _entries(pool, name)  # priority: the clock + 1
        pool.release(pool.allocate(2))  # one entry evicted each time
    # x (priority 1) goes first and lifts the clock to 1; y, stored at 2, ties with o,
    # which is older; z (3) outlives y (2)
    assert _evicted(pool) == [b"x", b"o", b"y"]
    assert pool.entry(old.key) is None


def test_admissions_spare_proven_entries_up_to_the_reserve():
    """While sparing, allocation takes free pages, then unproven entries, and leaves
    proven entries' pages alone up to the reserve; without sparing every entry can go."""
    pool = KVPool(8, 4, entry_reserve_pages=2)
    entries = _entries(pool, "pqu")  # 3 pages in entries, 5 free
    pool.note_hit(entries["p"])
    pool.note_hit(entries["q"])
    pool.drain_events()
    with pool.sparing_entries():
        assert pool.num_available == 6  # 5 free + the unproven entry
        assert pool.allocate(7) is None
        taken = pool.allocate(6)
    assert _evicted(pool) == [b"u"]  # the unproven one
    assert pool.num_available == 2  # outside sparing: both proven entries
    with pool.sparing_entries(False):
        extra = pool.allocate(1)
    assert len(_evicted(pool)) == 1
    for pages in (taken, extra):
        pool.release(pages)


def test_entry_reserve_must_be_a_page_count():
    with pytest.raises(ValueError, match="entry_reserve_pages"):
        KVPool(4, 4, entry_reserve_pages=-1)
