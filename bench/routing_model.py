"""A discrete-event model of ``bench/cluster_rag.py``'s workload, to see what a routing
policy does to hit rates, requests/s and TTFT without a GPU: the real ``choose_worker``
and ``RouteMemory``, modeled workers and time.

- Requests: one of 3 system prompts (uniform) + one of ``--docs`` documents (Zipf
  ``--zipf``) + a question of its own, ``--max-tokens`` output tokens; a closed loop of
  ``--concurrency`` clients a worker, split over one router replica a worker.
- Workers: continuous batching, one step at a time: every running request decodes a
  token, and waiting prompts are prefilled in arrival order within
  ``MAX_BATCHED_TOKENS``. A step takes ``StepCost`` (fitted to Qwen3-0.6B on one H200,
  ``bench.routing.H200_QWEN3_06B_CONTEXT``), plus ``--hit-step-ms`` where a step
  prefills beside decodes (the hit steps measured on the H200 cost that much more).
- Caches: each worker's pool holds ``--cache-pairs`` (system prompt, document) pairs,
  least recently used first out; a pair is cached once its prompt is prefilled. System
  prompts are always held. With ``--cold-spills`` a spilled request's pair is put
  first in line for eviction (``KVPool.release(cold_from=...)``).
- Directory: each worker's pairs as of its last publish (every ``--publish-s``).
- Routers: replica r sees each worker's load as it was ``--view-lag-ms`` ago, plus the
  requests it sent itself since (``WorkerPool.begin``), and remembers its own decisions
  (``RouteMemory``, lease ``--lease-s``). ``--router-ms``: the replica's own time per
  request before routing (preparing the prompt, the lookup), added to TTFT.

Prints, per worker count: each policy's requests/s, token hit rate (as cluster_rag
counts it), TTFT p50 / p90 and routing reasons, and chunk-aware over round-robin.

    python -m bench.routing_model --workers 2,4 [--view-lag-ms 10] [--cold-spills]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.common import Shape, document_sequence, print_table
from bench.routing import H200_QWEN3_06B_CONTEXT
from cluster.routing import policy as routing_policy
from cluster.routing.policy import (
    RouteMemory,
    RoutingWeights,
    WorkerView,
    choose_worker,
)

MAX_BATCHED_TOKENS = 8192
COST = H200_QWEN3_06B_CONTEXT
POLICIES = ("chunk_aware", "round_robin")


@dataclass
class Request:
    sent_s: float
    pair: tuple[int, int]  # (system prompt, document)
    replica: int
    hit: bool = False
    cold: bool = False  # a spill: its pair goes in first in line for eviction
    to_prefill: int = 0
    generated: int = 0
    ttft_s: float = 0.0


@dataclass
class Worker:
    worker_id: str
    cache_pairs: int
    pairs: OrderedDict = field(default_factory=OrderedDict)  # least recently used first
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    published: frozenset = frozenset()
    stepping: bool = False
    history: list[tuple[float, tuple[int, int, int]]] = field(default_factory=list)

    def load(self, prompt_tokens: int, max_tokens: int) -> tuple[int, int, int]:
        """(requests, tokens, queued prefill tokens) now."""
        requests = len(self.waiting) + len(self.running)
        backlog = sum(r.to_prefill for r in self.waiting)
        return requests, requests * (prompt_tokens + max_tokens), backlog

    def load_at(self, when_s: float) -> tuple[int, int, int]:
        """The load as it was at ``when_s`` (recorded at every change)."""
        while len(self.history) > 1 and self.history[1][0] <= when_s:
            self.history.pop(0)
        return self.history[0][1] if self.history else (0, 0, 0)


@dataclass
class Outcome:
    requests_per_s: float
    hit_rate: float  # cached prompt tokens over prompt tokens
    ttft_ms: tuple[float, float]  # p50, p90
    reasons: Counter


def simulate(policy: str, workers_n: int, shape: Shape, args: argparse.Namespace) -> Outcome:
    router_times = [float(ms) / 1000 for ms in args.router_ms.split(",")]
    router_s = router_times[POLICIES.index(policy) % len(router_times)]
    workers = [Worker(f"w{i}", args.cache_pairs) for i in range(workers_n)]
    by_id = {w.worker_id: w for w in workers}
    weights = RoutingWeights(
        max_requests_per_worker=1 << 20, default_prefill_tokens_per_s=1 / COST.per_prompt_token_s
    )
    memories = [RouteMemory(args.lease_s) for _ in range(workers_n)]
    own_sends: list[list[tuple[float, str, int]]] = [[] for _ in range(workers_n)]
    total = args.requests_per_worker * workers_n
    pairs = document_sequence(shape, total, args.seed)  # cluster_rag's requests
    events: list = []
    order = itertools.count()
    sent = itertools.count()
    done: list[Request] = []
    reasons: Counter = Counter()
    rotation = itertools.count()
    ends = (shape.system_tokens, shape.system_tokens + shape.doc_tokens)
    prompt_tokens = ends[1] + shape.question_tokens

    def at(when_s: float, action, *data) -> None:
        heapq.heappush(events, (when_s, next(order), action, data))

    def record(worker: Worker, now: float) -> None:
        worker.history.append((now, worker.load(prompt_tokens, shape.max_tokens)))

    def view(worker: Worker, replica: int, now: float) -> WorkerView:
        requests, tokens, backlog = (
            worker.load(prompt_tokens, shape.max_tokens)
            if args.view_lag_ms <= 0
            else worker.load_at(now - args.view_lag_ms / 1000)
        )
        if args.view_lag_ms > 0:  # what this replica sent since, as its pool counts it
            for sent_s, worker_id, uncached in own_sends[replica]:
                if worker_id == worker.worker_id and sent_s > now - args.view_lag_ms / 1000:
                    requests += 1
                    tokens += prompt_tokens + shape.max_tokens
                    backlog += uncached
        rate = 1 / COST.per_prompt_token_s
        return WorkerView(
            worker.worker_id, requests, tokens, backlog, rate, args.step_view_ms / 1000
        )

    def route(now: float, replica: int) -> None:
        index = next(sent)
        if index >= total:
            return
        system, doc = pairs[index]
        keys = [("system", system), (system, doc)]
        if policy == "round_robin":
            worker, reason = workers[index % workers_n], "rotation"
        else:
            holdings = {}
            for w in workers:
                held = (system, doc) in w.published
                holdings[w.worker_id] = ends[1] if held else ends[0]
            recent = memories[replica].recall(keys, ends, now)
            views = [view(w, replica, now) for w in workers]
            decision = choose_worker(
                views, holdings, weights, prompt_tokens, next(rotation), recent
            )
            memories[replica].remember(keys, decision.worker_id, now)
            worker, reason = by_id[decision.worker_id], decision.reason.value
        reasons[reason] += 1
        request = Request(now, (system, doc), replica, cold=args.cold_spills and reason == "spill")
        request.hit = request.pair in worker.pairs
        if request.hit:
            worker.pairs.move_to_end(request.pair)
        request.to_prefill = shape.question_tokens + (0 if request.hit else shape.doc_tokens)
        own_sends[replica].append((now, worker.worker_id, request.to_prefill))
        while own_sends[replica] and own_sends[replica][0][0] < now - 1.0:
            own_sends[replica].pop(0)
        worker.waiting.append(request)
        record(worker, now)
        if not worker.stepping:
            step(now, worker)

    def step(now: float, worker: Worker) -> None:
        if not worker.waiting and not worker.running:
            worker.stepping = False
            return
        worker.stepping = True
        budget, prefilled, finished_prefill = MAX_BATCHED_TOKENS, 0, []
        for request in list(worker.waiting):
            if budget <= 0:
                break
            take = min(request.to_prefill, budget)
            request.to_prefill -= take
            budget -= take
            prefilled += take
            if not request.to_prefill:
                worker.waiting.remove(request)
                finished_prefill.append(request)
        seqs = len(worker.running) + len(finished_prefill)
        kv = sum(prompt_tokens + r.generated for r in worker.running)
        seconds = COST(seqs, prefilled, kv)
        if prefilled and worker.running:
            seconds += args.hit_step_ms / 1000
        at(now + seconds, step_done, worker, finished_prefill)

    def step_done(now: float, worker: Worker, finished_prefill: list[Request]) -> None:
        for request in list(worker.running):
            request.generated += 1
            if request.generated >= shape.max_tokens:
                worker.running.remove(request)
                at(now + router_s, route, request.replica)  # the client's next
        for request in finished_prefill:
            request.generated, request.ttft_s = 1, now - request.sent_s + router_s
            done.append(request)
            worker.running.append(request)
            if not request.hit:
                worker.pairs[request.pair] = None
                worker.pairs.move_to_end(request.pair, last=not request.cold)
                while len(worker.pairs) > worker.cache_pairs:
                    worker.pairs.popitem(last=False)
        record(worker, now)
        step(now, worker)

    def publish(now: float, worker: Worker) -> None:
        worker.published = frozenset(worker.pairs)
        if len(done) < total:
            at(now + args.publish_s, publish, worker)

    for i, worker in enumerate(workers):
        at(i * args.publish_s / workers_n, publish, worker)
    for client in range(args.concurrency * workers_n):
        at(client * 1e-4, route, client % workers_n)
    now = 0.0
    while events:
        now, _, action, data = heapq.heappop(events)
        action(now, *data)
    cached = sum(shape.system_tokens + (shape.doc_tokens if r.hit else 0) for r in done)
    ttfts = sorted(r.ttft_s for r in done)
    return Outcome(
        len(done) / now,
        cached / (prompt_tokens * len(done)),
        tuple(1000 * ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] for q in (0.5, 0.9)),
        reasons,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,4", help="worker counts, e.g. 2,4")
    ap.add_argument("--docs", type=int, default=192)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--system-tokens", type=int, default=530, help="with the chat template")
    ap.add_argument("--doc-tokens", type=int, default=2060)
    ap.add_argument("--question-tokens", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--cache-pairs",
        type=int,
        default=104,
        help="pairs a pool holds (cluster_rag: 96 + headroom)",
    )
    ap.add_argument("--requests-per-worker", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32, help="clients per worker")
    ap.add_argument("--publish-s", type=float, default=0.25)
    ap.add_argument("--lease-s", type=float, default=1.0, help="RouteMemory's lease")
    ap.add_argument("--view-lag-ms", type=float, default=10.0)
    ap.add_argument("--step-view-ms", type=float, default=3.5, help="the step time routers see")
    ap.add_argument("--hit-step-ms", type=float, default=1.5)
    ap.add_argument(
        "--router-ms",
        default="0",
        help="the replica's time per request before routing: one value, or chunk-aware's "
        "and round-robin's (e.g. 12,3)",
    )
    ap.add_argument("--cold-spills", action="store_true")
    ap.add_argument("--tolerance", type=float, help="routing_policy.WAIT_TOLERANCE instead")
    ap.add_argument("--slack-ms", type=float, help="routing_policy.WAIT_SLACK_S instead")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[int, dict[str, Outcome]]:
    """Runs and prints the model; ``--tolerance`` / ``--slack-ms`` hold only meanwhile."""
    args = parse_args(argv)
    saved = routing_policy.WAIT_TOLERANCE, routing_policy.WAIT_SLACK_S
    if args.tolerance is not None:
        routing_policy.WAIT_TOLERANCE = args.tolerance
    if args.slack_ms is not None:
        routing_policy.WAIT_SLACK_S = args.slack_ms / 1000
    try:
        return _run(args)
    finally:
        routing_policy.WAIT_TOLERANCE, routing_policy.WAIT_SLACK_S = saved


def _run(args: argparse.Namespace) -> dict[int, dict[str, Outcome]]:
    shape = Shape(
        args.docs,
        args.zipf,
        args.system_tokens,
        args.doc_tokens,
        args.question_tokens,
        args.max_tokens,
    )
    results, rows = {}, []
    for count in sorted({int(n) for n in args.workers.split(",")}):
        results[count] = {p: simulate(p, count, shape, args) for p in POLICIES}
        base = results[count]["round_robin"].requests_per_s
        for policy, out in results[count].items():
            rows.append(
                [count, policy, f"{out.requests_per_s:.0f}", f"{out.requests_per_s / base:.2f}"]
                + [f"{out.hit_rate:.1%}", f"{out.ttft_ms[0]:.0f}", f"{out.ttft_ms[1]:.0f}"]
                + [", ".join(f"{k} {v}" for k, v in sorted(out.reasons.items()))]
            )
    print_table(
        f"Routing model: view lag {args.view_lag_ms:g} ms, cold spills {args.cold_spills}, "
        f"tolerance {routing_policy.WAIT_TOLERANCE:g}, "
        f"slack {1000 * routing_policy.WAIT_SLACK_S:g} ms",
        ["workers", "policy", "req/s", "x RR", "hit", "TTFT p50 ms", "p90", "reasons"],
        rows,
    )
    return results


if __name__ == "__main__":
    main()
