from __future__ import annotations

import pytest

from chunkstore.events import EventKind
from chunkstore.hashing import Namespace, page_keys
from workers.engine.kv_pool import KVPool

NS = Namespace("m")


def _keys(tokens, page_size=4):
    return page_keys(tokens, page_size, NS)


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
    keys = _keys(tokens)
    pages = pool.allocate(3)
    for i, (page, key) in enumerate(zip(pages, keys, strict=True)):
        assert pool.publish(page, key, tokens[i * 4 : (i + 1) * 4])
    pool.release(pages)
    token_pages = [tokens[i * 4 : (i + 1) * 4] for i in range(3)]
    assert pool.match_prefix(keys, token_pages) == pages
    # same key with other tokens (a collision) is not a hit
    assert pool.match_prefix(keys, [[99, 99, 99, 99]]) == []
    stored = [e for e in pool.drain_events() if e.kind is EventKind.STORED]
    assert [k for e in stored for k in e.keys] == keys
    # allocating evicts least recently used first: release order was tail first
    new = pool.allocate(1)
    assert new == [pages[0]] or new == [pages[2]]
    removed = pool.drain_events()
    assert removed[0].kind is EventKind.REMOVED and len(removed[0].keys) == 1


def test_tail_pages_evicted_before_head():
    pool = KVPool(3, 4)
    tokens = list(range(12))
    keys = _keys(tokens)
    pages = pool.allocate(3)
    for i, (page, key) in enumerate(zip(pages, keys, strict=True)):
        pool.publish(page, key, tokens[i * 4 : (i + 1) * 4])
    pool.release(pages)
    assert pool.allocate(1) == [pages[2]]
    token_pages = [tokens[i * 4 : (i + 1) * 4] for i in range(3)]
    assert pool.match_prefix(keys, token_pages) == pages[:2]


def test_duplicate_key_keeps_first_page_and_acquire_protects():
    pool = KVPool(4, 4)
    key = _keys([1, 2, 3, 4])[0]
    a, b = pool.allocate(2)
    assert pool.publish(a, key, [1, 2, 3, 4])
    assert not pool.publish(b, key, [1, 2, 3, 4])
    pool.release([a, b])
    assert pool.num_available == 4
    pool.acquire([a])  # a hit takes a reference: no longer evictable
    assert pool.allocate(4) is None
    assert pool.allocate(3) is not None


def test_clear_forgets_keys_and_emits_cleared():
    pool = KVPool(2, 4)
    key = _keys([1, 2, 3, 4])[0]
    (a,) = pool.allocate(1)
    pool.publish(a, key, [1, 2, 3, 4])
    pool.release([a])
    pool.clear()
    assert pool.cached_keys() == []
    assert pool.match_prefix([key], [[1, 2, 3, 4]]) == []
    assert pool.drain_events()[-1].kind is EventKind.CLEARED
    assert pool.num_available == 2


def test_publish_rejects_partial_or_unused_pages():
    pool = KVPool(2, 4)
    key = _keys([1, 2, 3, 4])[0]
    with pytest.raises(ValueError, match="in use"):
        pool.publish(0, key, [1, 2, 3, 4])
    (a,) = pool.allocate(1)
    with pytest.raises(ValueError, match="full pages"):
        pool.publish(a, key, [1, 2])
