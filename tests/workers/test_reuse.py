"""Chunk reuse is exact: greedy tokens with reuse on == reuse off == transformers."""

from __future__ import annotations

import random

import pytest

from tests.workers.reference import reference_greedy
from workers import LLM, SamplingParams
from workers.engine.reuse_info import ReuseInfo

PAGE = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_qwen3):
    return LLM(tiny_qwen3, page_size=PAGE), LLM(tiny_qwen3, page_size=PAGE, enable_reuse=False)


@pytest.fixture(scope="module")
def reference(tiny_qwen3, hf_reference):
    model = hf_reference(tiny_qwen3)
    return lambda prompt: reference_greedy(model, prompt, GREEDY.max_tokens)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(10, 500), k=n)


def _check_same(engines, reference, prompts, check_reference=True):
    """Runs prompts one after another on the reuse engine (so later ones can hit the
    cache) and all at once on the no-reuse engine; returns the reuse outputs. Every
    output says how it was served."""
    on, off = engines
    outs_on = [on.generate([p], GREEDY)[0] for p in prompts]
    outs_off = off.generate(prompts, GREEDY)
    for prompt, a, b in zip(prompts, outs_on, outs_off, strict=True):
        assert a.token_ids == b.token_ids
        assert b.num_cached_tokens == 0
        assert a.reuse == ReuseInfo("exact", reused_tokens=a.num_cached_tokens)
        assert b.reuse == ReuseInfo("off")
        if check_reference:
            assert list(a.token_ids) == reference(prompt)
    return outs_on


def _shared_pages(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // PAGE * PAGE


def test_system_plus_query(engines, reference):
    rng = random.Random(10)
    system = _tokens(rng, 70)
    prompts = [system + _tokens(rng, 9), system + _tokens(rng, 23)]
    outs = _check_same(engines, reference, prompts)
    assert outs[1].num_cached_tokens == _shared_pages(prompts[0], prompts[1]) == 64
    assert outs[1].reuse.as_dict() == {"mode": "exact", "reused_tokens": 64, "recomputed_tokens": 0}


def test_system_documents_query_and_reordering(engines, reference):
    rng = random.Random(11)
    system, docs, query = _tokens(rng, 40), [_tokens(rng, 50) for _ in range(3)], _tokens(rng, 7)
    abc = system + docs[0] + docs[1] + docs[2] + query
    abc_again = system + docs[0] + docs[1] + docs[2] + _tokens(rng, 11)
    cba = system + docs[2] + docs[1] + docs[0] + query
    outs = _check_same(engines, reference, [abc, abc_again, cba])
    assert outs[1].num_cached_tokens == _shared_pages(abc, abc_again) == 190 // PAGE * PAGE
    # a different order only shares the system prompt (exact mode)
    assert outs[2].num_cached_tokens == _shared_pages(abc, cba) == 32


@pytest.mark.parametrize("length", [PAGE - 1, PAGE, PAGE + 1])
def test_chunk_lengths_around_page_size(engines, reference, length):
    rng = random.Random(100 + length)
    chunk = _tokens(rng, length)
    prompts = [chunk + _tokens(rng, 5), chunk + _tokens(rng, 5), chunk]
    outs = _check_same(engines, reference, prompts)
    assert outs[1].num_cached_tokens == length // PAGE * PAGE
    # a prompt that is exactly cached pages still recomputes its last token
    assert outs[2].num_cached_tokens == (length - 1) // PAGE * PAGE


def test_chunk_repeated_twice(engines, reference):
    rng = random.Random(12)
    doc = _tokens(rng, 40)
    prompts = [doc + doc + _tokens(rng, 3), doc + doc + _tokens(rng, 4)]
    outs = _check_same(engines, reference, prompts)
    assert outs[1].num_cached_tokens == 80


def test_multi_turn_reuses_generated_tokens(engines, reference):
    """Each turn's prompt is the previous prompt + its reply + a new user turn."""
    rng = random.Random(13)
    on, off = engines
    prompt = _tokens(rng, 30)
    previous_len = 0
    for turn in range(4):
        a = on.generate([prompt], GREEDY)[0]
        b = off.generate([prompt], GREEDY)[0]
        assert a.token_ids == b.token_ids
        assert list(a.token_ids) == reference(prompt)
        if turn > 0:
            # everything before this turn's new user text, in whole pages, was cached
            assert a.num_cached_tokens == previous_len // PAGE * PAGE
        previous_len = len(prompt) + len(a.token_ids) - 1  # last reply token has no KV
        prompt = prompt + list(a.token_ids) + _tokens(rng, 9)


def test_chat_turns_reuse(engines, tiny_qwen3):
    on, off = engines
    messages = [{"role": "system", "content": "You are a careful assistant for cooks."}]
    for question in ["How long do I boil an egg?", "And rice?", "What about pasta?", "Thanks!"]:
        messages.append({"role": "user", "content": question})
        a = on.chat(messages, GREEDY)[0]
        b = off.chat(messages, GREEDY)[0]
        assert a.token_ids == b.token_ids and a.text == b.text
        messages.append({"role": "assistant", "content": a.text})
    assert a.num_cached_tokens >= PAGE


def test_32_concurrent_requests_share_system_prompt(engines, reference):
    rng = random.Random(14)
    on, off = engines
    system = _tokens(rng, 64)
    warm = on.generate([system + _tokens(rng, 5)], GREEDY)[0]
    assert warm.token_ids
    prompts = [system + _tokens(rng, rng.randint(1, 40)) for _ in range(32)]
    outs_on = on.generate(prompts, GREEDY)
    outs_off = off.generate(prompts, GREEDY)
    for prompt, a in zip(prompts[:4], outs_on, strict=False):
        assert list(a.token_ids) == reference(prompt)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    assert all(o.num_cached_tokens == 64 for o in outs_on)


def test_small_pool_forces_eviction_and_preemption(tiny_qwen3, engines, reference):
    rng = random.Random(15)
    _, off = engines
    small = LLM(tiny_qwen3, page_size=PAGE, num_pages=24, max_num_batched_tokens=64)
    system = _tokens(rng, 40)
    prompts = [system + _tokens(rng, rng.randint(20, 120)) for _ in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs_small = small.generate(prompts, params)
    outs_off = off.generate(prompts, params)
    assert [o.token_ids for o in outs_small] == [o.token_ids for o in outs_off]
    assert small.engine.scheduler.num_preemptions > 0
    events = small.engine.pool.drain_events()
    assert any(e.kind.value == "removed" for e in events), "the pool never evicted"
    assert small.engine.pool.num_available == small.engine.pool.num_pages
