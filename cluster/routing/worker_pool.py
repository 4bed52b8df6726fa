"""One router's view of the workers: health and load from polling, plus its own
in-flight work.

Invariants:
- A worker is routable only while ``HEALTHY`` and not draining: its last status
  poll answered, in ``Agreement`` with this router, and no call to it failed (and
  it refused nothing) since.
- A worker that disagrees (page size, model, checkpoint or directory) is
  ``REFUSED``, never routed to: its cache could never be hit. The reason, naming
  both values and the config keys, is logged and shown by ``describe`` (so in
  /health and "no healthy worker" errors) until a poll finds it in agreement.
- A worker's load is its own newest report (``EngineLoad``, carried by every poll
  answer and every output delta, newest by ``version``), corrected by what this
  router did since: requests and tokens are this router's in-flight work on it
  (exact, updated on every request) plus the others' share of the report: its count
  less the most of this router's work it can hold (for a delta, what was in flight
  when it arrived; for a poll, what was in flight when it was asked for plus what
  began while it was on its way, since the worker may have taken that too before it
  answered, plus what this router abandoned since the report before, since the worker
  may not have dropped that yet). So the others' share is never overcounted: a slow poll answer can't make
  an idle worker look full (a spurious 429) until the next report. The prefill
  backlog is the report's plus the uncached tokens this router sent since. So router
  replicas see each other's load as fresh as the latest delta any of their requests
  received, at most one poll interval late.
- A worker's ``incarnation`` changes whenever it is found gone (the router saw a
  call to it fail, a poll found the actor dead, or a poll answers with another
  epoch: it restarted): work started on an earlier incarnation will never finish,
  whatever its own awaits say.
- A worker that Ray reports dead for good (``ActorDiedError``: its restarts spent)
  is looked up by name again at each poll (``find``, off the event loop), so the actor
  the keeper creates in its place is found and polled like any restarted worker.
- No await on a worker outlives the caller: a cancelled caller returns at once,
  abandoning the call (``settle``), even where Ray never resolves the call.
- Only the event loop that called ``start`` touches the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError

from cluster.routing.policy import WorkerView
from workers.engine.config import DEFAULT_ENTRY_SYSTEM_PROMPT
from workers.runtime.worker_types import EngineLoad, WorkerInfo, WorkerStatus

logger = logging.getLogger(__name__)


class Health(StrEnum):
    STARTING = "starting"  # never answered yet
    HEALTHY = "healthy"
    DOWN = "down"  # a call failed, or it stopped answering polls
    REFUSED = "refused"  # it answers, but keys its cache unlike this router


@dataclass(frozen=True)
class Agreement:
    """What a worker must share with the router: the router finds a worker's cached
    pages in the directory only if it computes the same keys (same model namespace,
    same page size) and looks where the worker publishes them."""

    namespace_model: str  # model.name + "@" + the checkpoint's fingerprint
    page_size: int  # engine.page_size
    directory_namespace: str  # worker_types.directory_namespace of the router's directory
    # engine.entry_system_prompt: position-free entries are shared by key, so every worker
    # must compute them after the same context
    entry_system_prompt: str | None = DEFAULT_ENTRY_SYSTEM_PROMPT


def disagreement(expected: Agreement, info: WorkerInfo) -> str | None:
    """Why a worker's cache could never serve this router's requests (None: it agrees)."""
    problems = []
    if info.page_size != expected.page_size:
        problems.append(
            f"its KV pages hold {info.page_size} tokens but this router keys prompts by "
            f"{expected.page_size}-token pages (engine.page_size)"
        )
    model, _, fingerprint = info.namespace_model.rpartition("@")
    own_model, _, own_fingerprint = expected.namespace_model.rpartition("@")
    if model != own_model:
        problems.append(f"it serves model {model!r} but this router {own_model!r} (model.name)")
    elif fingerprint != own_fingerprint:
        problems.append(
            f"its checkpoint has fingerprint {fingerprint!r} but this router's "
            f"{own_fingerprint!r} (model.path: another checkpoint, or one rewritten since)"
        )
    if info.entry_system_prompt != expected.entry_system_prompt:
        problems.append(
            f"it computes position-free entries after the system prompt "
            f"{info.entry_system_prompt!r} but this router expects "
            f"{expected.entry_system_prompt!r} (engine.entry_system_prompt)"
        )
    if info.directory_namespace != expected.directory_namespace:
        problems.append(
            f"it publishes to the {info.directory_namespace} but this router looks in the "
            f"{expected.directory_namespace} (directory.kind, directory.redis.prefix)"
        )
    if not problems:
        return None
    return (
        f"worker {info.worker_id} refused: {'; '.join(problems)}; it was started with "
        "another config than this router's: restart the workers with the router's config"
    )


async def settle(future: asyncio.Future, timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for ``future``; True if it is done. Never awaits
    its cancellation: a cancelled caller returns at once, and the caller decides what
    to do with an unfinished ``future`` (cancel it, or wait again)."""
    done, _ = await asyncio.wait((future,), timeout=timeout_s)
    return bool(done)


def abandon(future: asyncio.Future) -> None:
    """Cancel ``future`` without waiting for it, and drop whatever it ends with (also
    when it is done already: an exception nobody reads would be logged as never
    retrieved)."""
    future.cancel()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


@dataclass(slots=True)
class _Tracked:
    handle: ActorHandle
    health: Health = Health.STARTING
    status: WorkerStatus | None = None
    load: EngineLoad | None = None  # its newest report (a poll's or a delta's)
    requests: int = 0  # this router's choices in flight on the worker
    tokens: int = 0
    unreported_prefill: int = 0  # uncached prompt tokens this router sent since ``load``
    requests_at_load: int = 0  # the most of ``requests`` that ``load`` can include
    tokens_at_load: int = 0
    begun: int = 0  # choices this router ever sent it (``begin``)
    begun_tokens: int = 0
    abandoned: int = 0  # choices this router ever closed before the worker finished them
    abandoned_tokens: int = 0
    abandoned_at_load: int = 0  # ``abandoned`` when ``load`` was asked for
    abandoned_tokens_at_load: int = 0
    draining: bool = False  # refusing new work (from its last poll or refusal)
    refusal: str | None = None  # why it is REFUSED (``disagreement``)
    incarnation: int = 0  # bumped whenever the worker is found gone (module invariants)
    down_because: str | None = None  # why it is DOWN, as its last failed poll said
    dead: bool = False  # Ray gave up restarting ``handle``: look the name up again


@dataclass(frozen=True, slots=True)
class _Sent:
    """A router's work on a worker when a report of its load was asked for."""

    requests: int
    tokens: int
    unreported_prefill: int
    begun: int
    begun_tokens: int
    abandoned: int
    abandoned_tokens: int

    @staticmethod
    def now(tracked: _Tracked) -> _Sent:
        t = tracked
        return _Sent(
            t.requests,
            t.tokens,
            t.unreported_prefill,
            t.begun,
            t.begun_tokens,
            t.abandoned,
            t.abandoned_tokens,
        )


class WorkerPool:
    def __init__(
        self,
        handles: Mapping[str, ActorHandle],
        agreement: Agreement,
        poll_interval_s: float,
        poll_timeout_s: float,
        find: Callable[[str], ActorHandle | None] | None = None,
    ) -> None:
        """``find``: the live actor of a worker id, or None (blocking: run in a thread);
        None: a dead worker's handle is never replaced."""
        self._workers = {worker_id: _Tracked(handle) for worker_id, handle in handles.items()}
        self._find = find
        self._agreement = agreement
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
            self._view(worker_id, tracked)
            for worker_id, tracked in self._workers.items()
            if tracked.health is Health.HEALTHY and not tracked.draining
        ]

    def health(self) -> dict[str, Health]:
        return {worker_id: tracked.health for worker_id, tracked in self._workers.items()}

    def describe(self) -> str:
        """Each worker's state, for error messages: "w0: healthy, w1: draining"
        (a refused worker's with the reason)."""
        return ", ".join(
            f"{worker_id}: {_state(t)}" for worker_id, t in sorted(self._workers.items())
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

    def incarnation(self, worker_id: str) -> int:
        """Changes whenever the worker is found gone; compare it to the value read
        when work started to learn whether that work can still finish."""
        return self._workers[worker_id].incarnation

    @property
    def poll_interval_s(self) -> float:
        return self._interval_s

    # -- updates -------------------------------------------------------------------
    def begin(self, worker_id: str, choices: int, tokens: int, uncached: int) -> None:
        """Count work this router sent to a worker (choices, as the engine counts;
        ``uncached``: the prompt tokens it is expected to prefill)."""
        tracked = self._workers[worker_id]
        tracked.requests += choices
        tracked.tokens += tokens
        tracked.begun += choices
        tracked.begun_tokens += tokens
        tracked.unreported_prefill += uncached

    def observe(self, worker_id: str, load: EngineLoad) -> None:
        """Take the load a worker reported with an output delta (if newer)."""
        tracked = self._workers[worker_id]
        if tracked.load is None or load.version > tracked.load.version:
            self._take_report(tracked, load, _Sent.now(tracked))  # all sent so far

    def end(self, worker_id: str, choices: int, tokens: int, abandoned: bool = False) -> None:
        """Uncount work; ``abandoned``: closed before the worker finished it (a client
        that left), so the worker may count it a little longer, until it cancels it."""
        tracked = self._workers[worker_id]
        tracked.requests -= choices
        tracked.tokens -= tokens
        if abandoned:
            tracked.abandoned += choices
            tracked.abandoned_tokens += tokens

    def mark_draining(self, worker_id: str) -> None:
        self._workers[worker_id].draining = True

    def mark_down(self, worker_id: str) -> None:
        tracked = self._workers[worker_id]
        if tracked.health is not Health.DOWN:
            logger.warning("worker %s is down; routing around it", worker_id)
        tracked.health = Health.DOWN
        tracked.down_because = "a call to it failed"
        tracked.incarnation += 1

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
        if tracked.dead:
            if self._find is None:
                return
            handle = await asyncio.to_thread(self._find, worker_id)
            if handle is None:
                return
            tracked.handle, tracked.dead = handle, False
        sent = _Sent.now(tracked)
        call = asyncio.ensure_future(tracked.handle.status.remote())
        try:
            if not await settle(call, self._timeout_s):
                raise TimeoutError(f"no answer in {self._timeout_s} s")
            status = call.result()
        except (TimeoutError, RayError) as error:
            if tracked.health is Health.HEALTHY:
                logger.warning("worker %s did not answer a poll: %r", worker_id, error)
            if isinstance(error, ActorDiedError):
                tracked.incarnation += 1  # its work in flight is lost
                tracked.dead = True
            if tracked.health is Health.HEALTHY or isinstance(error, RayError):
                tracked.health = Health.DOWN
                tracked.down_because = _why_down(error)
            return
        finally:
            abandon(call)  # unfinished, or finished as this poll was cancelled
        refusal = disagreement(self._agreement, status.info)
        if refusal is not None:
            if refusal != tracked.refusal:
                logger.error("%s", refusal)
            tracked.health, tracked.refusal = Health.REFUSED, refusal
            return
        tracked.refusal = None
        restarted = tracked.status is not None and tracked.status.info.epoch != status.info.epoch
        if restarted:
            tracked.incarnation += 1
        if restarted or tracked.load is None or status.load.version > tracked.load.version:
            self._take_report(tracked, status.load, sent)
        if tracked.health is not Health.HEALTHY:
            logger.info("worker %s is healthy (epoch %d)", worker_id, status.info.epoch)
        tracked.status = status
        tracked.draining = status.draining
        tracked.health = Health.HEALTHY

    @staticmethod
    def _take_report(tracked: _Tracked, load: EngineLoad, sent: _Sent) -> None:
        """``sent``: this router's work on the worker when the report was asked for
        (a delta's: when it arrived, which is now)."""
        tracked.load = load
        # in the report at most: what was in flight then, what began since, and what was
        # abandoned between the report before and then (the worker may not have
        # cancelled it yet: counted as another router's, it made an idle worker look
        # full until the next poll)
        abandoned = sent.abandoned - tracked.abandoned_at_load
        abandoned_tokens = sent.abandoned_tokens - tracked.abandoned_tokens_at_load
        tracked.abandoned_at_load = sent.abandoned
        tracked.abandoned_tokens_at_load = sent.abandoned_tokens
        tracked.requests_at_load = sent.requests + tracked.begun - sent.begun + abandoned
        tracked.tokens_at_load = (
            sent.tokens + tracked.begun_tokens - sent.begun_tokens + abandoned_tokens
        )
        tracked.unreported_prefill = max(0, tracked.unreported_prefill - sent.unreported_prefill)

    def _view(self, worker_id: str, tracked: _Tracked) -> WorkerView:
        load = tracked.load
        if load is None:
            return WorkerView(
                worker_id, tracked.requests, tracked.tokens, tracked.unreported_prefill
            )
        others = max(0, load.requests - tracked.requests_at_load)
        other_tokens = max(0, load.tokens - tracked.tokens_at_load)
        return WorkerView(
            worker_id,
            tracked.requests + others,
            tracked.tokens + other_tokens,
            load.prefill_backlog_tokens + tracked.unreported_prefill,
            load.prefill_tokens_per_s,
            load.step_s,
            load.host_load_s_per_token,
        )


def _why_down(error: BaseException) -> str:
    if isinstance(error, ActorDiedError):
        return "it died and Ray will not restart it"
    if isinstance(error, ActorUnavailableError):
        return "Ray is restarting it"
    if isinstance(error, TimeoutError):
        return "it did not answer a poll in time"
    return f"a poll failed: {type(error).__name__}"


def _state(tracked: _Tracked) -> str:
    if tracked.health is Health.REFUSED:
        return f"refused ({tracked.refusal})"
    if tracked.health is Health.DOWN and tracked.down_because:
        return f"down ({tracked.down_because})"
    if tracked.draining and tracked.health is Health.HEALTHY:
        return "draining"
    return tracked.health
