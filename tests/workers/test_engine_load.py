"""The engine's load shape (issue 13): prefill backlog, decoding sequences and the
prompt tokens each step computed, which routers use to estimate a request's wait."""

from __future__ import annotations

import pytest

from chunkstore.hashing import pack_tokens, root_key
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, LoadShape
from workers.engine.request import PromptRequest
from workers.engine.reuse_info import ReuseInfo, ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.runtime.worker_types import WorkerRequest

PAGE = 16
BUDGET = 32  # max_num_batched_tokens: a 100-token prompt takes four steps
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _engine(model_dir, budget: int = BUDGET, overlap: bool | None = None) -> Engine:
    config = EngineConfig(
        model_dir=str(model_dir),
        page_size=PAGE,
        max_num_batched_tokens=budget,
        overlap_scheduling=overlap,
    )
    return Engine(config)


def _run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_backlog_drops_by_the_prompt_tokens_each_step_computes(tiny_qwen3):
    engine = _engine(tiny_qwen3)
    assert engine.load_shape() == LoadShape(0, 0)
    prompt = list(range(100, 200))
    engine.add_request("a", prompt, GREEDY)
    assert engine.load_shape() == LoadShape(100, 0)  # waiting, no hint: all of it
    backlogs, computed = [100], []
    while engine.load_shape().prefill_backlog_tokens:
        engine.step()
        computed.append(engine.last_step_prompt_tokens)
        backlogs.append(engine.load_shape().prefill_backlog_tokens)
    assert computed == [32, 32, 32, 4]
    assert [a - b for a, b in zip(backlogs, backlogs[1:], strict=False)] == computed
    assert engine.load_shape() == LoadShape(0, 1)  # decoding now
    engine.step()
    assert engine.last_step_prompt_tokens == 0  # a decode token is no prompt token
    assert engine.last_step_seqs == 1
    assert engine.load_shape() == LoadShape(0, 1)
    _run(engine)
    assert engine.load_shape() == LoadShape(0, 0)
    assert engine.last_step_seqs == 1 and engine.step() == [] and engine.last_step_seqs == 0


def test_waiting_requests_count_the_hint_admitted_ones_the_real_cache(tiny_qwen3):
    engine = _engine(tiny_qwen3)
    prompt = list(range(100, 200))
    engine.add_request("first", prompt, GREEDY)
    _run(engine)
    # the hint is believed while the request waits, even past the prompt's length
    engine.add_request("hinted", prompt, GREEDY, expected_cached_tokens=96)
    assert engine.load_shape() == LoadShape(4, 0)
    engine.abort("hinted")
    engine.add_request("over", prompt, GREEDY, expected_cached_tokens=500)
    assert engine.load_shape() == LoadShape(0, 0)
    engine.abort("over")
    # admitted, the real cache hit counts: 96 of the first 100 tokens are cached,
    # the 4 left and 60 new ones are computed, 32 in the admitting step
    longer = prompt + list(range(300, 360))
    engine.add_request("longer", longer, GREEDY)  # no hint: all 160 estimated
    assert engine.load_shape() == LoadShape(160, 0)
    engine.step()
    assert engine.last_step_prompt_tokens == 32  # cached positions are not computed
    assert engine.load_shape() == LoadShape(160 - 96 - 32, 0)
    _run(engine)
    # an identical request: admission leaves 4 uncached tokens, computed at once
    engine.add_request("again", prompt, GREEDY, expected_cached_tokens=0)
    assert engine.load_shape() == LoadShape(100, 0)
    engine.step()
    assert engine.last_step_prompt_tokens == 4
    assert engine.load_shape() == LoadShape(0, 1)


def test_a_decoding_request_and_a_prefill_in_one_step(tiny_qwen3):
    engine = _engine(tiny_qwen3)
    engine.add_request("decoding", list(range(100, 120)), GREEDY)
    engine.step()
    assert engine.load_shape() == LoadShape(0, 1)
    engine.add_request("new", list(range(200, 300)), GREEDY, expected_cached_tokens=40)
    assert engine.load_shape() == LoadShape(60, 1)
    engine.step()  # one decode token, then 31 prompt tokens of the new request
    assert engine.last_step_prompt_tokens == 31 and engine.last_step_seqs == 2
    assert engine.load_shape() == LoadShape(100 - 31, 1)


PLACED = ((20, 60), (60, 100))


def test_entry_fills_and_scattered_repairs_count_as_prefill(tiny_qwen3):
    """Entry fills are prefill work; an approximate request's pending (scattered)
    positions are in its backlog, and each step's computed prompt tokens account for
    every drop of the backlog."""
    engine = _engine(tiny_qwen3, budget=4)
    docs = [list(range(200, 240)), list(range(300, 340))]
    for doc in docs:
        engine.fill_entry(doc)
    backlog = 80 + 2 * len(engine.entry_context)  # each fill computes the context too
    assert engine.load_shape() == LoadShape(backlog, 0)
    while engine.has_unfinished():
        engine.step()
        now = engine.load_shape().prefill_backlog_tokens
        assert backlog - now == engine.last_step_prompt_tokens == min(4, backlog)
        backlog = now
    assert backlog == 0

    def add(request_id: str, first: int, order: tuple[int, int], reuse: ReuseRequest) -> None:
        """20 new tokens, the two documents placed (20-60, 60-100), a 10-token tail."""
        head, tail = list(range(first, first + 20)), list(range(400, 410))
        prompt = head + docs[order[0]] + docs[order[1]] + tail
        params = SamplingParams(max_tokens=1)
        engine.add_request(request_id, prompt, params, placeable=PLACED, reuse=reuse)

    # repair without a deviation ratio: the first tokens are pending, computed in steps
    add("b", 500, (1, 0), ReuseRequest("approximate", first_tokens=4, deviation_ratio=0.0))
    engine.step()  # admission: both chunks placed, then 4 positions computed
    seq = engine._sequences["b"]
    recomputed = 8  # 4 in each chunk
    assert seq.reuse == ReuseInfo("approximate", 80, recomputed)
    assert len(seq.pending) == 20 + recomputed - 4
    backlog = engine.load_shape().prefill_backlog_tokens
    assert backlog == len(seq.pending) + 10
    total = backlog
    steps = []
    while backlog:
        engine.step()
        now = engine.load_shape().prefill_backlog_tokens
        steps.append(engine.last_step_prompt_tokens)
        assert backlog - now == engine.last_step_prompt_tokens
        backlog = now
    # the scattered positions first, then the tail, 4 a step
    assert steps == [4] * (total // 4) + ([total % 4] if total % 4 else [])
    assert engine.load_shape() == LoadShape(0, 0)  # its one token came with the prompt
    # with a deviation ratio, admission's one forward computes the 20 positions before
    # the chunks and the 8 selected. They take the admitting step's budget (here more
    # than all of it: that step launches nothing else) and count in the prompt tokens
    # of the next step launched, with the 4 of the tail it takes
    add("c", 600, (0, 1), ReuseRequest("approximate", first_tokens=0, deviation_ratio=0.1))
    assert engine.step() == [] and engine.last_step_prompt_tokens == 0
    assert engine._sequences["c"].reuse == ReuseInfo("approximate", 80, 8)
    assert engine.load_shape() == LoadShape(10, 0)  # the tail
    steps = []
    while engine.has_unfinished():
        engine.step()
        steps.append(engine.last_step_prompt_tokens)
    assert steps == [20 + 8 + 4, 4, 2]


def test_a_wrong_hint_changes_no_token(tiny_qwen3):
    prompt = list(range(100, 200))
    plain, hinted = _engine(tiny_qwen3), _engine(tiny_qwen3)
    plain.add_request("r", prompt, GREEDY)
    hinted.add_request("r", prompt, GREEDY, expected_cached_tokens=77)
    assert hinted.load_shape() == LoadShape(23, 0)
    assert _run(hinted) == _run(plain)
    with pytest.raises(ValueError, match="expected_cached_tokens"):
        plain.add_request("bad", prompt, GREEDY, expected_cached_tokens=-1)


@pytest.mark.parametrize("held_elsewhere", [True, False])
def test_a_request_held_elsewhere_gives_up_its_pages_first(tiny_qwen3, held_elsewhere):
    """A spilled request's own pages are evicted before older cached ones (its hit
    on the shared system prompt is not); without the hint, least recently used
    first. Tokens are the same either way."""
    config = EngineConfig(model_dir=str(tiny_qwen3), page_size=PAGE, num_pages=16)
    engine, plain = Engine(config), Engine(config)
    system = list(range(100, 132))  # 2 pages
    older, spilled = system + list(range(200, 264)), system + list(range(300, 364))
    outputs = []
    for e, hint in ((engine, held_elsewhere), (plain, False)):
        e.add_request("older", older, GREEDY)
        tokens = _run(e)
        e.add_request("spilled", spilled, GREEDY, held_elsewhere=hint)
        tokens |= _run(e)
        outputs.append(tokens)
    assert outputs[0] == outputs[1]
    # 10 keyed pages cached, 6 free: a new 9-page prompt evicts 4 cached pages
    engine.add_request("new", list(range(400, 544)), GREEDY)
    _run(engine)
    root, pool = root_key(engine.namespace()), engine.pool

    def cached_pages(prompt: list[int]) -> int:
        return len(pool.match_chain(root, pack_tokens(prompt), len(prompt) // PAGE))

    kept, lost = (older, spilled) if held_elsewhere else (spilled, older)
    assert cached_pages(kept) == 6
    assert cached_pages(lost) == 2  # the system prompt, released as usual


def test_a_prompt_request_refuses_a_negative_hint():
    assert PromptRequest((1, 2), "").expected_cached_tokens == 0
    assert PromptRequest((1, 2), "", expected_cached_tokens=5).expected_cached_tokens == 5
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="expected_cached_tokens must be an integer >= 0"):
            PromptRequest((1, 2), "", expected_cached_tokens=bad)
    with pytest.raises(ValueError, match="at least one choice"):
        WorkerRequest("r", PromptRequest((1, 2), ""), ())


def test_an_approximate_admission_that_cannot_get_its_pages_queues_no_forward(tiny_qwen3):
    """Selecting takes pages for the whole prompt before it queues its forward: when the
    pool cannot give them, the request waits and nothing was computed aside; once pages
    free up, one forward runs and counts in the step it admits into."""
    engine = _engine(tiny_qwen3, budget=32)
    docs = [list(range(200, 240)), list(range(300, 340))]
    keys = [engine.fill_entry(doc) for doc in docs]
    while engine.has_unfinished():
        engine.step()
    pool = engine.pool
    for key in keys:  # registered chunks: pinned, never evicted for room
        pool.hold_entry(pool.entry(key), pin=True)
    # room for the 100 positions up to the last placed chunk, not for the 30-token tail
    others = pool.allocate(pool.num_available - 7)
    forwards = []
    repair = engine.runner.repair_selecting_batch

    def counted(selections, layer):
        forwards.extend((one.start, one.end) for one in selections)
        return repair(selections, layer)

    engine.runner.repair_selecting_batch = counted
    prompt = list(range(600, 620)) + docs[0] + docs[1] + list(range(400, 430))
    selecting = ReuseRequest("approximate", first_tokens=0, deviation_ratio=0.1)
    params = SamplingParams(max_tokens=1)
    engine.add_request("c", prompt, params, placeable=PLACED, reuse=selecting)
    for _ in range(3):
        engine.step()
        assert not forwards and engine.runner.take_aside() is None
        assert [seq.request_id for seq in engine.scheduler.waiting] == ["c"]
    pool.release(others)
    engine.step()
    # the forward's 28 rows and the 30-token tail pass the budget of 32: the forward
    # stops before the tail, and the step takes 4 of it
    assert forwards == [(0, 100)]
    assert engine.last_step_prompt_tokens == 20 + 8 + 4


def test_a_step_behind_an_admission_forward_is_read_back_at_once(tiny_qwen3):
    """With overlapped steps a step is held (read back on the next call) unless it
    yields a first token; one launched behind a forward that admission queued aside is
    read back at once (held, the next step's plan could rewrite its plan's pinned
    buffer before the copy to the device ran)."""
    engine = _engine(tiny_qwen3, budget=4, overlap=True)
    docs = [list(range(200, 240)), list(range(300, 340))]
    for doc in docs:
        engine.fill_entry(doc)
    while engine.has_unfinished():
        engine.step()
    prompt = list(range(600, 620)) + docs[0] + docs[1] + list(range(400, 410))
    selecting = ReuseRequest("approximate", first_tokens=0, deviation_ratio=0.1)
    params = SamplingParams(max_tokens=2)
    engine.add_request("c", prompt, params, placeable=PLACED, reuse=selecting)
    engine.step()  # admission's forward, which takes the whole budget: nothing launched
    assert engine._in_flight is None and engine.last_step_prompt_tokens == 0
    engine.step()  # 4 of the 10 tail tokens, behind the forward: read back at once
    assert engine._in_flight is None and engine.last_read_back_prompt_tokens == 20 + 8 + 4
    engine.step()  # 4 more, no forward aside: held
    assert engine._in_flight is not None
    while engine.has_unfinished():
        engine.step()
