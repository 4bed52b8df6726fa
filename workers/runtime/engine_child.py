"""The engine process of a worker actor with ``WorkerSpec.engine_process`` on (see
``engine_host``): ``python -m workers.runtime.engine_child FD``, FD being its end of
the socket pair the actor made.

Protocol (pickled tuples over ``multiprocessing.connection``):
- actor -> child: ``("start", EngineConfig, cpu_threads)``, then ``("run",)`` once the
  actor is ready for outputs; then any of ``("submit", request_id, prompt, params,
  tenant_salt, reuse_kwargs)``, ``("abort", request_id)``, ``("chunks", call_id,
  method, args)``.
- child -> actor: ``("ready", facts)`` or ``("failed", why)`` after ``start``; then
  ``("iteration", [(request_id, output), ...], [CacheEvent, ...], (load, kv_pages,
  tally))`` after every loop iteration that changed anything, ``("reply", call_id, ok,
  result or exception)`` per chunks call, and ``("fatal", why)`` before exiting on an
  engine failure.
The child exits when the actor's end of the socket closes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from multiprocessing.connection import Connection

import torch

from chunkstore.events import CacheEvent
from workers.engine.engine import Engine
from workers.runtime.engine_host import engine_facts
from workers.runtime.engine_loop import EngineLoop
from workers.runtime.worker_chunks import WorkerChunks

logger = logging.getLogger(__name__)


def serve(conn: Connection) -> int:
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    _, engine_config, cpu_threads = conn.recv()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        engine = Engine(engine_config, stream_text=True)
    except Exception as error:  # noqa: BLE001 - reported to the actor, which raises it
        send(("failed", f"{type(error).__name__}: {error}"))
        return 1
    pending: list[tuple] = []  # (request_id, output): appended and sent on the loop thread
    last: list = [None]  # the last snapshot sent

    def after_iteration(events: list[CacheEvent]) -> None:
        snapshot = (loop.load(), loop.kv_pages(), loop.step_tally())
        changed = last[0] is None or snapshot[0].version != last[0][0].version
        if pending or events or changed:
            deliveries = pending.copy()
            pending.clear()
            last[0] = snapshot
            send(("iteration", deliveries, events, snapshot))

    def fatal(error: BaseException) -> None:
        try:
            send(("fatal", f"{type(error).__name__}: {error}"))
        finally:
            os._exit(1)

    loop = EngineLoop(engine, after_iteration, fatal)
    chunks = WorkerChunks(engine, loop)
    send(("ready", engine_facts(engine)))
    if conn.recv() != ("run",):
        return 1
    loop.start()

    def reply(call_id: int, future) -> None:
        error = future.exception()
        send(("reply", call_id, error is None, future.result() if error is None else error))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the actor is gone: so is its engine
            os._exit(0)
        kind = message[0]
        if kind == "submit":
            _, request_id, prompt, params, tenant_salt, reuse = message
            loop.submit(
                request_id,
                prompt,
                params,
                tenant_salt,
                lambda item, rid=request_id: pending.append((rid, item)),
                **reuse,
            )
        elif kind == "abort":
            loop.abort(message[1])
        elif kind == "chunks":
            _, call_id, method, args = message
            future = loop.call(lambda m=method, a=args: getattr(chunks, m)(*a))
            future.add_done_callback(lambda f, c=call_id: reply(c, f))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(serve(Connection(int(sys.argv[1]))))
