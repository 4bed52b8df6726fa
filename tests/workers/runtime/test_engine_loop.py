"""The worker's engine thread and cache mirror, without Ray."""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import queue
import selectors
import shutil
import threading

import pytest

from chunkstore.events import CacheEvent, EventKind
from chunkstore.hashing import Namespace, position_free_key
from tests.chunkstore.testkit import wait_until
from workers.engine.checkpoint import checkpoint_fingerprint
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, StepOutput
from workers.engine.request import PromptRequest
from workers.engine.reuse_info import DEFAULT_DEVIATION_RATIO, ReuseInfo, ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.actor import _collect, _Outbox, coalesce
from workers.runtime.cache_mirror import CacheMirror
from workers.runtime.engine_loop import (
    MIN_PREFILL_SHARE,
    RATE_SAMPLE_MIN_TOKENS,
    EngineLoop,
    MeasuredSpeed,
    Rejected,
)
from workers.runtime.worker_types import EngineLoad


@pytest.fixture
def loop(tiny_qwen3):
    mirror = CacheMirror()
    fatal: list[BaseException] = []
    engine = Engine(EngineConfig(model_dir=str(tiny_qwen3), page_size=16), stream_text=True)
    loop = EngineLoop(engine, mirror.absorb, fatal.append)
    loop.start()
    yield loop, mirror
    loop.stop()
    assert not fatal


def collect(loop: EngineLoop, request_id: str, prompt, params, **reuse) -> list:
    """``reuse``: the prompt's other fields (``PromptRequest``)."""
    items: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit(request_id, params, PromptRequest(tuple(prompt), "", **reuse), items.put)
    out = []
    while True:
        item = items.get(timeout=30)
        out.append(item)
        if isinstance(item, Rejected) or item.finished:
            return out


def test_outputs_rejections_counters_and_mirror(loop):
    loop, mirror = loop
    prompt = list(range(100, 164))
    outputs = collect(
        loop, "a", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert sum(len(o.new_token_ids) for o in outputs) == 5 and outputs[-1].finished
    load = loop.load()
    assert load.requests == 0 and load.tokens == 0 and load.requests_total == 1
    assert load.prompt_tokens_total == 64 and load.generated_tokens_total == 5
    assert mirror.size() == 4  # four full pages published, mirrored from the loop thread
    assert len(mirror.snapshot().keys) == 4
    again = collect(loop, "b", prompt, SamplingParams(max_tokens=1))
    assert again[0].num_cached_tokens == 48  # the last page is always recomputed
    rejected = collect(loop, "c", [10**9], SamplingParams(max_tokens=1))
    assert isinstance(rejected[0], Rejected) and "vocabulary" in rejected[0].message


def test_load_reports_backlog_rates_and_a_growing_version(loop):
    """The hint reaches the engine with the request (the backlog counts it while the
    request waits); once requests ran, the load carries measured rates, no backlog,
    and a version that grew with every update."""
    loop, _ = loop
    start = loop.load()
    assert (start.prefill_tokens_per_s, start.step_s, start.prefill_backlog_tokens) == (0, 0, 0)
    entered, gate = threading.Event(), threading.Event()
    # hold the loop thread inside a call, so the next two commands are taken together
    held = loop.call(lambda: entered.set() or gate.wait())
    assert entered.wait(30)
    items: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    # enough prompt tokens for a prefill-rate sample
    prompt = tuple(range(100, 100 + RATE_SAMPLE_MIN_TOKENS))
    loop.submit("a", params, PromptRequest(tuple(prompt), "", expected_cached_tokens=24), items.put)
    # a call after a submit runs after it is added, before the engine steps
    shape = loop.call(lambda: loop._engine.load_shape())
    gate.set()
    held.result(timeout=30)
    assert shape.result(timeout=30).prefill_backlog_tokens == len(prompt) - 24
    outputs = [items.get(timeout=30)]
    while not outputs[-1].finished:
        outputs.append(items.get(timeout=30))
    end = loop.load()
    assert end.prefill_tokens_per_s > 0 and end.step_s > 0
    assert end.version > start.version
    assert end.prefill_backlog_tokens == 0 and end.decode_seqs == 0
    assert end.requests == 0 and end.generated_tokens_total == 4
    # a load read later is never older
    assert loop.load().version >= end.version
    # every step read back is tallied by its kind: the CPU engine runs the torch
    # backend eagerly; one prefill step and three decode steps, at least
    tally = loop.step_tally()
    assert set(tally.steps_by_kind) == {"torch eager"}, tally
    steps, seconds = tally.steps_by_kind["torch eager"]
    assert steps >= 4 and 0 < seconds <= tally.busy_s


def test_prefill_rate_is_measured_beyond_the_decode_baseline():
    """Small prompts beside a decode batch feed the decode baseline, not the rate; a
    prefill step's rate counts only what it took beyond that baseline, and never less
    than its minimum share of the step."""
    speed = MeasuredSpeed()
    for _ in range(20):  # a decode batch with cache hits: 40-token tails, 6 ms steps
        speed.fold(0.006, 40)
    assert speed.prefill_tokens_per_s == 0.0  # not measured (routers assume the median)
    assert math.isclose(speed.decode_step_s, 0.006)
    speed.fold(0.006 + 0.013, 2600)  # a miss: 13 ms of prefill beside the batch
    assert math.isclose(speed.prefill_tokens_per_s, 2600 / 0.013)  # not 2600 / 0.019
    assert math.isclose(speed.step_s, 0.006 + 0.2 * 0.013)
    quick = MeasuredSpeed(decode_step_s=0.010)
    quick.fold(0.009, 1000)  # faster than the baseline: noise, held at the minimum share
    assert math.isclose(quick.prefill_tokens_per_s, 1000 / (MIN_PREFILL_SHARE * 0.009))


def test_approximate_requests_reach_the_engine_with_their_spans(loop, tiny_qwen3, tmp_path):
    """A request's spans and reuse request go to ``add_request``; a model that cannot
    place chunks refuses approximate requests with the engine's message."""
    loop, mirror = loop
    docs = [list(range(200, 240)), list(range(300, 340))]
    prompt = list(range(100, 120)) + docs[0] + docs[1] + list(range(400, 410))
    spans = ((20, 60), (60, 100))
    approximate = ReuseRequest("approximate")
    params = SamplingParams(max_tokens=1)
    first = collect(loop, "a", prompt, params, placeable=spans, reuse=approximate)[-1]
    assert first.reuse == ReuseInfo("approximate", 0, 0)
    # the documents' entries are filled by the loop after the request: wait for them
    namespace = Namespace(f"{tiny_qwen3.resolve().name}@{checkpoint_fingerprint(tiny_qwen3)}")
    entries = {position_free_key(namespace, doc) for doc in docs}
    assert wait_until(lambda: entries <= set(mirror.snapshot().keys), timeout_s=30)
    swapped = list(range(500, 520)) + docs[1] + docs[0] + list(range(400, 410))
    second = collect(loop, "b", swapped, params, placeable=spans, reuse=approximate)[-1]
    # both placed, the default share of them repaired
    assert second.reuse.mode == "approximate" and second.reuse.reused_tokens == 80
    selected = round(DEFAULT_DEVIATION_RATIO * 80)
    assert second.reuse.recomputed_tokens == selected
    assert collect(loop, "c", swapped, params, placeable=spans)[-1].reuse.mode == "exact"

    partial = tmp_path / "partial"
    shutil.copytree(tiny_qwen3, partial)
    config = json.loads((partial / "config.json").read_text())
    (partial / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5}))
    fatal: list[BaseException] = []
    refusing = EngineLoop(Engine(EngineConfig(model_dir=str(partial))), mirror.absorb, fatal.append)
    refusing.start()
    try:
        refused = collect(refusing, "d", prompt, params, placeable=spans, reuse=approximate)
        assert isinstance(refused[0], Rejected)
        assert "approximate reuse is not available" in refused[0].message
        assert "partial_rotary_factor" in refused[0].message
        assert collect(refusing, "e", prompt, params)[-1].reuse.mode == "exact"
    finally:
        refusing.stop()
    assert not fatal


def test_abort_stops_a_request_and_frees_its_load(loop):
    loop, _ = loop
    seen = threading.Event()
    params = SamplingParams(max_tokens=3000, ignore_eos=True)
    loop.submit("long", params, PromptRequest(tuple(range(10, 40)), ""), lambda item: seen.set())
    assert seen.wait(30)
    assert loop.load().requests == 1
    loop.abort("long")
    for _ in range(300):
        if loop.load().requests == 0:
            break
        threading.Event().wait(0.01)
    assert loop.load().requests == 0


def test_mirror_applies_events_in_order():
    mirror = CacheMirror()
    a, b = b"a" * 32, b"b" * 32
    mirror.absorb([CacheEvent(EventKind.STORED, (a, b)), CacheEvent(EventKind.REMOVED, (a,))])
    assert mirror.snapshot().keys == [b] and len(mirror.drain()) == 2 and mirror.drain() == []
    mirror.absorb([CacheEvent(EventKind.CLEARED)])
    assert mirror.snapshot().keys == []


def test_coalesce_merges_consecutive_outputs_per_choice():
    def out(rid, token, text, finished=False):
        return StepOutput(
            rid,
            (token,),
            text,
            finished,
            "length" if finished else None,
            10,
            4,
            ReuseInfo("exact", 4),
        )

    load = EngineLoad(1, 2, 3, 4, 5, 6, prefill_backlog_tokens=7, decode_seqs=1, version=9)
    deltas = coalesce([out("r#0", 1, "a"), out("r#1", 2, "b"), out("r#0", 3, "c", True)],
                      {"r#0": 0, "r#1": 1}, load)  # fmt: skip
    assert [(d.index, d.token_ids, d.text, d.finished) for d in deltas] == [
        (0, (1, 3), "ac", True),
        (1, (2,), "b", False),
    ]
    assert all(d.load == load for d in deltas)  # every delta carries the worker's load


def _out(rid: str, token: int, finished: bool = False) -> StepOutput:
    return StepOutput(
        rid,
        (token,),
        str(token),
        finished,
        "length" if finished else None,
        10,
        4,
        ReuseInfo("exact", 4),
    )


class _JumpingSelector(selectors.DefaultSelector):
    """Never sleeps: where the event loop would wait for its next timer, the virtual
    clock ``now`` jumps to that timer instead."""

    now = 0.0

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if not ready and timeout is None:
            raise RuntimeError("the virtual-time loop would wait forever: nothing is scheduled")
        if not ready and timeout:
            self.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: ``loop.time()``, ``asyncio.sleep`` and
    timeouts behave as usual, but time passes only while every task waits, and then
    at once. Timing is exact and independent of the machine; nothing awaited may
    depend on I/O from other threads or processes."""

    def __init__(self) -> None:
        self._clock = _JumpingSelector()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now


def _stream(interval_s: float, schedule: list[tuple[float, object]]) -> list[tuple]:
    """Feed ``schedule`` ((delay, item)) into ``_collect`` on virtual time; the deltas
    and the virtual times they came at (the first item is fed at its delay)."""

    async def run() -> list[tuple]:
        outputs: asyncio.Queue = asyncio.Queue()

        async def feed() -> None:
            for delay, item in schedule:
                await asyncio.sleep(delay)
                outputs.put_nowait(item)

        feeder = asyncio.create_task(feed())
        loop = asyncio.get_running_loop()
        got = [
            (loop.time(), delta) async for delta in _collect(outputs, ["r#0", "r#1"], interval_s)
        ]
        await feeder
        return got

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(run())


def _batches(got: list[tuple]) -> list[tuple[float, list]]:
    """Deltas grouped by the (virtual) time they came at."""
    batches: list[tuple[float, list]] = []
    for at, delta in got:
        if batches and batches[-1][0] == at:
            batches[-1][1].append(delta)
        else:
            batches.append((at, [delta]))
    return batches


def test_virtual_time_loop_jumps_to_timers():
    async def nap() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = [loop.time()]
        await asyncio.sleep(5.0)
        seen.append(loop.time())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 2.5)
        seen.append(loop.time())
        return seen

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        assert runner.run(nap()) == [0.0, 5.0, 7.5]


def test_deltas_come_at_most_once_per_interval_and_the_first_at_once():
    # two choices, a token each every 10 ms from t=10 ms; choice 1 ends with its third
    # token (t=30 ms), choice 0 with its eighth (t=80 ms)
    schedule = []
    for step in range(8):
        schedule.append((0.01, _out("r#0", step, finished=step == 7)))
        if step < 3:
            schedule.append((0.0, _out("r#1", 100 + step, finished=step == 2)))
    last_output_at = 0.08
    every = _stream(0.0, schedule)
    held = _stream(0.025, schedule)
    buffered = _stream(math.inf, schedule)
    for got in (every, held, buffered):
        tokens = {0: [], 1: []}
        for _, delta in got:
            tokens[delta.index] += delta.token_ids
        assert tokens == {0: list(range(8)), 1: [100, 101, 102]}  # nothing lost or repeated
        assert [d.finished for _, d in got] == [
            d.token_ids[-1] in (7, 102) for _, d in got
        ]  # a choice's delta says finished exactly when it carries its last token
        assert got[0][1].token_ids == (0,)
        assert got[0][0] == pytest.approx(0.01)  # the first token is never held back
        assert got[-1][0] == pytest.approx(last_output_at)  # nor the last, once all ended
        for _, deltas in _batches(got):
            assert len({d.index for d in deltas}) == len(deltas)  # one delta per choice
    assert len(every) == 11  # no interval: every output goes out on its own
    # held: then at most one batch per 25 ms, each as soon as the interval is over;
    # only the final flush (everything ended) comes sooner
    times = [at for at, _ in _batches(held)]
    assert times == pytest.approx([0.01, 0.035, 0.06, last_output_at])
    assert all(b - a >= 0.025 - 1e-9 for a, b in zip(times[:-2], times[1:-1], strict=True))
    assert times[-1] - times[-2] < 0.025  # the final flush was not held to the interval
    # buffered: the first delta, then everything else once both choices ended
    times = [at for at, _ in _batches(buffered)]
    assert times == pytest.approx([0.01, last_output_at])
    assert len(buffered) <= 4


def test_collected_deltas_carry_the_load_read_when_they_are_made():
    versions = iter(range(1, 100))

    def load() -> EngineLoad:
        return EngineLoad(0, 0, 0, 0, 0, 0, version=next(versions))

    async def run() -> list:
        outputs: asyncio.Queue = asyncio.Queue()
        for item in (_out("r#0", 1), _out("r#1", 2, True), _out("r#0", 3, True)):
            outputs.put_nowait(item)
        return [d async for d in _collect(outputs, ["r#0", "r#1"], 0.0, load)]

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        deltas = runner.run(run())
    assert deltas and all(d.load is not None and d.load.version > 0 for d in deltas)


def test_a_rejection_is_not_held_back():
    got = _stream(math.inf, [(0.01, _out("r#0", 1)), (0.01, Rejected("r#1", "prompt too long"))])
    assert [type(d).__name__ for _, d in got] == ["WorkerDelta", "WorkerRefusal"]
    assert [at for at, _ in got] == pytest.approx([0.01, 0.02])


def test_call_runs_on_the_loop_thread_and_prefill_keeps_others_streaming(loop):
    loop, mirror = loop
    items: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    loop.submit("other", params, PromptRequest(tuple(range(300, 340)), ""), items.put)
    thread = loop.call(lambda: threading.current_thread().name).result(timeout=30)
    assert thread == "engine-loop"
    loop.call(lambda: loop.prefill(list(range(200, 264)), "")).result(timeout=30)
    out = collect(loop, "reuse", list(range(200, 264)), SamplingParams(max_tokens=1))
    assert out[0].num_cached_tokens == 48  # the prefill's pages were cached
    other = []
    while not (other and other[-1].finished):
        other.append(items.get(timeout=30))
    assert sum(len(o.new_token_ids) for o in other) == 20  # delivered despite the prefill

    def refuse():
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        loop.call(refuse).result(timeout=30)
    assert loop.call(lambda: 1).result(timeout=30) == 1  # the loop lives on


def test_the_outbox_hands_a_burst_of_outputs_over_in_one_wake_up():
    """Outputs delivered from another thread while a hand-over is pending join it;
    each queue gets its items in order, nothing lost."""
    wake_ups = []

    class CountingLoop(asyncio.SelectorEventLoop):
        def call_soon_threadsafe(self, callback, *args, **kwargs):
            wake_ups.append(callback)
            return super().call_soon_threadsafe(callback, *args, **kwargs)

    async def run() -> tuple[list, list]:
        outbox = _Outbox(asyncio.get_running_loop())
        first, second = asyncio.Queue(), asyncio.Queue()
        sinks = (outbox.sink(first), outbox.sink(second))

        def engine_step(step: int) -> None:  # a step's outputs, from the engine thread
            for i in range(20):
                sinks[i % 2](_out(f"r#{i % 2}", 100 * step + i))

        for step in range(3):
            # the event loop waits while the thread delivers (as it waits for the GIL
            # while the engine thread delivers a step): one hand-over a step
            thread = threading.Thread(target=engine_step, args=(step,))
            thread.start()
            thread.join()
            await asyncio.sleep(0)
        got = ([], [])
        for queue_, out in zip((first, second), got, strict=True):
            while not queue_.empty():
                out.extend(queue_.get_nowait().new_token_ids)
        return got

    with asyncio.Runner(loop_factory=CountingLoop) as runner:
        first, second = runner.run(run())
    assert first == [100 * s + i for s in range(3) for i in range(0, 20, 2)]
    assert second == [100 * s + i for s in range(3) for i in range(1, 20, 2)]
    assert sum(w.__name__ == "_hand_over" for w in wake_ups) == 3  # one per step, not 60


def test_stream_items_cross_as_packed_bytes():
    """What ``Worker.generate`` yields: bytes that unpack to the same delta or
    refusal; anything else in a worker stream is refused by name."""
    from workers.runtime.worker_types import WorkerRefusal, pack_item, unpack_item

    load = EngineLoad(3, 90, 7, 700, 600, 20, prefill_backlog_tokens=5, version=9)
    delta = coalesce([_out("r#0", 1), _out("r#0", 2, True)], {"r#0": 0}, load)[0]
    refusal = WorkerRefusal("worker is draining", retryable=True)
    for item in (delta, refusal):
        packed = pack_item(item)
        assert isinstance(packed, bytes) and unpack_item(packed) == item
    with pytest.raises(TypeError, match="yielded dict"):
        unpack_item(pickle.dumps({"token_ids": (1,)}))


def test_the_outbox_loses_nothing_while_the_loop_hands_over_concurrently():
    """A producer thread delivering while the event loop hands over and consumers
    await: every item arrives, in order per queue."""
    per_queue, queues_n = 3000, 3

    async def run() -> list[list[int]]:
        outbox = _Outbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(queues_n)]
        sinks = [outbox.sink(q) for q in queues]

        def produce() -> None:
            for i in range(per_queue):
                for q, sink in enumerate(sinks):
                    sink(_out(f"r#{q}", i))

        async def consume(q: asyncio.Queue) -> list[int]:
            return [(await q.get()).new_token_ids[0] for _ in range(per_queue)]

        producer = asyncio.get_running_loop().run_in_executor(None, produce)
        got = await asyncio.gather(*(consume(q) for q in queues))
        await producer
        return got

    with asyncio.Runner() as runner:
        got = runner.run(run())
    assert got == [list(range(per_queue))] * queues_n
