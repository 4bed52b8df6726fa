"""The engine in a process of its own (``engine_host.ChildEngine``) against the engine
on the actor's thread (``LocalEngine``): the same outputs token for token, aborts,
rejections, chunk calls, the snapshots, and either process ending the other."""

from __future__ import annotations

import queue
import threading

import pytest

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import PromptRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.engine_host import ChildEngine, LocalEngine
from workers.runtime.engine_loop import Rejected

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _config(model) -> EngineConfig:
    return EngineConfig(model_dir=str(model), page_size=16, device="cpu")


def _run(host, prompts) -> dict[str, list[int]]:
    """Submits every prompt at once; tokens per request once all finished."""
    items: queue.SimpleQueue = queue.SimpleQueue()
    for i, prompt in enumerate(prompts):
        host.submit(f"r{i}", PARAMS, PromptRequest(tuple(prompt), ""), items.put)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finished = 0
    while finished < len(prompts):
        item = items.get(timeout=60)
        assert not isinstance(item, Rejected), item
        tokens[item.request_id] += item.new_token_ids
        finished += item.finished
    return tokens


@pytest.fixture
def child(tiny_qwen3):
    fatal: list[BaseException] = []
    events: list = []
    host = ChildEngine(_config(tiny_qwen3), 1, events.extend, fatal.append)
    host.start()
    yield host, events, fatal
    host.close()  # the child exits with its socket
    assert host._process.returncode == 0


def test_the_child_engine_answers_as_the_local_one(child, tiny_qwen3):
    host, events, fatal = child
    prompts = [list(range(100, 100 + n)) for n in (40, 17, 64)]
    local = LocalEngine(Engine(_config(tiny_qwen3), stream_text=True), lambda e: None, fatal.append)
    local.start()
    try:
        assert _run(host, prompts) == _run(local, prompts)
        assert host.facts == local.facts
    finally:
        local.close()
    # the snapshots follow: nothing running, three requests served, steps tallied
    load = host.load()
    assert load.requests == 0 and load.requests_total == 3
    assert load.generated_tokens_total == 18
    assert host.kv_pages()[0] > 0
    tally = host.step_tally()
    assert sum(n for n, _ in tally.steps_by_kind.values()) >= 6 and tally.busy_s > 0
    assert events  # the pool's events came across (pages published)
    assert not fatal


def test_rejections_aborts_and_chunk_calls_cross(child):
    host, _, fatal = child
    items: queue.SimpleQueue = queue.SimpleQueue()
    host.submit("bad", PARAMS, PromptRequest((10**9,), ""), items.put)
    rejected = items.get(timeout=60)
    assert isinstance(rejected, Rejected) and "vocabulary" in rejected.message
    # an aborted request's sink gets nothing more
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    got: list = []
    first = threading.Event()
    host.submit(
        "long",
        long,
        PromptRequest(tuple(range(100, 140)), ""),
        lambda i: got.append(i) or first.set(),
    )
    assert first.wait(60)
    host.abort("long")
    seen = len(got)
    assert _run(host, [list(range(200, 230))])  # the engine goes on
    assert len(got) == seen and not any(o.finished for o in got)
    # the child stopped it: nothing runs, and it made far fewer than its 500 tokens
    assert host.load().requests == 0 and host.outstanding() == 0
    assert host.load().generated_tokens_total < 6 + 100
    # a WorkerChunks method on the child's loop thread, its result back here
    assert host.chunks("infos", "").result(timeout=60) == []
    registered = host.chunks("register", "", "a system prompt", "system", None, ()).result(60)
    assert registered.created and host.chunks("infos", "").result(60) == [registered.info]
    assert not fatal


def test_a_request_submitted_again_under_its_id_gets_only_its_own_outputs(child):
    """Aborted, then submitted again at once under the same id: outputs of the first
    submission still on their way never reach the second's sink."""
    host, _, fatal = child
    assert host.kv_pages()[0] > 0  # snapshots exist from the start
    first = threading.Event()
    long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    host.submit("x", long, PromptRequest(tuple(range(100, 140)), ""), lambda item: first.set())
    assert first.wait(60)
    host.abort("x")
    items: queue.SimpleQueue = queue.SimpleQueue()
    short = tuple(range(300, 310))
    host.submit("x", PARAMS, PromptRequest(short, ""), items.put)
    outputs = [items.get(timeout=60)]
    while not outputs[-1].finished:
        outputs.append(items.get(timeout=60))
    assert all(o.num_prompt_tokens == len(short) for o in outputs)
    assert sum(len(o.new_token_ids) for o in outputs) == PARAMS.max_tokens
    assert not fatal


def test_a_failing_sink_ends_the_actor_not_just_the_reader(tiny_qwen3):
    fatal: list[BaseException] = []
    died = threading.Event()
    host = ChildEngine(_config(tiny_qwen3), 1, print, lambda e: fatal.append(e) or died.set())
    host.start()
    try:

        def sink(item):
            raise KeyError("a broken sink")

        host.submit("r", PARAMS, PromptRequest(tuple(range(100, 120)), ""), sink)
        assert died.wait(60)
        assert isinstance(fatal[0], KeyError)
    finally:
        host.close()


def test_a_child_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="could not start"):
        ChildEngine(EngineConfig(model_dir=str(tmp_path / "none")), None, print, print)


def test_the_actor_learns_when_the_child_dies(tiny_qwen3):
    fatal: list[BaseException] = []
    died = threading.Event()
    host = ChildEngine(_config(tiny_qwen3), 1, print, lambda e: fatal.append(e) or died.set())
    host.start()
    host._process.kill()
    assert died.wait(30)
    assert "engine process ended" in str(fatal[0])
    host.close()


@pytest.mark.parametrize("where", ["local", "child"])
def test_a_chunk_call_whose_caller_gave_up_never_fails_the_engine(where, tiny_qwen3):
    """A caller that cancels a chunk call's future: a call not yet started is skipped
    (local), one under way runs to its end; neither reaches the engine as an error,
    and ``roll_back`` then undoes a registration nobody learned of."""
    fatal: list[BaseException] = []
    if where == "child":
        host = ChildEngine(_config(tiny_qwen3), 1, lambda e: None, fatal.append)
    else:
        engine = Engine(_config(tiny_qwen3), stream_text=True)
        host = LocalEngine(engine, lambda e: None, fatal.append)
    host.start()
    try:
        gate = threading.Event()
        if where == "local":  # hold the loop thread so the next call is still queued
            blocker = host._loop.call(gate.wait)
        registering = host.chunks("register", "", "a system prompt", "system", None, ())
        cancelled = registering.cancel()
        gate.set()
        if where == "local":
            blocker.result(timeout=60)
            assert cancelled and registering.cancelled()
            assert host.chunks("infos", "").result(60) == []  # it never ran
            registering = host.chunks("register", "", "a system prompt", "system", None, ())
        else:
            assert not cancelled  # sent means started: it runs to its end
        registered = registering.result(timeout=60)
        assert registered.created and host.chunks("infos", "").result(60) != []
        # a registration of the same chunk came since: rolling the first back keeps it
        again = host.chunks("register", "", "a system prompt", "system", None, ()).result(60)
        assert not again.created
        chunk_id = registered.info.chunk_id
        undo = host.chunks("roll_back", "", chunk_id, registered.registration)
        assert undo.result(60) is False and host.chunks("infos", "").result(60) != []
        # rolling back the chunk's latest registration unpins it
        assert host.chunks("roll_back", "", chunk_id, again.registration).result(60)
        assert host.chunks("infos", "").result(60) == []  # the engine lives on
        assert not fatal
    finally:
        host.close()
