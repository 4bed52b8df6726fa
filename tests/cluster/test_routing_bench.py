"""``bench/routing.py`` on a small workload: every request is served, routing is
deterministic, and chunk-aware routing reuses more of the cache than round-robin.
Hit rates only: speed is measured by the bench, never asserted."""

from __future__ import annotations

from bench import routing


def test_chunk_aware_routing_reuses_more_than_round_robin(tiny_qwen3):
    args = routing.parse_args(
        ["--model-dir", str(tiny_qwen3), "--workers", "2", "--requests", "40", "--sets", "6",
         "--doc-tokens", "96", "160", "--num-pages", "40", "--concurrency", "4",
         "--max-tokens", "2"]
    )  # fmt: skip
    engine = routing.Engine(routing.engine_config(args))
    requests = routing.make_workload(args, engine.namespace(), engine.model_config.vocab_size)
    prompt_tokens = sum(len(r.prompt.token_ids) for r in requests)
    results = {
        name: routing.simulate(name, policy, requests, args)
        for name, policy in routing.POLICIES.items()
    }
    for result in results.values():
        assert sum(result.served) == len(requests)
        assert result.prompt_tokens == prompt_tokens
    assert results["chunk-aware"].hit_rate > results["round-robin"].hit_rate
    first = results["chunk-aware"]
    again = routing.simulate("chunk-aware", routing.chunk_aware, requests, args)
    assert (again.cached_tokens, again.served) == (first.cached_tokens, first.served)
