"""One router's view of the workers: health and load from polling, plus its own
in-flight work.

Invariants:
- A worker is routable only while ``HEALTHY`` and not draining: its last status
  poll answered, with the namespace the router keys by, and no call to it failed
  (and it refused nothing) since.
- A worker's load is this router's in-flight work on it (exact, updated on every
  request) plus the other routers' share from its last poll: the polled count
  minus what this router had in flight when that poll was sent. So several router
  replicas see each other's load, at most one poll interval late.
- Only the event loop that called ``start`` touches the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from ray.actor import ActorHandle
from ray.exceptions import RayError

from cluster.routing_policy import WorkerView
from workers.runtime.worker_types import WorkerStatus

logger = logging.getLogger(__name__)


class Health(StrEnum):
    STARTING = "starting"  # never answered yet
    HEALTHY = "healthy"
    DOWN = "down"  # a call failed, or it stopped answering polls


@dataclass(slots=True)
class _Tracked:
    handle: ActorHandle
    health: Health = Health.STARTING
    status: WorkerStatus | None = None
    requests: int = 0  # this router's choices in flight on the worker
    tokens: int = 0
    requests_at_poll: int = 0  # ``requests`` when the last answered poll was sent
    tokens_at_poll: int = 0
    draining: bool = False  # refusing new work (from its last poll or refusal)


class WorkerPool:
    def __init__(
        self,
        handles: Mapping[str, ActorHandle],
        namespace_model: str,
        poll_interval_s: float,
        poll_timeout_s: float,
    ) -> None:
        self._workers = {worker_id: _Tracked(handle) for worker_id, handle in handles.items()}
        self._namespace_model = namespace_model
        self._interval_s = poll_interval_s
        self._timeout_s = poll_timeout_s
        self._tasks: list[asyncio.Task] = []
        self._started: asyncio.Future | None = None

    async def start(self) -> None:
        """Poll every worker once, then keep polling in the background (idempotent)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._first_poll())
        await asyncio.shield(self._started)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- queries -------------------------------------------------------------------
    def views(self) -> list[WorkerView]:
        return [
            WorkerView(worker_id, *self._load(tracked))
            for worker_id, tracked in self._workers.items()
            if tracked.health is Health.HEALTHY and not tracked.draining
        ]

    def health(self) -> dict[str, Health]:
        return {worker_id: tracked.health for worker_id, tracked in self._workers.items()}

    def describe(self) -> str:
        """Each worker's state, for error messages: "w0: healthy, w1: draining"."""
        return ", ".join(
            f"{worker_id}: {'draining' if t.draining and t.health is Health.HEALTHY else t.health}"
            for worker_id, t in sorted(self._workers.items())
        )

    def healthy_count(self) -> int:
        """Workers a request can be routed to now."""
        return sum(t.health is Health.HEALTHY and not t.draining for t in self._workers.values())

    def max_model_len(self) -> int | None:
        """The smallest context length among healthy workers (None before any answered)."""
        lengths = [
            t.status.info.max_model_len
            for t in self._workers.values()
            if t.health is Health.HEALTHY and t.status is not None
        ]
        return min(lengths, default=None)

    def handle(self, worker_id: str) -> ActorHandle:
        return self._workers[worker_id].handle

    # -- updates -------------------------------------------------------------------
    def begin(self, worker_id: str, choices: int, tokens: int) -> None:
        """Count work this router sent to a worker (choices, as the engine counts)."""
        tracked = self._workers[worker_id]
        tracked.requests += choices
        tracked.tokens += tokens

    def end(self, worker_id: str, choices: int, tokens: int) -> None:
        tracked = self._workers[worker_id]
        tracked.requests -= choices
        tracked.tokens -= tokens

    def mark_draining(self, worker_id: str) -> None:
        self._workers[worker_id].draining = True

    def mark_down(self, worker_id: str) -> None:
        tracked = self._workers[worker_id]
        if tracked.health is not Health.DOWN:
            logger.warning("worker %s is down; routing around it", worker_id)
        tracked.health = Health.DOWN

    # -- polling -------------------------------------------------------------------
    async def _first_poll(self) -> None:
        await asyncio.gather(*(self._poll(worker_id) for worker_id in self._workers))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._poll_forever(w)) for w in self._workers]

    async def _poll_forever(self, worker_id: str) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._poll(worker_id)

    async def _poll(self, worker_id: str) -> None:
        tracked = self._workers[worker_id]
        sent = (tracked.requests, tracked.tokens)
        try:
            status = await asyncio.wait_for(tracked.handle.status.remote(), self._timeout_s)
        except (TimeoutError, RayError) as error:
            if tracked.health is Health.HEALTHY:
                logger.warning("worker %s did not answer a poll: %r", worker_id, error)
            if tracked.health is Health.HEALTHY or isinstance(error, RayError):
                tracked.health = Health.DOWN
            return
        if status.info.namespace_model != self._namespace_model:
            logger.error(
                "worker %s keys chunks as %r but this router as %r: not routing to it",
                worker_id,
                status.info.namespace_model,
                self._namespace_model,
            )
            tracked.health = Health.DOWN
            return
        if tracked.health is not Health.HEALTHY:
            logger.info("worker %s is healthy (epoch %d)", worker_id, status.info.epoch)
        tracked.status = status
        tracked.draining = status.draining
        tracked.requests_at_poll, tracked.tokens_at_poll = sent
        tracked.health = Health.HEALTHY

    def _load(self, tracked: _Tracked) -> tuple[int, int]:
        if tracked.status is None:
            return tracked.requests, tracked.tokens
        load = tracked.status.load
        others = max(0, load.requests - tracked.requests_at_poll)
        other_tokens = max(0, load.tokens - tracked.tokens_at_poll)
        return tracked.requests + others, tracked.tokens + other_tokens
