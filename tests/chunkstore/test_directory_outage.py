"""Redis killed mid-test and restarted: lookups degrade, nothing raises, the view
comes back once the publishers re-sync. Always on a private redis-server."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from chunkstore.publisher import EventPublisher
from chunkstore.redis_directory import RedisChunkDirectory
from tests.chunkstore.testkit import SimPool, make_keys, wait_until

pytestmark = pytest.mark.redis

KEYS = make_keys(30, tag="outage")


def view_matches(router: RedisChunkDirectory, pools: dict[str, SimPool]) -> bool:
    for key in KEYS:
        result = router.lookup([key], [16])
        expected = {name for name, pool in pools.items() if key in pool.keys}
        if not result.available or {h.worker_id for h in result.holdings} != expected:
            return False
    return True


def test_redis_killed_and_restarted(private_redis):
    rng = random.Random(7)
    options = {"prefix": "outage", "lease_ttl_s": 2.0, "retry_after_s": 0.05}
    router = RedisChunkDirectory(private_redis.url, **options)
    worker_side = RedisChunkDirectory(private_redis.url, **options)
    pools = {f"w{i}": SimPool() for i in range(3)}
    publishers = [
        EventPublisher(worker_side, name, 1, pool.drain, pool.snapshot, interval_s=0.03)
        for name, pool in pools.items()
    ]
    for pool in pools.values():
        pool.store(rng.sample(KEYS, 8))
    for publisher in publishers:
        publisher.start()
    try:
        assert wait_until(lambda: view_matches(router, pools), timeout_s=5)

        private_redis.kill()
        for _ in range(30):  # the outage: the pools keep changing, nobody raises
            result = router.lookup(KEYS[:3], [16, 32, 48])
            assert not result.available and result.holdings == ()
            pool = pools[rng.choice(sorted(pools))]
            pool.store(rng.sample(KEYS, 2))
            pool.remove(rng.sample(sorted(pool.keys), 1))
            time.sleep(0.01)
        assert not router.stats().available
        assert router.stats().failures > 0
        assert wait_until(lambda: all(p.stats().unavailable > 0 for p in publishers), 5)

        private_redis.start()  # empty: everything it knew is gone
        assert wait_until(lambda: view_matches(router, pools), timeout_s=5)
        assert all(p.stats().snapshots >= 2 for p in publishers)  # re-synced by snapshot
        assert router.stats().available
    finally:
        for publisher in publishers:
            publisher.stop(flush=False)
        router.close()
        worker_side.close()


def test_a_redis_that_never_answers_degrades_instead_of_hanging():
    """A server that accepts connections and never replies (hung, not dead): every
    call gives up after the directory's own timeout. The join bound only turns a
    hang into a failure; it is no claim about how fast the call is."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as silent:
        port = silent.getsockname()[1]
        directory = RedisChunkDirectory(
            f"redis://127.0.0.1:{port}/0", prefix="silent", timeout_s=0.05, retry_after_s=0
        )
        results: list = []
        caller = threading.Thread(
            target=lambda: results.extend(
                [directory.lookup(KEYS[:2], [1, 2]), directory.heartbeat("w", 1)]
            ),
            daemon=True,
        )
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), "a directory call waited on a silent Redis"
        assert [r.available for r in results] == [False, False]
        assert directory.stats().failures >= 2
        directory.close()


def test_unreachable_redis_never_raises():
    directory = RedisChunkDirectory("redis://127.0.0.1:1/0", prefix="nowhere", retry_after_s=0)
    assert not directory.lookup(KEYS[:2], [1, 2]).available
    assert not directory.publish("w", 1, 0, []).available
    assert not directory.publish_snapshot("w", 1, 0, KEYS[:2]).available
    assert not directory.heartbeat("w", 1).available
    directory.remove_worker("w")
    stats = directory.stats()
    assert (stats.available, stats.entries, stats.live_workers) == (False, None, None)
    assert stats.failures == 6 and stats.lookups == 1 and stats.hits == 0
    directory.close()
