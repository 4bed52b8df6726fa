"""A soak run of ``chunkserve serve``: mixed traffic for ``--minutes``, with client
timeouts and streams closed early among it, sampling every server process's memory,
the latency and the outcomes as it goes.

What runs, all started here and all stopped at the end (also on an error or Ctrl-C):
- Ray: a private head (``bench/http_rag.py``'s ``start_ray``: its own temp dir and free
  ports, CPUs only), joined by explicit address only;
- the app: ``python -m cluster.ops.cli serve --config CONFIG`` (default ``configs/local.yaml``:
  the shipped doc-QA model) named ``soak-XXXXXX`` on a free port of 127.0.0.1;
- the clients: ``--clients`` asyncio tasks in this process, each with its own
  ``openai.AsyncOpenAI`` and ``httpx.AsyncClient``. Closed loop with pacing: a client
  sends one request at a time, on its own beat of ``clients / rate`` seconds; a beat
  missed while waiting for an answer is skipped, never made up in a burst, so the
  total is at most ``--rate`` requests/s (the achieved rate is reported).

Traffic, doc-QA documents and questions (``modeltools/docqa_data.py``; answers are not
checked, only how each request ended):
- ``chat``: 2-8 documents as text parts and a question, ``max_tokens`` 8;
- ``approx_chat``: the same with ``reuse: {"mode": "approximate"}``;
- ``stream``: the same with the assistant turn begun ("Staff note:", continued: the model
  then writes notes up to ``max_tokens`` 32); one in 10 is closed by the client after
  two content deltas;
- ``chunk_register``: ``POST /v1/chunks`` of one document with ``ttl_s`` ``--ttl-s``;
- ``chunk_chat``: a chat whose first part is a registered chunk still pinned;
- one request in 10 of every kind gets a client timeout of 2-60 ms: rows ``KIND+timeout``.

Phases: warm-up traffic (``--warmup-minutes``); a quiet pause until the chunks registered
so far expired and no request runs: the baseline (each worker's KV pages in use and
requests in flight); the measured traffic (the rest of ``--minutes``); a quiet wait,
likewise, until the pages are back to the baseline or the chunks' TTL and a margin passed:
the end.

Sampled every ``--sample-s`` seconds: the RSS of every process of the private Ray cluster
(the ``ray start`` process's descendants, anything whose command line names its temp dir)
and of ``chunkserve serve``, each named by its role; every worker's epoch, pages in use
and requests in flight; each kind's latency p50/p90 and outcomes in the interval.

Reported: a table on stdout (processes' RSS and its slope over the measured phase,
latency p50 per kind in its first and last minute and their ratio, outcomes by kind,
restarts, pages and requests at baseline and end, Python tracebacks in the logs by
their last line) and a JSON summary (``--json``) with the samples besides. Progress, a
line per sample, goes to stderr.

Exit status: 0 nothing wrong found; 1 a problem (a 5xx, a connection error or other
exception, a request past ``--request-timeout-s``, a worker restart, pages in use above
the baseline at the end); 2 a service did not start; 130 interrupted.

    python bench/soak.py --minutes 10
    python bench/soak.py --minutes 1 --warmup-minutes 0.25 --rate 15 --ttl-s 10 --json /tmp/s.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402
from ray.exceptions import RayError  # noqa: E402

from bench import http_rag  # noqa: E402
from bench.http_rag import (  # noqa: E402
    ServeProcess,
    free_port,
    log,
    metrics_delta,
    scrape,
    start_ray,
    wait_healthy,
)
from cluster.config import ClusterConfig, load_config  # noqa: E402
from modeltools.docqa_data import DocQAExample, generate  # noqa: E402

KINDS = ("chat", "approx_chat", "stream", "chunk_register", "chunk_chat")
WEIGHTS = (0.3, 0.15, 0.25, 0.1, 0.2)
TIMEOUT_SHARE = 0.1  # of every kind: a client timeout of TIMEOUT_RANGE_S
TIMEOUT_RANGE_S = (0.002, 0.060)
EARLY_CLOSE_SHARE = 0.1  # of the streams: closed after EARLY_CLOSE_DELTAS content deltas
EARLY_CLOSE_DELTAS = 2
CHAT_MAX_TOKENS = 8
STREAM_MAX_TOKENS = 32
STREAM_PREFILL = "Staff note:"  # continued, the model writes notes: a long stream
EXAMPLES = 256
UNEXPECTED = ("5xx", "timeout", "connection_error", "other")
# After a chunk's TTL: the workers' expiry thread's period (1 s) and some slack.
EXPIRY_MARGIN_S = 3.0
SETTLE_TIMEOUT_S = 30.0  # beyond the TTL and margin: how long a quiet wait may take
STATUS_TIMEOUT_S = 5.0
STOP_LOAD_S = 10.0  # beyond --request-timeout-s: the clients' last requests
LATENCY_WINDOW_S = 60.0  # drift: the first and last minute (half the phase if shorter)


# -- the traffic ----------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    kind: str  # one of KINDS
    timeout_s: float | None  # a client timeout of TIMEOUT_RANGE_S, or None
    close_early: bool  # a stream the client closes after EARLY_CLOSE_DELTAS deltas

    @property
    def row(self) -> str:
        """The outcome table's row: the kind, ``+timeout`` where the client times out."""
        return self.kind + ("+timeout" if self.timeout_s is not None else "")


@dataclass(frozen=True)
class Outcome:
    row: str  # Plan.row
    result: str  # an HTTP status ("200"), "client_timeout", "early_close", "timeout", ...
    start: float  # seconds since the run started
    end: float


class Traffic:
    """Draws plans and builds their bodies from doc-QA examples; remembers the chunks
    registered and when the last pin made so far ends at the latest."""

    def __init__(self, model: str, ttl_s: float, seed: int) -> None:
        self.model = model
        self.ttl_s = ttl_s
        self.rng = random.Random(seed)
        self.examples: list[DocQAExample] = generate(seed, EXAMPLES, (2, 8), "heldout")
        self.chunks: list[tuple[str, float]] = []  # (id, monotonic time its pin ends by)
        self.pins_end = 0.0  # monotonic time by which every pin made so far has ended

    def draw(self) -> Plan:
        """A kind by WEIGHTS (a chunk_chat only while a chunk has 5 s of its pin left,
        else a chunk_register), a client timeout for TIMEOUT_SHARE of them, an early
        close for EARLY_CLOSE_SHARE of the other streams."""
        kind = self.rng.choices(KINDS, WEIGHTS)[0]
        if kind == "chunk_chat" and not self._live_chunks():
            kind = "chunk_register"
        timeout = None
        if self.rng.random() < TIMEOUT_SHARE:
            timeout = self.rng.uniform(*TIMEOUT_RANGE_S)
        early = kind == "stream" and timeout is None and self.rng.random() < EARLY_CLOSE_SHARE
        return Plan(kind, timeout, early)

    def _example(self) -> DocQAExample:
        return self.rng.choice(self.examples)

    def chat(self, kind: str) -> dict:
        """Keyword arguments of ``chat.completions.create`` for a chat or approx_chat."""
        ex = self._example()
        body = {"model": self.model, "messages": ex.messages, "max_tokens": CHAT_MAX_TOKENS}
        if kind == "approx_chat":
            body["extra_body"] = {"reuse": {"mode": "approximate"}}
        return body

    def stream(self) -> dict:
        """A streamed chat continuing a begun assistant turn (long answers)."""
        ex = self._example()
        messages = [*ex.messages, {"role": "assistant", "content": STREAM_PREFILL}]
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": STREAM_MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
        }

    def chunk(self) -> dict:
        """A ``POST /v1/chunks`` body: one document, pinned for the TTL."""
        return {"content": self.rng.choice(self._example().documents), "ttl_s": self.ttl_s}

    def registered(self, chunk_id: str, started: float) -> None:
        """A chunk registered by a request sent at ``started``: pinned until a TTL after
        it at least (expired ones are forgotten)."""
        self.chunks = [c for c in self.chunks if c[1] > time.monotonic()]
        self.chunks.append((chunk_id, started + self.ttl_s))

    def attempted_registration(self) -> None:
        """A registration ended (any way): its pin, if any, ends a TTL from now at the latest."""
        self.pins_end = max(self.pins_end, time.monotonic() + self.ttl_s)

    def _live_chunks(self) -> list[str]:
        """Ids of the chunks with more than 5 s of their pin left."""
        return [i for i, end in self.chunks if end - time.monotonic() > 5]

    def chunk_chat(self) -> dict:
        """A chat whose first part is a chunk with 5 s or more of its pin left (drawn
        only while there is one)."""
        ex = self._example()
        parts = [{"type": "chunk", "chunk_id": self.rng.choice(self._live_chunks())}]
        parts += [{"type": "text", "text": d} for d in (*ex.documents[1:], ex.question)]
        messages = [ex.messages[0], {"role": "user", "content": parts}]
        return {"model": self.model, "messages": messages, "max_tokens": CHAT_MAX_TOKENS}


@dataclass
class Client:
    chat: openai.AsyncOpenAI
    http: httpx.AsyncClient
    root: str  # http://127.0.0.1:PORT
    request_timeout_s: float


async def send(client: Client, traffic: Traffic, plan: Plan) -> str:
    """Sends one request of ``plan``; returns its HTTP status or how it ended otherwise
    (never raises but for cancellation)."""
    timeout = plan.timeout_s or client.request_timeout_s
    try:
        async with asyncio.timeout(client.request_timeout_s + STOP_LOAD_S):
            return await _send(client, traffic, plan, timeout)
    except (openai.APITimeoutError, httpx.TimeoutException, TimeoutError):
        return "client_timeout" if plan.timeout_s is not None else "timeout"
    except openai.APIStatusError as error:
        return str(error.status_code)
    except (openai.APIConnectionError, httpx.TransportError) as error:
        return f"connection_error:{type(error).__name__}: {error}"[:300]
    except Exception as error:  # noqa: BLE001 - every failure is counted, by kind
        return f"other:{type(error).__name__}: {error}"[:300]


async def _send(client: Client, traffic: Traffic, plan: Plan, timeout: float) -> str:
    """The request of ``plan``; "200" once answered (the client raises on any other)."""
    if plan.kind == "chunk_register":
        return await _register(client, traffic, timeout)
    if plan.kind == "stream":
        return await _stream(client, traffic.stream(), timeout, plan.close_early)
    body = traffic.chunk_chat() if plan.kind == "chunk_chat" else traffic.chat(plan.kind)
    await client.chat.chat.completions.create(**body, timeout=timeout)
    return "200"


async def _register(client: Client, traffic: Traffic, timeout: float) -> str:
    """``POST /v1/chunks``; its status. ``traffic`` learns of the pin in any case."""
    started = time.monotonic()
    try:
        reply = await client.http.post(
            f"{client.root}/v1/chunks", json=traffic.chunk(), timeout=timeout
        )
    finally:
        traffic.attempted_registration()
    if reply.status_code == 200:
        traffic.registered(reply.json()["id"], started)
    return str(reply.status_code)


async def _stream(client: Client, body: dict, timeout: float, close_early: bool) -> str:
    """Reads the stream to its end, or closes it after EARLY_CLOSE_DELTAS content deltas
    ("early_close", only where its last choice had not finished yet)."""
    stream = await client.chat.chat.completions.create(**body, timeout=timeout)
    deltas = 0
    async with stream:  # closes the response (the connection) on leaving
        async for chunk in stream:
            deltas += any(c.delta.content for c in chunk.choices)
            finished = any(c.finish_reason for c in chunk.choices)
            if close_early and deltas >= EARLY_CLOSE_DELTAS and not finished:
                return "early_close"
    return "200"


def outcome_class(result: str) -> str:
    """2xx/4xx/5xx for an HTTP status, else the result up to its first colon."""
    return f"{result[0]}xx" if result.isdigit() else result.split(":")[0]


# -- the run's record -----------------------------------------------------------------
@dataclass
class Run:
    """Everything measured, in seconds since ``started`` (monotonic)."""

    started: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    phases: dict[str, list[float]] = field(default_factory=dict)  # name -> [start, end]
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    labels: dict[int, str] = field(default_factory=dict)  # pid -> its latest role
    rss: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    workers: dict[str, list[dict]] = field(default_factory=lambda: defaultdict(list))
    readings: dict[str, dict] = field(default_factory=dict)  # "baseline"/"end" -> per worker
    sampled_outcomes: int = 0  # outcomes already in a sample's interval

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.started

    def begin(self, phase: str) -> None:
        """``phase`` is the current one, from now on."""
        self.phase = phase
        self.phases[phase] = [self.now(), self.now()]

    def end_phase(self) -> None:
        """The current phase ends now."""
        self.phases[self.phase][1] = self.now()

    def measured_span(self) -> tuple[float, float]:
        """The measured phase's start and end (now, while it runs; 0, 0 before it)."""
        start, end = self.phases.get("measured", [0.0, 0.0])
        return start, self.now() if self.phase == "measured" else end


# -- processes ------------------------------------------------------------------------
PROC = Path("/proc")
RAY_SCRIPTS = {
    "dashboard/agent.py": "dashboard agent",
    "runtime_env/agent/main.py": "runtime_env agent",
    "log_monitor.py": "log monitor",
    "autoscaler/_private/monitor.py": "autoscaler monitor",
    "dashboard/dashboard.py": "dashboard",
}
ACTOR_ROLES = {
    "DirectoryHost": "directory actor",
    "ClusterKeeper": "keeper",
    "ServeController": "serve controller",
    "ProxyActor": "serve proxy",
    "IDLE": "idle Ray worker",
}


def process_parents() -> dict[int, int]:
    """pid -> parent pid of every process now running (those gone meanwhile left out)."""
    parents = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def cmdline(pid: int) -> list[str]:
    """The process's arguments (a Ray worker's title, ``ray::Class...``, in the first);
    empty once it is gone."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a for a in raw.decode(errors="replace").split("\0") if a]


def rss_mb(pid: int) -> float | None:
    """VmRSS in MB (2^20 bytes); None once the process is gone."""
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


def server_pids(roots: list[int], temp_dir: str) -> dict[int, int]:
    """``roots`` and their descendants, and every process whose command line names
    ``temp_dir``: pid -> parent pid."""
    parents = process_parents()
    children = defaultdict(list)
    for pid, parent in parents.items():
        children[parent].append(pid)
    found: set[int] = set()
    todo = [pid for pid in roots if pid in parents]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children[pid]
    found |= {pid for pid in parents if temp_dir in " ".join(cmdline(pid))}
    return {pid: parents[pid] for pid in found}


def role(args: list[str]) -> str:
    """A process's role from its command line (``take_sample`` names a worker actor's
    process by its worker id instead)."""
    if not args:
        return "gone"
    title = " ".join(args)
    if title.startswith("ray::"):
        name = re.split(r"[ .(]", title.removeprefix("ray::"), maxsplit=1)[0]
        if name.startswith("ServeReplica:"):
            return "serve replica " + name.rsplit(":", 1)[-1]
        return ACTOR_ROLES.get(name, name)
    exe = Path(args[0]).name
    if exe in ("gcs_server", "raylet"):
        return exe
    if "cluster.ops.cli" in args and "serve" in args:
        return "chunkserve serve"
    if "ray.scripts.scripts" in args:
        return "ray start"
    if "ray.util.client.server" in args:
        return "ray client server"
    if "workers.runtime.engine_child" in args:
        return "engine child"
    for script, name in RAY_SCRIPTS.items():
        if any(a.endswith(script) for a in args):
            return name
    return exe


def find_ray_start() -> tuple[int, str]:
    """The pid and temp dir of the ``ray start`` process this process started."""
    parents = process_parents()
    for pid in sorted(p for p, parent in parents.items() if parent == os.getpid()):
        args = cmdline(pid)
        if "ray.scripts.scripts" in args and "start" in args:
            temp = [a.split("=", 1)[1] for a in args if a.startswith("--temp-dir=")]
            return pid, temp[0]
    raise RuntimeError("the ray start process started here is not running")


# -- workers --------------------------------------------------------------------------
def read_worker(name: str, namespace: str) -> dict:
    """One worker's epoch, pid, KV pages in use and requests in flight (all None where
    it does not answer within STATUS_TIMEOUT_S)."""
    try:
        handle = ray.get_actor(name, namespace=namespace)
        pid_ref = handle.__ray_call__.remote(lambda _actor: os.getpid())
        status, pid = ray.get([handle.status.remote(), pid_ref], timeout=STATUS_TIMEOUT_S)
    except (ValueError, RayError):
        return {"epoch": None, "pid": None, "pages_in_use": None, "requests": None}
    return {
        "epoch": status.info.epoch,
        "pid": pid,
        "pages_in_use": status.kv_pages_in_use,
        "requests": status.load.requests,
    }


async def read_workers(names: list[str], namespace: str) -> dict[str, dict]:
    """``read_worker`` of every worker at once, in threads (the event loop runs on)."""
    readings = [asyncio.to_thread(read_worker, name, namespace) for name in names]
    return dict(zip(names, await asyncio.gather(*readings), strict=True))


# -- sampling -------------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """What the sampler looks at."""

    roots: list[int]  # the ray start and chunkserve serve processes
    temp_dir: str
    workers: list[str]  # worker actor names
    namespace: str


async def take_sample(run: Run, cluster: Cluster) -> dict:
    """Reads every server process's RSS and every worker's status, and the interval's
    latency and outcomes since the last sample; appends it to ``run.samples``."""
    workers = await read_workers(cluster.workers, cluster.namespace)
    worker_pids = {w["pid"]: name for name, w in workers.items() if w["pid"] is not None}
    t = run.now()
    rss = {}
    for pid, parent in sorted(server_pids(cluster.roots, cluster.temp_dir).items()):
        mb = rss_mb(pid)
        if mb is not None:
            run.labels[pid] = worker_pids.get(pid) or role(cmdline(pid))
            if run.labels[pid] == "engine child" and parent in worker_pids:
                run.labels[pid] = f"engine child of {worker_pids[parent]}"
            run.rss[pid].append((t, mb))
            rss[f"{run.labels[pid]} [{pid}]"] = round(mb, 2)
    for name, reading in workers.items():
        run.workers[name].append({"t": round(t, 2), **reading})
    interval = run.outcomes[run.sampled_outcomes :]
    run.sampled_outcomes = len(run.outcomes)
    sample = {
        "t": round(t, 2),
        "phase": run.phase,
        "rss_mb": rss,
        "workers": workers,
        "latency_ms": latency_table(interval),
        "outcomes": class_counts(interval),
    }
    run.samples.append(sample)
    return sample


async def sample_forever(run: Run, cluster: Cluster, period_s: float) -> None:
    """A sample and a progress line every ``period_s`` until cancelled."""
    while True:
        await take_sample(run, cluster)
        log(progress_line(run, period_s))
        await asyncio.sleep(period_s)


def progress_line(run: Run, period_s: float) -> str:
    """Time, phase, requests so far (and per second in the last sample's interval),
    errors, client timeouts and early closes so far, the largest RSS slope so far."""
    classes = Counter(outcome_class(o.result) for o in run.outcomes)
    errors = sum(classes[c] for c in UNEXPECTED)
    slopes = rss_slopes(run)
    top = max(slopes.items(), key=lambda kv: kv[1], default=None)
    largest = f"{run.labels[top[0]]} [{top[0]}] {top[1]:+.2f} MB/min" if top else "-"
    recent = sum(run.samples[-1]["outcomes"].values())
    return (
        f"{run.now() / 60:5.1f} min, {run.phase}: {len(run.outcomes)} requests "
        f"({recent / period_s:.1f}/s lately), {errors} errors "
        f"({', '.join(f'{c} {classes[c]}' for c in UNEXPECTED if classes[c]) or 'none'}), "
        f"{classes['client_timeout']} client timeouts, {classes['early_close']} early closes; "
        f"largest RSS slope (measured phase) {largest}"
    )


# -- statistics -----------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_ms(outcomes: list[Outcome], row: str) -> list[float]:
    """Latencies of ``row``'s answered (2xx) requests, in ms."""
    return [
        1000 * (o.end - o.start)
        for o in outcomes
        if o.row == row and outcome_class(o.result) == "2xx"
    ]


def latency_table(outcomes: list[Outcome]) -> dict[str, dict]:
    """Per kind (no client timeout): p50, p90 (ms) and count of answered requests."""
    table = {}
    for kind in KINDS:
        values = latency_ms(outcomes, kind)
        if values:
            p50, p90 = quantile(values, 0.5), quantile(values, 0.9)
            table[kind] = {"p50": round(p50, 1), "p90": round(p90, 1), "n": len(values)}
    return table


def class_counts(outcomes: list[Outcome]) -> dict[str, int]:
    """Outcomes by ``outcome_class``."""
    return dict(Counter(outcome_class(o.result) for o in outcomes))


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points in MB/min; None for under 3 points."""
    if len(points) < 3:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (y - mean_y) for t, y in points)
    return 60 * cov / var if var else None


def rss_slopes(run: Run) -> dict[int, float]:
    """pid -> its RSS slope (MB/min) over the samples of the measured phase so far."""
    start, end = run.measured_span()
    slopes = {}
    for pid, points in run.rss.items():
        slope = slope_per_min([(t, y) for t, y in points if start <= t <= end])
        if slope is not None:
            slopes[pid] = slope
    return slopes


def latency_drift(run: Run) -> dict[str, dict]:
    """Per kind: p50 (ms) in the measured phase's first and last minute (each half of
    the phase where it is shorter than two minutes) and last / first."""
    start, end = run.measured_span()
    window = min(LATENCY_WINDOW_S, (end - start) / 2)
    first = [o for o in run.outcomes if start <= o.end < start + window]
    last = [o for o in run.outcomes if end - window < o.end <= end]
    drift = {}
    for kind in KINDS:
        a, b = quantile(latency_ms(first, kind), 0.5), quantile(latency_ms(last, kind), 0.5)
        ratio = round(b / a, 3) if a and b else None
        drift[kind] = {"first_p50_ms": _round(a), "last_p50_ms": _round(b), "drift": ratio}
    return drift | {"window_s": round(window, 1)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def outcome_table(outcomes: list[Outcome]) -> dict[str, dict]:
    """Per row (KIND or KIND+timeout): requests sent, results by HTTP status or name, and
    by class."""
    table = {}
    for row in [r for k in KINDS for r in (k, k + "+timeout")]:
        mine = [o for o in outcomes if o.row == row]
        results = Counter(o.result.split(":")[0] for o in mine)
        table[row] = {
            "sent": len(mine),
            "results": dict(sorted(results.items())),
            "classes": class_counts(mine),
        }
    return table


# -- the logs -------------------------------------------------------------------------
TRACEBACK = "Traceback (most recent call last)"
TRACEBACK_EXAMPLE_LINES = 40


def tracebacks(paths: list[Path]) -> dict:
    """Python tracebacks that begin a line in ``paths``, counted by their exception's
    line (object addresses blanked) and by file, with the first of each exception line
    (its file and text, at most TRACEBACK_EXAMPLE_LINES lines)."""
    by_line: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    examples: dict[str, dict] = {}
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith(TRACEBACK):
                end = _exception_end(lines, i + 1)
                last = re.sub(r"0x[0-9a-f]+", "0x?", lines[end].strip())[:200]
                by_line[last] += 1
                by_file[str(path.relative_to(path.parents[1]))] += 1
                text = "\n".join(lines[i : end + 1][-TRACEBACK_EXAMPLE_LINES:])
                examples.setdefault(last, {"file": str(path), "text": text})
    return {
        "count": sum(by_line.values()),
        "by_last_line": dict(by_line.most_common()),
        "by_file": dict(by_file.most_common()),
        "examples": examples,
    }


def _exception_end(lines: list[str], start: int) -> int:
    """The index of the first line from ``start`` on that is not a frame: what was
    raised (the last line where the traceback is cut short)."""
    for i in range(start, min(len(lines), start + 1000)):
        if lines[i].strip() and not lines[i][0].isspace():
            return i
    return min(len(lines), start + 1000) - 1


def log_files(temp_dir: str, serve_log: Path) -> list[Path]:
    """The Ray session's log files and chunkserve serve's output."""
    logs = Path(temp_dir) / "session_latest" / "logs"
    return [p for p in sorted(logs.rglob("*")) if p.is_file()] + [serve_log]


# -- the phases -----------------------------------------------------------------------
async def client_loop(
    client: Client, traffic: Traffic, run: Run, next_t: float, beat_s: float, until: float
) -> None:
    """Sends one request at a time, on beats ``beat_s`` apart from ``next_t`` (monotonic)
    until ``until``, skipping the beats missed; records every outcome."""
    while next_t < until:
        await asyncio.sleep(max(0.0, next_t - time.monotonic()))
        plan = traffic.draw()
        start = run.now()
        result = await send(client, traffic, plan)
        run.outcomes.append(Outcome(plan.row, result, start, run.now()))
        next_t = max(next_t + beat_s, time.monotonic())


async def traffic_phase(
    name: str, seconds: float, args: argparse.Namespace, traffic: Traffic, run: Run, url: str
) -> None:
    """``args.clients`` clients for ``seconds``; the phase ends once their last requests
    are done (each bounded by the request timeout)."""
    run.begin(name)
    log(f"{name}: {args.clients} clients at up to {args.rate:g} requests/s for {seconds:.0f} s")
    now = time.monotonic()
    until = now + seconds
    beat_s = args.clients / args.rate
    clients = [
        Client(
            openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0),
            httpx.AsyncClient(),
            url.removesuffix("/v1"),
            args.request_timeout_s,
        )
        for _ in range(args.clients)
    ]
    try:
        await asyncio.gather(
            *(
                client_loop(c, traffic, run, now + beat_s * i / args.clients, beat_s, until)
                for i, c in enumerate(clients)
            )
        )
    finally:
        for c in clients:
            await c.chat.close()
            await c.http.aclose()
    run.end_phase()


async def quiet_phase(name: str, traffic: Traffic, run: Run, cluster: Cluster) -> None:
    """No traffic until every pin made so far ended (its TTL and EXPIRY_MARGIN_S), no
    request runs, and, with a baseline taken, the pages in use are back to it; gives up
    SETTLE_TIMEOUT_S after the pins' end. The workers' last readings go to
    ``run.readings[name]``."""
    run.begin(name)
    settled_after = max(time.monotonic(), traffic.pins_end + EXPIRY_MARGIN_S)
    deadline = settled_after + SETTLE_TIMEOUT_S
    baseline = run.readings.get("baseline")
    log(f"{name}: waiting up to {deadline - time.monotonic():.0f} s for the pins to end")
    while True:
        readings = await read_workers(cluster.workers, cluster.namespace)
        if time.monotonic() >= settled_after and _settled(readings, baseline):
            break
        if time.monotonic() >= deadline:
            log(f"{name}: not settled within the wait: {readings}")
            break
        await asyncio.sleep(1.0)
    run.readings[name] = readings
    run.end_phase()
    log(f"{name}: {readings}")


def _settled(readings: dict[str, dict], baseline: dict | None) -> bool:
    """No request in flight anywhere and, with a baseline, pages in use at most it."""
    for name, r in readings.items():
        if r["requests"] != 0:
            return False
        if baseline is not None and (r["pages_in_use"] or 0) > (
            baseline[name]["pages_in_use"] or 0
        ):
            return False
    return True


async def soak(args: argparse.Namespace, run: Run, cluster: Cluster, url: str, model: str) -> dict:
    """The phases, sampled throughout; returns the /metrics counters over the measured
    phase."""
    traffic = Traffic(model, args.ttl_s, args.seed)
    sampler = asyncio.create_task(sample_forever(run, cluster, args.sample_s))
    try:
        if args.warmup_minutes > 0:
            await traffic_phase("warm-up", 60 * args.warmup_minutes, args, traffic, run, url)
        await quiet_phase("baseline", traffic, run, cluster)
        root = url.removesuffix("/v1")
        before = await asyncio.to_thread(scrape, root)
        measured_s = 60 * (args.minutes - args.warmup_minutes)
        await traffic_phase("measured", measured_s, args, traffic, run, url)
        await asyncio.sleep(1.0)  # replicas push their counts every 0.5 s
        metrics = metrics_delta(before, await asyncio.to_thread(scrape, root))
        await quiet_phase("end", traffic, run, cluster)
    finally:
        sampler.cancel()
    await take_sample(run, cluster)
    return metrics


# -- the summary ----------------------------------------------------------------------
def machine() -> dict:
    """This machine's cores and RAM (GiB)."""
    meminfo = (PROC / "meminfo").read_text()
    kb = int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.MULTILINE).group(1))
    return {"cores": os.cpu_count(), "ram_gib": round(kb / 2**20, 1)}


def commit() -> str:
    """The short commit of HEAD, "-dirty" after it with tracked files changed."""

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def process_table(run: Run) -> dict[str, dict]:
    """Per process ("role [pid]"): RSS at its first and last sample and most, and its
    slope over the measured phase."""
    slopes = rss_slopes(run)
    table = {}
    for pid, points in sorted(run.rss.items(), key=lambda kv: run.labels[kv[0]]):
        table[f"{run.labels[pid]} [{pid}]"] = {
            "pid": pid,
            "rss_mb_start": round(points[0][1], 1),
            "rss_mb_end": round(points[-1][1], 1),
            "rss_mb_max": round(max(y for _, y in points), 1),
            "seen_s": [round(points[0][0], 1), round(points[-1][0], 1)],
            "slope_mb_per_min": None if pid not in slopes else round(slopes[pid], 3),
        }
    return table


def worker_table(run: Run) -> dict[str, dict]:
    """Per worker: the epochs and pids seen (a restart: more than one epoch), the
    samples it did not answer, and pages in use and requests in flight at baseline and
    end."""
    table = {}
    for name, readings in run.workers.items():
        epochs = list(dict.fromkeys(r["epoch"] for r in readings if r["epoch"] is not None))
        table[name] = {
            "epochs": epochs,
            "restarted": len(epochs) > 1,
            "pids": list(dict.fromkeys(r["pid"] for r in readings if r["pid"] is not None)),
            "unanswered_samples": sum(r["epoch"] is None for r in readings),
            "baseline": _pages(run.readings.get("baseline", {}).get(name)),
            "end": _pages(run.readings.get("end", {}).get(name)),
        }
    return table


def _pages(reading: dict | None) -> dict | None:
    """A reading's pages in use and requests in flight (None without a reading)."""
    if reading is None:
        return None
    return {"pages_in_use": reading["pages_in_use"], "requests": reading["requests"]}


def _back_to_baseline(worker: dict) -> bool:
    """Pages in use at the end at most at the baseline (False without both readings)."""
    base, end = worker["baseline"], worker["end"]
    if base is None or end is None or None in (base["pages_in_use"], end["pages_in_use"]):
        return False
    return end["pages_in_use"] <= base["pages_in_use"]


def problems(outcomes: dict, workers: dict) -> list[str]:
    """What the run found wrong, one line each (empty: nothing)."""
    found = []
    for row, counts in outcomes.items():
        bad = {c: n for c, n in counts["classes"].items() if c in UNEXPECTED}
        if bad:
            found.append(f"{row}: {bad} (results {counts['results']})")
    for name, w in workers.items():
        if w["restarted"]:
            found.append(f"{name} restarted: epochs {w['epochs']}")
        if not _back_to_baseline(w) or (w["end"] or {}).get("requests") != 0:
            found.append(
                f"{name}: not back to baseline: {w['baseline']} at baseline, {w['end']} at the end"
            )
    return found


def summarize(args, run: Run, metrics: dict, logs: dict, serve_log: Path) -> dict:
    """The JSON summary (samples included); ``problems`` empty when nothing went wrong."""
    start, end = run.measured_span()
    measured = [o for o in run.outcomes if start <= o.start <= end]
    outcomes = outcome_table(run.outcomes)
    workers = worker_table(run)
    errors = [o.result for o in run.outcomes if outcome_class(o.result) in UNEXPECTED]
    return {
        "bench": "soak",
        "command": "python " + shlex.join(sys.argv),
        "commit": commit(),
        "machine": machine(),
        "config": str(args.config),
        "sets": args.set,
        "minutes": args.minutes,
        "warmup_minutes": args.warmup_minutes,
        "clients": args.clients,
        "rate": args.rate,
        "ttl_s": args.ttl_s,
        "phases": {k: [round(a, 1), round(b, 1)] for k, (a, b) in run.phases.items()},
        "requests": len(run.outcomes),
        "measured_requests_per_s": round(len(measured) / (end - start), 2) if end > start else 0,
        "processes": process_table(run),
        "latency": latency_drift(run),
        "outcomes": outcomes,
        "first_errors": errors[:10],
        "workers": workers,
        "restarted": any(w["restarted"] for w in workers.values()),
        "pages_back_to_baseline": all(_back_to_baseline(w) for w in workers.values()),
        "tracebacks": logs,
        "metrics": metrics,
        "serve_log": str(serve_log),
        "problems": problems(outcomes, workers),
        "samples": run.samples,
    }


def report(summary: dict) -> str:
    """The table printed at the end."""
    m = summary["machine"]
    lines = [
        f"soak: {summary['minutes']:g} min (warm-up {summary['warmup_minutes']:g}), "
        f"{summary['clients']} clients at up to {summary['rate']:g} req/s "
        f"(measured: {summary['measured_requests_per_s']:g}/s), {summary['requests']} requests; "
        f"commit {summary['commit']}; {m['cores']} cores, {m['ram_gib']} GiB",
        f"command: {summary['command']}",
        "",
        f"{'process':<40} {'RSS start':>10} {'RSS end':>9} {'max':>8} {'MB/min':>8}",
    ]
    for name, p in summary["processes"].items():
        slope = "-" if p["slope_mb_per_min"] is None else f"{p['slope_mb_per_min']:+.2f}"
        lines.append(
            f"{name[:40]:<40} {p['rss_mb_start']:>10.1f} {p['rss_mb_end']:>9.1f} "
            f"{p['rss_mb_max']:>8.1f} {slope:>8}"
        )
    start, end = summary["phases"]["measured"]
    lines.append(
        f"(RSS in MB at the first and last sample; MB/min: least-squares slope over the "
        f"measured phase, {start:g}-{end:g} s)"
    )
    window = summary["latency"]["window_s"]
    lines += ["", f"{'latency p50 (ms)':<18} {'first':>8} {'last':>8} {'drift':>7}  ({window:g} s)"]
    for kind in KINDS:
        d = summary["latency"][kind]
        cells = [_cell(d["first_p50_ms"]), _cell(d["last_p50_ms"]), _cell(d["drift"], "{:.2f}")]
        lines.append(f"{kind:<18} {cells[0]:>8} {cells[1]:>8} {cells[2]:>7}")
    lines += ["", _outcome_header()]
    for row, counts in summary["outcomes"].items():
        lines.append(_outcome_line(row, counts))
    return "\n".join(lines + [""] + _closing_lines(summary))


def _cell(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


OUTCOME_COLUMNS = ("2xx", "4xx", "5xx", "client_timeout", "early_close", *UNEXPECTED[1:])


def _outcome_header() -> str:
    names = {"client_timeout": "c.timeout", "early_close": "early", "connection_error": "conn"}
    return f"{'outcomes':<22} {'sent':>6} " + " ".join(
        f"{names.get(c, c):>9}" for c in OUTCOME_COLUMNS
    )


def _outcome_line(row: str, counts: dict) -> str:
    """A row of the outcome table; HTTP statuses other than 200 named after it."""
    cells = " ".join(f"{counts['classes'].get(c, 0):>9}" for c in OUTCOME_COLUMNS)
    codes = {k: v for k, v in counts["results"].items() if k.isdigit() and k != "200"}
    return f"{row:<22} {counts['sent']:>6} {cells}" + (f"  {codes}" if codes else "")


def _closing_lines(summary: dict) -> list[str]:
    """Workers (restarts, baseline and end), tracebacks in the logs and problems."""
    lines = []
    for name, w in summary["workers"].items():
        lines.append(
            f"{name}: epochs {w['epochs']} ({'RESTARTED' if w['restarted'] else 'no restart'}); "
            f"baseline {w['baseline']}, end {w['end']}"
            + (f"; {w['unanswered_samples']} samples unanswered" if w["unanswered_samples"] else "")
        )
    logs = summary["tracebacks"]
    files = ", ".join(f"{name} {n}" for name, n in logs["by_file"].items())
    lines.append(f"tracebacks in the logs: {logs['count']}" + (f" ({files})" if files else ""))
    lines += [f"  {n:>5}  {line}" for line, n in list(logs["by_last_line"].items())[:10]]
    lines.append("problems: " + ("none" if not summary["problems"] else ""))
    lines += [f"  {p}" for p in summary["problems"]]
    return lines


# -- main -----------------------------------------------------------------------------
def serve_sets(args: argparse.Namespace, ray_address: str) -> list[str]:
    """chunkserve serve's overrides: a name of its own, the private Ray, a free port
    on 127.0.0.1, then ``--set``s."""
    tag = f"{random.randrange(16**6):06x}"
    own = [f"name=soak-{tag}", f"ray.address={ray_address}", "server.host=127.0.0.1"]
    return own + [f"server.port={free_port()}", *args.set]


def start(stack: ExitStack, args: argparse.Namespace, env: dict, serve_log: Path):
    """Ray, the app and a driver of our own on Ray; returns the config, the app's URL
    and what to sample."""
    ray_address = start_ray(stack, SimpleNamespace(gpus_per_worker=0), env)
    ray_pid, temp_dir = find_ray_start()
    sets = serve_sets(args, ray_address)
    cfg: ClusterConfig = load_config(args.config, sets)
    log(f"starting chunkserve serve ({cfg.workers.count} worker(s)); log: {serve_log}")
    serve = ServeProcess(sets, env, serve_log, args.config)
    stack.callback(serve.stop)
    try:
        url = wait_healthy(serve, cfg.workers.count, args.startup_timeout_s)
    except RuntimeError:
        log("chunkserve serve output (tail):\n" + serve.tail())
        raise
    ray.init(
        address=ray_address,
        namespace=cfg.ray.namespace,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    stack.callback(ray.shutdown)
    trap_termination()  # again: ray.init put Ray's own handler (it aborts) in place of ours
    names = [f"{cfg.name}-worker-{i}" for i in range(cfg.workers.count)]
    cluster = Cluster([ray_pid, serve.proc.pid], temp_dir, names, cfg.ray.namespace)
    return cfg, url, cluster


def trap_termination() -> None:
    """SIGTERM and SIGHUP stop everything as Ctrl-C does (a KeyboardInterrupt)."""

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)


def main() -> int:
    """Runs the soak; everything started is stopped before it returns the exit status."""
    args = parse_args()
    http_rag.LOG_TAG = "soak"
    trap_termination()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, single-user cluster
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    serve_log = Path(tempfile.gettempdir()) / f"soak-serve-{os.getpid()}.log"
    run = Run()
    with ExitStack() as stack:
        try:
            cfg, url, cluster = start(stack, args, env, serve_log)
            metrics = asyncio.run(soak(args, run, cluster, url, cfg.model.name))
            logs = tracebacks(log_files(cluster.temp_dir, serve_log))
        except KeyboardInterrupt:
            log("interrupted: stopping everything")
            return 130
        except RuntimeError as error:  # a service did not start: its output is above
            log(f"error: {error}; stopping everything")
            return 2
        summary = summarize(args, run, metrics, logs, serve_log)
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
        print(report(summary), flush=True)
    return 1 if summary["problems"] else 0


def parse_args() -> argparse.Namespace:
    """The command line, checked (the config's path made absolute)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="traffic, warm-up included")
    ap.add_argument("--warmup-minutes", type=float, default=1.0, help="not in the slopes")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (asyncio tasks)")
    ap.add_argument("--rate", type=float, default=40.0, help="requests/s of all clients, at most")
    ap.add_argument("--config", type=Path, default=REPO / "configs/local.yaml")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="extra config override for chunkserve serve (repeatable)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the JSON summary here")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--ttl-s", type=float, default=30.0, help="registered chunks' ttl_s")
    ap.add_argument(
        "--request-timeout-s", type=float, default=60.0, help="a request's own client timeout"
    )
    ap.add_argument("--startup-timeout-s", type=float, default=600.0, help="the app's start")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.config = args.config.resolve()
    if not 0 <= args.warmup_minutes < args.minutes:
        ap.error("--warmup-minutes must be at least 0 and less than --minutes")
    if args.clients < 1 or args.rate <= 0 or args.sample_s <= 0 or args.ttl_s <= 0:
        ap.error("--clients, --rate, --sample-s and --ttl-s must be positive")
    return args


if __name__ == "__main__":
    sys.exit(main())
