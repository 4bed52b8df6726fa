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


def test_the_gpu_cost_model_times_steps_deterministically(tiny_qwen3):
    """With ``--step-cost h200`` a step's time comes from the cost model, not the host:
    two runs take the same simulated time, and every request has a time to first token
    of at least one modeled step."""
    args = routing.parse_args(
        ["--model-dir", str(tiny_qwen3), "--workers", "2", "--requests", "24", "--sets", "4",
         "--doc-tokens", "96", "160", "--num-pages", "40", "--concurrency", "4",
         "--max-tokens", "3", "--step-cost", "h200"]
    )  # fmt: skip
    engine = routing.Engine(routing.engine_config(args))
    requests = routing.make_workload(args, engine.namespace(), engine.model_config.vocab_size)
    runs = [routing.simulate("rr", routing.round_robin, requests, args) for _ in range(2)]
    assert runs[0].time_s == runs[1].time_s > 0
    assert len(runs[0].ttfts) == len(requests)
    assert min(runs[0].ttfts) >= routing.H200_QWEN3_06B.base_s
    # the cost model: a step of 3 sequences computing 100 prompt tokens
    cost = routing.H200_QWEN3_06B
    assert cost(3, 100) == cost.base_s + 3 * cost.per_seq_s + 100 * cost.per_prompt_token_s
    assert cost(0, 0) == 0


def test_measured_rates_are_the_engine_loops_averages_of_modeled_steps(tiny_qwen3):
    """``--rates measured``: what a router sees of a worker is what its engine loop would
    measure (``MeasuredSpeed`` folded with each modeled step), not the model's rate; and
    the context cost model charges the KV its sequences hold."""
    from workers.runtime.engine_loop import MeasuredSpeed

    args = routing.parse_args(
        ["--model-dir", str(tiny_qwen3), "--workers", "1", "--requests", "6", "--sets", "2",
         "--doc-tokens", "96", "160", "--num-pages", "40", "--concurrency", "3",
         "--max-tokens", "3", "--step-cost", "h200-context", "--rates", "measured"]
    )  # fmt: skip
    worker = routing.Worker(
        "w", routing.engine_config(args), routing.EmbeddedChunkDirectory(),
        routing.H200_QWEN3_06B_CONTEXT, measured_rates=True,
    )  # fmt: skip
    engine = worker.engine
    requests = routing.make_workload(args, engine.namespace(), engine.model_config.vocab_size)
    params = routing.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i, request in enumerate(requests[:3]):
        worker.add(f"r{i}", request, params, routing.Decision("w", routing.Reason.LOAD, 0))
    expected, held = MeasuredSpeed(), []
    cost = routing.H200_QWEN3_06B_CONTEXT
    while engine.has_unfinished():
        held.append(sum(len(seq.token_ids) for seq in engine.scheduler.running))
        _, elapsed = worker.step()
        assert elapsed == cost(engine.last_step_seqs, engine.last_step_prompt_tokens, held[-1])
        expected.fold(elapsed, engine.last_step_prompt_tokens)
        view = worker.view()
        assert (view.prefill_tokens_per_s, view.step_s) == (
            expected.prefill_tokens_per_s,
            expected.step_s,
        )
    assert max(held) > 0  # decode steps: their sequences' KV is charged
    assert 0 < view.prefill_tokens_per_s < 1 / cost.per_prompt_token_s  # decode's share


def test_a_replica_sees_loads_as_of_its_last_poll_plus_what_it_sent():
    class Stub:  # a worker whose reported load the test sets
        def __init__(self, worker_id):
            self.worker_id, self.load = worker_id, 0

        def view(self):
            return routing.WorkerView(self.worker_id, self.load, 10 * self.load, 100 * self.load)

    workers = [Stub("a"), Stub("b")]
    replica = routing.ReplicaViews(index=1, count=2, poll_s=1.0)  # polls at 0.5, 1.5, ...
    assert [v.requests for v in replica.views(workers, 0.0)] == [0, 0]
    replica.sent("a", tokens=7, uncached=5)
    workers[1].load = 3  # another replica's requests: unseen until the next poll
    (a, b) = replica.views(workers, 0.4)
    assert (a.requests, a.tokens, a.prefill_backlog, b.requests) == (1, 7, 5, 0)
    (a, b) = replica.views(workers, 0.6)  # polled: the workers' own reports
    assert (a.requests, a.prefill_backlog, b.requests, b.prefill_backlog) == (0, 0, 3, 300)
