"""The chunk-aware router: one directory lookup, a policy decision, a worker stream.

Retries (the one retry layer; ``router.max_attempts`` in the config):
- A request's worker starts are counted by one ``Attempts``: at most
  ``max_attempts`` in all, never the same worker twice, whoever retries. ``open``
  retries while nothing reached the client (the worker died before its first delta,
  or refused as draining); a caller that buffers the whole answer may start over
  after ``WorkerLost`` only by calling ``open`` again with the same ``Attempts``.
  So a request starts at most ``max_attempts`` generations, never more.

Invariants:
- A chunk-aware decision is remembered (``policy.RouteMemory``, for
  ``recent_route_lease_s``) as soon as it is made, so the same prefix sent again
  before the directory lists it follows it.
- At most one directory lookup per request (kept in its ``Attempts``, reused when
  retrying): the prompt's chunk keys and, for an approximate request, its chunks'
  entry keys, in one call; scored by ``policy.prefill_saved``. None while only
  one worker is open (the decision's reason is then ``SOLE``): its answer could change
  nothing, and the round trip would delay every request of a one-worker deployment.
- ``open`` returns only once the chosen worker produced the first delta.
- After the first delta the request is bound to its worker: a death then surfaces
  as ``WorkerLost``.
- Every request counted in the pool's in-flight load is uncounted exactly once
  (``WorkerStream.close``), whether it finished, failed or was abandoned.
- A worker found dead is marked down and its directory entries are purged (its
  restarted incarnation re-publishes under a new epoch).
- No wait for a worker's output outlives that worker: a stream whose worker the
  pool finds gone (``WorkerPool.incarnation``) fails within a poll interval, as
  if Ray had reported the death (which it may fail to do).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from chunkstore.directory import LookupResult
from chunkstore.ray_access import AsyncDirectory
from cluster.errors import BadRequest, NoHealthyWorker, Overloaded, WorkerLost
from cluster.metrics import Metrics
from cluster.routing.policy import (
    DEFAULT_HOST_LOAD_SHARE,
    Decision,
    HostHeld,
    Policy,
    Reason,
    RouteMemory,
    RoutingWeights,
    Unroutable,
    WorkerView,
    choose_worker,
    host_load_shares,
    prefill_saved,
    round_robin,
)
from cluster.routing.prompts import PreparedPrompt
from cluster.routing.worker_pool import WorkerPool, abandon, settle
from workers.engine.reuse_info import ReuseRequest
from workers.runtime.worker_types import (
    EngineLoad,
    WorkerDelta,
    WorkerRefusal,
    WorkerRequest,
    unpack_item,
)

logger = logging.getLogger(__name__)


class WorkerStream:
    """Output of one request on one worker; the first delta has already arrived."""

    def __init__(
        self,
        decision: Decision,
        first: WorkerDelta,
        generator: ray.ObjectRefGenerator,
        watch: WorkerWatch,
        observe: Callable[[EngineLoad], None],
        on_lost: Callable[[], None],
        on_close: Callable[[bool], None],
    ) -> None:
        self.decision = decision
        self._first = first
        self._generator = generator
        self._watch = watch
        self._observe = observe  # the worker's load, reported with a delta
        self._on_lost = on_lost
        self._on_close = on_close
        self._closed = False

    @property
    def worker_id(self) -> str:
        return self.decision.worker_id

    async def deltas(self) -> AsyncIterator[WorkerDelta]:
        """Every delta, the first one included. Raises ``WorkerLost`` if the worker dies.

        What the worker sent while this router was busy (its client slow to read, or
        its loop loaded) comes merged (``merge_deltas``): a slow reader gets fewer,
        larger events, one that keeps up an event a worker delta."""
        try:
            yield self._first
            ended = False
            while not ended:
                items = []
                while not items or self._generator.next_ready():
                    try:
                        items.append(await self._next())
                    except StopAsyncIteration:
                        ended = True
                        break
                if items:
                    for delta in merge_deltas(items):
                        yield delta
        finally:
            self.close()

    async def _next(self) -> WorkerDelta:
        try:
            item = await _next_item(self._generator, self._watch)
        except (RayActorError, _WorkerGone) as error:
            self._on_lost()
            raise WorkerLost(
                f"worker {self.worker_id} died while streaming this response; retry"
            ) from error
        if isinstance(item, WorkerRefusal):
            raise BadRequest(item.message)
        if item.load is not None:
            self._observe(item.load)
        return item

    def close(self) -> None:
        """Stop the worker's generation if unfinished; uncount the request (idempotent)."""
        if self._closed:
            return
        self._closed = True
        unfinished = not self._generator.is_finished()
        self._on_close(unfinished)
        if unfinished:
            ray.cancel(self._generator)


def merge_deltas(deltas: list[WorkerDelta]) -> list[WorkerDelta]:
    """One delta per choice from consecutive deltas of one stream, in first-seen order:
    tokens, text and logprobs joined; the end, reuse and load of the last."""
    if len(deltas) == 1:
        return deltas
    grouped: dict[int, list[WorkerDelta]] = {}
    for delta in deltas:
        grouped.setdefault(delta.index, []).append(delta)
    merged = []
    for group in grouped.values():
        last = group[-1]
        merged.append(
            dataclasses.replace(
                last,
                token_ids=tuple(t for d in group for t in d.token_ids),
                text="".join(d.text for d in group),
                logprobs=tuple(entry for d in group for entry in d.logprobs),
            )
        )
    return merged


class Attempts:
    """One request's worker starts, shared by every retry of it (see the module's
    "Retries"): ``left`` starts remain; ``tried`` workers are not chosen again."""

    def __init__(self, max_attempts: int) -> None:
        self.left = max_attempts
        self.tried: set[str] = set()
        self.looked_up = False
        self.holdings: dict[str, int] | None = None  # the request's directory answer

    @property
    def exhausted(self) -> bool:
        return self.left <= 0


@dataclass(frozen=True)
class RouterSettings:
    weights: RoutingWeights
    max_attempts: int  # worker starts per request, all retries together
    policy: Policy = Policy.CHUNK_AWARE
    recent_route_lease_s: float = 0.0  # RouteMemory's lease (chunk-aware); 0: no memory
    # what a placed token that repair does not recompute still costs, as a share of a
    # computed one: the workers' selection layers over the model's (``placed_saving``)
    selection_share: float = 0.0


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        directory: AsyncDirectory,
        settings: RouterSettings,
        metrics: Metrics,
    ) -> None:
        self.pool = pool
        self._directory = directory
        self._settings = settings
        self._metrics = metrics
        self._rotation = itertools.count()
        self._memory = RouteMemory(settings.recent_route_lease_s)
        self._purges: set[asyncio.Task] = set()

    async def directory_answers(self, timeout_s: float) -> bool:
        """Whether the chunk directory answers now (its stats, within ``timeout_s``)."""
        try:
            return await asyncio.wait_for(self._directory.stats(), timeout_s) is not None
        except TimeoutError:
            return False

    def attempts(self) -> Attempts:
        """A fresh budget of ``max_attempts`` worker starts for one request."""
        return Attempts(self._settings.max_attempts)

    async def open(
        self, prompt: PreparedPrompt, request: WorkerRequest, attempts: Attempts | None = None
    ) -> WorkerStream:
        """Route ``request`` and wait for its first delta, spending ``attempts`` (a
        fresh budget if None; pass the same one to start a request over)."""
        attempts = self.attempts() if attempts is None else attempts
        await self.pool.start()
        while not attempts.exhausted:
            views = [v for v in self.pool.views() if v.worker_id not in attempts.tried]
            # with one worker open there is nothing to choose: no directory round trip
            if self._chunk_aware and not attempts.looked_up and len(views) > 1:
                attempts.looked_up = True
                attempts.holdings = await self._lookup(prompt, request.prompt.reuse)
                views = [v for v in self.pool.views() if v.worker_id not in attempts.tried]
            now = time.monotonic()
            decision = self._choose(views, attempts.holdings, prompt, now)
            if self._chunk_aware and not attempts.looked_up and isinstance(decision, Decision):
                decision = dataclasses.replace(decision, reason=Reason.SOLE)
            if decision is Unroutable.OVERLOADED:
                raise Overloaded(self._overloaded_message(views))
            if isinstance(decision, Unroutable):
                break
            if self._chunk_aware:  # before its first delta: a burst meanwhile follows it
                self._memory.remember(prompt.lookup_keys, decision.worker_id, now)
            self._metrics.routes.inc(decision.reason.value)
            attempt_request = dataclasses.replace(
                request,
                request_id=f"{request.request_id}.{len(attempts.tried)}",
                prompt=dataclasses.replace(
                    request.prompt,
                    expected_cached_tokens=decision.expected_cached_tokens,
                    held_elsewhere=decision.reason is Reason.SPILL,
                ),
            )
            attempts.tried.add(decision.worker_id)
            attempts.left -= 1
            stream = await self._start(decision, attempt_request)
            if stream is not None:
                return stream
            self._metrics.retries.inc()
        raise NoHealthyWorker(self._no_worker_message(attempts.tried))

    @property
    def _chunk_aware(self) -> bool:
        return self._settings.policy is Policy.CHUNK_AWARE

    def _choose(
        self,
        views: list[WorkerView],
        holdings: dict[str, int] | None,
        prompt: PreparedPrompt,
        now: float,
    ) -> Decision | Unroutable:
        weights, rotation = self._settings.weights, next(self._rotation)
        if self._chunk_aware:
            recent = self._memory.recall(prompt.lookup_keys, prompt.token_ends, now)
            prompt_tokens = len(prompt.token_ids)
            return choose_worker(views, holdings, weights, prompt_tokens, rotation, recent)
        return round_robin(views, weights.max_requests_per_worker, rotation)

    async def _lookup(self, prompt: PreparedPrompt, reuse: ReuseRequest) -> dict[str, int] | None:
        """Worker id -> prompt tokens it would not compute; None: no information."""
        if not prompt.lookup_keys and not prompt.entry_keys:
            return {}  # nothing shareable: an answer, not an outage
        result = await self._directory.lookup(
            prompt.lookup_keys, prompt.token_ends, prompt.entry_keys
        )
        self._metrics.lookups.inc()
        if not result.available:
            self._metrics.lookup_failures.inc()
            return None
        exact = {h.worker_id: h.tokens for h in result.holdings}
        return prefill_saved(
            exact,
            {e.worker_id: e.entries for e in result.entries},
            prompt.placeable[: len(prompt.entry_keys)],
            reuse.first_tokens,
            reuse.deviation_ratio,
            self._settings.selection_share,
            self._host_held(result),
        )

    def _host_held(self, result: LookupResult) -> dict[str, HostHeld]:
        """What the answer says workers hold only in host memory, with their load costs."""
        prefix = {h.worker_id: h.host_tokens for h in result.holdings if h.host_tokens}
        entries = {e.worker_id: e.host_entries for e in result.entries if e.host_entries}
        if not prefix and not entries:
            return {}
        shares = host_load_shares(self.pool.views(), self._settings.weights)
        return {
            worker: HostHeld(
                prefix.get(worker, 0),
                frozenset(entries.get(worker, ())),
                shares.get(worker, DEFAULT_HOST_LOAD_SHARE),
            )
            for worker in {*prefix, *entries}
        }

    async def _start(self, decision: Decision, request: WorkerRequest) -> WorkerStream | None:
        """The stream once its first delta arrived; None if the worker cannot take it."""
        worker_id = decision.worker_id
        choices = len(request.params)
        tokens = len(request.prompt.token_ids) + sum(p.max_tokens for p in request.params)
        uncached = max(0, len(request.prompt.token_ids) - decision.expected_cached_tokens)
        self.pool.begin(worker_id, choices, tokens, uncached)
        watch = WorkerWatch(self.pool, worker_id)
        generator = (
            self.pool.handle(worker_id).generate.options(num_returns="streaming").remote(request)
        )
        try:
            first = await _next_item(generator, watch)
        except (RayActorError, _WorkerGone):
            self.pool.end(worker_id, choices, tokens)
            self._lost(worker_id)
            return None
        except BaseException:
            self.pool.end(worker_id, choices, tokens)
            ray.cancel(generator)
            raise
        if isinstance(first, WorkerDelta) and first.load is not None:
            self.pool.observe(worker_id, first.load)
        if isinstance(first, WorkerRefusal):
            self.pool.end(worker_id, choices, tokens)
            if first.retryable:
                self.pool.mark_draining(worker_id)
                return None
            raise BadRequest(first.message)
        return WorkerStream(
            decision,
            first,
            generator,
            watch,
            observe=lambda load: self.pool.observe(worker_id, load),
            on_lost=lambda: self._lost(worker_id),
            on_close=lambda unfinished: self.pool.end(worker_id, choices, tokens, unfinished),
        )

    def _lost(self, worker_id: str) -> None:
        self.pool.mark_down(worker_id)
        self._memory.forget(worker_id)
        task = asyncio.get_running_loop().create_task(self._directory.remove_worker(worker_id))
        self._purges.add(task)
        task.add_done_callback(self._purges.discard)

    def _overloaded_message(self, views: list[WorkerView]) -> str:
        limit = self._settings.weights.max_requests_per_worker
        ordered = sorted(views, key=lambda view: view.worker_id)
        loads = ", ".join(f"{view.worker_id}: {view.requests}" for view in ordered)
        return (
            f"every worker is at its limit of {limit} requests (router.max_requests_per_worker;"
            f" in flight: {loads}); retry later"
        )

    def _no_worker_message(self, tried: set[str]) -> str:
        if tried:
            return f"no worker could take the request (tried {len(tried)}); retry"
        return f"no healthy worker ({self.pool.describe()})"


class _WorkerGone(Exception):
    """The pool found the worker gone while a call to it was still unanswered."""


class WorkerWatch:
    """Whether a worker is still the incarnation it was when work was sent to it."""

    def __init__(self, pool: WorkerPool, worker_id: str) -> None:
        self._pool = pool
        self.worker_id = worker_id
        self._incarnation = pool.incarnation(worker_id)
        self.check_s = pool.poll_interval_s

    def gone(self) -> bool:
        return self._pool.incarnation(self.worker_id) != self._incarnation


async def _next_item(
    generator: ray.ObjectRefGenerator, watch: WorkerWatch
) -> WorkerDelta | WorkerRefusal:
    """The stream's next item. Ray fails it when the worker dies, but not always (a
    death racing the item's report can leave it unresolved forever), so the pool's
    polls bound the wait: once the worker is found gone this raises ``_WorkerGone``.
    A cancelled caller returns at once, abandoning the read."""
    read = asyncio.ensure_future(_read_next(generator))
    try:
        while not await settle(read, watch.check_s):
            if watch.gone():
                raise _WorkerGone(f"worker {watch.worker_id} was found gone")
        return read.result()
    finally:
        abandon(read)  # unfinished, or finished as its reader left: its end is dropped


async def _read_next(generator: ray.ObjectRefGenerator) -> WorkerDelta | WorkerRefusal:
    ref = await generator.__anext__()
    return unpack_item(await ref)
