"""What only the Redis implementation has: round trips, URLs, prefixes, key expiry."""

from __future__ import annotations

import time

import pytest
import redis
import redis.connection

from chunkstore.events import CacheEvent, EventKind
from chunkstore.redis_directory import RedisChunkDirectory
from tests.chunkstore.testkit import RedisProcess, make_keys

pytestmark = pytest.mark.redis

KEYS = make_keys(10, tag="redis")
ENDS = [16 * (i + 1) for i in range(10)]


@pytest.fixture
def directory(redis_url, redis_prefix):
    directory = RedisChunkDirectory(redis_url, prefix=redis_prefix, timeout_s=0.5)
    yield directory
    directory.close()


def count_round_trips(monkeypatch) -> list[int]:
    """Counts packed sends (one per round trip: a pipeline is sent as one)."""
    sent = [0]
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        sent[0] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    return sent


def test_a_whole_request_lookup_is_one_round_trip(directory, monkeypatch):
    for w in range(16):
        directory.publish_snapshot(f"w{w}", 1, 0, KEYS[: w % 10 + 1])
    directory.lookup(KEYS, ENDS)  # loads the script if this server lacks it
    sent = count_round_trips(monkeypatch)
    for n in range(1, 11):
        result = directory.lookup(KEYS[:n], ENDS[:n])
        runs = {h.worker_id: h.chunks for h in result.holdings}
        assert runs == {f"w{w}": min(n, w % 10 + 1) for w in range(16)}
    assert sent[0] == 10


def test_publish_and_heartbeat_are_one_round_trip_each(directory, monkeypatch):
    directory.publish("w", 1, 0, [])
    directory.heartbeat("w", 1)
    sent = count_round_trips(monkeypatch)
    directory.publish("w", 1, 1, [CacheEvent(EventKind.STORED, tuple(KEYS))])
    directory.heartbeat("w", 1)
    assert sent[0] == 2


def test_large_snapshot_is_staged_and_swapped_in(directory):
    keys = make_keys(12_345, tag="big")
    assert directory.publish_snapshot("w", 1, 0, keys).applied
    assert directory.stats().entries == len(keys)
    assert directory.lookup(keys[-3:], [1, 2, 3]).holding("w").chunks == 3


def test_prefixes_isolate_clusters(redis_url, redis_prefix):
    one = RedisChunkDirectory(redis_url, prefix=f"{redis_prefix}:one", timeout_s=0.5)
    two = RedisChunkDirectory(redis_url, prefix=f"{redis_prefix}:two", timeout_s=0.5)
    one.publish_snapshot("w", 1, 0, KEYS[:2])
    assert one.lookup(KEYS[:2], ENDS[:2]).holdings
    assert two.lookup(KEYS[:2], ENDS[:2]).holdings == ()
    assert two.stats().live_workers == 0
    one.close()
    two.close()


def test_every_worker_key_expires_one_ttl_after_its_lease(redis_url, redis_prefix):
    ttl = 0.3
    directory = RedisChunkDirectory(redis_url, prefix=redis_prefix, lease_ttl_s=ttl, timeout_s=0.5)
    client = redis.Redis.from_url(redis_url)
    directory.publish_snapshot("gone", 1, 0, KEYS[:3])
    directory.heartbeat("gone", 1)
    assert len(list(client.scan_iter(match=f"{directory.prefix}*"))) == 3
    time.sleep(2 * ttl + 0.2)
    assert list(client.scan_iter(match=f"{directory.prefix}*")) == []
    client.close()
    directory.close()


def test_password_url_and_wrong_password_degrades():
    server = RedisProcess(password="s3cret")
    server.start()
    try:
        good = RedisChunkDirectory(server.url, prefix="auth", timeout_s=0.5)
        assert good.publish_snapshot("w", 1, 0, KEYS[:1]).applied
        assert good.lookup(KEYS[:1], [1]).holding("w") is not None
        bad_url = server.url.replace("s3cret", "wrong")
        bad = RedisChunkDirectory(bad_url, prefix="auth", timeout_s=0.5)
        assert not bad.lookup(KEYS[:1], [1]).available
        assert not bad.publish("w", 1, 1, []).available
        good.close()
        bad.close()
    finally:
        server.kill()


def test_rediss_url_uses_tls_and_degrades_against_a_plain_server(redis_url):
    tls_url = redis_url.replace("redis://", "rediss://:pw@", 1)
    directory = RedisChunkDirectory(tls_url, prefix="tls", timeout_s=0.2)
    pool = directory._client.connection_pool
    assert pool.connection_class is redis.connection.SSLConnection
    assert not directory.lookup(KEYS[:1], [1]).available  # no TLS there: no information
    directory.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "http://:hunter2@host:1/0"}, "redis://"),
        ({"prefix": ""}, "prefix"),
        ({"prefix": "a b"}, "prefix"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"timeout_s": 5}, "timeout_s"),
        ({"retry_after_s": -1}, "retry_after_s"),
    ],
)
def test_bad_configuration_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message) as error:
        RedisChunkDirectory(**kwargs)
    assert "hunter2" not in str(error.value)
