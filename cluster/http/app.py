"""The OpenAI-compatible HTTP app: a Ray Serve deployment with a FastAPI ingress.

Every replica is a router: it authenticates, tokenizes, looks up the directory
and streams from a worker. Replicas share nothing but the directory, the workers
(found by name, created on first use) and the metrics board, so any number of them
stay correct.

Order of checks: authentication (401), body size (413, ``server.max_request_bytes``,
as the body arrives: a larger one is never read whole), body parsing and validation
(400), model (404), prompt size (400, ``server.max_prompt_chars``, before
tokenizing), prompt length in tokens (400), routing (429, 503). Every error body is
OpenAI-style ``{"error": {...}}``. Work that takes CPU time in proportion to the
request (parsing a large body, tokenizing) runs off the event loop, so ``/health``
and small requests keep being answered while a huge one is prepared.
"""

# No ``from __future__ import annotations``: FastAPI must see real types on the
# ingress methods (``request: Request``) after Serve re-wraps them.
import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import NoReturn

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field
from ray import serve
from ray.actor import ActorHandle
from ray.exceptions import RayError, TaskCancelledError
from ray.serve import Application
from ray.serve import context as serve_context
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.actors import check_placement, ensure_cluster, find_keeper, replica_demand
from cluster.assembly import build_service
from cluster.chunk_protocol import ChunkList, RegisterChunkRequest
from cluster.chunk_service import ChunkService
from cluster.completions import Reply
from cluster.config import ClusterConfig, load_config
from cluster.errors import (
    APIError,
    HTTPStatusError,
    NoHealthyWorker,
    NotFound,
    PayloadTooLarge,
)
from cluster.metrics import Metrics, SharedMetrics, worker_families
from cluster.model_store import ensure_model
from cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_request,
)
from cluster.tenancy import Authenticator
from workers.runtime.worker_types import WorkerStatus

logger = logging.getLogger(__name__)

CHUNK_CALL_TIMEOUT_S = 300  # registering computes the chunk's KV (slow on CPU)
STATUS_TIMEOUT_S = 2.0  # a worker's status, asked for by a /metrics scrape
PARSE_INLINE_BYTES = 64 * 2**10  # larger bodies are parsed off the event loop

WORKER_HEADER = "X-Chunkserve-Worker"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

api = FastAPI(title="chunkserve", docs_url=None, redoc_url=None, openapi_url=None)

# Everything the ingress class uses is defined above it: Serve pickles the app when
# the class is decorated, so names defined later would be missing in the replicas.


def _json(payload: BaseModel | dict, status: int = 200, headers: dict | None = None) -> Response:
    content = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def error_response(error: APIError) -> Response:
    retry = None if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return _json(error.body(), status=error.status, headers=retry)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or ``PayloadTooLarge`` as soon as it is known to exceed ``limit``
    bytes (from its Content-Length, else while it arrives)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(_too_large(f"has {int(declared)} bytes", limit))
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(_too_large(f"has more than {limit} bytes", limit))
        parts.append(part)
    return b"".join(parts)


def _too_large(what: str, limit: int) -> str:
    return (
        f"the request body {what}, more than the {limit} bytes this server accepts "
        "(server.max_request_bytes)"
    )


async def parse_body(body_type: type[BaseModel], raw: bytes):
    """``parse_request``, off the event loop for a large body."""
    if len(raw) > PARSE_INLINE_BYTES:
        return await asyncio.to_thread(parse_request, body_type, raw)
    return parse_request(body_type, raw)


# A client that disconnects cancels its request: Serve cancels the handler, and Ray
# the actor calls it made (a read of one then raises TaskCancelledError); a body still
# arriving ends with Starlette's ClientDisconnect.
CLIENT_LEFT = (asyncio.CancelledError, TaskCancelledError, ClientDisconnect)
# What the request counters record for a request whose client left before its answer
# began (nginx's "client closed request"; never sent to anyone). A stream the client
# closes after its first event counts as the 200 it was sent.
CLIENT_CLOSED_REQUEST = 499


def _client_left(request: Request) -> NoReturn:
    """Log a client's disconnect as one line and end its handler as cancelled (no
    traceback: nothing went wrong on this side)."""
    request_id = serve_context._get_serve_request_context().request_id
    logger.info(
        "client disconnected: %s %s (request %s)", request.method, request.url.path, request_id
    )
    raise asyncio.CancelledError


class EventStream(StreamingResponse):
    """A streamed answer whose client may leave: Serve's ``receive`` ends with
    ``TaskCancelledError`` when it does, where Starlette awaits an ``http.disconnect``
    message; both mean the client is gone and end the stream quietly."""

    async def listen_for_disconnect(self, receive) -> None:
        try:
            await super().listen_for_disconnect(receive)
        except TaskCancelledError:
            pass


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        return error_response(NotFound(f"no route {request.method} {request.url.path}"))
    return error_response(HTTPStatusError(exc.status_code, str(exc.detail)))


@api.exception_handler(Exception)
async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(APIError("internal server error"))


@serve.deployment
@serve.ingress(api)
class ChunkserveServer:
    def __init__(self, config: ClusterConfig) -> None:
        model_dir = ensure_model(config.model)
        actors = ensure_cluster(config, model_dir, detached=True)
        self._metrics = Metrics()
        self._shared = SharedMetrics(self._metrics, f"{config.name}-metrics", config.ray.namespace)
        self._service = build_service(config, model_dir, actors, self._metrics)
        self._service.max_prompt_chars = config.server.max_prompt_chars
        self._chunks = ChunkService(self._service.router.pool, CHUNK_CALL_TIMEOUT_S)
        self._auth = Authenticator(config.server.api_keys)
        self._model = config.model.name
        self._workers = config.workers.count
        self._max_body = config.server.max_request_bytes
        self._created = int(time.time())
        self._config = config
        self._keeper: ActorHandle | None = None  # found on the first /health that needs it

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat", ChatCompletionRequest, self._chat)

    @api.post("/v1/chunks")
    async def register_chunk(self, request: Request) -> Response:
        async def run(tenant: str) -> BaseModel:
            raw = await read_body(request, self._max_body)
            body = await parse_body(RegisterChunkRequest, raw)
            return await self._chunks.register(body, tenant)

        return await self._chunk_call(request, run)

    @api.get("/v1/chunks")
    async def list_chunks(self, request: Request) -> Response:
        async def run(tenant: str) -> BaseModel:
            return ChunkList(data=await self._chunks.list_chunks(tenant))

        return await self._chunk_call(request, run)

    @api.get("/v1/chunks/{chunk_id}")
    async def get_chunk(self, chunk_id: str, request: Request) -> Response:
        return await self._chunk_call(request, lambda tenant: self._chunks.get(tenant, chunk_id))

    @api.delete("/v1/chunks/{chunk_id}")
    async def delete_chunk(self, chunk_id: str, request: Request) -> Response:
        return await self._chunk_call(request, lambda tenant: self._chunks.delete(tenant, chunk_id))

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._complete(
            request, "completions", CompletionRequest, self._service.completion
        )

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._auth.tenant(request.headers.get("authorization"))
        except APIError as error:
            return error_response(error)
        card = ModelCard(id=self._model, created=self._created)
        return _json(ModelList(data=[card]))

    @api.get("/health")
    async def health(self) -> Response:
        """200 "ok" with every configured worker able to take requests, 200 "degraded"
        with fewer (the counts and each worker's state say which), 503 with none."""
        pool = self._service.router.pool
        await pool.start()
        healthy = pool.healthy_count()
        if healthy == self._workers:
            return _json({"status": "ok", "healthy_workers": healthy, "workers": healthy})
        states = pool.describe() + await self._recovery()
        if not healthy:
            return error_response(NoHealthyWorker(f"no healthy worker ({states})"))
        detail = f"{healthy} of {self._workers} workers can take requests ({states})"
        counts = {"healthy_workers": healthy, "workers": self._workers}
        return _json({"status": "degraded", **counts, "detail": detail})

    async def _recovery(self) -> str:
        """What the keeper is doing about workers Ray gave up restarting ("; w0: Ray
        gave up ..."), or "" (none, or the keeper did not answer in time)."""
        try:
            if self._keeper is None:
                self._keeper = await asyncio.to_thread(find_keeper, self._config)
            if self._keeper is None:
                return ""
            recovery = await asyncio.wait_for(self._keeper.recovery.remote(), STATUS_TIMEOUT_S)
        except (RayError, TimeoutError):
            self._keeper = None  # look it up again next time
            return ""
        now = time.time()
        return "".join(f"; {w}: {r.describe(now)}" for w, r in sorted(recovery.items()))

    @api.get("/metrics")
    async def metrics(self) -> Response:
        """The whole app's counts (every replica's, see ``cluster.metrics``), then this
        replica's gauges and each worker's."""
        pool = self._service.router.pool
        await pool.start()  # the first poll answered: the gauges say what /health says
        workers = sorted(pool.health())
        statuses = await asyncio.gather(*(self._worker_status(w) for w in workers))
        text = await self._shared.render(worker_families(dict(zip(workers, statuses, strict=True))))
        return Response(text, media_type=PROMETHEUS_TEXT)

    async def _worker_status(self, worker_id: str) -> WorkerStatus | None:
        handle = self._service.router.pool.handle(worker_id)
        try:
            return await asyncio.wait_for(handle.status.remote(), STATUS_TIMEOUT_S)
        except (RayError, TimeoutError):
            return None

    async def _chat(self, body: ChatCompletionRequest, tenant: str, arrived: float) -> Reply:
        messages = await self._chunks.expand(body.messages, tenant) if body.chunk_ids else None
        return await self._service.chat(body, tenant, messages, arrived)

    async def _chunk_call(
        self, request: Request, run: Callable[[str], Awaitable[BaseModel]]
    ) -> Response:
        try:
            tenant = self._auth.tenant(request.headers.get("authorization"))
            return _json(await run(tenant))
        except APIError as error:
            return error_response(error)
        except CLIENT_LEFT:
            _client_left(request)

    async def _complete(
        self,
        request: Request,
        endpoint: str,
        body_type: type[ChatCompletionRequest] | type[CompletionRequest],
        handle: Callable[..., Awaitable[Reply]],
    ) -> Response:
        arrived = time.monotonic()
        self._shared.start()
        self._metrics.in_flight += 1
        try:
            tenant = self._auth.tenant(request.headers.get("authorization"))
            body = await parse_body(body_type, await read_body(request, self._max_body))
            reply = await handle(body, tenant, arrived)
        except APIError as error:
            self._finish(endpoint, error.status)
            return error_response(error)
        except CLIENT_LEFT:
            self._finish(endpoint, CLIENT_CLOSED_REQUEST)
            _client_left(request)
        except BaseException:
            self._finish(endpoint, 500)
            raise
        headers = {WORKER_HEADER: reply.worker_id}
        if reply.events is None:
            self._finish(endpoint, 200, arrived)
            return _json(reply.body, headers=headers)
        events = self._counted(request, reply.events, endpoint, arrived)
        return EventStream(events, media_type="text/event-stream", headers=headers)

    async def _counted(
        self, request: Request, events: AsyncGenerator[str, None], endpoint: str, arrived: float
    ) -> AsyncIterator[str]:
        completed = False
        try:
            async for event in events:
                yield event
            completed = True
        except CLIENT_LEFT:
            _client_left(request)
        finally:
            await events.aclose()  # now, not at garbage collection: it counts the tokens
            # its 200 went out with the first event: counted as sent, closed or not
            self._finish(endpoint, 200, arrived if completed else None)

    def _finish(self, endpoint: str, status: int, arrived: float | None = None) -> None:
        """``arrived``: for an answer sent in full, when its request arrived."""
        self._metrics.in_flight -= 1
        self._metrics.requests.inc(endpoint, str(status))
        if arrived is not None:
            self._metrics.e2e.observe(time.monotonic() - arrived)


def build_app(cfg: ClusterConfig) -> Application:
    return ChunkserveServer.options(
        name=f"{cfg.name}-router",
        num_replicas=cfg.server.num_replicas,
        max_ongoing_requests=cfg.server.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.server.replica_num_cpus},
    ).bind(cfg)


class AppArgs(BaseModel):
    """Arguments of ``serve run cluster.app:app_builder config=FILE``."""

    config: str = Field(description="cluster config YAML")
    overrides: list[str] = Field(
        default_factory=list, description="dotted.key=value overrides, as with --set"
    )


def app_builder(args: AppArgs) -> Application:
    """The app of ``serve run`` / ``serve deploy``. Its replicas are checked here,
    before Serve asks for them: one that no node can hold would otherwise wait for
    ever, since none of our code runs until a replica starts (that replica checks the
    workers). Built outside Ray (a syntax check of the config), there is no cluster
    to check against."""
    cfg = load_config(args.config, args.overrides)
    if ray.is_initialized():
        check_placement(cfg, lambda: [replica_demand(cfg, running=True)])
    return build_app(cfg)
