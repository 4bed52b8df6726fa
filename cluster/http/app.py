"""The OpenAI-compatible HTTP app: a Ray Serve deployment whose replicas each serve
the FastAPI API (``build_api``), on a listener of their own at the configured port
(``server.ingress: replicas``, ``cluster.http.ingress``) or behind Serve's proxy
(``serve_proxy``).

Every replica is a router: it authenticates, tokenizes, looks up the directory
and streams from a worker. Replicas share nothing but the directory, the workers
(found by name, created on first use) and the metrics board, so any number of them
stay correct.

Order of checks: authentication (401), body size (413, ``server.max_request_bytes``,
as the body arrives: a larger one is never read whole), body parsing and validation
(400; a body with more messages than accepted is refused before it is parsed), model
(404), prompt size (400, ``server.max_messages`` and ``server.max_prompt_chars``, before
rendering or tokenizing; for chunks too), prompt length in tokens (400), routing (429,
503). Every error body is
OpenAI-style ``{"error": {...}}``. Work that takes CPU time in proportion to the
request (parsing a large body, tokenizing) runs off the event loop, so ``/health``
and small requests keep being answered while a huge one is prepared.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' parameter
# types (``request: Request``) from their annotations when ``build_api`` adds them.
import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import NoReturn

import ray
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.actor import ActorHandle
from ray.exceptions import RayError, TaskCancelledError
from ray.serve import Application
from ray.serve import context as serve_context
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.api.completions import Reply
from cluster.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    parse_request,
)
from cluster.assembly import build_service
from cluster.config import ClusterConfig, load_config
from cluster.errors import (
    APIError,
    HTTPStatusError,
    ModelNotFound,
    NoHealthyWorker,
    NotFound,
    PayloadTooLarge,
)
from cluster.http.chunk_protocol import ChunkList, RegisterChunkRequest
from cluster.http.chunk_service import ChunkService
from cluster.http.ingress import ReplicaListener
from cluster.http.tenancy import Authenticator, ScrapeGuard
from cluster.metrics import Metrics, SharedMetrics, worker_families
from cluster.ops.actors import check_placement, ensure_cluster, find_keeper, replica_demand
from cluster.ops.model_store import ensure_model
from workers.runtime.worker_types import WorkerStatus

logger = logging.getLogger(__name__)

CHUNK_CALL_TIMEOUT_S = 300  # registering computes the chunk's KV (slow on CPU)
STATUS_TIMEOUT_S = 2.0  # a worker's status, asked for by a /metrics scrape
PARSE_INLINE_BYTES = 64 * 2**10  # larger bodies are parsed off the event loop

WORKER_HEADER = "X-Chunkserve-Worker"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _json(payload: BaseModel | dict, status: int = 200, headers: dict | None = None) -> Response:
    content = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def error_response(error: APIError) -> Response:
    retry = None if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)}
    return _json(error.body(), status=error.status, headers=retry)


def refused(request: Request, error: APIError) -> Response:
    """``error_response``, logged as one line naming the status, code and parameter, so
    an operator sees what was refused (the access log gives only the status)."""
    logger.info(
        "%s %s %d %s (param %s): %.300s",
        request.method,
        request.url.path,
        error.status,
        error.code or error.type,
        error.param or "-",
        error.message,
    )
    return error_response(error)


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
# ended (nginx's "client closed request"; never sent to anyone), streamed or not.
CLIENT_CLOSED_REQUEST = 499


def _client_left(request: Request) -> NoReturn:
    """Log a client's disconnect as one line and end its handler as cancelled (no
    traceback: nothing went wrong on this side)."""
    # Serve's request id; none where the replica's own listener took the request
    request_id = serve_context._get_serve_request_context().request_id or "-"
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


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404:
        return refused(request, NotFound(f"no route {request.method} {request.url.path}"))
    return refused(request, HTTPStatusError(exc.status_code, str(exc.detail)))


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(APIError("internal server error"))


def build_api(server: "ChunkserveServer") -> FastAPI:
    """The HTTP API, its routes bound to one replica's ``server``: what Serve's proxy
    forwards to and what the replica's own listener serves alike."""
    api = FastAPI(title="chunkserve", docs_url=None, redoc_url=None, openapi_url=None)
    api.add_exception_handler(StarletteHTTPException, _http_error)
    api.add_exception_handler(Exception, _server_error)
    api.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    api.add_api_route("/v1/completions", server.completions, methods=["POST"])
    api.add_api_route("/v1/chunks", server.register_chunk, methods=["POST"])
    api.add_api_route("/v1/chunks", server.list_chunks, methods=["GET"])
    api.add_api_route("/v1/chunks/{chunk_id}", server.get_chunk, methods=["GET"])
    api.add_api_route("/v1/chunks/{chunk_id}", server.delete_chunk, methods=["DELETE"])
    api.add_api_route("/v1/models", server.models, methods=["GET"])
    api.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])
    api.add_api_route("/health", server.health, methods=["GET", "HEAD"])
    api.add_api_route("/metrics", server.metrics, methods=["GET", "HEAD"])
    return api


class ChunkserveServer:
    """One router replica. Its HTTP API (``build_api``) reaches it through Serve's proxy
    (``server.ingress: serve_proxy``) or through a listener of its own on the
    configured port (``replicas``, the default: ``cluster.http.ingress``)."""

    def __init__(self, config: ClusterConfig) -> None:
        model_dir = ensure_model(config.model)
        actors = ensure_cluster(config, model_dir, detached=True)
        self._metrics = Metrics()
        self._shared = SharedMetrics(self._metrics, f"{config.name}-metrics", config.ray.namespace)
        self._service = build_service(config, model_dir, actors, self._metrics)
        self._service.max_prompt_chars = config.server.max_prompt_chars
        self._service.max_messages = config.server.max_messages
        self._chunks = ChunkService(
            self._service.router.pool, CHUNK_CALL_TIMEOUT_S, self._service.check_prompt_size
        )
        self._auth = Authenticator(config.server.api_keys)
        self._scrape = ScrapeGuard(config.server.metrics_token, config.server.api_keys)
        self._model = config.model.name
        self._workers = config.workers.count
        self._max_body = config.server.max_request_bytes
        self._created = int(time.time())
        self._config = config
        self._keeper: ActorHandle | None = None  # found on the first /health that needs it
        self._api = build_api(self)
        self._listener: ReplicaListener | None = None
        server = config.server
        if server.ingress == "replicas":  # on Serve's user-code event loop, which runs this
            self._listener = ReplicaListener(
                self._api, server.host, server.port, server.route_prefix
            )
            self._shared.start()  # the event-loop lag counts from the start

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._api

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose listener died is restarted."""
        failure = None if self._listener is None else self._listener.failure()
        if failure is not None:
            raise RuntimeError(failure)

    async def __del__(self) -> None:
        """Serve's stop: the listener drains first, then Serve's own shutdown."""
        if self._listener is not None:
            await self._listener.stop()
        parent = getattr(super(), "__del__", None)
        if parent is not None:
            await parent()

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat", ChatCompletionRequest, self._chat)

    async def register_chunk(self, request: Request) -> Response:
        async def run(tenant: str) -> BaseModel:
            raw = await read_body(request, self._max_body)
            await self._service.check_raw_messages(raw, "content")
            body = await parse_body(RegisterChunkRequest, raw)
            return await self._chunks.register(body, tenant)

        return await self._chunk_call(request, run)

    async def list_chunks(self, request: Request) -> Response:
        async def run(tenant: str) -> BaseModel:
            return ChunkList(data=await self._chunks.list_chunks(tenant))

        return await self._chunk_call(request, run)

    async def get_chunk(self, chunk_id: str, request: Request) -> Response:
        return await self._chunk_call(request, lambda tenant: self._chunks.get(tenant, chunk_id))

    async def delete_chunk(self, chunk_id: str, request: Request) -> Response:
        return await self._chunk_call(request, lambda tenant: self._chunks.delete(tenant, chunk_id))

    async def completions(self, request: Request) -> Response:
        return await self._complete(
            request, "completions", CompletionRequest, self._service.completion
        )

    async def models(self, request: Request) -> Response:
        try:
            self._auth.tenant(request.headers.get("authorization"))
        except APIError as error:
            return refused(request, error)
        card = ModelCard(id=self._model, created=self._created)
        return _json(ModelList(data=[card]))

    async def model(self, model_id: str, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the OpenAI SDK's ``models.retrieve``)."""
        try:
            self._auth.tenant(request.headers.get("authorization"))
            if model_id != self._model:
                raise ModelNotFound(
                    f"the model {model_id!r} does not exist; this server serves {self._model!r}",
                    param="model",
                )
        except APIError as error:
            return refused(request, error)
        return _json(ModelCard(id=self._model, created=self._created))

    async def health(self) -> Response:
        """200 "ok" with every configured worker able to take requests, 200 "degraded"
        with fewer (the counts and each worker's state say which), 503 with none."""
        pool = self._service.router.pool
        await pool.start()
        healthy = pool.healthy_count()
        counts = {"healthy_workers": healthy, "workers": self._workers}
        directory = await self._service.router.directory_answers(STATUS_TIMEOUT_S)
        if healthy == self._workers and directory:
            return _json({"status": "ok", **counts})
        states = pool.describe() + await self._recovery()
        if not healthy:
            return error_response(NoHealthyWorker(f"no healthy worker ({states})"))
        details = []
        if healthy < self._workers:
            details.append(f"{healthy} of {self._workers} workers can take requests ({states})")
        if not directory:
            details.append(
                "the chunk directory does not answer: requests are routed by load alone, "
                "hitting no cache, until it does"
            )
        return _json({"status": "degraded", **counts, "detail": "; ".join(details)})

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

    async def metrics(self, request: Request) -> Response:
        """The whole app's counts (every replica's, see ``cluster.metrics``), then this
        replica's gauges and each worker's."""
        try:
            self._scrape.check(request.headers.get("authorization"))
        except APIError as error:
            return refused(request, error)
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
            return refused(request, error)
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
            raw = await read_body(request, self._max_body)
            if body_type is ChatCompletionRequest:
                await self._service.check_raw_messages(raw, "messages")
            body = await parse_body(body_type, raw)
            reply = await handle(body, tenant, arrived)
        except APIError as error:
            self._finish(endpoint, error.status)
            return refused(request, error)
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
        completed, status = False, 200
        try:
            async for event in events:
                yield event
            completed = True
        except APIError as error:  # its error event went out in-band: the stream ends
            status = error.status
        except CLIENT_LEFT:
            status = CLIENT_CLOSED_REQUEST
            _client_left(request)
        finally:
            await events.aclose()  # now, not at garbage collection: it counts the tokens
            # counted by how it ended: answered in full (200), failed in-band (the
            # error's status), or closed by its client after its first event (499)
            self._finish(endpoint, status, arrived if completed else None)

    def _finish(self, endpoint: str, status: int, arrived: float | None = None) -> None:
        """``arrived``: for an answer sent in full, when its request arrived."""
        self._metrics.in_flight -= 1
        self._metrics.requests.inc(endpoint, str(status))
        if arrived is not None:
            self._metrics.e2e.observe(time.monotonic() - arrived)


def build_app(cfg: ClusterConfig) -> Application:
    deployment = serve.deployment(serve.ingress()(ChunkserveServer))
    return deployment.options(
        name=f"{cfg.name}-router",
        num_replicas=cfg.router_replicas,
        max_ongoing_requests=cfg.server.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.server.replica_num_cpus},
        # no line per request: refusals are logged with their reasons (``refused``),
        # and /metrics counts the rest
        logging_config={"enable_access_log": False},
    ).bind(cfg)


class AppArgs(BaseModel):
    """Arguments of ``serve run cluster.http.app:app_builder config=FILE``. A key it
    does not know (a misspelling in a Serve config's ``args``) is refused, named."""

    model_config = ConfigDict(extra="forbid")

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
