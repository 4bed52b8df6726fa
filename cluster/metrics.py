"""Router metrics, rendered in the Prometheus text format at ``GET /metrics``.

Each router replica (and each batch driver) counts in its own ``Metrics``, updated
and read from one event loop only, so no locking. The HTTP app's replicas share
their counts through one ``MetricsBoard`` actor per app (``SharedMetrics``): every
replica pushes a snapshot of its cumulative counts every ``PUSH_INTERVAL_S``, and
the replica answering a scrape pushes its own first, then renders the sum over
every replica's latest snapshot. So any replica answers for the whole app and
repeated scrapes agree; only another replica's last ``PUSH_INTERVAL_S`` of work may
be missing from a scrape.

Invariants:
- Counters and histograms never decrease while the board lives: the snapshot of a
  replica that stopped stays in the sum. Its gauges (requests in flight) leave the
  sum once its snapshot is ``STALE_S`` old.
- The board is owned by the replica that created it and dies with it; the other
  replicas then create a new one, and their next pushes restore their own counts
  (a stopped replica's counts are lost, which Prometheus reads as a counter reset).
- Worker gauges (up, load, cached pages) and the workers' step counters are read
  from the workers at scrape time, not summed over replicas.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayError

from workers.runtime.worker_types import WorkerStatus

logger = logging.getLogger(__name__)

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0)
LOOP_LAG_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LOOP_PROBE_S = 0.05  # the event loop's lag is sampled this often

PUSH_INTERVAL_S = 0.5  # a replica's counts reach other replicas' scrapes this late
STALE_S = 5.0  # a replica silent this long is gone: its gauges leave the sum
BOARD_TIMEOUT_S = 2.0  # one call to the board

Labels = tuple[str, ...]


@dataclass
class Counter:
    name: str
    help: str
    label_names: Labels = ()
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, *labels: str, by: float = 1) -> None:
        self.values[labels] = self.values.get(labels, 0) + by

    def total(self) -> float:
        return sum(self.values.values())

    def merged(self, other: Counter) -> Counter:
        values = dict(self.values)
        for labels, value in other.values.items():
            values[labels] = values.get(labels, 0) + value
        return Counter(self.name, self.help, self.label_names, values)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        values = self.values if self.values or self.label_names else {(): 0}
        for labels, value in sorted(values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, labels)} {_num(value)}")
        return lines


@dataclass
class Gauge:
    name: str
    help: str
    label_names: Labels = ()
    values: dict[Labels, float] = field(default_factory=dict)

    def set(self, value: float, *labels: str) -> Gauge:
        self.values[labels] = value
        return self

    def merged(self, other: Gauge) -> Gauge:
        """Summed: a gauge merged across replicas is each replica's share (in flight)."""
        values = dict(self.values)
        for labels, value in other.values.items():
            values[labels] = values.get(labels, 0) + value
        return Gauge(self.name, self.help, self.label_names, values)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge"]
        values = self.values if self.values or self.label_names else {(): 0}
        for labels, value in sorted(values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, labels)} {_num(value)}")
        return lines


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    observations: int = 0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.buckets):
            self.counts[index] += count
        self.total += value * count
        self.observations += count

    def merged(self, other: Histogram) -> Histogram:
        if other.buckets != self.buckets:
            raise ValueError(f"{self.name}: replicas disagree on the buckets; redeploy them all")
        zeros = [0] * len(self.buckets)
        counts = [a + b for a, b in zip(self.counts or zeros, other.counts or zeros, strict=True)]
        return Histogram(
            self.name,
            self.help,
            self.buckets,
            counts,
            self.total + other.total,
            self.observations + other.observations,
        )

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts or [0] * len(self.buckets), strict=True):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.observations}')
        lines.append(f"{self.name}_sum {_num(self.total)}")
        lines.append(f"{self.name}_count {self.observations}")
        return lines


Family = Counter | Gauge | Histogram
Snapshot = tuple[Family, ...]  # one replica's families, copied
AgedSnapshot = tuple[float, Snapshot]  # seconds since it was taken, the snapshot


class Metrics:
    def __init__(self) -> None:
        self.requests = Counter(
            "chunkserve_requests_total",
            "HTTP/batch requests by endpoint and status",
            ("endpoint", "status"),
        )
        self.ttft = Histogram(
            "chunkserve_time_to_first_token_seconds",
            "request arrival to first token",
            TTFT_BUCKETS_S,
        )
        self.e2e = Histogram(
            "chunkserve_e2e_request_latency_seconds",
            "request arrival to the end of its answer (answers sent in full: not "
            "refused requests, not streams the client closed early)",
            E2E_BUCKETS_S,
        )
        self.inter_token = Histogram(
            "chunkserve_inter_token_latency_seconds",
            "time between a choice's successive tokens as the router receives them; a "
            "delta of k tokens after a gap g counts as k gaps of g/k (streams coalesce "
            "tokens; a buffered answer arrives at once, so it counts its mean gap)",
            INTER_TOKEN_BUCKETS_S,
        )
        self.queue_time = Histogram(
            "chunkserve_request_queue_time_seconds",
            "request arrival until a worker is handed it: reading the body, preparing "
            "the prompt (including waiting for a prompt thread) and routing. Workers do "
            "not report their own queue wait; it is part of time to first token",
            TTFT_BUCKETS_S,
        )
        self.prompt_tokens = Counter(
            "chunkserve_prompt_tokens_total", "prompt tokens served (streams closed early too)"
        )
        self.cached_tokens = Counter(
            "chunkserve_cached_prompt_tokens_total", "prompt tokens served from the KV cache"
        )
        self.generated_tokens = Counter(
            "chunkserve_generated_tokens_total",
            "tokens generated and received by the router (streams closed early too)",
        )
        self.lookups = Counter("chunkserve_directory_lookups_total", "chunk directory lookups")
        self.lookup_failures = Counter(
            "chunkserve_directory_lookup_failures_total",
            "lookups that got no information (directory unreachable)",
        )
        self.routes = Counter(
            "chunkserve_routing_decisions_total", "routing decisions by reason", ("reason",)
        )
        self.retries = Counter(
            "chunkserve_worker_retries_total", "requests moved to another worker before output"
        )
        self.loop_lag = Histogram(
            "chunkserve_event_loop_lag_seconds",
            f"how late the router's event loop ran a timer that was due (sampled every "
            f"{LOOP_PROBE_S * 1000:g} ms): the wait any callback there had for the loop, "
            "busy with other requests' work",
            LOOP_LAG_BUCKETS_S,
        )
        self.cpu_seconds = Counter(
            "chunkserve_router_cpu_seconds_total",
            "CPU seconds of the router processes (user + system, every thread), counted "
            "while they serve",
        )
        self.in_flight = 0
        self.preparing: dict[str, int] = {}  # lane -> prompts waiting for or in preparation
        self.healthy_workers: Callable[[], float] = lambda: 0
        self._watching: asyncio.Task | None = None

    def watch_loop(self) -> None:
        """Sample the running event loop's lag into ``loop_lag`` and this process's CPU
        time into ``cpu_seconds`` from now on, every ``LOOP_PROBE_S`` (idempotent; call
        from the loop that serves)."""
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._watch_forever())

    async def _watch_forever(self) -> None:
        loop = asyncio.get_running_loop()
        cpu = time.process_time()
        while True:
            due = loop.time() + LOOP_PROBE_S
            await asyncio.sleep(LOOP_PROBE_S)
            self.loop_lag.observe(max(0.0, loop.time() - due))
            now = time.process_time()
            self.cpu_seconds.inc(by=now - cpu)
            cpu = now

    def cache_hit_rate(self) -> float:
        prompt = self.prompt_tokens.total()
        return self.cached_tokens.total() / prompt if prompt else 0.0

    def snapshot(self) -> Snapshot:
        """Copies of the families that add up across replicas."""
        in_flight = Gauge("chunkserve_requests_in_flight", "requests being served")
        preparing = Gauge(
            "chunkserve_prompts_preparing",
            "prompts waiting for or being tokenized, by lane (large prompts have their "
            "own thread, so they never hold up small ones)",
            ("lane",),
        )
        for lane, count in sorted(self.preparing.items()):
            preparing.set(count, lane)
        families = (
            self.requests,
            self.ttft,
            self.e2e,
            self.inter_token,
            self.queue_time,
            self.prompt_tokens,
            self.cached_tokens,
            self.generated_tokens,
            self.lookups,
            self.lookup_failures,
            self.routes,
            self.retries,
            self.loop_lag,
            self.cpu_seconds,
        )
        return (*copy.deepcopy(families), in_flight.set(self.in_flight), preparing)

    def local_gauges(self) -> list[Family]:
        """This router's own view (not summed over replicas)."""
        healthy = Gauge("chunkserve_healthy_workers", "workers this router can route to")
        return [healthy.set(self.healthy_workers())]

    def render(self, extra: Sequence[Family] = ()) -> str:
        """This process's metrics alone (a batch driver, or a replica without a board)."""
        return render([(0.0, self.snapshot())], [*self.local_gauges(), *extra])


def render(snapshots: Sequence[AgedSnapshot], extra: Sequence[Family] = ()) -> str:
    """The sum of ``snapshots`` (gauges only from those under ``STALE_S`` old), the
    cache hit rate of that sum, then ``extra``, in the Prometheus text format."""
    merged = merge(snapshots)
    prompt, cached = (
        merged.get("chunkserve_prompt_tokens_total"),
        merged.get("chunkserve_cached_prompt_tokens_total"),
    )
    rate = 0.0
    if isinstance(prompt, Counter) and isinstance(cached, Counter) and prompt.total():
        rate = cached.total() / prompt.total()
    hit_rate = Gauge("chunkserve_cache_hit_rate", "cached / prompt tokens so far").set(rate)
    families = [*merged.values(), hit_rate, *extra]
    return "\n".join(line for family in families for line in family.render()) + "\n"


def merge(snapshots: Sequence[AgedSnapshot]) -> dict[str, Family]:
    """Families by name, in the order of the first snapshot that has them, summed."""
    merged: dict[str, Family] = {}
    for age_s, snapshot in snapshots:
        for family in snapshot:
            if isinstance(family, Gauge) and age_s > STALE_S:
                continue
            have = merged.get(family.name)
            merged[family.name] = family if have is None else have.merged(family)  # type: ignore[arg-type]
    return merged


def worker_families(statuses: Mapping[str, WorkerStatus | None]) -> list[Family]:
    """Gauges and counters per worker from its status (None: it did not answer);
    the counters are totals since the worker started (a restart reads as a reset)."""
    up = Gauge("chunkserve_worker_up", "1 if the worker answered this scrape", ("worker",))
    requests = Gauge(
        "chunkserve_worker_requests", "choices queued or running on the worker", ("worker",)
    )
    tokens = Gauge(
        "chunkserve_worker_load_tokens",
        "prompt plus most new tokens of the worker's queued and running choices: the "
        "KV cache its work may need",
        ("worker",),
    )
    pages = Gauge(
        "chunkserve_worker_cached_pages",
        "KV pages the worker's cache holds (reusable prompt pages)",
        ("worker",),
    )
    kv_total = Gauge(
        "chunkserve_worker_kv_pages", "the worker's KV pool size in pages", ("worker",)
    )
    kv_in_use = Gauge(
        "chunkserve_worker_kv_pages_in_use",
        "KV pages no allocation can take (running sequences' and pinned pages); cached "
        "pages that can be evicted are not counted",
        ("worker",),
    )
    backlog = Gauge(
        "chunkserve_worker_prefill_backlog_tokens",
        "prompt tokens queued for prefill on the worker (waiting or mid-prefill), what "
        "a new request waits behind; the router's expected-wait routing reads it",
        ("worker",),
    )
    prefill_rate = Gauge(
        "chunkserve_worker_prefill_tokens_per_second",
        "the worker's measured prefill rate (moving average over its steps); 0 before "
        "it prefilled anything",
        ("worker",),
    )
    steps = Counter(
        "chunkserve_worker_steps_total",
        "engine steps the worker ran, by kind: a CUDA graph or eager, and the attention "
        "kind (decode, prefill, prefill-split, prefill-small-tiles, cascade; torch on the "
        "CPU backend)",
        ("worker", "kind"),
    )
    step_seconds = Counter(
        "chunkserve_worker_step_seconds_total",
        "the worker's steps' time by kind (as steps_total): on a GPU each step's span on "
        "the device, from reaching its start to its tokens' copy; on the CPU its compute",
        ("worker", "kind"),
    )
    busy = Counter(
        "chunkserve_worker_engine_busy_seconds_total",
        "wall time the worker's engine loop spent inside steps (launching, waiting for "
        "the device, emitting tokens): its rate is how busy the engine is",
        ("worker",),
    )
    host_slots = Gauge(
        "chunkserve_worker_host_kv_pages",
        "pages the worker's host-memory KV tier holds at most (engine.host_kv_gib); "
        "workers without the tier are left out",
        ("worker",),
    )
    host_used = Gauge(
        "chunkserve_worker_host_kv_pages_used",
        "pages in the worker's host-memory KV tier, by what they hold: prefix pages "
        "(exact reuse) or position-free chunk entries",
        ("worker", "kind"),
    )
    host_hits = Counter(
        "chunkserve_worker_host_kv_hits_total",
        "admissions that loaded a prefix or a chunk entry back from the host tier",
        ("worker",),
    )
    host_bytes = Counter(
        "chunkserve_worker_host_kv_bytes_total",
        "KV bytes moved between device and host memory, by direction (to_host: "
        "evictions written; to_device: loads)",
        ("worker", "direction"),
    )
    host_skipped = Counter(
        "chunkserve_worker_host_kv_pages_skipped_total",
        "evicted pages not written to the host tier because the writes already staged "
        "held their device memory (evictions outrunning the host link): dropped as "
        "without a tier",
        ("worker",),
    )
    host_load = Counter(
        "chunkserve_worker_host_kv_load_seconds_total",
        "time the host tier's loads took (on a GPU their copies' span on the device); "
        "over host_kv_bytes_total{direction=to_device}: the load cost per byte",
        ("worker",),
    )
    for worker_id, status in sorted(statuses.items()):
        up.set(0 if status is None else 1, worker_id)
        if status is not None:
            requests.set(status.load.requests, worker_id)
            tokens.set(status.load.tokens, worker_id)
            pages.set(status.cached_pages, worker_id)
            kv_total.set(status.kv_pages_total, worker_id)
            kv_in_use.set(status.kv_pages_in_use, worker_id)
            backlog.set(status.load.prefill_backlog_tokens, worker_id)
            prefill_rate.set(status.load.prefill_tokens_per_s, worker_id)
            for kind, (count, seconds) in status.step_tally.steps_by_kind.items():
                steps.inc(worker_id, kind, by=count)
                step_seconds.inc(worker_id, kind, by=seconds)
            busy.inc(worker_id, by=status.step_tally.busy_s)
            tier = status.host_tier
            if tier is not None:
                host_slots.set(tier.slots, worker_id)
                host_used.set(tier.pages, worker_id, "prefix")
                host_used.set(tier.entry_pages, worker_id, "entry")
                host_hits.inc(worker_id, by=tier.hits)
                host_bytes.inc(worker_id, "to_host", by=tier.bytes_written)
                host_bytes.inc(worker_id, "to_device", by=tier.bytes_loaded)
                host_skipped.inc(worker_id, by=tier.pages_skipped)
                host_load.inc(worker_id, by=tier.load_s)
    return [
        up, requests, tokens, pages, kv_total, kv_in_use, backlog, prefill_rate,
        steps, step_seconds, busy, host_slots, host_used, host_hits, host_bytes, host_skipped,
        host_load,
    ]  # fmt: skip


class MetricsBoard:
    """The latest snapshot of every router replica of one app, by replica id.
    Runs as a named actor (``MetricsBoardActor``); see the module invariants."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, Snapshot]] = {}

    async def put(self, replica_id: str, snapshot: Snapshot) -> None:
        self._latest[replica_id] = (time.monotonic(), snapshot)

    async def exchange(self, replica_id: str, snapshot: Snapshot) -> list[AgedSnapshot]:
        """Keep ``snapshot``; every replica's latest, with its age."""
        await self.put(replica_id, snapshot)
        now = time.monotonic()
        return [(now - at, kept) for at, kept in self._latest.values()]


MetricsBoardActor = ray.remote(enable_task_events=False)(MetricsBoard)  # as WorkerActor


class SharedMetrics:
    """A replica's ``Metrics`` and its link to the app's board (see the module
    docstring). Use from the replica's event loop only."""

    def __init__(self, metrics: Metrics, board_name: str, namespace: str) -> None:
        self.metrics = metrics
        self._replica_id = uuid.uuid4().hex
        self._board_name = board_name
        self._namespace = namespace
        self._board = self._connect()
        self._pushing: asyncio.Task | None = None

    def start(self) -> None:
        """Push this replica's counts in the background from now on (idempotent)."""
        if self._pushing is None:
            self._pushing = asyncio.get_running_loop().create_task(self._push_forever())
            self.metrics.watch_loop()

    async def render(self, extra: Sequence[Family] = ()) -> str:
        """Every replica's counts summed, then this replica's gauges and ``extra``."""
        self.start()
        gauges = [*self.metrics.local_gauges(), *extra]
        for attempt in range(2):
            snapshot = self.metrics.snapshot()
            try:
                call = self._board.exchange.remote(self._replica_id, snapshot)
                return render(await asyncio.wait_for(call, BOARD_TIMEOUT_S), gauges)
            except RayActorError:  # its owner (another replica) stopped: make a new one
                if attempt == 0:
                    await self._reconnect()
            except (RayError, TimeoutError) as error:
                logger.warning("metrics board unreachable (%r): this replica's counts only", error)
                break
        return render([(0.0, self.metrics.snapshot())], gauges)

    async def _push_forever(self) -> None:
        while True:
            await asyncio.sleep(PUSH_INTERVAL_S)
            try:
                call = self._board.put.remote(self._replica_id, self.metrics.snapshot())
                await asyncio.wait_for(call, BOARD_TIMEOUT_S)
            except RayActorError:
                await self._reconnect()
            except (RayError, TimeoutError) as error:
                logger.debug("metrics push failed: %r", error)

    async def _reconnect(self) -> None:
        self._board = await asyncio.to_thread(self._connect)

    def _connect(self) -> ActorHandle:
        """The app's board, created (owned by this replica) if none runs. Blocking."""
        return MetricsBoardActor.options(
            name=self._board_name,
            namespace=self._namespace,
            get_if_exists=True,
            num_cpus=0,
        ).remote()


def _labels(names: Labels, values: Labels) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))
