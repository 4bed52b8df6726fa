"""The engine process of a worker actor with ``WorkerSpec.engine_process`` on (see
``engine_host``): ``python -m workers.runtime.engine_child FD``, FD being its end of
the socket pair the actor made.

Protocol (pickled tuples over ``multiprocessing.connection``):
- actor -> child: ``("start", EngineConfig, cpu_threads)``, then ``("run",)`` once the
  actor is ready for outputs; then any of ``("submit", submission, request_id, params,
  PromptRequest)``, ``("abort", request_id)``, ``("chunks",
  call_id, method, args)``. ``submission`` numbers each submit, so outputs of an
  aborted request never reach a later one with the same id.
- child -> actor: ``("ready", facts, snapshot)`` or ``("failed", why)`` after
  ``start``; then ``("iteration", [(submission, output), ...], [CacheEvent, ...],
  snapshot)`` (snapshot: load, KV pages, tally) once a step's outputs were delivered
  and after every loop iteration that changed anything, ``("reply", call_id, True,
  result)`` or ``("reply", call_id, False, (is a ValueError, repr, message))`` per
  chunks call, and ``("fatal", why)`` before exiting on an engine failure.
The child exits when the actor's end of the socket closes, or when the actor's process
is gone (checked every ``PARENT_CHECK_S``, also while the engine loads).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch

from chunkstore.events import CacheEvent
from workers.engine.engine import Engine
from workers.runtime.engine_host import SWITCH_INTERVAL_S, engine_facts
from workers.runtime.engine_loop import EngineLoop
from workers.runtime.worker_chunks import WorkerChunks

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0


def serve(conn: Connection) -> int:
    send_lock = threading.Lock()

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    _exit_with_parent()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the reading thread beside the engine's
    _, engine_config, cpu_threads = conn.recv()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        engine = Engine(engine_config, stream_text=True)
    except Exception as error:  # noqa: BLE001 - reported to the actor, which raises it
        logger.exception("the engine could not start")
        send(("failed", f"{type(error).__name__}: {error}"))
        return 1
    pending: list[tuple[int, object]] = []  # (submission, output); loop thread only
    last = None  # the last snapshot sent

    def snapshot() -> tuple:
        return (loop.load(), loop.kv_pages(), loop.step_tally())

    def flush(events: list[CacheEvent]) -> None:
        """Loop thread: send what changed since the last message."""
        nonlocal last
        now = snapshot()
        if pending or events or last is None or now[0].version != last[0].version:
            deliveries = pending.copy()
            pending.clear()
            last = now
            send(("iteration", deliveries, events, now))

    def fatal(error: BaseException) -> None:
        try:
            send(("fatal", f"{type(error).__name__}: {error}"))
        finally:
            os._exit(1)

    # outputs go out once a step delivered them (also steps taken inside a chunk's
    # registration), pool events after every iteration
    loop = EngineLoop(engine, flush, fatal, on_delivered=lambda: flush([]))
    chunks = WorkerChunks(engine, loop)
    send(("ready", engine_facts(engine), snapshot()))
    if conn.recv() != ("run",):
        return 1
    loop.start()

    def reply(call_id: int, future) -> None:
        error = future.exception()
        if error is None:
            send(("reply", call_id, True, future.result()))
        else:  # rebuilt by the actor: a ValueError is a refusal, anything else a failure
            send(
                ("reply", call_id, False, (isinstance(error, ValueError), repr(error), str(error)))
            )

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the actor is gone: so is its engine
            os._exit(0)
        kind = message[0]
        if kind == "submit":
            _, submission, request_id, params, prompt = message
            loop.submit(
                request_id, params, prompt, lambda item, n=submission: pending.append((n, item))
            )
        elif kind == "abort":
            loop.abort(message[1])
        elif kind == "chunks":
            _, call_id, method, args = message
            future = loop.call(lambda m=method, a=args: getattr(chunks, m)(*a))
            future.add_done_callback(lambda f, c=call_id: reply(c, f))


def _exit_with_parent() -> None:
    """Exit once the actor's process is gone, also while the engine loads (when
    nothing reads the socket)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(serve(Connection(int(sys.argv[1]))))
