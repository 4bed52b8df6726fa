"""Identical text under two tenants gives different keys (page keys and position-free
entry keys alike); B's lookups never see A's chunks or entries."""

from __future__ import annotations

from chunkstore.events import CacheEvent, EventKind
from chunkstore.hashing import (
    Namespace,
    chunk_keys,
    pack_tokens,
    packed_position_free_key,
    page_keys,
    position_free_key,
)

PAGE = 4
SYSTEM = list(b"You are a helpful assistant. ")
DOCUMENT = list(b"The quarterly figures are attached below.")
CHUNK_LENGTHS = [len(SYSTEM), len(DOCUMENT)]


def request_keys(namespace: Namespace) -> tuple[list[bytes], list[int]]:
    tokens = SYSTEM + DOCUMENT
    pages = page_keys(tokens, PAGE, namespace)
    keys = chunk_keys(CHUNK_LENGTHS, pages, PAGE)
    assert None not in keys
    return keys, [len(SYSTEM), len(tokens)]


def test_identical_tokens_under_two_tenants_give_disjoint_keys():
    tokens = SYSTEM + DOCUMENT
    a = page_keys(tokens, PAGE, Namespace("model", tenant_salt="tenant-a"))
    b = page_keys(tokens, PAGE, Namespace("model", tenant_salt="tenant-b"))
    assert len(a) == len(b) > 0
    assert not set(a) & set(b)


def test_lookup_under_tenant_b_never_reports_tenant_a(make_directory):
    directory = make_directory()
    tenant_a = Namespace("model", tenant_salt="tenant-a")
    tenant_b = Namespace("model", tenant_salt="tenant-b")
    tokens = SYSTEM + DOCUMENT
    directory.publish_snapshot("worker-a", 1, 0, page_keys(tokens, PAGE, tenant_a))
    keys_a, ends = request_keys(tenant_a)
    keys_b, _ = request_keys(tenant_b)
    assert directory.lookup(keys_a, ends).holding("worker-a").chunks == 2
    result_b = directory.lookup(keys_b, ends)
    assert result_b.available and result_b.holdings == ()
    # once tenant B's own request is cached, B sees only B's worker
    directory.publish_snapshot("worker-b", 1, 0, page_keys(tokens, PAGE, tenant_b))
    assert [h.worker_id for h in directory.lookup(keys_b, ends).holdings] == ["worker-b"]


def test_identical_chunks_under_two_tenants_give_different_entry_keys():
    a = Namespace("model", tenant_salt="tenant-a")
    b = Namespace("model", tenant_salt="tenant-b")
    assert position_free_key(a, DOCUMENT) != position_free_key(b, DOCUMENT)
    assert position_free_key(a, DOCUMENT) == position_free_key(a, list(DOCUMENT))
    # the packed form an admission hashes (a slice of the prompt's packed ids) agrees
    packed = pack_tokens([7, *DOCUMENT, 9])[4:-4]
    assert packed_position_free_key(a, packed) == position_free_key(a, DOCUMENT)
    assert packed_position_free_key(b, packed) != position_free_key(a, DOCUMENT)
    # and entry keys never collide with page keys of the same tokens
    assert position_free_key(a, DOCUMENT[:PAGE]) not in page_keys(DOCUMENT[:PAGE], PAGE, a)


def test_entry_lookup_under_tenant_b_never_reports_tenant_a(make_directory):
    directory = make_directory()
    tenant_a = Namespace("model", tenant_salt="tenant-a")
    tenant_b = Namespace("model", tenant_salt="tenant-b")
    entry_a, entry_b = position_free_key(tenant_a, DOCUMENT), position_free_key(tenant_b, DOCUMENT)
    stored_a = CacheEvent(EventKind.ENTRY_STORED, (entry_a,))
    directory.publish("worker-a", 1, 0, [stored_a])
    assert directory.lookup([], [], [entry_a]).entries_of("worker-a") == (0,)
    result_b = directory.lookup([], [], [entry_b])
    assert result_b.available and result_b.entries == ()
