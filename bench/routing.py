"""Chunk-aware routing against round-robin and an oracle, on a Zipf workload over
shared chunks.

Workers are in-process engines (``workers.engine.engine.Engine`` on the tiny random-weight
model, CPU), not Ray actors: this compares where requests go, not transport. Each
engine's KV pool holds only a few of the chunk sets, so where a request lands decides
whether its prefix is cached. Policies:

- chunk-aware: the router's path. The project's ``choose_worker`` (weights: the config
  defaults) scores workers by expected wait: each engine's queued prefill
  (``Engine.load_shape``) plus the request's tokens it does not hold, by the holdings
  an ``EmbeddedChunkDirectory`` reports; the
  directory is fed by each engine's KV events the way the cluster feeds it (pool ->
  ``CacheMirror`` -> ``EventPublisher``), one publish per engine step.
- round-robin: worker i, i+1, ... regardless of cache or load.
- oracle: the same ``choose_worker``, but each worker's cached tokens are read from its
  KV pool at routing time (page-exact and never stale).

Requests come from a closed loop of ``--concurrency`` clients, in workload order, and
are routed in the loop; the workers then advance in lockstep rounds of one engine step
each. A round lasts as long as its slowest step, as if each worker had its own device,
so load imbalance costs time. A step's time is either its thread CPU time (torch on one
thread; ``--step-cost cpu``, where prefill dominates as on a CPU worker) or a cost
model of a GPU (``--step-cost h200``: a decode step's fixed cost plus a cost per
sequence and per prompt token, fitted to Qwen3-0.6B on an H200, ``H200_QWEN3_06B``;
the routers then see each worker's modeled prefill rate and step time, as real
workers report theirs). Throughput is requests (and prompt tokens) over the summed
rounds; time to first token is the simulated time from a request's routing to the end
of the round that gave its first token.

Run from the repository root: ``python -m bench.routing [--requests 400]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import print_table
from chunkstore.chunking import Chunk
from chunkstore.embedded_directory import EmbeddedChunkDirectory
from chunkstore.hashing import Namespace, pack_tokens
from chunkstore.publisher import EventPublisher
from cluster.config import RouterSection
from cluster.routing.policy import Decision, Reason, RoutingWeights, WorkerView, choose_worker
from cluster.routing.prompts import PreparedPrompt, prepare_chunks
from modeltools.make_model import make_model
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, StepOutput
from workers.engine.sampling_params import SamplingParams
from workers.runtime.cache_mirror import CacheMirror
from workers.runtime.engine_loop import MeasuredSpeed

DEFAULT_MODEL_DIR = Path("/tmp/chunkserve-bench/tiny-qwen3")
PAGE_SIZE = 16
DEFAULTS = RouterSection()  # the router's weights as every shipped config leaves them
WEIGHTS = RoutingWeights(
    max_requests_per_worker=DEFAULTS.max_requests_per_worker,
    default_prefill_tokens_per_s=DEFAULTS.default_prefill_tokens_per_s,
)


@dataclass(frozen=True)
class StepCost:
    """Seconds an engine step takes on a modeled device: ``base_s`` + ``per_seq_s`` per
    sequence in the step + ``per_prompt_token_s`` per prompt token it computes +
    ``per_kv_token_s`` per token of KV its sequences hold (what decode attention reads)."""

    base_s: float
    per_seq_s: float
    per_prompt_token_s: float
    per_kv_token_s: float = 0.0

    def __call__(self, seqs: int, prompt_tokens: int, kv_tokens: int = 0) -> float:
        if not seqs:
            return 0.0
        return (
            self.base_s
            + self.per_seq_s * seqs
            + self.per_prompt_token_s * prompt_tokens
            + self.per_kv_token_s * kv_tokens
        )


# Qwen3-0.6B shapes on one H200 (bench/latency.py and bench/throughput.py at 64bdb0f):
# decode steps of 1.84 / 3.02 / 6.22 ms at batch 1 / 64 / 256 (context 512), prefill 205K
# tokens/s.
H200_QWEN3_06B = StepCost(base_s=1.82e-3, per_seq_s=1.72e-5, per_prompt_token_s=4.9e-6)
# The same, with the per-sequence cost split into KV reads that grow with the context
# (114.7 KB of KV a token at 4.8 TB/s: 23.9 ns; 12.2 us of the 17.2 at context 512) and
# the rest (5.0 us): the cluster workload's sequences hold ~2,600 tokens, not 512.
H200_QWEN3_06B_CONTEXT = StepCost(
    base_s=1.82e-3, per_seq_s=5.0e-6, per_prompt_token_s=4.9e-6, per_kv_token_s=2.39e-8
)
STEP_COSTS = {"h200": H200_QWEN3_06B, "h200-context": H200_QWEN3_06B_CONTEXT}


@dataclass(frozen=True)
class Request:
    prompt: PreparedPrompt  # tokens, chunk keys and token ends, as the router computes them


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if not (args.model_dir / "config.json").exists():
        make_model(args.model_dir, preset="tiny", overwrite=True)
    probe = Engine(engine_config(args))
    warm_up(probe)
    requests = make_workload(args, probe.namespace(), probe.model_config.vocab_size)
    runs = [
        simulate(name, policy, requests, args)
        for _ in range(args.repeats)  # interleaved, so load on the host hits all alike
        for name, policy in POLICIES.items()
    ]
    report(args, requests, [median_run([r for r in runs if r.policy == name]) for name in POLICIES])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="made (tiny) if missing"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--sets", type=int, default=30, help="shared chunk sets")
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent s")
    parser.add_argument("--system-prompts", type=int, default=3, help="set k uses k mod this")
    parser.add_argument("--system-tokens", type=int, default=40)
    parser.add_argument(
        "--doc-tokens", type=int, nargs=2, default=[320, 640], metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--query-tokens", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX")
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="generated per request")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--num-pages", type=int, default=160, help="KV pages per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per policy (median time)")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas, taking requests in turn; with more than one, each sees a "
        "worker's load as of its last poll plus what it sent since (as cluster routers do)",
    )
    parser.add_argument(
        "--poll-s",
        type=float,
        default=DEFAULTS.poll_interval_s,
        help="with --replicas > 1: simulated seconds between a replica's load polls",
    )
    parser.add_argument(
        "--rates",
        choices=["modeled", "measured"],
        default="modeled",
        help="with a cost model: the prefill rate and step time routers see are the "
        "model's own, or what each worker's engine loop would measure (its EWMAs)",
    )
    parser.add_argument(
        "--step-cost",
        choices=["cpu", *STEP_COSTS],
        default="cpu",
        help="a step's time: its thread CPU time, or a GPU's modeled cost (deterministic: "
        "one run per policy is enough)",
    )
    return parser.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_dir=str(args.model_dir), device="cpu", num_pages=args.num_pages, page_size=PAGE_SIZE
    )


def warm_up(engine: Engine) -> None:
    """One request through, so no policy pays torch's first-call costs."""
    engine.add_request("warm-up", list(range(1, 200)), SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()


def make_workload(args: argparse.Namespace, namespace: Namespace, vocab: int) -> list[Request]:
    """Request = system prompt + document of a Zipf-chosen set + a query of its own."""
    rng = random.Random(args.seed)

    def tokens(count: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(count))

    systems = [tokens(args.system_tokens) for _ in range(args.system_prompts)]
    documents = [tokens(rng.randint(*args.doc_tokens)) for _ in range(args.sets)]
    popularity = [1 / (rank + 1) ** args.zipf for rank in range(args.sets)]
    requests = []
    for k in rng.choices(range(args.sets), popularity, k=args.requests):
        chunks = [
            Chunk("system", systems[k % args.system_prompts]),
            Chunk("context", documents[k]),
            Chunk("query", tokens(rng.randint(*args.query_tokens))),
        ]
        requests.append(Request(prepare_chunks(chunks, namespace, PAGE_SIZE)))
    return requests


class Worker:
    """An engine whose KV events reach the directory as a worker actor's do, plus the
    load a router tracks for it. Invariant: ``requests``/``tokens`` count exactly the
    requests added and not yet finished."""

    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        directory: EmbeddedChunkDirectory,
        cost: StepCost | None = None,
        measured_rates: bool = False,
    ):
        self.worker_id = worker_id
        self.engine = Engine(config)
        self.cost = cost  # None: steps take their thread CPU time
        # with a cost model: report the prefill rate and step time as a worker's engine
        # loop measures them (its EWMAs over modeled steps), not the model's own rate
        self.measured_rates = measured_rates
        self.measured = MeasuredSpeed()
        self._mirror = CacheMirror()
        self._publisher = EventPublisher(
            directory, worker_id, 1, self._mirror.drain, self._mirror.snapshot
        )
        self.requests = 0
        self.tokens = 0
        self.served = 0
        self.last_step_s = 0.0

    def view(self) -> WorkerView:
        """What the router sees: its own counts and the worker's queued prefill. With
        CPU time, no measured rates (the workers are alike, and decisions stay
        deterministic: the router assumes one rate for all); with a cost model, the
        modeled prefill rate and the last step's modeled time, as a worker reports."""
        backlog = self.engine.load_shape().prefill_backlog_tokens
        if self.cost is None:
            return WorkerView(self.worker_id, self.requests, self.tokens, backlog)
        if self.measured_rates:
            rate, step_s = self.measured.prefill_tokens_per_s, self.measured.step_s
        else:
            rate, step_s = 1 / self.cost.per_prompt_token_s, self.last_step_s
        return WorkerView(self.worker_id, self.requests, self.tokens, backlog, rate, step_s)

    def add(
        self, request_id: str, request: Request, params: SamplingParams, decision: Decision
    ) -> None:
        """As the router sends it: with its cache estimate, and marked held elsewhere
        where the decision is a spill."""
        self.engine.add_request(
            request_id,
            list(request.prompt.token_ids),
            params,
            expected_cached_tokens=decision.expected_cached_tokens,
            held_elsewhere=decision.reason is Reason.SPILL,
        )
        self.requests += 1
        self.tokens += len(request.prompt.token_ids) + params.max_tokens

    def step(self) -> tuple[list[StepOutput], float]:
        """One engine step (and its seconds: thread CPU time, or the cost model's),
        then publish its KV events."""
        engine = self.engine
        stepped = engine.has_unfinished()
        kv_tokens = sum(len(seq.token_ids) for seq in engine.scheduler.running)
        start = time.thread_time()
        outputs = engine.step() if stepped else []
        elapsed = time.thread_time() - start
        if self.cost is not None:
            elapsed = 0.0
            if stepped:
                elapsed = self.cost(
                    engine.last_step_seqs, engine.last_step_prompt_tokens, kv_tokens
                )
            if elapsed:
                self.last_step_s = elapsed
                self.measured.fold(elapsed, engine.last_step_prompt_tokens)
        self._mirror.absorb(self.engine.pool.drain_events())
        self._publisher.flush()
        return outputs, elapsed

    def finish(self, output: StepOutput, params: SamplingParams) -> None:
        self.requests -= 1
        self.tokens -= output.num_prompt_tokens + params.max_tokens
        self.served += 1

    def cached_tokens(self, request: Request) -> int:
        """Prompt tokens the engine would take from its pool now (the oracle's view);
        like the scheduler, it leaves the last prompt token to compute."""
        ids = request.prompt.token_ids
        usable = (len(ids) - 1) // PAGE_SIZE
        root = self.engine.namespace().root_key
        return len(self.engine.pool.match_chain(root, pack_tokens(ids), usable)) * PAGE_SIZE


Policy = Callable[[Request, Sequence[WorkerView]], Decision]
PolicyFactory = Callable[[list[Worker], EmbeddedChunkDirectory], Policy]


def round_robin(workers: list[Worker], directory: EmbeddedChunkDirectory) -> Policy:
    turn = itertools.count()

    def route(request: Request, views: Sequence[WorkerView]) -> Decision:
        return Decision(views[next(turn) % len(views)].worker_id, Reason.LOAD, 0)

    return route


def chunk_aware(workers: list[Worker], directory: EmbeddedChunkDirectory) -> Policy:
    rotation = itertools.count()

    def route(request: Request, views: Sequence[WorkerView]) -> Decision:
        prompt = request.prompt  # one lookup of the chunk keys, as Router._lookup does
        result = directory.lookup(prompt.lookup_keys, prompt.token_ends)
        holdings = {h.worker_id: h.tokens for h in result.holdings} if result.available else None
        return decide(request, views, holdings, next(rotation))

    return route


def oracle(workers: list[Worker], directory: EmbeddedChunkDirectory) -> Policy:
    rotation = itertools.count()

    def route(request: Request, views: Sequence[WorkerView]) -> Decision:
        holdings = {w.worker_id: n for w in workers if (n := w.cached_tokens(request))}
        return decide(request, views, holdings, next(rotation))

    return route


def decide(
    request: Request,
    views: Sequence[WorkerView],
    holdings: dict[str, int] | None,
    rotation: int,
) -> Decision:
    prompt_tokens = len(request.prompt.token_ids)
    decision = choose_worker(views, holdings, WEIGHTS, prompt_tokens, rotation)
    if not isinstance(decision, Decision):
        raise ValueError(f"unroutable ({decision}): raise max_requests_per_worker")
    return decision


POLICIES: dict[str, PolicyFactory] = {
    "chunk-aware": chunk_aware,
    "round-robin": round_robin,
    "oracle": oracle,
}


@dataclass(frozen=True)
class Result:
    policy: str
    prompt_tokens: int
    cached_tokens: int
    time_s: float  # summed rounds: the slowest engine step of each
    route_s: float  # wall time spent deciding
    served: tuple[int, ...]  # requests per worker
    affinity: int  # decisions for a worker's cache
    ttfts: tuple[float, ...]  # simulated seconds from routing to the first token, sorted

    def ttft_ms(self, quantile: float) -> float:
        return 1000 * self.ttfts[min(len(self.ttfts) - 1, int(quantile * len(self.ttfts)))]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def simulate(
    name: str, factory: PolicyFactory, requests: list[Request], args: argparse.Namespace
) -> Result:
    """Serve every request with fresh workers (cold caches) under one policy."""
    directory = EmbeddedChunkDirectory()
    config = engine_config(args)
    cost = STEP_COSTS.get(args.step_cost)
    workers = [
        Worker(f"worker-{i}", config, directory, cost, args.rates == "measured")
        for i in range(args.workers)
    ]
    by_id = {w.worker_id: w for w in workers}
    route = factory(workers, directory)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    waiting = deque(enumerate(requests))
    in_flight: dict[str, Worker] = {}
    prompt_tokens = cached_tokens = affinity = 0
    time_s = route_s = 0.0
    routed_at: dict[str, float] = {}  # simulated time; dropped at the first token
    ttfts = []
    replicas = [ReplicaViews(i, args.replicas, args.poll_s) for i in range(args.replicas)]
    while waiting or in_flight:
        while waiting and len(in_flight) < args.concurrency:
            index, request = waiting.popleft()
            replica = replicas[index % len(replicas)]
            views = (
                [w.view() for w in workers]
                if len(replicas) == 1
                else replica.views(workers, time_s)
            )
            start = time.perf_counter()
            decision = route(request, views)
            route_s += time.perf_counter() - start
            prompt_len = len(request.prompt.token_ids)
            if len(replicas) > 1:
                uncached = prompt_len - decision.expected_cached_tokens
                replica.sent(decision.worker_id, prompt_len + params.max_tokens, uncached)
            # for a cache: one the directory lists, or one this router just filled
            affinity += decision.reason in (Reason.AFFINITY, Reason.RECENT)
            worker = by_id[decision.worker_id]
            worker.add(f"req-{index}", request, params, decision)
            in_flight[f"req-{index}"] = worker
            routed_at[f"req-{index}"] = time_s
        round_s = 0.0
        finished_round = []
        for worker in workers:
            outputs, elapsed = worker.step()
            round_s = max(round_s, elapsed)
            finished_round += outputs
        time_s += round_s
        for output in finished_round:  # every output of the round comes at its end
            if output.request_id in routed_at:
                ttfts.append(time_s - routed_at.pop(output.request_id))
            if output.finished:
                in_flight.pop(output.request_id).finish(output, params)
                prompt_tokens += output.num_prompt_tokens
                cached_tokens += output.num_cached_tokens
    served = tuple(w.served for w in workers)
    return Result(
        name, prompt_tokens, cached_tokens, time_s, route_s, served, affinity, tuple(sorted(ttfts))
    )


class ReplicaViews:
    """Worker loads as one router replica sees them: each worker's view as of the
    replica's last poll, plus the requests this replica sent there since (their tokens,
    and their uncached prompt tokens as prefill not yet reported); what other replicas
    sent since, and what finished, is unseen until the next poll. Replica ``index`` of
    ``count`` polls every ``poll_s``, offset by ``index / count`` of the interval."""

    def __init__(self, index: int, count: int, poll_s: float) -> None:
        self._offset = poll_s * index / count
        self._poll_s = poll_s
        self._polled_at = -1
        self._snapshot: dict[str, WorkerView] = {}
        self._sent: dict[str, list[int]] = {}  # requests, tokens, prefill since the poll

    def views(self, workers: list[Worker], now: float) -> list[WorkerView]:
        poll = int((now + self._offset) // self._poll_s)
        if poll != self._polled_at:
            self._polled_at = poll
            self._snapshot = {w.worker_id: w.view() for w in workers}
            self._sent = {w.worker_id: [0, 0, 0] for w in workers}
        out = []
        for w in workers:
            seen, (requests, tokens, prefill) = self._snapshot[w.worker_id], self._sent[w.worker_id]
            out.append(
                dataclasses.replace(
                    seen,
                    requests=seen.requests + requests,
                    tokens=seen.tokens + tokens,
                    prefill_backlog=seen.prefill_backlog + prefill,
                )
            )
        return out

    def sent(self, worker_id: str, tokens: int, uncached: int) -> None:
        counts = self._sent[worker_id]
        counts[0] += 1
        counts[1] += tokens
        counts[2] += uncached


def median_run(runs: list[Result]) -> Result:
    """The run of median time. Routing is deterministic: every run served alike."""
    if len({(r.cached_tokens, r.served) for r in runs}) != 1:
        raise ValueError(
            f"{runs[0].policy}: runs differ in routing; the bench must be deterministic"
        )
    return sorted(runs, key=lambda r: r.time_s)[len(runs) // 2]


def report(args: argparse.Namespace, requests: list[Request], results: list[Result]) -> None:
    by_name = {r.policy: r for r in results}
    rr, best = by_name["round-robin"], by_name["oracle"]
    rows = []
    for r in results:
        rps = len(requests) / r.time_s
        rows.append(
            [
                r.policy,
                f"{r.hit_rate:.1%}",
                f"{r.prompt_tokens - r.cached_tokens:,}",
                f"{r.time_s:.2f}",
                f"{rps:.0f}",
                f"{r.prompt_tokens / r.time_s:,.0f}",
                f"{r.hit_rate / rr.hit_rate:.2f}",
                f"{rr.time_s / r.time_s:.2f}",
                f"{r.hit_rate / best.hit_rate:.2f}",
                f"{best.time_s / r.time_s:.2f}",
                f"{r.ttft_ms(0.5):.1f}",
                f"{r.ttft_ms(0.9):.1f}",
                f"{max(r.served) / (len(requests) / args.workers):.2f}",
                f"{r.affinity / len(requests):.0%}",
                f"{r.route_s / len(requests) * 1e6:.0f}",
            ]
        )
    headers = [
        "policy", "hit rate", "prefill tokens", "time s", "req/s", "prompt tok/s",
        "hit ×RR", "req/s ×RR", "hit ×oracle", "req/s ×oracle", "TTFT p50 ms", "p90",
        "max load", "affinity", "route µs",
    ]  # fmt: skip
    print_table(
        f"Routing: {len(requests)} requests, {args.sets} chunk sets (Zipf s={args.zipf}), "
        f"{args.workers} workers",
        headers,
        rows,
    )
    prompt = sum(len(r.prompt.token_ids) for r in requests)
    timing = (
        "thread CPU time"
        if args.step_cost == "cpu"
        else f"the {args.step_cost} cost model ({STEP_COSTS[args.step_cost]})"
    )
    print(
        f"\n- Workers: {args.workers} in-process engines (workers.engine.engine.Engine), not Ray; "
        f"tiny random-weight model, CPU float32, torch 1 thread; {args.num_pages} KV pages "
        f"of {PAGE_SIZE} tokens each.\n"
        f"- Workload: {prompt:,} prompt tokens; system prompt ({args.system_tokens} tokens, "
        f"{args.system_prompts} kinds) + document ({args.doc_tokens[0]}-{args.doc_tokens[1]} "
        f"tokens) + unique query ({args.query_tokens[0]}-{args.query_tokens[1]}); "
        f"{args.max_tokens} generated tokens each; {args.concurrency} in flight; seed {args.seed}; "
        f"{args.replicas} router replica(s)"
        f"{f', polling loads every {args.poll_s} s' if args.replicas > 1 else ''}.\n"
        "- hit rate: cached prompt tokens / prompt tokens. prefill tokens: prompt tokens "
        f"computed. time: sum over lockstep rounds of the slowest engine step ({timing}), "
        f"median of {args.repeats} runs; TTFT in the same simulated time. max load: busiest worker's requests / the mean. affinity: decisions made "
        "for a worker's cache. route µs: per request (directory lookup + policy).\n"
        f"- Host: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}."
    )


if __name__ == "__main__":
    main()
