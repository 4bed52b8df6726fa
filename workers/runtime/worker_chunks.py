"""A worker's registered chunks, one ``ChunkRegistry`` per tenant.

Invariants:
- Every registry call runs on the engine loop thread (``EngineLoop.call``); this
  object is touched by no other thread, so it needs no lock.
- Registries are keyed by tenant salt and each keys ids and pages by its tenant's
  namespace: a tenant can neither find nor hit another tenant's chunks.
- Expiry times are Unix seconds (``time.time``), so routers can report them.
- Refusals come back as ``ChunkFailure`` values, never as exceptions across Ray.
- Every successful ``register`` gets a number of its own (``Registered.registration``),
  the chunk's latest: ``roll_back`` undoes a registration whose caller gave up only
  while it is still the chunk's latest and created the chunk, so a registration that
  came after it (or found the chunk already there) is never undone by it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from chunkstore.chunking import Message
from workers.engine.chunk_registry import ChunkInfo, ChunkRegistry, UnknownChunkError
from workers.engine.engine import Engine
from workers.runtime.engine_loop import EngineLoop


@dataclass(frozen=True)
class ChunkFailure:
    message: str  # for the client
    unknown: bool  # an unknown chunk id (404) rather than bad input (400)


@dataclass(frozen=True)
class Registered:
    info: ChunkInfo
    created: bool  # False: the chunk was registered here already (TTL refreshed)
    registration: int  # this registration's number (``WorkerChunks.roll_back``)


class WorkerChunks:
    def __init__(self, engine: Engine, loop: EngineLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._registries: dict[str, ChunkRegistry] = {}  # tenant salt -> registry
        self._registrations = itertools.count(1)
        # (tenant salt, chunk id) -> the number of its latest registration
        self._latest: dict[tuple[str, str], int] = {}

    # -- run on the loop thread (pass to ``EngineLoop.call``) ---------------------
    def register(
        self,
        tenant_salt: str,
        content: str | Sequence[Message],
        role: str,
        ttl_s: float | None,
        after: Sequence[str],
        mode: str = "exact",
    ) -> Registered | ChunkFailure:
        registry = self._registry(tenant_salt)
        before = {info.chunk_id for info in registry.infos()}
        try:
            chunk_id = registry.register(content, role, ttl_s, tuple(after), mode)
        except UnknownChunkError as error:
            return ChunkFailure(str(error), unknown=True)
        except ValueError as error:
            return ChunkFailure(str(error), unknown=False)
        info = next(i for i in registry.infos() if i.chunk_id == chunk_id)
        registration = next(self._registrations)
        self._latest[tenant_salt, chunk_id] = registration
        return Registered(info, created=chunk_id not in before, registration=registration)

    def roll_back(self, tenant_salt: str, chunk_id: str, registration: int) -> bool:
        """Undo registration ``registration`` of ``chunk_id`` (its caller gave up
        before it learned the id), unless another registration of the chunk came
        since. ``created`` is the caller's to check: a registration that found the
        chunk already there is never rolled back. True if the chunk was unpinned."""
        if self._latest.get((tenant_salt, chunk_id)) != registration:
            return False
        return self.unregister(tenant_salt, chunk_id)

    def unregister(self, tenant_salt: str, chunk_id: str) -> bool:
        """False if the tenant has no such chunk here."""
        self._latest.pop((tenant_salt, chunk_id), None)
        try:
            self._registry(tenant_salt).unregister(chunk_id)
        except UnknownChunkError:
            return False
        return True

    def infos(self, tenant_salt: str) -> list[ChunkInfo]:
        return self._registry(tenant_salt).infos()

    def messages(self, tenant_salt: str, chunk_ids: Sequence[str]) -> dict[str, list[Message]]:
        """The own messages of those of ``chunk_ids`` registered here."""
        registry = self._registry(tenant_salt)
        known = {info.chunk_id for info in registry.infos()}
        return {i: list(registry.compose([i])) for i in dict.fromkeys(chunk_ids) if i in known}

    def record_use(
        self, tenant_salt: str, chunk_ids: Sequence[str], prompt: Sequence[int], cached: int
    ) -> None:
        self._registry(tenant_salt).record_use(chunk_ids, prompt, cached)

    def expire(self) -> None:
        """Drop every tenant's chunks whose TTL ended (unpinning their pages)."""
        for registry in self._registries.values():
            registry.expire()
        held = {
            (tenant_salt, info.chunk_id)
            for tenant_salt, registry in self._registries.items()
            for info in registry.infos()
        }
        self._latest = {key: n for key, n in self._latest.items() if key in held}

    def _registry(self, tenant_salt: str) -> ChunkRegistry:
        registry = self._registries.get(tenant_salt)
        if registry is None:

            def compute(tokens: list[int]) -> None:
                self._loop.prefill(tokens, tenant_salt)

            registry = ChunkRegistry(
                self._engine,
                compute,
                time.time,
                tenant_salt=tenant_salt,
                step_until=self._loop.step_until,
            )
            self._registries[tenant_salt] = registry
        return registry
