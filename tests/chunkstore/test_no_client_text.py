"""Nothing the client wrote reaches Redis: every key and value under the prefix is
free of a marker string, whether as text, as token ids, or as packed token ids."""

from __future__ import annotations

import struct

import msgpack
import pytest
import redis

from chunkstore.events import CacheEvent, EventKind
from chunkstore.hashing import Namespace, chunk_keys, page_keys, position_free_key
from chunkstore.publisher import EventPublisher
from chunkstore.redis_directory import RedisChunkDirectory
from tests.chunkstore.testkit import SimPool

pytestmark = pytest.mark.redis

MARKER = "SECRET-MARKER-TEXT"
PAGE = 3


def forbidden_patterns() -> list[bytes]:
    tokens = list(MARKER.encode())
    patterns = [MARKER.encode(), MARKER.lower().encode(), MARKER.encode("utf-16-le")]
    patterns += [struct.pack(f"<{PAGE}I", *tokens[i : i + PAGE]) for i in range(len(tokens) - 2)]
    patterns.append(",".join(map(str, tokens[:6])).encode())  # token ids as text
    return patterns


def dump(client: redis.Redis, prefix: str) -> list[bytes]:
    """Every key name and every value under the prefix, whatever its type."""
    blobs: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*"):
        blobs.append(key)
        kind = client.type(key).decode()
        if kind == "string":
            value = client.get(key)
            blobs += [value, repr(msgpack.unpackb(value, raw=True)).encode()]
        elif kind == "set":
            blobs += list(client.smembers(key))
        elif kind == "zset":
            blobs += [
                m
                for pair in client.zrange(key, 0, -1, withscores=True)
                for m in (pair[0], str(pair[1]).encode())
            ]
        elif kind == "hash":
            blobs += [x for kv in client.hgetall(key).items() for x in kv]
        elif kind == "list":
            blobs += list(client.lrange(key, 0, -1))
        else:
            pytest.fail(f"unexpected Redis type {kind} at {key!r}")
    return blobs


def test_marker_text_never_reaches_redis(redis_url, redis_prefix):
    directory = RedisChunkDirectory(redis_url, prefix=redis_prefix, timeout_s=0.5)
    tokens = list(MARKER.encode()) * 2
    pages = page_keys(tokens, PAGE, Namespace("model", tenant_salt=MARKER))
    pool = SimPool()
    publisher = EventPublisher(directory, "worker-0", 1, pool.drain, pool.snapshot)
    pool.store(pages[:4])
    publisher.flush()  # snapshot
    pool.store(pages[4:])
    pool.remove(pages[:1])
    publisher.flush()  # batch
    # position-free entries of the marker's chunks (approximate reuse), published as a
    # worker's KV pool does
    namespace = Namespace("model", tenant_salt=MARKER)
    entries = [position_free_key(namespace, tokens[:n]) for n in (len(MARKER), len(tokens))]
    directory.publish("worker-1", 1, 0, [CacheEvent(EventKind.ENTRY_STORED, tuple(entries))])
    keys = [k for k in chunk_keys([len(MARKER)] * 2, pages, PAGE) if k is not None]
    result = directory.lookup(keys, [len(MARKER), 2 * len(MARKER)], entries)
    assert result.holdings and result.entries_of("worker-1") == (0, 1)

    client = redis.Redis.from_url(redis_url)
    blobs = dump(client, directory.prefix)
    client.close()
    directory.close()
    # live zset, states, key sets and their members
    assert len(blobs) >= 3 + len(pages) + 3 + len(entries)
    for blob in blobs:
        for pattern in forbidden_patterns():
            assert pattern not in blob, f"client text in Redis: {blob!r:.80}"
