"""Randomized workload with aborts: afterwards every page is free or cached and
unreferenced."""

from __future__ import annotations

import random

from workers import LLM, SamplingParams


def test_random_workload_with_aborts_leaks_nothing(tiny_qwen3):
    rng = random.Random(7)
    llm = LLM(tiny_qwen3, page_size=8, num_pages=40, max_num_batched_tokens=48, max_num_seqs=6)
    engine = llm.engine
    shared = [rng.choices(range(10, 500), k=n) for n in (8, 20, 33)]
    live: list[str] = []
    finished = 0
    for i in range(60):
        if rng.random() < 0.6:
            prompt = rng.choice(shared) + rng.choices(range(10, 500), k=rng.randint(1, 40))
            params = SamplingParams(
                max_tokens=rng.randint(1, 30),
                temperature=rng.choice([0.0, 0.8]),
                seed=rng.randint(0, 99),
                ignore_eos=True,
            )
            engine.add_request(f"r{i}", prompt, params)
            live.append(f"r{i}")
        if live and rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                finished += 1
                live.remove(out.request_id)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished += 1
    assert finished > 10
    pool = engine.pool
    assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages))
    assert pool.num_available == pool.num_pages
    assert len(pool.cached_keys()) > 0  # shared prefixes stayed cached
