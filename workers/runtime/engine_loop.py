"""The one thread that drives an ``Engine`` (the engine is not thread-safe).

Invariants:
- Only the loop thread calls the engine; other threads only enqueue commands
  (``submit``, ``abort``) and read counters (``load``).
- Commands are applied in the order they were enqueued, before the next step.
- Every submitted choice that is not aborted gets exactly one terminal item on its
  sink: a finished ``StepOutput``, or a ``Rejected`` when the engine refused it.
  After ``abort`` the sink gets nothing more.
- Sinks are called on the loop thread and must not block.
- Pool events are handed to ``on_events`` after every iteration, in order.
- An exception from the engine leaves it in an unknown state: ``on_fatal`` is
  called and the loop stops (the actor then crashes and Ray restarts it).
- ``call(fn)`` runs ``fn`` on the loop thread between iterations (how the chunk
  registry reaches the engine). A ``ValueError`` from ``fn`` is a refusal, returned
  through its future; any other exception is fatal, as from the engine. A caller
  that gives up may cancel the future: until ``fn`` starts that skips it (nothing
  was done); once it started, ``cancel`` fails and ``fn`` runs to its end, its result
  set on the future (``concurrent.futures`` semantics). A cancelled caller never
  reaches the loop as an error.
- ``prefill`` (loop thread only, inside a ``call``) steps the engine until its own
  request finishes, delivering other requests' outputs as usual.
- ``load()`` is one consistent snapshot (taken under the counters' lock). Its
  ``version`` grows with every change of any counter, so of two snapshots of one
  loop the one with the larger version is the newer. After every engine step
  (also those ``prefill`` and ``step_until`` take) and every iteration, the load
  says the engine's prefill backlog and decoding sequences as ``Engine.load_shape``
  counts them then; before the step's outputs reach their sinks, so an output's
  consumer reads a load that includes that step. ``prefill_tokens_per_s`` and
  ``step_s`` are EWMAs (weight ``LOAD_EWMA_WEIGHT``) of steps timed with
  ``time.perf_counter`` around ``Engine.step``; steps that computed nothing are not
  timed. Steps of fewer than ``RATE_SAMPLE_MIN_TOKENS`` prompt tokens are the decode
  baseline (an EWMA of their time); a step of at least that many samples the rate as
  its prompt tokens over what it took beyond that baseline (at least
  ``MIN_PREFILL_SHARE`` of it). All are 0.0 until measured; the first measurement
  sets an average directly.
- ``step_tally()`` says where the engine's time goes, for benchmarks and operators
  (totals since start; differences of two snapshots give a window): every step read
  back, by its kind (``ModelRunner.last_run_kind``: graph or eager, and the attention
  kind), with its time (``Engine.last_resolved_steps``: on CUDA, its span on the
  device), the wall time spent inside ``Engine.step`` (busy), and the engine's
  ``WorkloadTally`` as of the last step (positions computed, entries hit, missed,
  taken, filled and evicted). With overlapped steps a call's wall time is mostly the
  wait for the step before, so only the device spans say what each kind of step costs.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from chunkstore.events import CacheEvent
from workers.engine.engine import Engine, StepOutput
from workers.engine.host_tier import TierStats
from workers.engine.request import PromptRequest
from workers.engine.sampling_params import SamplingParams
from workers.engine.workload_tally import StepTally
from workers.runtime.worker_types import EngineLoad, KVPages

logger = logging.getLogger(__name__)

# Weight of the newest step in the load's moving averages (step time, prefill rate):
# the last ~5 steps dominate, so a change of batch mix shows within a few steps while
# one slow step (a GC pause, a big admission) moves the estimate by a fifth only.
LOAD_EWMA_WEIGHT = 0.2
# A step that computed fewer prompt tokens than this is not a prefill-rate sample: its
# fixed cost (launches, the decode batch beside it) dominates, so tokens / second there
# understates the rate many times over, and noisily; routers would then shun a worker
# for the size of its last small prompts. Its time feeds ``step_s`` and the decode
# baseline. On 4 H200s, with samples from 64 tokens and no baseline, workers serving
# mostly cache hits (40-token tails beside ~30 decoding sequences) measured 11.5K tokens/s
# against 69-75K elsewhere, and routers sent them no misses (`bench/cluster_rag.py`).
RATE_SAMPLE_MIN_TOKENS = 256
# A rate sample counts at least this share of its step as prefill, however close the
# step came to the decode baseline (a noisy baseline would otherwise give any rate).
MIN_PREFILL_SHARE = 0.25


@dataclass(frozen=True)
class Rejected:
    request_id: str
    message: str  # why the engine refused the request, for the client


Sink = Callable[[StepOutput | Rejected], None]


@dataclass(frozen=True)
class _Submit:
    request_id: str
    params: SamplingParams
    prompt: PromptRequest
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], object]
    future: Future


_STOP = None


@dataclass(slots=True)
class _Active:
    sink: Sink
    tokens: int  # prompt + max new tokens: what this choice may occupy
    seen_output: bool = False


@dataclass(slots=True)
class MeasuredSpeed:
    """A worker's measured speed, as its load reports it: EWMAs of the step time, of
    the time of steps without a prefill-rate sample (the decode baseline) and of the
    prefill rate (the module's docstring says which steps sample which)."""

    step_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0

    def fold(self, step_s: float, prompt_tokens: int) -> None:
        """A step of ``step_s`` seconds (> 0) that computed ``prompt_tokens``."""
        self.step_s = _ewma(self.step_s, step_s)
        if prompt_tokens < RATE_SAMPLE_MIN_TOKENS:
            self.decode_step_s = _ewma(self.decode_step_s, step_s)
            return
        prefill_s = max(step_s - self.decode_step_s, MIN_PREFILL_SHARE * step_s)
        self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, prompt_tokens / prefill_s)


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    tokens: int = 0
    requests_total: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generated_tokens_total: int = 0
    prefill_backlog_tokens: int = 0
    decode_seqs: int = 0
    speed: MeasuredSpeed = field(default_factory=MeasuredSpeed)
    host_tier: TierStats | None = None  # as of the last step
    version: int = 0
    tally: StepTally = field(default_factory=StepTally)


def _ewma(average: float, sample: float) -> float:
    """The moving average after ``sample``; 0.0 means none yet (the sample sets it)."""
    if average == 0.0:
        return sample
    return average + LOAD_EWMA_WEIGHT * (sample - average)


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_events: Callable[[list[CacheEvent]], None],
        on_fatal: Callable[[BaseException], None],
        on_delivered: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_delivered``: called on the loop thread once a step's outputs reached
        their sinks (steps that ``prefill`` and ``step_until`` take too)."""
        self._engine = engine
        self._on_events = on_events
        self._on_fatal = on_fatal
        self._on_delivered = on_delivered
        self._commands: queue.SimpleQueue[_Submit | _Abort | _Call | None] = queue.SimpleQueue()
        self._prefill_ids = itertools.count()
        self._active: dict[str, _Active] = {}  # loop thread only
        self._lock = threading.Lock()  # guards _counters (bump version on every change)
        self._counters = _Counters()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join()

    def submit(
        self, request_id: str, params: SamplingParams, prompt: PromptRequest, sink: Sink
    ) -> None:
        """Queue one choice of ``prompt`` for ``Engine.submit``; its outputs go to
        ``sink`` (a request the engine refuses, e.g. approximate on a model that cannot
        place chunks, gets a ``Rejected`` naming why)."""
        self._commands.put(_Submit(request_id, params, prompt, sink))

    def abort(self, request_id: str) -> None:
        """Stop a choice (a no-op once it finished)."""
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the loop thread; its result (or ValueError) on the future,
        which the caller may cancel until ``fn`` starts (the module's invariants)."""
        future: Future = Future()
        self._commands.put(_Call(fn, future))
        return future

    def prefill(self, tokens: list[int], tenant_salt: str) -> None:
        """Loop thread only: compute ``tokens`` so their full pages are cached."""
        request_id = f"prefill-{next(self._prefill_ids)}"
        params = SamplingParams(max_tokens=1, temperature=0)
        self._engine.add_request(request_id, tokens, params, tenant_salt=tenant_salt)
        finished = False
        while not finished:
            for output in self._step():
                if output.request_id == request_id:
                    finished = finished or output.finished
                else:
                    self._deliver(output)
            self._on_delivered()

    def step_until(self, done: Callable[[], bool]) -> None:
        """Loop thread only: step the engine, delivering every output, until
        ``done()`` (e.g. a position-free entry has been filled)."""
        while not done():
            if not self._engine.has_unfinished():
                raise RuntimeError("the engine ran out of work before the awaited state")
            for output in self._step():
                self._deliver(output)
            self._on_delivered()

    def load(self) -> EngineLoad:
        with self._lock:
            c = self._counters
            return EngineLoad(
                requests=c.requests,
                tokens=c.tokens,
                requests_total=c.requests_total,
                prompt_tokens_total=c.prompt_tokens_total,
                cached_tokens_total=c.cached_tokens_total,
                generated_tokens_total=c.generated_tokens_total,
                prefill_backlog_tokens=c.prefill_backlog_tokens,
                decode_seqs=c.decode_seqs,
                prefill_tokens_per_s=c.speed.prefill_tokens_per_s,
                step_s=c.speed.step_s,
                host_load_s_per_token=(
                    c.host_tier.load_s_per_page / self._engine.pool.page_size
                    if c.host_tier is not None
                    else 0.0
                ),
                version=c.version,
            )

    def step_tally(self) -> StepTally:
        """Steps by kind, busy time and the engine's workload since the loop started (a
        copy; the workload snapshot is shared: each step replaces it, never changes it)."""
        with self._lock:
            tally = self._counters.tally
            return StepTally(dict(tally.steps_by_kind), tally.busy_s, tally.workload)

    def kv_pages(self) -> KVPages:
        """Read from another thread without stopping the loop: a snapshot that may be
        one step old, never torn within a count."""
        pool = self._engine.pool
        with self._lock:
            host = self._counters.host_tier
        return KVPages(pool.num_pages, pool.num_pages - pool.num_available, host)

    # -- loop thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as error:  # noqa: BLE001 - the engine state is unknown now
            logger.exception("engine loop failed")
            self._on_fatal(error)

    def _iterate(self) -> bool:
        for command in self._take(block=not self._engine.has_unfinished()):
            if command is _STOP:
                return False
            if isinstance(command, _Submit):
                self._add(command)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                self._cancel(command.request_id)
        if self._engine.has_unfinished():
            for output in self._step():
                self._deliver(output)
            self._on_delivered()
        else:
            self._update_load(None)  # commands alone may have changed it (an abort)
        self._on_events(self._engine.pool.drain_events())
        return True

    def _step(self) -> list[StepOutput]:
        """One engine step, timed; the load is updated before outputs are delivered."""
        started = time.perf_counter()
        outputs = self._engine.step()
        self._update_load(time.perf_counter() - started)
        return outputs

    def _update_load(self, step_s: float | None) -> None:
        """Take the engine's backlog and decode count; fold a step of ``step_s``
        seconds (None: no step ran) into the averages."""
        engine = self._engine
        shape = engine.load_shape()
        timed = step_s is not None and step_s > 0 and engine.last_step_seqs > 0
        # the steps this call read back are what its wall time waited for
        prompt_tokens = engine.last_read_back_prompt_tokens if timed else 0
        host = engine.pool.host.stats() if engine.pool.host is not None else None
        with self._lock:
            c = self._counters
            if timed:
                c.speed.fold(step_s, prompt_tokens)
            if step_s is not None:
                c.tally.add(step_s, engine.last_resolved_steps)
                c.tally.workload = engine.tally.copy()
            c.prefill_backlog_tokens = shape.prefill_backlog_tokens
            c.decode_seqs = shape.decode_seqs
            c.host_tier = host
            c.version += 1

    def _call(self, command: _Call) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # its caller gave up before it started: nothing to undo
        try:
            result = command.fn()
        except ValueError as error:
            command.future.set_exception(error)
            return
        except BaseException as error:
            command.future.set_exception(error)
            raise
        command.future.set_result(result)

    def _take(self, block: bool) -> list[_Submit | _Abort | _Call | None]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, command: _Submit) -> None:
        try:
            self._engine.submit(command.request_id, command.params, command.prompt)
        except ValueError as error:
            command.sink(Rejected(command.request_id, str(error)))
            return
        tokens = len(command.prompt.token_ids) + command.params.max_tokens
        self._active[command.request_id] = _Active(command.sink, tokens)
        with self._lock:
            self._counters.requests += 1
            self._counters.tokens += tokens
            self._counters.requests_total += 1
            self._counters.version += 1

    def _cancel(self, request_id: str) -> None:
        if request_id in self._active:
            self._engine.abort(request_id)
            self._retire(request_id)

    def _deliver(self, output: StepOutput) -> None:
        active = self._active.get(output.request_id)
        if active is None:
            return
        with self._lock:
            if not active.seen_output:
                self._counters.prompt_tokens_total += output.num_prompt_tokens
                self._counters.cached_tokens_total += output.num_cached_tokens
            self._counters.generated_tokens_total += len(output.new_token_ids)
            self._counters.version += 1
        active.seen_output = True
        active.sink(output)
        if output.finished:
            self._retire(output.request_id)

    def _retire(self, request_id: str) -> None:
        active = self._active.pop(request_id)
        with self._lock:
            self._counters.requests -= 1
            self._counters.tokens -= active.tokens
            self._counters.version += 1
