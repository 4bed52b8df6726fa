"""``/v1/chunks`` and chunk parts in chat requests, over the worker actors.

Invariants:
- The workers are the only store of registered chunks (content included): nothing
  about a chunk is kept in the directory or in Redis beyond its page keys. A router
  replica keeps no chunk state, so any number of replicas agree.
- Every call passes the caller's tenant salt; a worker answers from that tenant's
  registry only, so another tenant's id is unknown (404) everywhere.
- A registration that fails on any chosen worker is undone on the workers where it
  created the chunk, and so is one whose client left before it was answered, so
  nothing stays pinned on error or abandonment (``Worker.roll_back_chunk``: a
  registration of the same chunk that came meanwhile is kept).
- No call blocks the event loop: actor calls are awaited with a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import RayError, TaskCancelledError

from chunkstore.chunking import Message, message_chars
from cluster.api.openai_protocol import ChatMessage, ChunkPart
from cluster.errors import BadRequest, NoHealthyWorker, NotFound
from cluster.http.chunk_protocol import Chunk, DeletedChunk, RegisterChunkRequest
from cluster.routing.worker_pool import WorkerPool
from workers.engine.chunk_registry import ChunkInfo
from workers.runtime.worker_chunks import ChunkFailure, Registered

logger = logging.getLogger(__name__)

_FAILED = object()  # a worker that did not answer


class ChunkService:
    def __init__(
        self,
        pool: WorkerPool,
        timeout_s: float,
        check_size: Callable[[int, int, str], Awaitable[None]],
    ) -> None:
        """``check_size(chars, messages, param)``: refuses (``BadRequest``) content
        larger than a prompt may be, before a worker renders or tokenizes any of it."""
        self._pool = pool
        self._timeout_s = timeout_s
        self._check_size = check_size
        self._undoing: set[asyncio.Task] = set()  # roll-backs under way (held: not GC'd)

    async def register(self, body: RegisterChunkRequest, tenant: str) -> Chunk:
        await self._pool.start()
        content = body.content_for_registry()
        messages = [{"content": content}] if isinstance(content, str) else content
        await self._check_size(message_chars(messages), len(messages), "content")
        chosen = await self._choose(body, tenant)
        calls = {
            w: self._pool.handle(w).register_chunk.remote(
                tenant, content, body.role, body.ttl_s, body.after, body.mode
            )
            for w in chosen
        }
        try:
            results = await self._gather(calls)
        except asyncio.CancelledError:  # the client left: nothing it asked for stays
            self._undo_later(tenant, calls)
            raise
        done = {w: r for w, r in results.items() if isinstance(r, Registered)}
        if len(done) < len(chosen):
            # unanswered calls may still register: undo them if they ever do
            self._undo_later(tenant, {w: calls[w] for w, r in results.items() if r is _FAILED})
            await self._gather(
                {w: self._pool.handle(w).roll_back_chunk.remote(tenant, r) for w, r in done.items()}
            )
            raise _failure(results)
        info = next(iter(done.values())).info
        return _chunk(info, sorted(done), [r.info for r in done.values()])

    async def list_chunks(self, tenant: str) -> list[Chunk]:
        per_worker = await self._infos(tenant)
        order: dict[str, list[tuple[str, ChunkInfo]]] = {}
        for worker_id, infos in per_worker.items():
            for info in infos:
                order.setdefault(info.chunk_id, []).append((worker_id, info))
        return [
            _chunk(held[0][1], sorted(w for w, _ in held), [i for _, i in held])
            for held in order.values()
        ]

    async def get(self, tenant: str, chunk_id: str) -> Chunk:
        for chunk in await self.list_chunks(tenant):
            if chunk.id == chunk_id:
                return chunk
        raise _unknown(chunk_id)

    async def delete(self, tenant: str, chunk_id: str) -> DeletedChunk:
        await self._pool.start()
        results = await self._each(
            self._workers(), lambda w: w.unregister_chunk.remote(tenant, chunk_id)
        )
        if not any(r is True for r in results.values()):
            raise _unknown(chunk_id)
        return DeletedChunk(id=chunk_id)

    async def expand(self, messages: Sequence[ChatMessage], tenant: str) -> list[Message]:
        """The messages with chunk parts replaced by the chunks' content: a message whose
        content is one chunk part becomes the chunk's messages; a chunk part among other
        parts becomes the text parts of the chunk's (single) message."""
        ids = list(dict.fromkeys(i for m in messages for i in m.chunk_ids))
        await self._pool.start()
        found: dict[str, list[Message]] = {}
        results = await self._each(self._workers(), lambda w: w.chunk_messages.remote(tenant, ids))
        for result in results.values():
            if isinstance(result, dict):
                found.update(result)
        missing = [i for i in ids if i not in found]
        if missing:
            raise _unknown(missing[0])
        out: list[Message] = []
        for message in messages:
            out += _expand_message(message, found)
        return out

    # -- internals -----------------------------------------------------------------
    def _workers(self) -> list[str]:
        return [v.worker_id for v in self._pool.views()]

    async def _choose(self, body: RegisterChunkRequest, tenant: str) -> list[str]:
        """The ``replicas`` least-loaded workers (among those holding all ``after``)."""
        views = self._pool.views()
        if body.after:
            per_worker = await self._infos(tenant)
            held = {w: {i.chunk_id for i in infos} for w, infos in per_worker.items()}
            for chunk_id in body.after:
                if not any(chunk_id in ids for ids in held.values()):
                    raise _unknown(chunk_id, param="after")
            views = [v for v in views if set(body.after) <= held.get(v.worker_id, set())]
            where = "holding every chunk in `after`"
        else:
            where = "healthy"
        if not views:
            raise NoHealthyWorker(f"no worker can take the chunk ({self._pool.describe()})")
        if body.replicas > len(views):
            raise BadRequest(
                f"replicas is {body.replicas}, but only {len(views)} worker(s) {where} "
                "can pin the chunk; lower replicas",
                param="replicas",
            )
        ordered = sorted(views, key=lambda v: (v.requests, v.tokens, v.worker_id))
        return [v.worker_id for v in ordered[: body.replicas]]

    def _undo_later(self, tenant: str, calls: dict[str, ObjectRef]) -> None:
        """Roll back, once they end, the registrations ``calls`` made for a caller
        that gave up (a worker whose call Ray cancelled rolled it back itself)."""

        async def undo(worker_id: str, call: ObjectRef) -> None:
            try:
                registered = await asyncio.wait_for(call, self._timeout_s)
                if isinstance(registered, Registered):
                    handle = self._pool.handle(worker_id)
                    await asyncio.wait_for(
                        handle.roll_back_chunk.remote(tenant, registered), self._timeout_s
                    )
            except (RayError, TimeoutError):
                pass  # cancelled at the worker (which rolls back), or the worker is gone

        for worker_id, call in calls.items():
            task = asyncio.get_running_loop().create_task(undo(worker_id, call))
            self._undoing.add(task)
            task.add_done_callback(self._undoing.discard)

    async def _infos(self, tenant: str) -> dict[str, list[ChunkInfo]]:
        await self._pool.start()
        results = await self._each(self._workers(), lambda w: w.list_chunks.remote(tenant))
        return {w: r for w, r in results.items() if r is not _FAILED}

    async def _each(
        self, worker_ids: Sequence[str], call: Callable[[ActorHandle], Awaitable]
    ) -> dict[str, object]:
        """Each worker's answer to ``call`` (``_FAILED`` where it did not answer)."""
        return await self._gather({w: call(self._pool.handle(w)) for w in worker_ids})

    async def _gather(self, calls: dict[str, Awaitable]) -> dict[str, object]:
        """Each worker's answer to its call (``_FAILED`` where it did not answer)."""

        async def one(worker_id: str, call: Awaitable) -> object:
            try:
                return await asyncio.wait_for(call, self._timeout_s)
            except TaskCancelledError:  # Ray cancelled it because our caller left
                raise asyncio.CancelledError from None
            except Exception:  # noqa: BLE001 - a dead or slow worker: reported as failed
                logger.warning("chunk call to worker %s failed", worker_id, exc_info=True)
                return _FAILED

        answers = await asyncio.gather(*(one(w, c) for w, c in calls.items()))
        return dict(zip(calls, answers, strict=True))


def _expand_message(message: ChatMessage, found: dict[str, list[Message]]) -> list[Message]:
    content = message.content
    if isinstance(content, str) or not message.chunk_ids:
        return [message.as_chunking_message()]
    if len(content) == 1:
        return [dict(m) for m in found[content[0].chunk_id]]
    parts: list[dict[str, str]] = []
    for part in content:
        if not isinstance(part, ChunkPart):
            parts.append({"type": "text", "text": part.text})
            continue
        chunk_messages = found[part.chunk_id]
        if len(chunk_messages) != 1:
            raise BadRequest(
                f"chunk {part.chunk_id!r} holds {len(chunk_messages)} messages; use it as a "
                "message's only content part",
                param="messages",
            )
        inner = chunk_messages[0]["content"]
        parts += [{"type": "text", "text": inner}] if isinstance(inner, str) else list(inner)
    return [{"role": message.role, "content": parts}]


def _chunk(info: ChunkInfo, holders: list[str], infos: Sequence[ChunkInfo]) -> Chunk:
    expiries = [i.expires_at for i in infos]
    return Chunk(
        id=info.chunk_id,
        role=info.role,
        tokens=info.num_tokens,
        pinned_tokens=info.pinned_tokens,
        holders=holders,
        expires_at=None if None in expiries else max(expiries),
        hits=sum(i.hits for i in infos),
        tokens_saved=sum(i.tokens_saved for i in infos),
        mode=info.mode,
    )


def _unknown(chunk_id: str, param: str | None = None) -> NotFound:
    return NotFound(
        f"no chunk {chunk_id!r} for this API key: never registered, deleted, or its TTL ended",
        param=param,
    )


def _failure(results: dict[str, object]) -> Exception:
    failures = [r for r in results.values() if isinstance(r, ChunkFailure)]
    if not failures:
        return NoHealthyWorker("a worker did not answer while pinning the chunk; retry")
    first = failures[0]
    if first.unknown:
        return NotFound(first.message, param="after")
    return BadRequest(first.message, param="content")
