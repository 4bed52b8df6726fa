"""Reaching the chunk directory from Ray processes.

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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import StrEnum

import ray
from ray.exceptions import RayError

from chunkstore import directory as d
from chunkstore.directory_mirror import DirectoryChanges
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
    # its lookups are answered there (``cluster.directory_access.MirroredHostAccess``);
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
        self, worker_id: str, epoch: int, seq: int, keys: Sequence[PageKey]
    ) -> d.PublishResult:
        return self._directory.publish_snapshot(worker_id, epoch, seq, keys)

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
        self, worker_id: str, epoch: int, seq: int, keys: Sequence[PageKey]
    ) -> d.PublishResult:
        d.check_stream(worker_id, epoch, seq)
        d.check_keys(keys)
        return self._call(self._host.publish_snapshot.remote(worker_id, epoch, seq, list(keys)))

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
