"""A router's copy of the embedded directory (``MirroredHostAccess``) against the real
host actor: lookups answered in the router's process follow what workers publish
within a few sync intervals, concurrent first lookups share one follower, a removed
worker vanishes at once, the host still counts
the router's lookups, and without the host the copy turns to "no information" once
it is older than the lease TTL."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from chunkstore import directory as d
from chunkstore.events import CacheEvent, EventKind
from chunkstore.ray_access import (
    ActorDirectory,
    DirectoryHostActor,
    DirectoryKind,
    DirectorySpec,
    MirroredHostAccess,
    open_directory,
)
from tests.chunkstore.testkit import make_keys
from tests.cluster.conftest import unique_name

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

LEASE_TTL_S = 2.0
KEYS = make_keys(2, tag="copy")


async def eventually(check, timeout_s: float = 10.0):
    """``check()``'s first truthy result, awaited every 20 ms."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.02)


def test_a_routers_copy_follows_the_host_and_goes_stale_without_it(ray_cluster):
    name = unique_name("directory")
    host = DirectoryHostActor.options(name=name, num_cpus=0).remote(LEASE_TTL_S)
    spec = DirectorySpec(
        kind=DirectoryKind.EMBEDDED,
        lease_ttl_s=LEASE_TTL_S,
        host_actor=name,
        ray_namespace="chunkserve-tests",
        call_timeout_s=1.0,
        router_sync_interval_s=0.05,
    )
    worker = ActorDirectory(host, call_timeout_s=5.0)
    assert worker.publish("w0", 1, 0, [CacheEvent(EventKind.STORED, (KEYS[0],))]).applied

    async def run() -> None:
        access = open_directory(spec)
        assert isinstance(access, MirroredHostAccess)
        try:
            # the first lookups wait for the first copy; one task follows the feed
            firsts = await asyncio.gather(*(access.lookup(KEYS, [16, 32]) for _ in range(8)))
            for first in firsts:
                assert [(h.worker_id, h.chunks) for h in first.holdings] == [("w0", 1)]
            followers = [
                t
                for t in asyncio.all_tasks()
                if t.get_coro().__qualname__ == "MirroredHostAccess._follow"
            ]
            assert len(followers) == 1
            stored = [CacheEvent(EventKind.STORED, (KEYS[1],))]
            assert (await asyncio.to_thread(worker.publish, "w0", 1, 1, stored)).applied

            async def both_held() -> bool:
                result = await access.lookup(KEYS, [16, 32])
                return [(h.worker_id, h.chunks) for h in result.holdings] == [("w0", 2)]

            assert await eventually(both_held)
            await access.remove_worker("w0")  # hidden at once, then gone from the host
            assert (await access.lookup(KEYS, [16, 32])).holdings == ()
            await asyncio.sleep(0.2)
            assert (await access.lookup(KEYS, [16, 32])).holdings == ()

            async def counted():  # reported with a later sync
                stats = await access.stats()
                return stats is not None and stats.lookups >= 3 and stats.hits >= 2

            assert await eventually(counted)
            ray.kill(host, no_restart=True)
            await asyncio.sleep(LEASE_TTL_S + 0.5)
            assert await access.lookup(KEYS, [16, 32]) == d.NO_INFORMATION
            assert await access.stats() is None
        finally:
            access.close()

    asyncio.run(run())
