"""A router replica's own HTTP listener (``server.ingress: replicas``): the app served
straight from each replica, with no Serve proxy in between.

Why: Serve's HTTP proxy is one process a node. Every request and every streamed event
crosses it, and a Ray call between it and the replica, which cost about as much CPU
as the replica's own work (``bench/http_rag.py --ingress serve_proxy`` prints the CPU
milliseconds a request of each process). So one proxy capped a whole node's HTTP
throughput however many replicas ran behind it.

How: every replica binds ``server.host:server.port`` with ``SO_REUSEPORT``, so the
replicas on a node listen on one port and the kernel deals new connections among them;
uvicorn serves the replica's app on the replica's event loop.

Invariants:
- A replica that cannot bind the port fails its start, with the reason (another
  process holds the port without ``SO_REUSEPORT``).
- One app a port: the kernel deals connections to every socket on the port, so
  another app's replicas (or a Serve proxy) on it would answer some of this app's
  connections.
- Stopping, the listening socket closes first (new connections go to the node's other
  replicas), then requests in flight get up to ``DRAIN_S`` to finish.
- A request whose client disconnects before its response starts is cancelled
  (``CancelOnDisconnect``), as Serve's proxy cancels its handlers: its worker stops
  generating an answer nobody would read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DRAIN_S = 15.0  # requests in flight at a stop get this long (Serve waits 20 s by default)
KEEP_ALIVE_S = 90  # idle client connections stay open this long (clients pool them)
BACKLOG = 4096  # connections waiting to be accepted, per replica


def bind_shared(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other processes of this user may bind
    too (``SO_REUSEPORT``). Raises ``RuntimeError`` naming the address if it can't."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise RuntimeError(
            f"this router replica cannot listen on {host}:{port} ({error}): another "
            "process holds the port (set server.port to a free one, or server.ingress: "
            "serve_proxy to serve through Serve's proxy)"
        ) from error
    return sock


def mounted(app: ASGIApp, route_prefix: str) -> ASGIApp:
    """``app`` at ``route_prefix`` (as Serve's proxy serves it: the prefix is the
    request's root path)."""
    prefix = route_prefix.rstrip("/")
    return app if not prefix else Mount(prefix, app=app)


class CancelOnDisconnect:
    """Cancels the handling of a request whose client disconnected before its
    response started.

    uvicorn tells an app of a disconnect only through ``receive``, which a handler
    awaiting a worker's whole answer never calls: it would run to its end for nobody
    (a client that timed out after 1 s left a 3,000-token answer generating). So this
    reads the request for the app, one message ahead (the body keeps its flow control),
    and on ``http.disconnect`` cancels the app unless its response has started (a
    streamed response then listens for the disconnect itself)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inbox: asyncio.Queue[Message] = asyncio.Queue(maxsize=1)
        started = False  # the response's start was sent
        left = False  # the client disconnected

        async def read_ahead() -> None:
            nonlocal left
            while True:
                message = await receive()
                await inbox.put(message)
                if message["type"] == "http.disconnect":
                    left = True
                    if not started:
                        handling.cancel()
                    return

        async def app_receive() -> Message:
            if left and inbox.empty():
                return {"type": "http.disconnect"}
            return await inbox.get()

        async def app_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        handling = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        reading = asyncio.ensure_future(read_ahead())
        try:
            await handling
        except asyncio.CancelledError:
            if not handling.done():  # this request's own task was cancelled: so is the app
                handling.cancel()
            elif left:
                return  # cancelled for its client's leaving: nothing to answer
            raise
        finally:
            reading.cancel()


class ReplicaListener:
    """Serves ``app`` on ``host:port`` from the running event loop until ``stop``."""

    def __init__(self, app: ASGIApp, host: str, port: int, route_prefix: str = "/") -> None:
        sock = bind_shared(host, port)
        config = uvicorn.Config(
            mounted(CancelOnDisconnect(app), route_prefix),
            lifespan="off",
            access_log=False,
            log_config=None,
            log_level=logging.WARNING,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=DRAIN_S,
            backlog=BACKLOG,
        )
        self._server = uvicorn.Server(config)
        # Ray owns the replica process's signals: uvicorn must not take them
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self.address = f"{host}:{port}"
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))

    def failure(self) -> str | None:
        """Why the listener stopped serving on its own; None while it serves."""
        if not self._task.done() or self._server.should_exit:
            return None
        error = None if self._task.cancelled() else self._task.exception()
        return f"the HTTP listener on {self.address} stopped" + (f": {error!r}" if error else "")

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish (up to ``DRAIN_S``), end."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), DRAIN_S + 5)
        except TimeoutError:
            self._task.cancel()
        except Exception:  # noqa: BLE001 - a listener that failed has stopped too
            logger.exception("the HTTP listener on %s failed", self.address)
