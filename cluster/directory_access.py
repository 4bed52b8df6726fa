"""The router's async access to the chunk directory.

Invariants: no method blocks the event loop (Redis calls run in a thread, the
embedded host is awaited) and none raises: an unreachable directory means
``NO_INFORMATION`` for lookups, ``None`` for stats, a no-op for removals.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

import ray
from ray.exceptions import RayError

from chunkstore import directory as d
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
    """The embedded directory, in its Ray actor."""

    def __init__(self, spec: DirectorySpec) -> None:
        self._host = ray.get_actor(spec.host_actor, namespace=spec.ray_namespace)
        self._timeout_s = spec.call_timeout_s

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
        try:
            return await asyncio.wait_for(ref, self._timeout_s)
        except (TimeoutError, RayError) as error:
            logger.warning("chunk directory host unreachable: %s", type(error).__name__)
            return None


def open_directory(spec: DirectorySpec) -> AsyncDirectory:
    if spec.kind is DirectoryKind.REDIS:
        return RedisAccess(spec)
    return HostAccess(spec)
