"""The Ray worker actor: one engine per GPU (or CPU slot), streaming output to routers.

Invariants:
- The engine is driven only by the ``EngineLoop`` thread, here or in the engine's own
  process (``WorkerSpec.engine_process``; ``engine_host``). Async methods only enqueue
  commands and await per-request asyncio queues: the actor's event loop never blocks.
- ``epoch`` is new for every start of the actor: the wall clock in milliseconds when
  this incarnation started, so a restart (which takes far longer than a millisecond)
  always gets a larger one unless the clock is set back.
- The KV pool's events reach the directory via ``CacheMirror`` (filled by the loop
  thread) and ``EventPublisher`` (its own thread; each cycle doubles as heartbeat).
- ``generate`` yields ``WorkerRefusal`` only as its first and last item; a request
  that yielded nothing had no visible effect, so the router may retry it elsewhere.
- Every ``WorkerDelta`` carries the loop's load (``EngineLoad``) read when the delta
  was made, as does every ``status``: routers see queued prefill, decode count and
  measured rates with each poll and each output.
- Outputs reach the event loop through one ``_Outbox``: a step's outputs for all
  requests usually cost one wake-up of the loop, and reach each request's queue in
  order.
- A fatal engine error kills the process, so Ray restarts the actor (new epoch).
- Registered chunks live in ``WorkerChunks``, reached only through the loop thread;
  they die with the actor (a restarted worker holds none). A chunk whose TTL ended
  is unpinned within ``_EXPIRE_INTERVAL_S`` (a timer thread enqueues the check).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future

import ray
import torch

from chunkstore.chunking import Message
from chunkstore.publisher import EventPublisher
from chunkstore.ray_access import connect_directory
from workers.engine.chunk_registry import ChunkInfo
from workers.engine.engine import StepOutput
from workers.runtime.cache_mirror import CacheMirror
from workers.runtime.engine_host import SWITCH_INTERVAL_S, ChildEngine, LocalEngine
from workers.runtime.engine_loop import Rejected
from workers.runtime.worker_chunks import ChunkFailure, Registered
from workers.runtime.worker_types import (
    EngineLoad,
    WorkerDelta,
    WorkerInfo,
    WorkerRefusal,
    WorkerRequest,
    WorkerSpec,
    WorkerStatus,
    directory_namespace,
    pack_item,
)

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05
_EXPIRE_INTERVAL_S = 1.0


def new_epoch() -> int:
    return time.time_ns() // 1_000_000


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        started = time.monotonic()
        self._epoch = new_epoch()
        self._mirror = CacheMirror()
        if spec.engine_process:
            self._engine = ChildEngine(spec.engine, spec.cpu_threads, self._mirror.absorb, _crash)
        else:
            if spec.cpu_threads is not None:
                torch.set_num_threads(spec.cpu_threads)
            from workers.engine.engine import Engine  # the engine lives in this process

            engine = Engine(spec.engine, stream_text=True)
            self._engine = LocalEngine(engine, self._mirror.absorb, _crash)
        facts = self._engine.facts
        self._info = WorkerInfo(
            worker_id=spec.worker_id,
            epoch=self._epoch,
            namespace_model=facts["namespace_model"],
            max_model_len=facts["max_model_len"],
            page_size=facts["page_size"],
            directory_namespace=directory_namespace(spec.directory),
            startup_s=time.monotonic() - started,
            entry_system_prompt=spec.engine.entry_system_prompt,
        )
        self._publisher = EventPublisher(
            connect_directory(spec.directory),
            spec.worker_id,
            self._epoch,
            self._mirror.drain,
            self._mirror.snapshot,
            interval_s=spec.publish_interval_s,
        )
        self._draining = False
        self._outbox: _Outbox | None = None
        # The engine thread (when it runs here) waits for the device with the GIL
        # released; the event loop thread (streaming deltas) then holds it until it
        # blocks or is asked to drop it, after the switch interval (5 ms by default): a
        # wait that each step paid.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._engine.start()
        self._publisher.start()
        threading.Thread(target=self._expire_forever, name="chunk-expiry", daemon=True).start()
        logger.info(
            "worker %s started in %.1f s (epoch %d)",
            spec.worker_id,
            self._info.startup_s,
            self._epoch,
        )

    async def generate(self, request: WorkerRequest) -> AsyncIterator[bytes]:
        """Stream the request's output, each item packed (``worker_types.pack_item``);
        call with ``.options(num_returns="streaming")``."""
        if self._draining:
            yield pack_item(WorkerRefusal("worker is draining", retryable=True))
            return
        if self._outbox is None:  # every call runs on the actor's one event loop
            self._outbox = _Outbox(asyncio.get_running_loop())
        outputs: asyncio.Queue[StepOutput | Rejected] = asyncio.Queue()
        sink = self._outbox.sink(outputs)
        ids = [f"{request.request_id}#{i}" for i in range(len(request.params))]
        for request_id, params in zip(ids, request.params, strict=True):
            self._engine.submit(request_id, params, request.prompt, sink)
        recorded = not request.chunk_ids
        try:
            async for item in _collect(outputs, ids, request.stream_interval_s, self._engine.load):
                if not recorded and isinstance(item, WorkerDelta):
                    recorded = True  # before the client sees output: later calls see the hit
                    self._record_use(request, item.cached_tokens)
                yield pack_item(item)
        finally:  # finished, failed or cancelled by the caller: free the engine's work
            for request_id in ids:
                self._engine.abort(request_id)

    def _expire_forever(self) -> None:
        while True:
            time.sleep(_EXPIRE_INTERVAL_S)
            self._engine.chunks("expire")

    def _record_use(self, request: WorkerRequest, cached: int) -> None:
        self._engine.chunks(
            "record_use",
            request.prompt.tenant_salt,
            request.chunk_ids,
            request.prompt.token_ids,
            cached,
        )

    # -- registered chunks (see workers.runtime.worker_chunks) ------------------------------
    async def register_chunk(
        self,
        tenant_salt: str,
        content: str | Sequence[Message],
        role: str,
        ttl_s: float | None,
        after: Sequence[str],
        mode: str = "exact",
    ) -> Registered | ChunkFailure:
        """A caller that gives up (the call is cancelled) leaves nothing pinned: a
        registration not started yet never runs, one under way is rolled back once
        it ends."""
        future = self._engine.chunks("register", tenant_salt, content, role, ttl_s, after, mode)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: self._roll_back_abandoned(tenant_salt, f))
            raise

    async def roll_back_chunk(self, tenant_salt: str, registered: Registered) -> bool:
        """Undo a registration whose caller gave up (``WorkerChunks.roll_back``)."""
        future = self._roll_back(tenant_salt, registered)
        return False if future is None else await asyncio.wrap_future(future)

    def _roll_back_abandoned(self, tenant_salt: str, future: Future) -> None:
        """On the thread that ended ``future``: roll its registration back, if it
        created a chunk (a cancelled future never ran)."""
        if future.cancelled() or future.exception() is not None:
            return
        registered = future.result()
        if isinstance(registered, Registered) and self._roll_back(tenant_salt, registered):
            chunk_id = registered.info.chunk_id
            logger.info("chunk %s: its registering caller left; rolling it back", chunk_id)

    def _roll_back(self, tenant_salt: str, registered: Registered) -> Future | None:
        """The rollback of a registration that created its chunk, queued on the loop
        thread (None: it found the chunk there, and nothing is undone)."""
        if not registered.created:
            return None
        chunk_id, number = registered.info.chunk_id, registered.registration
        return self._engine.chunks("roll_back", tenant_salt, chunk_id, number)

    async def unregister_chunk(self, tenant_salt: str, chunk_id: str) -> bool:
        return await asyncio.wrap_future(self._engine.chunks("unregister", tenant_salt, chunk_id))

    async def list_chunks(self, tenant_salt: str) -> list[ChunkInfo]:
        return await asyncio.wrap_future(self._engine.chunks("infos", tenant_salt))

    async def chunk_messages(
        self, tenant_salt: str, chunk_ids: Sequence[str]
    ) -> dict[str, list[Message]]:
        return await asyncio.wrap_future(self._engine.chunks("messages", tenant_salt, chunk_ids))

    async def info(self) -> WorkerInfo:
        return self._info

    async def status(self) -> WorkerStatus:
        publisher = await asyncio.to_thread(self._publisher.stats)  # may wait on a flush
        kv = self._engine.kv_pages()
        return WorkerStatus(
            info=self._info,
            load=self._engine.load(),
            cached_pages=self._mirror.size(),
            kv_pages_total=kv.total,
            kv_pages_in_use=kv.in_use,
            draining=self._draining,
            directory_in_sync=publisher.in_sync,
            directory_superseded=publisher.superseded,
            step_tally=self._engine.step_tally(),
            host_tier=kv.host,
        )

    async def health(self) -> bool:
        return True  # reaching this method means the actor and its loop thread live

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests, wait for running ones, flush chunk events.
        True if everything finished within ``timeout_s``."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._engine.outstanding() and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        await asyncio.to_thread(self._publisher.flush)
        return self._engine.outstanding() == 0

    async def resume(self) -> None:
        self._draining = False


# No task events: the GCS would keep ~3 KB for each call (each request's stream, each
# status poll), 10 MB/min under load until Ray's cap of 100,000 calls (~370 MB).
WorkerActor = ray.remote(enable_task_events=False)(Worker)


def _crash(error: BaseException) -> None:
    logger.critical("worker engine failed (%r); exiting so that Ray restarts it", error)
    os._exit(1)


class _Outbox:
    """Hands the engine thread's outputs to the actor's event loop: outputs delivered
    while a hand-over is pending join it, so a step's outputs for every request
    usually cost the event loop one wake-up, not one each (the engine thread holds
    the GIL while it delivers a step's outputs; a switch mid-delivery splits them over
    two). Each queue gets its items in the order they were delivered."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, StepOutput | Rejected]] = []

    def sink(self, outputs: asyncio.Queue):
        """A sink (``EngineLoop.submit``) putting items on ``outputs``."""
        return lambda item: self._put(outputs, item)

    def _put(self, outputs: asyncio.Queue, item: StepOutput | Rejected) -> None:
        with self._lock:
            self._pending.append((outputs, item))
            if len(self._pending) > 1:
                return  # the hand-over already asked for takes this one too
        try:
            self._loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the event loop closed: the actor is shutting down
            with self._lock:
                self._pending.clear()

    def _hand_over(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for outputs, item in pending:
            outputs.put_nowait(item)


async def _collect(
    outputs: asyncio.Queue[StepOutput | Rejected],
    ids: list[str],
    interval_s: float,
    load: Callable[[], EngineLoad | None] = lambda: None,
) -> AsyncIterator[WorkerDelta | WorkerRefusal]:
    """Deltas until every choice finished: the first as soon as it exists, then at
    most one per choice every ``interval_s``, coalescing what arrived meanwhile (a
    choice's last delta is never held back past the moment every choice finished).
    Each delta carries ``load()``, read when its batch of deltas is made."""
    index_of = {request_id: i for i, request_id in enumerate(ids)}
    unfinished = len(ids)
    loop = asyncio.get_running_loop()
    next_yield = -math.inf  # the first output goes out at once
    while unfinished:
        items = [await outputs.get()]
        ending = _ends(items[0])
        while ending < unfinished and loop.time() < next_yield:
            try:
                item = await asyncio.wait_for(outputs.get(), _timeout(next_yield - loop.time()))
            except TimeoutError:
                break
            items.append(item)
            ending += _ends(item)
        while not outputs.empty():
            items.append(outputs.get_nowait())
        rejected = next((item for item in items if isinstance(item, Rejected)), None)
        if rejected is not None:
            yield WorkerRefusal(rejected.message, retryable=False)
            return
        for delta in coalesce(items, index_of, load()):
            yield delta
            unfinished -= delta.finished
        next_yield = loop.time() + interval_s


def _ends(item: StepOutput | Rejected) -> float:
    """Choices this item ends (a rejection ends them all)."""
    return math.inf if isinstance(item, Rejected) else float(item.finished)


def _timeout(seconds: float) -> float | None:
    return None if math.isinf(seconds) else max(0.0, seconds)


def coalesce(
    outputs: list[StepOutput], index_of: dict[str, int], load: EngineLoad | None = None
) -> list[WorkerDelta]:
    """One delta per choice from consecutive step outputs, in first-seen order, each
    carrying ``load``."""
    grouped: dict[int, list[StepOutput]] = {}
    for output in outputs:
        grouped.setdefault(index_of[output.request_id], []).append(output)
    deltas = []
    for index, group in grouped.items():
        last = group[-1]
        deltas.append(
            WorkerDelta(
                index=index,
                token_ids=tuple(t for o in group for t in o.new_token_ids),
                text="".join(o.new_text for o in group),
                finished=last.finished,
                finish_reason=last.finish_reason,
                prompt_tokens=last.num_prompt_tokens,
                reuse=last.reuse,
                logprobs=tuple(o.logprobs for o in group if o.logprobs is not None),
                load=load,
            )
        )
    return deltas
