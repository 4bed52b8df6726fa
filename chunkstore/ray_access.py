"""Reaching the chunk directory from Ray processes: all of the directory's Ray access
(the host actor, the workers' blocking client, the routers' async access) is here; the
rest of ``chunkstore`` does not import Ray.

Redis: every worker and router opens its own ``RedisChunkDirectory`` client.
Embedded: the ``EmbeddedChunkDirectory`` lives in one small named Ray actor, the
``DirectoryHost``; workers publish to it through ``ActorDirectory`` (a blocking
``ChunkDirectory``, used only from the publisher's thread) and routers await it, or
(``router_sync_interval_s`` > 0) follow its change feed into a read-only copy of their
own and look up there. So "embedded" means one process of a single-node cluster that
every write goes to; routers' copies only follow it.

Invariants of ``ActorDirectory`` (same as the protocol's): arguments are checked
locally, so a remote failure is always "unreachable": mutations return
``UNAVAILABLE``, lookups ``NO_INFORMATION``; nothing raises, no call waits longer
than ``call_timeout_s``.

Routers reach it asynchronously (``AsyncDirectory``, made by ``open_directory``).
Its invariants: no method blocks the event loop (Redis calls run in a thread, the
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
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import ray
from ray.exceptions import RayError

from chunkstore import directory as d
from chunkstore.directory_mirror import DirectoryChanges, DirectoryMirror
from chunkstore.embedded_directory import EmbeddedChunkDirectory
from chunkstore.events import CacheEvent
from chunkstore.hashing import PageKey
from chunkstore.redis_directory import RedisChunkDirectory

logger = logging.getLogger(__name__)


class DirectoryKind(StrEnum):
    EMBEDDED = "embedded"
    REDIS = "redis"


@dataclass(frozen=True)
class DirectorySpec:
    """How to reach a cluster's directory (the same for workers and routers)."""

    kind: DirectoryKind
    lease_ttl_s: float
    host_actor: str  # name of the DirectoryHost actor (embedded)
    ray_namespace: str  # Ray namespace of the host actor
    call_timeout_s: float  # one call to the host actor (embedded)
    redis_url: str = ""
    redis_prefix: str = "chunkserve"
    redis_timeout_s: float = 0.05
    # embedded: a router's copy of the directory is brought up to date this often, and
    # its lookups are answered there (``MirroredHostAccess`` below);
    # 0: every lookup is a call to the host actor
    router_sync_interval_s: float = 0.0


class DirectoryHost:
    """The embedded directory, served by a Ray actor (methods run one at a time)."""

    def __init__(self, lease_ttl_s: float) -> None:
        self._directory = EmbeddedChunkDirectory(lease_ttl_s=lease_ttl_s)

    def publish(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[CacheEvent]
    ) -> d.PublishResult:
        return self._directory.publish(worker_id, epoch, seq, events)

    def publish_snapshot(
        self,
        worker_id: str,
        epoch: int,
        seq: int,
        keys: Sequence[PageKey],
        host_keys: Sequence[PageKey] = (),
    ) -> d.PublishResult:
        return self._directory.publish_snapshot(worker_id, epoch, seq, keys, host_keys)

    def heartbeat(self, worker_id: str, epoch: int) -> d.PublishResult:
        return self._directory.heartbeat(worker_id, epoch)

    def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        return self._directory.lookup(keys, token_ends, entry_keys)

    def changes(
        self, directory_id: str, since: int, lookups: int = 0, hits: int = 0
    ) -> DirectoryChanges:
        """The feed routers' copies follow (``EmbeddedChunkDirectory.changes``)."""
        return self._directory.changes(directory_id, since, lookups, hits)

    def remove_worker(self, worker_id: str) -> None:
        self._directory.remove_worker(worker_id)

    def stats(self) -> d.DirectoryStats:
        return self._directory.stats()


# No task events: every router copies its changes 20 times a second (see Worker's actor).
DirectoryHostActor = ray.remote(enable_task_events=False)(DirectoryHost)


class ActorDirectory:
    """A blocking ``ChunkDirectory`` backed by the host actor, for threads (the event
    publisher's): never call it from async code, it waits up to ``call_timeout_s``."""

    def __init__(self, host: ray.actor.ActorHandle, call_timeout_s: float) -> None:
        self._host = host
        self._timeout_s = call_timeout_s
        self.failures = 0

    def publish(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[CacheEvent]
    ) -> d.PublishResult:
        d.check_stream(worker_id, epoch, seq)
        d.check_events(events)
        return self._call(self._host.publish.remote(worker_id, epoch, seq, list(events)))

    def publish_snapshot(
        self,
        worker_id: str,
        epoch: int,
        seq: int,
        keys: Sequence[PageKey],
        host_keys: Sequence[PageKey] = (),
    ) -> d.PublishResult:
        d.check_stream(worker_id, epoch, seq)
        d.check_snapshot(keys, host_keys)
        call = self._host.publish_snapshot.remote(
            worker_id, epoch, seq, list(keys), list(host_keys)
        )
        return self._call(call)

    def heartbeat(self, worker_id: str, epoch: int) -> d.PublishResult:
        d.check_worker(worker_id, epoch)
        return self._call(self._host.heartbeat.remote(worker_id, epoch))

    def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        d.check_lookup(keys, token_ends, entry_keys)
        ref = self._host.lookup.remote(list(keys), list(token_ends), list(entry_keys))
        return self._call(ref, fallback=d.NO_INFORMATION)

    def remove_worker(self, worker_id: str) -> None:
        self._call(self._host.remove_worker.remote(worker_id), fallback=None)

    def stats(self) -> d.DirectoryStats:
        unavailable = d.DirectoryStats(False, None, None, 0, 0, self.failures)
        return self._call(self._host.stats.remote(), fallback=unavailable)

    def close(self) -> None:
        pass  # the host actor belongs to the cluster, not to this client

    def _call(self, ref: ray.ObjectRef, fallback: object = d.UNAVAILABLE):
        # ``future()`` rather than ``ray.get``: this runs on a thread of an async actor,
        # where ``ray.get`` is legal but warns about blocking the event loop.
        try:
            return ref.future().result(timeout=self._timeout_s)
        except (FutureTimeout, RayError) as error:
            self.failures += 1
            logger.warning("chunk directory host unreachable: %s", type(error).__name__)
            return fallback


def connect_directory(spec: DirectorySpec) -> d.ChunkDirectory:
    """A blocking client of the cluster's directory (for threads, never async code)."""
    if spec.kind is DirectoryKind.REDIS:
        return RedisChunkDirectory(
            spec.redis_url,
            prefix=spec.redis_prefix,
            lease_ttl_s=spec.lease_ttl_s,
            timeout_s=spec.redis_timeout_s,
        )
    host = ray.get_actor(spec.host_actor, namespace=spec.ray_namespace)
    return ActorDirectory(host, spec.call_timeout_s)


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
