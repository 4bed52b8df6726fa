"""Where a worker actor's engine runs: in the actor's own process (``LocalEngine``: the
loop thread beside the event loop that streams outputs), or in a child process of its
own (``ChildEngine``, ``WorkerSpec.engine_process``), so that the engine's Python never
waits for the GIL behind the streaming (on 4 H200s a worker streaming to 24 requests
from a thread ran its decode steps 2-3x slower than its GPU, and the process served
1.3-1.6x the requests/s: ``bench/cluster_rag.py --engine-process``).

Both give the actor one interface: ``submit`` / ``abort`` (outputs reach the sink given
with ``submit``, as ``EngineLoop.submit`` says), ``load`` / ``kv_pages`` /
``step_tally`` snapshots, ``chunks(method, *args)`` (a ``WorkerChunks`` method run on
the loop thread; a future of its result), and the facts a ``WorkerInfo`` needs.

Invariants of ``ChildEngine``:
- The child (``python -m workers.runtime.engine_child``, whose docstring gives the
  protocol) owns the ``Engine``, its ``EngineLoop`` and ``WorkerChunks``; the two
  processes talk over one socket pair, pickled messages
  (``multiprocessing.connection``). The parent's messages are read by the child's main
  thread. Outputs leave the child once a step delivered them, pool events after every
  loop iteration, each message with the load, tally and KV-page snapshots, so the
  parent's snapshots are at most one step old.
- A sink is dropped with its choice's terminal item (a finished output or a
  rejection) or at ``abort``; what arrives for a dropped sink is discarded. Each
  submit has a number of its own, so a request aborted and submitted again under the
  same id never receives the first one's outputs.
- A ``chunks`` call's future is running from the moment the call is sent (the child
  runs it to its end): a caller that gives up cannot cancel it (``cancel`` returns
  False) and drops its result, so setting the result never fails. ``LocalEngine``'s
  may be cancelled until its call starts, as ``EngineLoop.call`` says: either way a
  cancelled future means the call never ran.
- Snapshots (load, KV pages, tally) come with ``ready`` and then with every output
  message; ``outstanding()`` counts choices on the actor's side, so a drain sees a
  submit at once.
- Either process ending ends the other: the child exits when its socket closes or the
  actor's process is gone (also while its engine loads), and the actor's reader calls
  ``on_fatal`` when the child's end closes, it reports an engine failure, or handling
  a message fails (the actor then exits and Ray restarts it).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from workers.engine.request import PromptRequest
from workers.engine.sampling_params import SamplingParams
from workers.engine.workload_tally import StepTally
from workers.runtime.engine_loop import EngineLoop, Rejected, Sink
from workers.runtime.worker_chunks import WorkerChunks
from workers.runtime.worker_types import EngineLoad, KVPages

if TYPE_CHECKING:  # the actor of a ChildEngine never builds an engine itself
    from chunkstore.events import CacheEvent
    from workers.engine.engine import Engine

# the facts a WorkerInfo takes from the engine
Facts = dict[str, Any]
# the GIL switch interval of a worker's processes (Worker.__init__ says why); the
# engine process's too, for its reading thread beside the engine's
SWITCH_INTERVAL_S = 0.0005


def engine_facts(engine: Engine) -> Facts:
    return {
        "namespace_model": engine.namespace_model,
        "max_model_len": engine.max_model_len,
        "page_size": engine.pool.page_size,
    }


class LocalEngine:
    """The engine on a thread of the actor's process."""

    def __init__(
        self,
        engine: Engine,
        on_events: Callable[[list[CacheEvent]], None],
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self.facts = engine_facts(engine)
        self._loop = EngineLoop(engine, on_events, on_fatal)
        self._chunks = WorkerChunks(engine, self._loop)

    def start(self) -> None:
        self._loop.start()

    def close(self) -> None:
        """Stop the loop thread (the engine stays as it is)."""
        self._loop.stop()

    def submit(
        self, request_id: str, params: SamplingParams, prompt: PromptRequest, sink: Sink
    ) -> None:
        self._loop.submit(request_id, params, prompt, sink)

    def abort(self, request_id: str) -> None:
        self._loop.abort(request_id)

    def load(self) -> EngineLoad:
        return self._loop.load()

    def kv_pages(self) -> KVPages:
        return self._loop.kv_pages()

    def step_tally(self) -> StepTally:
        return self._loop.step_tally()

    def outstanding(self) -> int:
        """Choices queued or running."""
        return self._loop.load().requests

    def chunks(self, method: str, *args) -> Future:
        chunks = self._chunks
        return self._loop.call(lambda: getattr(chunks, method)(*args))


class ChildEngine:
    """The engine in a child process of its own (see the module's invariants)."""

    def __init__(
        self,
        engine_config,
        cpu_threads: int | None,
        on_events: Callable[[list[CacheEvent]], None],
        on_fatal: Callable[[BaseException], None],
    ) -> None:
        self._on_events = on_events
        self._on_fatal = on_fatal
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the actor's import path (Ray's working directory among it) for the child
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "workers.runtime.engine_child", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self._socket = ours  # shut down by ``close``: that wakes a blocked read, close() not
        self._conn = Connection(os.dup(ours.fileno()))
        self._closing = False
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _sinks, _submissions
        # submission number -> sink; request id -> its live submission number
        self._sinks: dict[int, Sink] = {}
        self._submissions: dict[str, int] = {}
        self._numbers = itertools.count()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._send(("start", engine_config, cpu_threads))
        self.facts, self._snapshot = self._recv_start()
        self._reader = threading.Thread(target=self._read, name="engine-child-reader", daemon=True)

    def _recv_start(self) -> tuple[Facts, tuple[EngineLoad, tuple[int, int], StepTally]]:
        try:
            message = self._conn.recv()
        except Exception as error:  # the child died or sent garbage: no engine here
            self._process.kill()
            code = self._process.wait()
            self._conn.close()
            raise RuntimeError(f"the engine process ended ({code}) while starting") from error
        if message[0] == "failed":
            self._process.wait()
            self._conn.close()
            raise RuntimeError(f"the engine process could not start: {message[1]}")
        _, facts, snapshot = message
        return facts, snapshot

    def start(self) -> None:
        self._send(("run",))
        self._reader.start()

    def submit(
        self, request_id: str, params: SamplingParams, prompt: PromptRequest, sink: Sink
    ) -> None:
        with self._lock:
            number = next(self._numbers)
            self._sinks[number] = sink
            self._submissions[request_id] = number
        self._send(("submit", number, request_id, params, prompt))

    def abort(self, request_id: str) -> None:
        with self._lock:  # after abort the sink gets nothing more
            number = self._submissions.pop(request_id, None)
            self._sinks.pop(number, None)
        self._send(("abort", request_id))

    def load(self) -> EngineLoad:
        return self._snapshot[0]

    def outstanding(self) -> int:
        """Choices submitted here that have not ended (nor been aborted): unlike
        ``load().requests`` (one message old), counts a submit at once."""
        with self._lock:
            return len(self._sinks)

    def kv_pages(self) -> KVPages:
        return self._snapshot[1]

    def step_tally(self) -> StepTally:
        return self._snapshot[2]

    def chunks(self, method: str, *args) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()  # sent means started: see the invariants
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._send(("chunks", call_id, method, args))
        return future

    def close(self) -> None:
        """End the engine process (it exits as its socket closes); no ``on_fatal``."""
        self._closing = True
        self._socket.shutdown(socket.SHUT_RDWR)
        self._process.wait()
        if self._reader.is_alive():
            self._reader.join()
        self._conn.close()
        self._socket.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """The reader thread: any failure here ends the actor (``on_fatal``), as an
        engine failure does in ``LocalEngine``."""
        try:
            while self._handle(self._conn.recv()):
                pass
        except (EOFError, OSError) as error:
            if not self._closing:
                code = self._process.wait()
                self._on_fatal(RuntimeError(f"the engine process ended ({code}): {error!r}"))
        except BaseException as error:  # noqa: BLE001 - a sink, events or a message failed
            self._on_fatal(error)

    def _handle(self, message: tuple) -> bool:
        kind = message[0]
        if kind == "iteration":
            _, deliveries, events, snapshot = message
            self._snapshot = snapshot
            for number, item in deliveries:
                with self._lock:
                    sink = self._sinks.get(number)
                    if sink is not None and _terminal(item):
                        del self._sinks[number]
                        if self._submissions.get(item.request_id) == number:
                            del self._submissions[item.request_id]
                if sink is not None:
                    sink(item)
            if events:
                self._on_events(events)
        elif kind == "reply":
            _, call_id, ok, value = message
            future = self._calls.pop(call_id)
            if ok:
                future.set_result(value)
            else:
                refusal, text, message_text = value
                future.set_exception(ValueError(message_text) if refusal else RuntimeError(text))
        elif kind == "fatal":
            self._on_fatal(RuntimeError(f"the engine failed: {message[1]}"))
            return False
        return True


def _terminal(item) -> bool:
    return isinstance(item, Rejected) or item.finished
