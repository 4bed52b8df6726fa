"""The router's async access to the chunk directory.

Invariants: no method blocks the event loop (Redis calls run in a thread, the
embedded host is awaited) and none raises: an unreachable directory means
``NO_INFORMATION`` for lookups, ``None`` for stats, a no-op for removals.

The embedded directory is reached one of two ways: ``MirroredHostAccess`` (the
default) keeps a copy in the router's process, brought up to date from the host
actor's change feed every ``router_sync_interval_s``, and answers lookups from it
(no round trip per request; the copy is at most that much older than the host, which
itself learns of a worker's cache only with its next publish); ``HostAccess`` calls the
host actor for every lookup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import ray
from ray.exceptions import RayError

from chunkstore import directory as d
from chunkstore.directory_mirror import DirectoryMirror
from chunkstore.hashing import PageKey
from chunkstore.redis_directory import RedisChunkDirectory
from workers.runtime.directory_client import DirectoryKind, DirectorySpec

logger = logging.getLogger(__name__)


class AsyncDirectory(Protocol):
    async def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult: ...

    async def stats(self) -> d.DirectoryStats | None: ...

    async def remove_worker(self, worker_id: str) -> None: ...

    def close(self) -> None: ...


class RedisAccess:
    def __init__(self, spec: DirectorySpec) -> None:
        self._directory = RedisChunkDirectory(
            spec.redis_url,
            prefix=spec.redis_prefix,
            lease_ttl_s=spec.lease_ttl_s,
            timeout_s=spec.redis_timeout_s,
        )

    async def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        return await asyncio.to_thread(self._directory.lookup, keys, token_ends, entry_keys)

    async def stats(self) -> d.DirectoryStats | None:
        stats = await asyncio.to_thread(self._directory.stats)
        return stats if stats.available else None

    async def remove_worker(self, worker_id: str) -> None:
        await asyncio.to_thread(self._directory.remove_worker, worker_id)

    def close(self) -> None:
        self._directory.close()


class HostAccess:
    """The embedded directory, in its Ray actor. An unreachable host is logged once
    per outage, not once per call."""

    def __init__(self, spec: DirectorySpec) -> None:
        self._host = ray.get_actor(spec.host_actor, namespace=spec.ray_namespace)
        self._timeout_s = spec.call_timeout_s
        self._reachable = True  # as last logged

    async def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        d.check_lookup(keys, token_ends, entry_keys)
        ref = self._host.lookup.remote(list(keys), list(token_ends), list(entry_keys))
        result = await self._call(ref)
        return d.NO_INFORMATION if result is None else result

    async def stats(self) -> d.DirectoryStats | None:
        return await self._call(self._host.stats.remote())

    async def remove_worker(self, worker_id: str) -> None:
        await self._call(self._host.remove_worker.remote(worker_id))

    def close(self) -> None:
        pass

    async def _call(self, ref: ray.ObjectRef):
        """The call's result; None if the host did not answer within the timeout."""
        try:
            result = await asyncio.wait_for(ref, self._timeout_s)
        except (TimeoutError, RayError) as error:
            if self._reachable:
                logger.warning("chunk directory host unreachable: %s", type(error).__name__)
            self._reachable = False
            return None
        self._reachable = True
        return result


class MirroredHostAccess(HostAccess):
    """The embedded directory through a copy of it in this process (see the module).

    - The copy follows the host's feed (``EmbeddedChunkDirectory.changes``): a task
      started by the first lookup asks for what changed every ``interval_s``. The
      first lookup waits for the first answer (at most ``call_timeout_s``).
    - While the last answer is older than ``stale_after_s`` (the host is not
      answering), lookups answer ``NO_INFORMATION``, as through an unreachable host.
    - Each feed call reports the lookups answered here since the previous answer, so
      the host's ``stats`` still count every router's lookups.
    - ``remove_worker`` hides the worker in the copy at once (for up to the lease TTL:
      by then the host has dropped the dead incarnation's lease, or a new incarnation
      has reset its record) and asks the host to remove it.
    - Concurrent first lookups share one first feed call; one task follows the feed.
    """

    def __init__(self, spec: DirectorySpec, clock: Callable[[], float] = time.monotonic) -> None:
        if not spec.router_sync_interval_s > 0:
            raise ValueError("a mirrored directory needs router_sync_interval_s > 0")
        super().__init__(spec)
        self._interval_s = spec.router_sync_interval_s
        self._stale_after_s = spec.lease_ttl_s
        self._clock = clock
        self._mirror = DirectoryMirror()
        self._synced_at = float("-inf")  # when the last answer arrived
        self._unreported = [0, 0]  # lookups, hits answered here since the last answer
        self._sync_lock = asyncio.Lock()
        self._first_sync: asyncio.Future | None = None
        self._follower: asyncio.Task | None = None

    async def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        d.check_lookup(keys, token_ends, entry_keys)
        if self._first_sync is None:  # before any await: one first sync, one follower
            self._first_sync = asyncio.ensure_future(self._sync())
            self._follower = asyncio.get_running_loop().create_task(self._follow())
        if not self._first_sync.done():
            try:
                await asyncio.shield(self._first_sync)
            except Exception:  # logged by nobody else: the copy stays empty, i.e. stale
                logger.exception("the first copy of the chunk directory failed")
        now = self._clock()
        if now - self._synced_at > self._stale_after_s:
            return d.NO_INFORMATION
        result = self._mirror.lookup(keys, token_ends, entry_keys, now)
        self._unreported[0] += 1
        self._unreported[1] += bool(result.holdings)
        return result

    async def remove_worker(self, worker_id: str) -> None:
        self._mirror.hide_worker(worker_id, self._clock() + self._stale_after_s)
        await super().remove_worker(worker_id)

    def close(self) -> None:
        for task in (self._first_sync, self._follower):
            if task is not None:
                task.cancel()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._sync()
            except Exception:  # never stop following; lookups turn stale meanwhile
                logger.exception("following the chunk directory's changes failed")

    async def _sync(self) -> None:
        """One feed call; its answer applied (nothing changes if the host does not
        answer)."""
        async with self._sync_lock:  # answers apply in the order they were asked for
            lookups, hits = self._unreported
            mirror = self._mirror
            ref = self._host.changes.remote(mirror.directory_id, mirror.version, lookups, hits)
            answer = await self._call(ref)
            if answer is None:
                return
            self._unreported[0] -= lookups
            self._unreported[1] -= hits
            now = self._clock()
            try:
                mirror.apply(answer, now)
            except ValueError:  # cannot happen while answers apply in order: start over
                logger.exception("the chunk directory's changes did not follow the copy")
                self._mirror = DirectoryMirror()
                return
            self._synced_at = now


def open_directory(spec: DirectorySpec) -> AsyncDirectory:
    if spec.kind is DirectoryKind.REDIS:
        return RedisAccess(spec)
    if spec.router_sync_interval_s > 0:
        return MirroredHostAccess(spec)
    return HostAccess(spec)
