"""A RAG workload through a real cluster: chunk-aware routing against round-robin for
1, 2, ... workers, and a worker killed mid-run.

The path is the one ``chunkserve batch`` and every HTTP router replica take, minus
HTTP: Ray worker actors (``cluster.ops.actors``; one per GPU with ``--gpus-per-worker 1``),
the embedded chunk directory, and the project's router and completion service
(``cluster.assembly.build_service``). Each run has ``--routers-per-worker`` router
replicas, each an actor of its own as the HTTP app's replicas are, and a closed loop
of clients (``--concurrency`` per worker, split over the replicas) sends streamed chat
requests; TTFT is measured where the client would see it (the router's first delta).
With ``--rate-share S`` each policy also runs open-loop: the same requests arriving as a
Poisson process at S times the slower policy's closed-loop rate, so that the policies'
TTFTs are compared at one offered load (a closed loop compares them at different ones).

Workload: each request is a system prompt (one of ``--systems``, 3 by default) +
``--docs-per-request`` documents (of ``--docs``, drawn Zipf(``--zipf``), in the order
retrieval ranked them), each a content part, + a unique question part, the shape of
``configs/examples/rag_requests.jsonl``. ``--reuse exact approximate`` runs every policy
with each reuse mode: approximate reuse places a held document after any system prompt
and any other documents, where exact reuse needs the same ones before it. Each worker's KV pool is capped at
``--pages`` pages, so one worker cannot hold every document and several together hold
more: where a request lands decides whether its document is cached. Exact reuse keys a
document by what precedes it, so each (system prompt, document) pair is a prefix of its
own: 3 x ``--docs`` of them. The default cap (``default_pages``) holds half the documents
once, a sixth of the pairs, plus headroom for the requests in flight; four workers
together hold two thirds of the pairs. (A cap that holds a third of the pairs on every
worker, with Zipf 1.0 and 600 requests per worker, leaves round-robin's misses mostly a
document's first sight on a worker, which routing saves only partly.) Zipf 0.8 and 2,000
requests per worker keep first sights a small share of a run.

Every (workers, policy) run uses fresh texts (nothing cached from earlier runs) over the
same sequence of document indices, so every run sees the same workload, cold. The
workers start once (the most asked for); a run with fewer uses the first ones only.
Their pools still hold what earlier runs left, and under approximate reuse that
matters: entries placed at least once keep up to ``engine.entry_reserve`` of a pool
against new ones (``KVPool.sparing_entries``), so a run after an approximate one finds
that reserve taken by entries nobody will place again. On CPU workers (tiny model,
``--docs 256 --docs-per-request 4 --concurrency 16 --pages 768``) chunk-aware +
approximate found 61.8% of its prompts placed or cached as a first run and 49.5-50.3%
after another approximate run. ``--cluster-per-run`` starts a cluster for each (policy,
reuse) run, so each starts from empty pools (the comparisons of reuse modes need it);
with ``--rate-share`` each pair then runs open-loop on a fresh cluster again.

Host-memory KV tier (``--host-kv-gib 0 G``): the whole comparison runs once per value,
each on a cluster of its own whose workers have a host tier of that many GiB
(``engine.host_kv_gib``; 0: off), and the report lists the runs together, the tier's
size in each run's policy label. ``--host-kv-write all reused`` runs each tier once with
each write policy (``engine.host_kv_write``); the summary lines count the pages the
tiers wrote and loaded.

Kill test (``--kill``): all workers, chunk-aware, buffered (non-streamed) requests like
the batch job's, from one router in this process; when ``--kill-at`` of the requests
are answered, one worker is killed (Ray restarts it). Every request must still be answered: the router skips the dead
worker and a request bound to it is retried elsewhere.

    python bench/cluster_rag.py --model DIR --workers 1,2,4 [--gpus-per-worker 1] [--kill]

Run it from the repository root: the router replicas' actors import ``bench.router_phases``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import functools
import io
import json
import pstats
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.actor import ActorHandle

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import router_phases  # noqa: E402
from bench.common import Shape, print_table, retrieval_sequence  # noqa: E402
from bench.process_cpu import cpu_by_role, cpu_snapshot, per_request_ms  # noqa: E402
from cluster.api.completions import CompletionService  # noqa: E402
from cluster.api.openai_protocol import ChatCompletionRequest  # noqa: E402
from cluster.assembly import build_service  # noqa: E402
from cluster.config import ClusterConfig, apply_override, parse_config  # noqa: E402
from cluster.errors import APIError  # noqa: E402
from cluster.metrics import Metrics  # noqa: E402
from cluster.ops.actors import ClusterActors, ensure_cluster, kill_cluster, wait_ready  # noqa: E402
from workers.engine.checkpoint import load_tokenizer  # noqa: E402

MODEL_NAME = "bench"
CORPUS = Path(__file__).resolve().parents[1] / "modeltools/data/corpus.txt"
POLICIES = ("chunk_aware", "round_robin")
HIT_SHARE = 0.5  # a request with at least this share of its prompt cached counts as a hit


@dataclass
class RequestResult:
    worker: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reason: str = ""  # the routing decision's reason (cluster.routing.policy.Reason)
    expected_wait_s: float = 0.0  # the router's estimate of the time to first token
    # the chosen worker as the router saw it: requests in flight, queued prefill
    # tokens, measured prefill rate (tokens/s) and step time (s); 0 where not measured
    seen: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)
    # where the TTFT went, in seconds (``router_phases``): preparing the prompt
    # (template, tokens, keys), routing it (of which the directory lookup), and from the
    # call to the chosen worker to its first delta
    phases: tuple[float, float, float, float] | None = None


def rate_text(rate: float) -> str:
    return f"{rate:.3g}/s"


def ttft_quantile_ms(results: Sequence[RequestResult], q: float, hits: bool | None = None) -> float:
    """The ``q`` quantile of TTFT in ms over all requests, or over hits (at least
    ``HIT_SHARE`` of the prompt cached) or misses only; NaN with none."""
    return quantile_ms(
        [
            r.ttft_s
            for r in results
            if hits is None or (r.cached_tokens >= HIT_SHARE * r.prompt_tokens) == hits
        ],
        q,
    )


def quantile_ms(seconds: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``seconds``, in ms; NaN with none."""
    ordered = sorted(seconds)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@dataclass
class RunResult:
    label: str
    workers: int
    policy: str
    seconds: float
    results: list[RequestResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    retries: int = 0
    kill: dict | None = None  # the kill test's events
    # per worker during the run: its steps by kind, (steps, device seconds), and
    # "busy": the engine loop's seconds inside its steps (WorkerStatus.step_tally)
    steps: dict[str, dict] = field(default_factory=dict)
    open_rate: float | None = None  # open loop: the offered requests/s; None: closed loop
    reuse: str = "exact"  # what every request asked for
    cpu_s: dict[str, float] = field(default_factory=dict)  # process kind -> CPU seconds
    # the workers' host KV tier: (GiB, write policy), None where off; and the pages the
    # tiers wrote and loaded during the run
    host_tier: tuple[float, str] | None = None
    host_pages: tuple[int, int] = (0, 0)

    def summary(self) -> dict:
        return {
            "workers": self.workers,
            "policy": self.policy,
            "reuse": self.reuse,
            "host_tier": self.host_tier,
            "host_pages_written_loaded": self.host_pages,
            "open_rate": self.open_rate,
            "answered": len(self.results),
            "errors": self.errors,
            "retries": self.retries,
            "seconds": self.seconds,
            "requests_per_s": self.requests_per_s(),
            "output_tokens_per_s": self.output_tokens_per_s(),
            "hit_rate": self.hit_rate(),
            "ttft_ms": {q: self.ttft_ms(q) for q in (0.5, 0.9, 0.99)},
            "ttft_ms_hits": {q: self.ttft_ms(q, hits=True) for q in (0.5, 0.9)},
            "ttft_ms_misses": {q: self.ttft_ms(q, hits=False) for q in (0.5, 0.9)},
            "steps_by_kind": self.steps,
            # per request: worker, TTFT ms, latency ms, prompt tokens, cached tokens,
            # routing reason, the router's expected wait ms, and the chosen worker as the
            # router saw it: requests, queued prefill tokens, prefill tok/s, step ms
            "requests": [
                [r.worker, round(1000 * r.ttft_s, 2), round(1000 * r.latency_s, 2)]
                + [r.prompt_tokens, r.cached_tokens, r.reason, round(1000 * r.expected_wait_s, 2)]
                + [r.seen[0], r.seen[1], round(r.seen[2]), round(1000 * r.seen[3], 3)]
                for r in self.results
            ],
            "routing": self.routing(),
            "ttft_phases_ms": self.phases(),
            "views": self.views(),
            "requests_per_worker": dict(Counter(r.worker for r in self.results)),
            "cpu_ms_per_request": per_request_ms(self.cpu_s, len(self.results)),
            "kill": self.kill,
        }

    @property
    def policy_label(self) -> str:
        """The policy, with the offered rate of an open-loop run."""
        return self.policy + ("" if self.open_rate is None else f" @ {rate_text(self.open_rate)}")

    def requests_per_s(self) -> float:
        return len(self.results) / self.seconds

    def output_tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.results) / self.seconds

    def prompt_tokens_per_s(self) -> float:
        return sum(r.prompt_tokens for r in self.results) / self.seconds

    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.results)
        return sum(r.cached_tokens for r in self.results) / prompt if prompt else 0.0

    def ttft_ms(self, q: float, hits: bool | None = None) -> float:
        return ttft_quantile_ms(self.results, q, hits)

    def routing(self) -> dict:
        """Per routing reason: requests, TTFT p50 / p90 ms, and how far the measured TTFT
        ran past the router's expected wait (p50 / p90 ms; chunk-aware decisions carry an
        estimate, round-robin ones do not). Where the holders' queues are longer than
        the router's views say, affinity requests run far past their estimates."""
        out = {}
        for reason in sorted({r.reason for r in self.results}):
            picked = [r for r in self.results if r.reason == reason]
            past = [r.ttft_s - r.expected_wait_s for r in picked]
            out[reason] = {
                "requests": len(picked),
                "ttft_ms": [ttft_quantile_ms(picked, q) for q in (0.5, 0.9)],
                "past_estimate_ms": None
                if reason == "rotation"  # round-robin estimates nothing
                else [round(quantile_ms(past, q), 2) for q in (0.5, 0.9)],
            }
        return out

    def views(self) -> dict:
        """Per worker, medians over the requests sent to it of what the router saw when
        it chose it (requests in flight, queued prefill tokens, measured prefill rate,
        step ms), beside the TTFT p50 they got: where the load came out uneven, whether
        the routers' views said so."""
        out = {}
        for worker in sorted({r.worker for r in self.results}):
            sent = [r for r in self.results if r.worker == worker]
            columns = list(zip(*(r.seen for r in sent), strict=True))
            requests, backlog, rate, step = (statistics.median(c) for c in columns)
            out[worker] = {
                "requests": len(sent),
                "seen_in_flight": requests,
                "seen_backlog_tokens": backlog,
                "seen_prefill_tokens_per_s": round(rate),
                "seen_step_ms": round(1000 * step, 3),
                "ttft_ms_p50": ttft_quantile_ms(sent, 0.5),
            }
        return out

    def phases(self) -> dict[str, list[float]]:
        """p50 / p90 ms of each part of the TTFT (``RequestResult.phases``), over the
        requests that recorded them (streamed ones)."""
        timed = [r.phases for r in self.results if r.phases is not None]
        if not timed:
            return {}
        names = ("prepare", "route", "lookup", "worker")
        return {
            name: [round(quantile_ms(column, q), 2) for q in (0.5, 0.9)]
            for name, column in zip(names, zip(*timed, strict=True), strict=True)
        }

    def worker_shares(self) -> str:
        counts = Counter(r.worker.rsplit("-", 1)[-1] for r in self.results)
        return "/".join(str(counts[k]) for k in sorted(counts))


# -- workload --------------------------------------------------------------------------
class TextMaker:
    """Random prose of about a given token count, from the model's corpus words."""

    def __init__(self, tokenizer) -> None:
        self.words = CORPUS.read_text().split()
        sample = " ".join(self.words[:1000])
        self.tokens_per_word = len(tokenizer.encode(sample, add_special_tokens=False)) / 1000

    def text(self, rng: random.Random, tokens: int) -> str:
        count = max(1, round(tokens / self.tokens_per_word))
        return " ".join(rng.choices(self.words, k=count))


def make_bodies(
    maker: TextMaker,
    shape: Shape,
    sequence: list[tuple[int, tuple[int, ...]]],
    seed: int,
    stream: bool,
    reuse: str = "exact",
) -> list[ChatCompletionRequest]:
    """Requests over texts of their own (``seed``): a run's chunks are new to every pool.
    ``sequence``: ``retrieval_sequence``'s (system, documents) per request; each
    document is a content part of its own, then the question."""
    rng = random.Random(seed)
    systems = [maker.text(rng, shape.system_tokens) for _ in range(shape.systems)]
    docs = [f"Document {d}: " + maker.text(rng, shape.doc_tokens) for d in range(shape.docs)]
    bodies = []
    for system, ranked in sequence:
        question = "Question: " + maker.text(rng, shape.question_tokens)
        content = [{"type": "text", "text": docs[d]} for d in ranked]
        content.append({"type": "text", "text": question})
        messages = [
            {"role": "system", "content": systems[system]},
            {"role": "user", "content": content},
        ]
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": shape.max_tokens}
        body |= {"temperature": 0, "stream": stream, "reuse": reuse}
        if stream:
            body["stream_options"] = {"include_usage": True}
        bodies.append(ChatCompletionRequest.model_validate(body))
    return bodies


# -- running ---------------------------------------------------------------------------
async def run_workload(
    service: CompletionService,
    bodies: list[ChatCompletionRequest],
    clients: int,
    label: str,
    on_answered=None,
) -> RunResult:
    """``clients`` concurrent clients over ``bodies`` in order; ``on_answered(count)``
    is awaited after each answer."""
    run = RunResult(label, 0, "", 0.0)  # the caller names its workers and policy
    queue = list(reversed(bodies))
    retries = service.metrics.retries
    retries_before = retries.total()

    async def client() -> None:
        while queue:
            await answer_into(run, service, queue.pop())
            if on_answered is not None:
                await on_answered(len(run.results) + len(run.errors))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    run.seconds = time.perf_counter() - started
    run.retries = int(retries.total() - retries_before)
    return run


async def run_open_loop(
    service: CompletionService, bodies: list[ChatCompletionRequest], rate: float, seed: int
) -> RunResult:
    """``bodies`` sent as a Poisson process of ``rate`` requests/s, each answered on a
    task of its own, whatever is still in flight (open loop: the offered load does not
    fall when answers slow down)."""
    run = RunResult("replica", 0, "", 0.0)
    retries_before = service.metrics.retries.total()
    rng = random.Random(seed)
    started = time.perf_counter()
    due, tasks = started, []
    for body in bodies:
        due += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(answer_into(run, service, body)))
    await asyncio.gather(*tasks)
    run.seconds = time.perf_counter() - started
    run.retries = int(service.metrics.retries.total() - retries_before)
    return run


async def answer_into(run: RunResult, service: CompletionService, body: ChatCompletionRequest):
    """Sends ``body`` now; its result, or its error, goes into ``run``."""
    try:
        run.results.append(await answer(service, body, time.perf_counter()))
    except APIError as error:
        run.errors.append(f"{type(error).__name__}: {error}")


async def answer(
    service: CompletionService, body: ChatCompletionRequest, started: float
) -> RequestResult:
    phases = router_phases.begin()
    reply = await service.chat(body, "")
    view = reply.decision.view
    seen = (view.requests, view.prefill_backlog, view.prefill_tokens_per_s, view.step_s)
    routed = (reply.decision.reason.value, reply.decision.expected_wait_s, seen)
    if reply.events is None:  # buffered: TTFT is not visible, count the whole answer
        done = time.perf_counter() - started
        usage = reply.body.usage
        return RequestResult(
            reply.worker_id,
            done,
            done,
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens,
            usage.completion_tokens,
            *routed,
        )
    first = time.perf_counter()
    ttft = first - started
    timed = router_phases.phases_of(phases, started, first)
    usage = None
    async for events in reply.events:  # one or more server-sent events, written at once
        # only an error or the usage chunk is read: this client shares the router
        # replica's event loop, which a real client would not load
        if '"usage":{' not in events and '"error"' not in events:
            continue
        for event in events.split("\n\n"):
            payload = event.removeprefix("data: ").strip()
            if payload.startswith("{") and ('"usage":{' in payload or '"error"' in payload):
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise APIError(chunk["error"]["message"])
                usage = chunk.get("usage") or usage
    if usage is None:
        raise APIError("the stream ended without a usage chunk")
    return RequestResult(
        reply.worker_id,
        ttft,
        time.perf_counter() - started,
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["completion_tokens"],
        *routed,
        timed,
    )


def subset_service(
    cfg: ClusterConfig, model_dir: Path, actors: ClusterActors, count: int, policy: str
) -> CompletionService:
    """A router over the first ``count`` workers. ``policy``: a router policy, optionally
    with router settings, e.g. ``chunk_aware,default_prefill_tokens_per_s=50000``."""
    workers = dict(list(actors.workers.items())[:count])
    subset = ClusterActors(workers, actors.directory, actors.directory_host)
    raw = cfg.model_dump()
    name, *settings = policy.split(",")
    for setting in [f"policy={name}", *settings]:
        apply_override(raw, f"router.{setting}")
    policy_cfg = parse_config(raw, source=f"policy {policy!r}")
    service = build_service(policy_cfg, model_dir, subset, Metrics())
    router_phases.time_router_phases(service.router)
    return service


class RouterReplica:
    """One router in a process of its own, as each replica of the HTTP app is: its own
    tokenizer thread, worker-load view and directory client over the shared workers."""

    def __init__(
        self,
        cfg: ClusterConfig,
        model_dir: Path,
        actors: ClusterActors,
        count: int,
        policy: str,
        profile: bool = False,
    ) -> None:
        self.service = subset_service(cfg, model_dir, actors, count, policy)
        # the event loop's thread under cProfile during a run (clients included)
        self._profiler = cProfile.Profile() if profile else None

    async def ready(self) -> None:
        await self.service.router.pool.start()  # first load poll of every worker
        self.service.metrics.watch_loop()

    async def run(self, bodies: list[ChatCompletionRequest], clients: int) -> RunResult:
        return await self._profiled(run_workload(self.service, bodies, clients, "replica"))

    async def run_open(self, bodies: list[ChatCompletionRequest], rate: float, seed: int):
        return await self._profiled(run_open_loop(self.service, bodies, rate, seed))

    def profile_text(self, top: int = 40) -> str:
        """The profile's functions by their own time, then by cumulative time ("" if
        not profiled)."""
        if self._profiler is None:
            return ""
        out = io.StringIO()
        stats = pstats.Stats(self._profiler, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        return out.getvalue()

    async def _profiled(self, work):
        if self._profiler is None:
            return await work
        self._profiler.enable()
        try:
            return await work
        finally:
            self._profiler.disable()

    async def close(self) -> None:
        await self.service.router.pool.close()


async def run_replicated(
    replicas: list[ActorHandle],
    bodies: list[ChatCompletionRequest],
    clients: int,
    label: str,
    open_rate: float | None = None,
    seed: int = 0,
) -> RunResult:
    """The requests dealt over the replicas, run at once: closed loop with the clients
    split evenly, or with ``open_rate`` open loop, each replica a Poisson process of
    its share of the rate (together, one of ``open_rate``)."""
    shares = [bodies[i :: len(replicas)] for i in range(len(replicas))]
    per_replica = max(1, clients // len(replicas))
    await asyncio.gather(*(r.ready.remote() for r in replicas))
    started = time.perf_counter()
    parts = await asyncio.gather(
        *(
            r.run.remote(share, per_replica)
            if open_rate is None
            else r.run_open.remote(share, open_rate / len(replicas), seed + i)
            for i, (r, share) in enumerate(zip(replicas, shares, strict=True))
        )
    )
    run = RunResult(label, 0, "", time.perf_counter() - started, open_rate=open_rate)
    for part in parts:
        run.results += part.results
        run.errors += part.errors
        run.retries += part.retries
    return run


async def kill_test(
    service: CompletionService,
    bodies: list[ChatCompletionRequest],
    clients: int,
    kill_at: int,
    victim: ActorHandle,
) -> tuple[RunResult, dict]:
    events: dict = {}
    recovery: list[asyncio.Task] = []  # wait_back, once the worker is killed

    async def on_answered(count: int) -> None:
        if count >= kill_at and "answered_before_kill" not in events:
            events["answered_before_kill"] = count
            events["epoch_before"] = (await victim.info.remote()).epoch
            events["killed_at_s"] = time.perf_counter()
            ray.kill(victim, no_restart=False)
            recovery.append(asyncio.create_task(wait_back(victim, events)))

    run = await run_workload(service, bodies, clients, "kill", on_answered)
    await asyncio.gather(*recovery)
    return run, events


async def wait_back(victim: ActorHandle, events: dict, timeout_s: float = 600) -> None:
    """Record when the worker answers again as a new incarnation (a new epoch)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        try:
            info = await asyncio.wait_for(victim.info.remote(), 5)
        except Exception:
            info = None
        if info is None or info.epoch == events["epoch_before"]:
            await asyncio.sleep(0.5)
            continue
        events["back_after_s"] = time.perf_counter() - events["killed_at_s"]
        events["epoch_after"] = info.epoch
        return
    events["back_error"] = f"not back within {timeout_s:.0f} s"


# -- main ------------------------------------------------------------------------------
PAGE_SIZE = 16
REUSE_MODES = ("exact", "approximate")
# config keys this bench sets from its own flags (--set refuses them)
OWN_FLAGS = {
    "engine.num_pages": "--pages",
    "engine.host_kv_gib": "--host-kv-gib",
    "engine.host_kv_write": "--host-kv-write",
    "engine.load_format": "--load-format",
    "workers.count": "--workers",
    "workers.num_gpus": "--gpus-per-worker",
    "workers.tensor_parallel_size": "--tensor-parallel-size",
    "workers.engine_process": "--engine",
    "router.policy": "--policies",
    "server.default_max_tokens": "--max-tokens",
}
HEADROOM_PAGES = 1024  # system prompts and the unique tails of the requests in flight


def default_pages(docs: int, doc_tokens: int) -> int:
    """KV pages per worker that hold half the documents once (a sixth of the
    (system prompt, document) prefixes), plus headroom for the requests in flight."""
    return (docs + 1) // 2 * -(-doc_tokens // PAGE_SIZE) + HEADROOM_PAGES


def cluster_config(
    args: argparse.Namespace, count: int, host_kv_gib: float = 0.0, host_write: str = "all"
) -> ClusterConfig:
    engine = {"page_size": PAGE_SIZE, "num_pages": args.pages, "host_kv_gib": host_kv_gib}
    engine |= {"host_kv_write": host_write, "load_format": args.load_format}
    if args.gpus_per_worker > 0:
        engine |= {"device": "cuda", "dtype": "bfloat16", "attention_backend": "flashinfer"}
        engine |= {"gpu_memory_utilization": 0.9 * args.gpus_per_worker}
    else:
        engine |= {"device": "cpu", "dtype": "float32"}
    raw = {
        "name": f"bench-{random.randrange(16**6):06x}",
        "model": {"name": MODEL_NAME, "path": str(args.model)},
        "engine": engine,
        "workers": {
            "count": count,
            "num_gpus": args.gpus_per_worker * args.tensor_parallel_size,
            "tensor_parallel_size": args.tensor_parallel_size,
            "num_cpus": 1,
            "max_restarts": 3,
            "startup_timeout_s": 600,
            "engine_process": {"auto": None, "process": True, "thread": False}[args.engine],
        },
        "directory": {"kind": "embedded"},
        "router": {"max_requests_per_worker": 4096},
        "server": {"default_max_tokens": args.max_tokens},
    }
    for override in args.set:
        apply_override(raw, override)
    return parse_config(raw, source="--set")


def main() -> None:
    args = parse_args()
    shape = Shape(
        args.docs, args.zipf, args.system_tokens, args.doc_tokens, 32, args.max_tokens,
        args.docs_per_request, args.systems,
    )  # fmt: skip
    counts = sorted({int(n) for n in args.workers.split(",")})
    gpus = {}
    if args.gpus_per_worker > 0:  # counted here: Ray's own detection may miss a VM's GPUs
        import torch

        gpus = {"num_gpus": torch.cuda.device_count()}
    ray.init(namespace="chunkserve-bench", log_to_driver=False, **gpus)
    tokenizer = load_tokenizer(args.model)
    maker = TextMaker(tokenizer)
    runs: list[RunResult] = []
    tiers = [
        (gib, write)
        for gib in args.host_kv_gib
        for write in (args.host_kv_write if gib else ["all"])
    ]
    pairs = args.pair_list
    for host_kv_gib, host_write in tiers:
        on_tier = functools.partial(
            runs_on_cluster, args, shape, counts, maker, host_kv_gib, host_write
        )
        if not args.cluster_per_run:
            measured = on_tier(pairs)
        else:  # each pair alone; then, at one offered rate, each again on a fresh cluster
            measured = [run for pair in pairs for run in on_tier([pair])]
            if rates := open_rates(args.rate_share, measured, counts):
                measured += [run for pair in pairs for run in on_tier([pair], rates)]
        if len(tiers) > 1:
            several = len(args.host_kv_write) > 1 or host_write != "all"
            writes = f", {host_write} writes" if host_kv_gib and several else ""
            for run in measured:
                run.policy += f", host tier {host_kv_gib:g} GiB{writes}"
        runs += measured
    report(args, shape, runs)
    if args.json:
        args.json.write_text(json.dumps([run.summary() for run in runs], indent=1))


def runs_on_cluster(
    args, shape, counts, maker, host_kv_gib, host_write, pairs, rates=None
) -> list[RunResult]:
    """The runs of ``pairs`` (policy, reuse) on a cluster started for them and stopped
    after; ``rates``: open-loop only, at these offered requests/s by worker count."""
    cfg = cluster_config(args, max(counts), host_kv_gib, host_write)
    started = time.perf_counter()
    actors = ensure_cluster(cfg, args.model, detached=False)
    try:
        infos = wait_ready(actors, cfg.workers.startup_timeout_s)
        ranks = args.tensor_parallel_size
        print(
            f"{max(counts)} workers"
            + (f" of {ranks} ranks" if ranks > 1 else "")
            + f" ready in {time.perf_counter() - started:.1f} s "
            f"(host KV tier {host_kv_gib:g} GiB); each worker's own start (engine, "
            "graphs): " + ", ".join(f"{info.startup_s:.1f} s" for info in infos),
            flush=True,
        )
        return asyncio.run(measure(args, cfg, actors, shape, counts, maker, pairs, rates))
    finally:
        kill_cluster(cfg)


def open_rates(share: float, closed: list[RunResult], counts: list[int]) -> dict[int, float]:
    """The open-loop rate of each worker count: ``share`` of the lowest closed-loop
    requests/s among its runs. Empty where there is no share, or where a run answered
    nothing (it leaves no rate to offer), which is said."""
    if share <= 0:
        return {}
    rates = {count: share * min(r.requests_per_s() for r in closed if r.workers == count)
             for count in counts}  # fmt: skip
    if not all(rates.values()):
        print("no open-loop runs: a closed-loop run answered nothing")
        return {}
    return rates


async def measure(args, cfg, actors, shape, counts, maker, pairs, rates=None) -> list[RunResult]:
    """The runs of ``pairs`` (policy, reuse) at each worker count on one cluster,
    closed-loop (then open-loop at ``--rate-share``, unless each pair has a cluster of
    its own), or open-loop only at ``rates`` (offered requests/s by worker count); then
    the kill test if asked."""
    sequence = retrieval_sequence(shape, args.requests_per_worker * max(counts), args.seed)
    warm = make_bodies(maker, shape, sequence[: 4 * max(counts)], seed=10**6, stream=True)
    warm_service = subset_service(cfg, args.model, actors, max(counts), "round_robin")
    await run_workload(warm_service, warm, max(counts) * 2, "warm-up")  # kernels, graphs
    await warm_service.router.pool.close()
    runs: list[RunResult] = []
    plan = [(c, p, m, (rates or {}).get(c)) for c in counts for p, m in pairs]
    while plan:
        count, policy, reuse, open_rate = plan.pop(0)
        routers = max(1, round(count * args.routers_per_worker))
        profile = args.profile_routers is not None
        replicas = [
            ray.remote(num_cpus=0)(RouterReplica).remote(
                cfg, args.model, actors, count, policy, profile
            )
            for _ in range(routers)
        ]
        requests = sequence[: args.requests_per_worker * count]
        bodies = make_bodies(maker, shape, requests, len(runs) + 1, stream=True, reuse=reuse)
        used = dict(list(actors.workers.items())[:count])
        await asyncio.gather(*(r.ready.remote() for r in replicas))  # their start is not counted
        before, cpu_before = await step_tallies(used), cpu_snapshot()
        run = await run_replicated(
            replicas, bodies, args.concurrency * count, "", open_rate, seed=args.seed * 1000
        )
        run.cpu_s = cpu_by_role(cpu_before, cpu_snapshot())
        run.steps = tally_difference(before, await step_tallies(used))
        if cfg.engine.host_kv_gib > 0:
            run.host_tier = (cfg.engine.host_kv_gib, cfg.engine.host_kv_write)
            run.host_pages = host_pages_moved(run)
        run.workers, run.policy, run.reuse = count, policy_name(policy, reuse, args), reuse
        run.label = f"{count} × {run.policy_label}"
        if profile:  # the first replica's profile stands for all (they run alike)
            loop = "closed" if open_rate is None else f"open{open_rate:.0f}"
            path = args.profile_routers / f"router-{count}-{policy}-{loop}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(await replicas[0].profile_text.remote())
        await asyncio.gather(*(r.close.remote() for r in replicas))
        for replica in replicas:
            ray.kill(replica)
        print(summary_line(run) + f", {routers} router replica(s)", flush=True)
        cpu = per_request_ms(run.cpu_s, len(run.results))
        print("  CPU ms a request: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
        runs.append(run)
        closed = [r for r in runs if r.workers == count and r.open_rate is None]
        if not args.cluster_per_run and open_rate is None and len(closed) == len(pairs):
            rate = open_rates(args.rate_share, closed, [count]).get(count)
            if rate:
                plan[:0] = [(count, p, m, rate) for p, m in pairs]
    if args.kill:
        count = max(counts)
        service = subset_service(cfg, args.model, actors, count, "chunk_aware")
        requests = sequence[: args.requests_per_worker * count]
        bodies = make_bodies(maker, shape, requests, 99, stream=False, reuse=args.reuse[0])
        victim = list(actors.workers)[count - 1]
        run, events = await kill_test(
            service,
            bodies,
            args.concurrency * count,
            int(args.kill_at * len(bodies)),
            actors.workers[victim],
        )
        run.workers, run.reuse = count, args.reuse[0]
        run.policy = policy_name("chunk_aware", args.reuse[0], args) + " (kill)"
        run.kill = {"victim": victim, "sent": len(bodies)} | {
            k: v for k, v in events.items() if k != "killed_at_s"
        }
        await service.router.pool.close()
        print(summary_line(run), flush=True)
        print(kill_line(run, events, len(bodies), victim), flush=True)
        runs.append(run)
    return runs


def policy_name(policy: str, reuse: str, args: argparse.Namespace) -> str:
    """A run's policy as reports name it: with its reuse mode where several are compared."""
    return policy if len(args.reuse) == 1 else f"{policy}, {reuse}"


async def step_tallies(workers: dict[str, ActorHandle]) -> dict[str, dict | None]:
    """Each worker's step tally now: its steps by kind, "busy", its host tier's pages
    written and loaded, and its engine's workload tally (None: it did not answer, e.g.
    restarting after the kill)."""
    statuses = await asyncio.gather(
        *(w.status.remote() for w in workers.values()), return_exceptions=True
    )
    return {
        wid: None
        if isinstance(s, BaseException)
        else {
            "kinds": s.step_tally.steps_by_kind,
            "busy": s.step_tally.busy_s,
            "host": (s.host_tier.pages_written, s.host_tier.pages_loaded)
            if s.host_tier
            else (0, 0),
            "work": dataclasses.asdict(s.step_tally.workload),
        }
        for wid, s in zip(workers, statuses, strict=True)
    }


def tally_difference(before: dict[str, dict | None], after: dict[str, dict | None]) -> dict:
    """Per worker that answered both times, its steps by kind, busy seconds, host pages
    moved and workload counts between the two tallies."""
    out = {}
    for wid, now in after.items():
        then = before.get(wid)
        if now is None or then is None:
            continue
        kinds = {}
        for kind, (n, seconds) in now["kinds"].items():
            n0, s0 = then["kinds"].get(kind, (0, 0.0))
            if n > n0:
                kinds[kind] = (n - n0, seconds - s0)
        host = tuple(a - b for a, b in zip(now["host"], then["host"], strict=True))
        work = {name: count - then["work"][name] for name, count in now["work"].items()}
        out[wid] = {"kinds": kinds, "busy": now["busy"] - then["busy"], "host": host, "work": work}
    return out


def host_pages_moved(run: RunResult) -> tuple[int, int]:
    """Pages the workers' host tiers wrote and loaded during the run."""
    moved = [tally["host"] for tally in run.steps.values()]
    return sum(w for w, _ in moved), sum(loaded for _, loaded in moved)


def summary_line(run: RunResult) -> str:
    return (
        f"{run.label}: {len(run.results)} ok, {len(run.errors)} errors, {run.seconds:.1f} s, "
        f"{run.requests_per_s():.1f} req/s, hit {run.hit_rate():.1%}, "
        f"TTFT p50 {run.ttft_ms(0.5):.0f} ms p90 {run.ttft_ms(0.9):.0f} ms (hits "
        f"{run.ttft_ms(0.5, True):.0f}/{run.ttft_ms(0.9, True):.0f}, misses "
        f"{run.ttft_ms(0.5, False):.0f}/{run.ttft_ms(0.9, False):.0f}), "
        f"per worker {run.worker_shares()}"
        + (", host tier pages written {} / loaded {}".format(*run.host_pages) if run.host_tier else "")
    )  # fmt: skip


def kill_line(run: RunResult, events: dict, sent: int, victim: str) -> str:
    back = events.get("back_after_s")
    back_text = f"answered again after {back:.1f} s" if back else events.get("back_error")
    return (
        f"kill test: {victim} killed once {events.get('answered_before_kill')} of {sent} "
        f"requests were answered; {len(run.results)}/{sent} answered, "
        f"{len(run.errors)} errors, {run.retries} retried on another worker; "
        f"the worker {back_text}" + (f"; first errors: {run.errors[:3]}" if run.errors else "")
    )


def report(args, shape: Shape, runs: list[RunResult]) -> None:
    # neither the kill run nor an open-loop one is a scaling point
    measured = [r for r in runs if r.kill is None and r.open_rate is None]
    base = {r.policy: r for r in measured if r.workers == min(r.workers for r in measured)}
    rows = []
    for run in runs:
        scaling_point = run.kill is None and run.open_rate is None
        one = base.get(run.policy) if scaling_point else None
        scaling = (
            run.requests_per_s() / (run.workers / one.workers * one.requests_per_s())
            if one is not None
            else None
        )
        rows.append(
            [
                run.workers,
                run.policy,
                "closed" if run.open_rate is None else rate_text(run.open_rate),
                len(run.results),
                len(run.errors),
                f"{run.hit_rate():.1%}",
                run.requests_per_s(),
                run.output_tokens_per_s(),
                run.prompt_tokens_per_s(),
                run.ttft_ms(0.5),
                run.ttft_ms(0.9),
                run.ttft_ms(0.99),
                "—" if scaling is None else f"{scaling:.2f}",
                run.worker_shares(),
            ]
        )
    print_table(
        f"RAG through the cluster: system {shape.system_tokens} (of {shape.systems}) + "
        f"{shape.docs_per_request} x document {shape.doc_tokens} (of {shape.docs}, Zipf "
        f"{shape.zipf}, in relevance order) + question {shape.question_tokens} tokens, "
        f"{shape.max_tokens} output tokens; {args.pages} KV pages per worker; "
        f"{args.concurrency} clients per worker"
        + "".join(f"; {override}" for override in args.set),
        [
            "workers",
            "policy",
            "arrivals",
            "ok",
            "errors",
            "hit",
            "req/s",
            "out tok/s",
            "prompt tok/s",
            "TTFT p50 ms",
            "p90",
            "p99",
            "scaling",
            "requests per worker",
        ],
        rows,
    )
    rows = [
        [run.workers, run.policy_label, reason, stats["requests"], *stats["ttft_ms"]]
        + (stats["past_estimate_ms"] or ["—", "—"])
        for run in runs
        for reason, stats in run.routing().items()
    ]
    print_table(
        "Routing decisions: TTFT by reason, and how far it ran past the router's expected "
        "wait (chunk-aware only; round-robin makes no estimate)",
        [
            "workers",
            "policy",
            "reason",
            "requests",
            "TTFT p50 ms",
            "p90",
            "past estimate p50 ms",
            "p90",
        ],
        rows,
    )
    rows = [
        [run.workers, run.policy_label]
        + [f"{p50:g} / {p90:g}" for p50, p90 in run.phases().values()]
        + [f"{run.ttft_ms(0.5):.1f} / {run.ttft_ms(0.9):.1f}"]
        for run in runs
        if run.phases()
    ]
    print_table(
        "Where the time to first token went, as the router replica saw it (p50 / p90 ms "
        "of each part on its own): preparing the prompt (chat template, tokens, keys), "
        "routing it (of which the directory lookup), and from the call to the chosen "
        "worker to its first delta",
        ["workers", "policy", "prepare", "route", "of which lookup", "worker", "TTFT"],
        rows,
    )
    rows = [
        [run.workers, run.policy_label, worker, *stats.values()]
        for run in runs
        for worker, stats in run.views().items()
    ]
    print_table(
        "What the routers saw of each worker when they chose it (medians over its requests)",
        ["workers", "policy", "worker", "requests", "in flight", "queued prefill tokens"]
        + ["prefill tok/s", "step ms", "TTFT p50 ms"],
        rows,
    )
    rows = [
        [
            run.workers,
            run.policy_label,
            worker,
            f"{tally['busy'] / run.seconds:.0%}",
            kind,
            n,
            1000 * s / n,
            f"{s / run.seconds:.0%}",
        ]
        for run in runs
        for worker, tally in run.steps.items()
        for kind, (n, s) in sorted(tally["kinds"].items(), key=lambda item: -item[1][1])
    ]
    print_table(
        "Where each worker's time went during the run: busy = the engine loop's time "
        "inside its steps over the run's; steps by kind (a graph or eager, and the "
        "attention kind) with their time on the device (each step's span there)",
        ["workers", "policy", "worker", "busy", "step kind", "steps", "device ms", "of run"],
        rows,
    )
    rows = []
    for run in runs:
        served = Counter(r.worker for r in run.results)
        rows += [
            [run.workers, run.policy, worker, *work_row(tally["work"], served[worker])]
            for worker, tally in run.steps.items()
            if any(tally["work"].values())
        ]
    if rows:
        print_table(
            "What each worker's engine computed during the run: prompt positions through "
            "every layer (fills and admission forwards included) a request it served, and "
            "positions only through the selection layers; approximate requests' placeable "
            "documents found as entries, missed (computed in context), the missed ones taken "
            "as entries or filled, and entries evicted for room",
            ["workers", "policy", "worker", "positions a request", "selection-only",
             "entry hits", "misses", "taken", "fills", "evicted"],
            rows,
        )  # fmt: skip
    by_key = {(r.workers, r.policy, r.open_rate): r for r in runs if r.kill is None}
    for count, rate in sorted({(k[0], k[2]) for k in by_key}, key=lambda k: (k[0], k[1] or 0)):
        aware = by_key.get((count, "chunk_aware", rate))
        rr = by_key.get((count, "round_robin", rate))
        if aware is None or rr is None:
            continue
        served = (
            f"chunk-aware / round-robin = {aware.requests_per_s() / rr.requests_per_s():.2f}× req/s"
            if rate is None
            else f"offered {rate_text(rate)}, served {aware.requests_per_s():.3g} / "
            f"{rr.requests_per_s():.3g} req/s"
        )
        loop = "closed loop" if rate is None else "open loop"
        print(
            f"{count} workers, {loop}: {served}; TTFT p50 "
            f"{aware.ttft_ms(0.5):.0f} vs {rr.ttft_ms(0.5):.0f} ms, p90 "
            f"{aware.ttft_ms(0.9):.0f} vs {rr.ttft_ms(0.9):.0f} ms"
        )


def work_row(work: dict[str, int], served: int) -> list:
    """A worker's workload counts over a run (``WorkloadTally``) as a report row;
    ``served``: the requests it answered."""
    hits, misses = work["entry_hits"], work["entry_misses"]
    return [
        round(work["prompt_positions"] / served) if served else "—",
        work["selection_only_positions"],
        f"{hits} ({hits / (hits + misses):.0%})" if hits + misses else "0",
        misses,
        work["entries_taken"],
        work["fills_queued"],
        work["entry_evictions"],
    ]


def add_worker_gpu_arguments(ap: argparse.ArgumentParser) -> None:
    """--gpus-per-worker, --tensor-parallel-size (``check_worker_gpu_arguments``) and
    --load-format."""
    ap.add_argument(
        "--gpus-per-worker", type=float, default=1.0, help="per rank of a worker; 0: CPU workers"
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks per worker, each on a GPU of its own (workers.tensor_parallel_size)",
    )
    ap.add_argument(
        "--load-format",
        choices=("safetensors", "dummy"),
        default="safetensors",
        help="dummy: random weights made in place (engine.load_format), for a checkpoint "
        "of config and tokenizer only (make-model --no-weights)",
    )


def check_worker_gpu_arguments(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tensor_parallel_size > 1 and args.gpus_per_worker not in (0, 1):
        ap.error("--tensor-parallel-size takes a whole GPU a rank: --gpus-per-worker 1 (or 0)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    ap.add_argument("--workers", default="1,2", help="worker counts to compare, e.g. 1,2,4")
    ap.add_argument(
        "--policies",
        nargs="+",
        help="router policies to compare, each optionally with router settings: "
        "chunk_aware,recent_route_lease_s=0 (default: " + " ".join(POLICIES) + ")",
    )
    ap.add_argument(
        "--pairs",
        nargs="+",
        metavar="POLICY:REUSE",
        help="the (policy, reuse) runs to compare, instead of every policy with every reuse "
        "mode: e.g. round_robin:exact chunk_aware:approximate",
    )
    add_worker_gpu_arguments(ap)
    ap.add_argument(
        "--engine",
        choices=("auto", "process", "thread"),
        default="auto",
        help="each worker's engine in a process of its own or on a thread of the actor's "
        "(workers.engine_process; auto: a process for GPU workers)",
    )
    ap.add_argument(
        "--rate-share",
        type=float,
        default=0.0,
        help="also run each policy open-loop (Poisson arrivals) at this share of the "
        "lowest closed-loop req/s of the policies at that worker count, so that TTFT "
        "is compared at one request rate; 0: closed loop only",
    )
    ap.add_argument(
        "--pages",
        type=int,
        help="KV pages per worker (default: half the documents plus headroom; default_pages)",
    )
    ap.add_argument(
        "--reuse",
        nargs="+",
        choices=REUSE_MODES,
        help="reuse modes to compare, each with every policy (the kill test takes the first; "
        "default: exact)",
    )
    ap.add_argument(
        "--host-kv-gib",
        type=float,
        nargs="+",
        default=[0.0],
        help="host-memory KV tier per worker, in GiB (engine.host_kv_gib); several values "
        "run the comparison once each, e.g. 0 200 (off, then on)",
    )
    ap.add_argument(
        "--host-kv-write",
        nargs="+",
        choices=("all", "reused"),
        default=["all"],
        help="the host tier's write policy (engine.host_kv_write); several run each tier "
        "once with each",
    )
    ap.add_argument("--docs", type=int, default=192)
    ap.add_argument(
        "--docs-per-request", type=int, default=1, help="retrieved documents a request (top-k)"
    )
    ap.add_argument("--systems", type=int, default=3, help="system prompts (tenants, personas)")
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests-per-worker", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32, help="clients per worker")
    ap.add_argument(
        "--routers-per-worker",
        type=float,
        default=1.0,
        help="router replicas (processes) per worker, at least one",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill", action="store_true", help="also run the kill test")
    ap.add_argument(
        "--cluster-per-run",
        action="store_true",
        help="start a cluster for each (policy, reuse) run, so each starts from empty pools, "
        "and with --rate-share another for each open-loop run (not with --kill)",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for every run's cluster, e.g. engine.entry_reserve=0.25 "
        "(repeatable; not for what this bench's own flags set)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write each run's summary here")
    ap.add_argument(
        "--profile-routers",
        type=Path,
        metavar="DIR",
        help="run each router replica's event loop under cProfile and write the first "
        "replica's profile of each run into DIR (slows the routers: for finding where "
        "their time goes, not for comparing rates)",
    )
    ap.add_argument("--kill-at", type=float, default=0.3, help="share answered before the kill")
    args = ap.parse_args()
    if args.pairs and (args.policies or args.reuse):
        ap.error("--pairs names the runs: not with --policies or --reuse")
    if args.pairs:
        args.pair_list = [text.rpartition(":")[::2] for text in args.pairs]
        for text, (policy, reuse) in zip(args.pairs, args.pair_list, strict=True):
            if not policy or reuse not in REUSE_MODES:
                ap.error(f"--pairs {text}: expected POLICY:REUSE, REUSE one of {REUSE_MODES}")
        args.policies = list(dict.fromkeys(policy for policy, _ in args.pair_list))
        args.reuse = list(dict.fromkeys(reuse for _, reuse in args.pair_list))
    else:
        args.policies, args.reuse = args.policies or list(POLICIES), args.reuse or ["exact"]
        args.pair_list = [(p, r) for p in args.policies for r in args.reuse]
    if args.cluster_per_run and args.kill:
        ap.error("--cluster-per-run runs each pair alone: not with --kill")
    for override in args.set:
        key = override.partition("=")[0]
        if key in OWN_FLAGS:
            ap.error(f"--set {key}: use {OWN_FLAGS[key]}")
    try:  # the overrides meet the config's checks before anything starts
        cluster_config(args, 1)
    except ValueError as error:
        ap.error(str(error))
    if args.pages is None:
        args.pages = default_pages(args.docs, args.doc_tokens)
    check_worker_gpu_arguments(ap, args)
    return args


if __name__ == "__main__":
    main()
