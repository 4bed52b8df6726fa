"""Router metrics, rendered in the Prometheus text format at ``GET /metrics``.

Each router replica (and each batch driver) keeps its own counters; Prometheus
sums them across scrape targets. Invariant: updated and read from one event loop
only, so no locking.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Counter:
    name: str
    help: str
    label_names: tuple[str, ...] = ()
    values: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, *labels: str, by: float = 1) -> None:
        self.values[labels] = self.values.get(labels, 0) + by

    def total(self) -> float:
        return sum(self.values.values())

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not self.values and not self.label_names:
            self.values[()] = 0
        for labels, value in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, labels)} {_num(value)}")
        return lines


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observations: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.buckets):
            self.counts[index] += 1
        self.total += value
        self.observations += 1

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


@dataclass
class Gauge:
    name: str
    help: str
    read: Callable[[], float]

    def render(self) -> list[str]:
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} gauge",
            f"{self.name} {_num(self.read())}",
        ]


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
        self.prompt_tokens = Counter("chunkserve_prompt_tokens_total", "prompt tokens served")
        self.cached_tokens = Counter(
            "chunkserve_cached_prompt_tokens_total", "prompt tokens served from the KV cache"
        )
        self.generated_tokens = Counter("chunkserve_generated_tokens_total", "tokens generated")
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
        self.in_flight = 0
        self.healthy_workers: Callable[[], float] = lambda: 0

    def cache_hit_rate(self) -> float:
        prompt = self.prompt_tokens.total()
        return self.cached_tokens.total() / prompt if prompt else 0.0

    def render(self) -> str:
        gauges = [
            Gauge("chunkserve_requests_in_flight", "requests being served", lambda: self.in_flight),
            Gauge(
                "chunkserve_healthy_workers",
                "workers this router can route to",
                self.healthy_workers,
            ),
            Gauge(
                "chunkserve_cache_hit_rate", "cached / prompt tokens so far", self.cache_hit_rate
            ),
        ]
        parts = [
            self.requests,
            self.ttft,
            self.prompt_tokens,
            self.cached_tokens,
            self.generated_tokens,
            self.lookups,
            self.lookup_failures,
            self.routes,
            self.retries,
            *gauges,
        ]
        return "\n".join(line for part in parts for line in part.render()) + "\n"


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))
