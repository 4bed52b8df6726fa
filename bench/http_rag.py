"""The RAG workload of ``bench/cluster_rag.py`` through the real HTTP app: ``chunkserve
serve`` with the Redis chunk directory, driven by the official ``openai`` client.

What runs, all started here and all stopped at the end (also on an error or Ctrl-C):
- Redis: ``redis-server`` (from PATH) on a free port, unless ``--redis-url`` names one;
- Ray: a private head (``ray start --head --block``, its own temp dir and ports, this
  machine's GPUs counted by torch), stopped by terminating that process;
- the app: ``python -m cluster.ops.cli serve --config configs/redis.yaml`` with ``--set``s for
  the model, the workers, the GPUs, the Redis URL (a prefix of its own), the port and the
  Ray address; its output goes to ``--serve-log``;
- the clients: a closed loop of ``--concurrency`` ``openai.AsyncOpenAI`` clients sending
  streamed chat completions with ``stream_options={"include_usage": True}``, spread over
  ``--client-processes`` processes (the requests dealt in turn).

Workload (as ``bench/cluster_rag.py``): a system prompt (one of 3) + one document (of
``--docs``, drawn Zipf(``--zipf``)) as a content part + a unique question part. A warm-up
of its own texts (kernels, graphs) comes first and is not counted.

Measured per request: TTFT (until the first streamed content delta), latency, the
usage's prompt and ``prompt_tokens_details.cached_tokens``, and the
``X-Chunkserve-Worker`` header. Printed: one summary line on stdout, then a JSON summary
(also written to ``--json``) with, besides, the ``/metrics`` counters over the measured
run and ``chunkserve status`` at its end. Progress goes to stderr.

    python bench/http_rag.py --model DIR --workers 4 --gpus-per-worker 1
    python bench/http_rag.py --model /tmp/tiny --workers 1 --gpus-per-worker 0 \\
        --requests 30 --concurrency 4 --doc-tokens 256 --system-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cluster_rag import (  # noqa: E402
    MODEL_NAME,
    OWN_FLAGS,
    TextMaker,
    add_worker_gpu_arguments,
    check_worker_gpu_arguments,
    default_pages,
    make_bodies,
    ttft_quantile_ms,
)
from bench.cluster_rag import RequestResult as Result  # noqa: E402
from bench.common import Shape, retrieval_sequence  # noqa: E402
from bench.process_cpu import cpu_by_role, cpu_snapshot, per_request_ms  # noqa: E402
from workers.engine.checkpoint import load_tokenizer  # noqa: E402

BASE_CONFIG = REPO / "configs/redis.yaml"
STOP_TIMEOUT_S = 120  # serve removes its app and workers on SIGTERM
LOG_TAG = "http_rag"  # starts every progress line (bench/soak.py sets its own)


def log(message: str) -> None:
    print(f"[{LOG_TAG} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout_s: float, what: str, alive=None, step_s: float = 0.25) -> None:
    """Poll ``check()`` until true; ``alive()`` false or the timeout is an error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if alive is not None and not alive():
            raise RuntimeError(f"{what}: the process exited")
        time.sleep(step_s)
    raise RuntimeError(f"{what}: not ready within {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, name: str, sig: int, timeout_s: float) -> None:
    """Send ``sig`` to a process we started in a session of its own, wait, then kill
    whatever is left of its process group (by its id)."""
    if proc.poll() is None:
        log(f"stopping {name} (pid {proc.pid}) ...")
        try:
            proc.send_signal(sig)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{name} did not stop within {timeout_s:.0f} s: killing its process group")
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# -- the services ---------------------------------------------------------------------
def redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(stack: ExitStack) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not on PATH (on the GPU host, bench/gpu_run.sh puts the one "
            ".whl-http carries in /tmp/site/.redis/bin); "
            "or give --redis-url"
        )
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True
    )
    stack.callback(stop_process, proc, "redis-server", signal.SIGTERM, 10)
    wait_for(lambda: redis_answers(port), 20, "redis-server", alive=lambda: proc.poll() is None)
    log(f"redis-server ({binary}) on port {port}")
    return f"redis://127.0.0.1:{port}/0"


def gpu_count() -> int:
    import torch  # counted here: Ray's own detection may miss a VM's GPUs

    return torch.cuda.device_count()


def start_ray(stack: ExitStack, args: argparse.Namespace, env: dict) -> str:
    """A private Ray head; returns its GCS address."""
    temp_dir = tempfile.mkdtemp(prefix="hrag", dir="/tmp")  # short: socket paths
    port = free_port()
    gpus = gpu_count() if args.gpus_per_worker > 0 else 0
    cpus = max(os.cpu_count() or 1, 2)
    cmd = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        f"--temp-dir={temp_dir}", f"--port={port}", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
        "--include-dashboard=false", "--disable-usage-stats",
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
    ]  # fmt: skip
    log_path = Path(temp_dir) / "ray-start.log"
    out = stack.enter_context(open(log_path, "w"))  # noqa: SIM115 - closed by the stack
    # The app is gone by the time the head stops: no drain (30 s by default) is needed.
    env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )

    def stop() -> None:
        stop_process(proc, "the Ray head", signal.SIGTERM, 60)
        shutil.rmtree(temp_dir, ignore_errors=True)

    stack.callback(stop)
    address = f"127.0.0.1:{port}"

    def up() -> bool:
        return "--block" in log_path.read_text() or "Ray runtime started" in log_path.read_text()

    try:
        wait_for(up, 180, "ray start", alive=lambda: proc.poll() is None, step_s=0.5)
    except RuntimeError:
        log("ray start output:\n" + log_path.read_text()[-3000:])
        raise
    log(f"Ray head at {address}: {cpus} CPUs, {gpus} GPUs (temp dir {temp_dir})")
    return address


def config_overrides(
    args: argparse.Namespace, redis_url: str, ray_address: str, port: int
) -> list[str]:
    tag = f"{random.randrange(16**6):06x}"
    sets = {
        "name": f"http-rag-{tag}",
        "model.name": MODEL_NAME,
        "model.path": str(args.model),
        "model.make_if_missing": "null",
        "workers.count": args.workers,
        "workers.num_gpus": args.gpus_per_worker * args.tensor_parallel_size,
        "workers.tensor_parallel_size": args.tensor_parallel_size,
        "engine.load_format": args.load_format,
        "workers.num_cpus": args.worker_cpus,
        "workers.startup_timeout_s": args.startup_timeout_s,
        "directory.redis.url": redis_url,
        "directory.redis.prefix": f"http-rag-{tag}",
        "server.host": "127.0.0.1",
        "server.port": port,
        "server.num_replicas": args.replicas,
        "server.default_max_tokens": args.max_tokens,
        "router.max_requests_per_worker": 4096,
        "ray.address": ray_address,
    }
    if args.gpus_per_worker > 0:
        sets |= {
            "engine.device": "cuda",
            "engine.dtype": "bfloat16",
            "engine.attention_backend": "flashinfer",
            "engine.gpu_memory_utilization": round(0.9 * args.gpus_per_worker, 3),
        }
    else:
        sets |= {"engine.device": "cpu", "engine.dtype": "float32"}
    if args.pages:
        sets["engine.num_pages"] = args.pages
    out = [f"{key}={value}" for key, value in sets.items()]
    return out + list(args.set)


class ServeProcess:
    """``chunkserve serve`` as a child process; its output goes to a log file, and its
    own lines (not Ray's worker log lines) to stderr."""

    OWN_LINE = re.compile(r"^(chunkserve|model |starting |error|Traceback|\S+Error)")

    def __init__(
        self, sets: list[str], env: dict, log_path: Path, config: Path = BASE_CONFIG
    ) -> None:
        cmd = [sys.executable, "-m", "cluster.ops.cli", "serve", "--config", str(config)]
        for item in sets:
            cmd += ["--set", item]
        self.log_path = log_path
        self.url: str | None = None
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            text = line.rstrip()
            if self.OWN_LINE.match(text):
                log(f"serve: {text}")
            match = re.search(r"serving '.*' at (http://\S+/v1)", text)
            if match:
                self.url = match.group(1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        # SIGTERM: serve removes the app and its workers, then exits 0.
        stop_process(self.proc, "chunkserve serve", signal.SIGTERM, STOP_TIMEOUT_S)
        self._reader.join(timeout=5)
        self._log.close()
        log(f"chunkserve serve exited with {self.proc.returncode}; its log: {self.log_path}")


def http_get(url: str, timeout_s: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (OSError, ValueError) as error:
        return 0, str(error)


def wait_healthy(serve: ServeProcess, workers: int, timeout_s: float) -> str:
    wait_for(lambda: serve.url is not None, timeout_s, "chunkserve serve", alive=serve.alive)
    root = serve.url.removesuffix("/v1")

    def healthy() -> bool:
        status, body = http_get(f"{root}/health")
        if status != 200:
            return False
        try:
            return json.loads(body).get("healthy_workers") == workers
        except ValueError:
            return False

    wait_for(healthy, 120, f"{root}/health with {workers} healthy worker(s)", alive=serve.alive)
    status, models = http_get(f"{serve.url}/models")
    log(f"app ready at {serve.url}; /v1/models: {status} {models.strip()[:200]}")
    return serve.url


# -- the clients ----------------------------------------------------------------------
@dataclass
class Run:
    seconds: float = 0.0
    results: list[Result] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    client_cpu_s: float = 0.0  # CPU seconds of the client processes over the run

    def ttft_ms(self, q: float, hits: bool | None = None) -> float:
        return ttft_quantile_ms(self.results, q, hits)

    def cached_share(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.results)
        return sum(r.cached_tokens for r in self.results) / prompt if prompt else 0.0

    def requests_per_s(self) -> float:
        return len(self.results) / self.seconds if self.seconds else 0.0


# the chat body's fields that the openai client does not know: sent in ``extra_body``
EXTENSION_FIELDS = ("reuse",)


def client_kwargs(body: dict) -> dict:
    """``body`` as keyword arguments of the openai client's ``create``."""
    kwargs = {k: v for k, v in body.items() if k not in EXTENSION_FIELDS}
    extra = {k: body[k] for k in EXTENSION_FIELDS if k in body}
    return kwargs | {"extra_body": extra} if extra else kwargs


async def one_request(client, body: dict) -> Result:
    started = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(**client_kwargs(body))
    worker = raw.headers.get("x-chunkserve-worker", "?")
    stream = raw.parse()
    ttft = None
    usage = None
    async for chunk in stream:
        if ttft is None and any(choice.delta.content for choice in chunk.choices):
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
    done = time.perf_counter() - started
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    details = usage.prompt_tokens_details
    return Result(
        worker,
        done if ttft is None else ttft,  # no content at all (empty answer): the whole stream
        done,
        usage.prompt_tokens,
        (details.cached_tokens or 0) if details is not None else 0,
        usage.completion_tokens,
    )


def run_client_processes(
    url: str, bodies: list[dict], clients: int, processes: int, label: str
) -> Run:
    """``run_clients`` in ``processes`` processes at once, each with its share of the
    clients and of the requests (dealt in turn), so that the clients' own Python (the
    openai client parses every streamed chunk) does not bound what is measured. All
    start together at a wall-clock instant meant to come after they are up; ``seconds``
    runs from the first one's start to the last answer (a process up late starts late,
    and is reported)."""
    if processes <= 1:
        return asyncio.run(run_clients(url, bodies, clients, label))
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    shares = [bodies[i::processes] for i in range(processes)]
    per_process = [clients // processes + (i < clients % processes) for i in range(processes)]
    start_at = time.time() + 10.0  # spawned interpreters import this module and openai
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            pool.submit(_client_process, url, share, n, f"{label} [{i}]", start_at)
            for i, (share, n) in enumerate(zip(shares, per_process, strict=True))
        ]
        parts = [f.result() for f in futures]
    starts = [start for _, start, _ in parts]
    if max(starts) - start_at > 0.5:
        log(f"{label}: a client process started {max(starts) - start_at:.1f} s late")
    run = Run(seconds=max(end for _, _, end in parts) - min(starts))
    for part, _, _ in parts:
        run.results += part.results
        run.errors += part.errors
        run.client_cpu_s += part.client_cpu_s
    return run


def _client_process(
    url: str, bodies: list[dict], clients: int, label: str, start_at: float
) -> tuple[Run, float, float]:
    """One client process: waits for ``start_at``, runs; returns its run and the wall
    times it started and ended."""
    import openai  # noqa: F401 - imported before the start, not in the measured time

    time.sleep(max(0.0, start_at - time.time()))
    started = time.time()
    run = asyncio.run(run_clients(url, bodies, clients, label))
    return run, started, time.time()


async def run_clients(url: str, bodies: list[dict], clients: int, label: str) -> Run:
    import openai

    run = Run()
    queue = list(reversed(bodies))
    total = len(bodies)
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    last_report = [time.monotonic()]

    async def worker() -> None:
        while queue:
            body = queue.pop()
            try:
                run.results.append(await one_request(client, body))
            except Exception as error:  # noqa: BLE001 - every failure is counted
                run.errors.append(f"{type(error).__name__}: {error}"[:500])
            done = len(run.results) + len(run.errors)
            if time.monotonic() - last_report[0] > 5 or done == total:
                last_report[0] = time.monotonic()
                log(f"{label}: {done}/{total} answered ({len(run.errors)} errors)")

    started, cpu = time.perf_counter(), time.process_time()
    try:
        await asyncio.gather(*(worker() for _ in range(clients)))
    finally:
        run.seconds = time.perf_counter() - started
        run.client_cpu_s = time.process_time() - cpu
        await client.close()
    return run


# -- reporting ------------------------------------------------------------------------
METRIC_LINE = re.compile(r"^(chunkserve_[a-z_]+)(\{[^}]*\})?\s+(\S+)$")
# histograms read whole (buckets, sum, count): the routers' own view of each request
HISTOGRAMS = (
    "chunkserve_event_loop_lag_seconds",
    "chunkserve_time_to_first_token_seconds",
    "chunkserve_request_queue_time_seconds",
)
COUNTERS = (
    "chunkserve_router_cpu_seconds_total",
    "chunkserve_requests_total",
    "chunkserve_prompt_tokens_total",
    "chunkserve_cached_prompt_tokens_total",
    "chunkserve_generated_tokens_total",
    "chunkserve_routing_decisions_total",
    "chunkserve_worker_retries_total",
    "chunkserve_directory_lookups_total",
    "chunkserve_directory_lookup_failures_total",
)


def scrape(root: str) -> dict[str, float]:
    status, text = http_get(f"{root}/metrics", timeout_s=30)
    if status != 200:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line.strip())
        name = match.group(1) if match else ""
        if name in COUNTERS or re.sub(r"_(bucket|sum|count)$", "", name) in HISTOGRAMS:
            key = match.group(1) + (match.group(2) or "")
            try:
                values[key] = values.get(key, 0.0) + float(match.group(3))
            except ValueError:
                pass
    return values


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    delta = {k: after[k] - before.get(k, 0.0) for k in sorted(after)}
    delta = {k: v for k, v in delta.items() if v}
    prompt = delta.get("chunkserve_prompt_tokens_total", 0.0)
    cached = delta.get("chunkserve_cached_prompt_tokens_total", 0.0)
    counters = {k: v for k, v in delta.items() if not k.startswith(HISTOGRAMS)}
    histograms = {name: histogram_summary(delta, name) for name in HISTOGRAMS}
    return {
        "counters": counters,
        "histograms": histograms,
        "cache_hit_rate": cached / prompt if prompt else None,
    }


def histogram_summary(delta: dict[str, float], name: str) -> dict | None:
    """A histogram's observations over the run: their count, mean, and the upper bounds
    of the buckets holding the median and the 90th percentile (ms); None if none."""
    count = delta.get(f"{name}_count", 0.0)
    if not count:
        return None
    bounds = sorted(
        (float(re.search(r'le="([^"]+)"', key).group(1)), value)
        for key, value in delta.items()
        if key.startswith(f"{name}_bucket")
    )

    def quantile_ms(q: float) -> float:
        return next((1000 * b for b, cumulative in bounds if cumulative >= q * count), math.inf)

    return {
        "count": int(count),
        "mean_ms": round(1000 * delta.get(f"{name}_sum", 0.0) / count, 3),
        "p50_at_most_ms": quantile_ms(0.5),
        "p90_at_most_ms": quantile_ms(0.9),
    }


def chunkserve_status(sets: list[str], env: dict) -> str:
    cmd = [sys.executable, "-m", "cluster.ops.cli", "status", "--config", str(BASE_CONFIG)]
    for item in sets:
        cmd += ["--set", item]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "chunkserve status: timed out"
    lines = [line for line in done.stdout.splitlines() if not line.startswith("(")]
    text = "\n".join(lines).strip()
    return (
        text if done.returncode == 0 else f"{text}\n(exit {done.returncode}) {done.stderr[-1000:]}"
    )


def summarize(
    args, shape: Shape, run: Run, metrics: dict, status: str, cpu: dict[str, float], ingress: str
) -> dict:
    return {
        "bench": "http_rag",
        "ingress": ingress,
        "workers": args.workers,
        "gpus_per_worker": args.gpus_per_worker,
        "tensor_parallel_size": args.tensor_parallel_size,
        "load_format": args.load_format,
        "router_replicas": args.replicas,
        "concurrency": args.concurrency,
        "client_processes": args.client_processes,
        "shape": shape.__dict__,
        "reuse": args.reuse,
        "requests": len(run.results) + len(run.errors),
        "answered": len(run.results),
        "errors": len(run.errors),
        "first_errors": run.errors[:5],
        "seconds": round(run.seconds, 3),
        "requests_per_s": round(run.requests_per_s(), 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in run.results) / run.seconds, 1)
        if run.seconds
        else 0.0,
        "ttft_ms": {str(q): round(run.ttft_ms(q), 2) for q in (0.5, 0.9, 0.99)},
        "ttft_ms_mean": round(1000 * sum(r.ttft_s for r in run.results) / len(run.results), 2)
        if run.results
        else None,
        "ttft_ms_hits": {str(q): round(run.ttft_ms(q, True), 2) for q in (0.5, 0.9)},
        "ttft_ms_misses": {str(q): round(run.ttft_ms(q, False), 2) for q in (0.5, 0.9)},
        "latency_ms_p50": round(
            1000 * sorted(r.latency_s for r in run.results)[len(run.results) // 2], 2
        )
        if run.results
        else None,
        "prompt_tokens": sum(r.prompt_tokens for r in run.results),
        "cached_tokens": sum(r.cached_tokens for r in run.results),
        "cached_share": round(run.cached_share(), 4),
        "requests_per_worker": dict(sorted(Counter(r.worker for r in run.results).items())),
        "metrics": metrics,
        "cpu_ms_per_request": per_request_ms(cpu, len(run.results)),
        "chunkserve_status": status,
    }


def summary_line(summary: dict) -> str:
    t = summary["ttft_ms"]
    per_worker = "/".join(str(n) for n in summary["requests_per_worker"].values())
    hit = summary["metrics"].get("cache_hit_rate")
    return (
        f"http_rag: {summary['workers']} worker(s) x {summary['gpus_per_worker']} GPU"
        f" x {summary['tensor_parallel_size']} rank(s), "
        f"{summary['router_replicas']} router replicas ({summary['ingress']}), {summary['concurrency']} clients "
        f"in {summary['client_processes']} process(es): "
        f"{summary['requests']} requests, {summary['errors']} errors, "
        f"{summary['seconds']:.1f} s, {summary['requests_per_s']:.1f} req/s, "
        f"{summary['output_tokens_per_s']:.0f} out tok/s, "
        f"TTFT p50 {t['0.5']:.0f} ms p90 {t['0.9']:.0f} ms p99 {t['0.99']:.0f} ms, "
        f"cached share {summary['cached_share']:.1%}"
        + (f" (/metrics {hit:.1%})" if hit is not None else "")
        + f", per worker {per_worker}"
    )


def breakdown_lines(summary: dict) -> list[str]:
    """Where a request's time and CPU went: each kind of process's CPU ms a request,
    the routers' event-loop lag, and time to first token as the routers saw it (arrival
    to first token; of which arrival to the worker call) against the clients' (the rest
    is Serve's proxy, the client and the sockets between)."""
    cpu = summary["cpu_ms_per_request"]
    lines = ["CPU ms a request: " + ", ".join(f"{role} {ms:.2f}" for role, ms in cpu.items())]
    hist = summary["metrics"].get("histograms", {})
    lag = hist.get("chunkserve_event_loop_lag_seconds")
    if lag:
        lines.append(
            f"router event-loop lag: mean {lag['mean_ms']:.2f} ms, p50 <= "
            f"{lag['p50_at_most_ms']:g} ms, p90 <= {lag['p90_at_most_ms']:g} ms"
        )
    ttft = hist.get("chunkserve_time_to_first_token_seconds")
    queue = hist.get("chunkserve_request_queue_time_seconds")
    if ttft and queue and summary["ttft_ms_mean"] is not None:
        outside = summary["ttft_ms_mean"] - ttft["mean_ms"]
        lines.append(
            f"TTFT means: clients {summary['ttft_ms_mean']:.1f} ms; routers "
            f"{ttft['mean_ms']:.1f} ms, of which {queue['mean_ms']:.1f} before the worker "
            f"call (body, prompt, route); outside the routers {outside:.1f} ms"
        )
    return lines


# -- main -----------------------------------------------------------------------------
def main() -> int:
    args = parse_args()
    args.replicas = args.replicas or max(2, args.workers)
    args.concurrency = args.concurrency or 32 * args.workers
    if args.client_processes < 1:
        raise SystemExit("http_rag: --client-processes must be at least 1")
    args.client_processes = min(args.client_processes, args.concurrency)
    args.requests = args.requests or 600 * args.workers
    args.warmup = 4 * args.workers if args.warmup is None else args.warmup
    args.pages = default_pages(args.docs, args.doc_tokens) if args.pages is None else args.pages
    if args.router_path and not args.pages:
        raise SystemExit("http_rag: --router-path needs a page count (--pages > 0) for both paths")
    shape = Shape(
        args.docs, args.zipf, args.system_tokens, args.doc_tokens, args.question_tokens,
        args.max_tokens, args.docs_per_request, args.systems,
    )  # fmt: skip

    def on_term(signum, frame):  # SIGTERM/SIGHUP: stop everything like Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("RAY_AUTH_MODE", "disabled")  # a private, single-user cluster

    router_path = None
    if args.router_path:  # first: its Ray must be gone before this bench starts its own
        try:
            router_path = run_router_path(args, env)
        except KeyboardInterrupt:
            log("interrupted")
            return 130

    log("preparing the workload ...")
    maker = TextMaker(load_tokenizer(args.model))
    sequence = retrieval_sequence(shape, args.requests, args.seed)
    dump = {"exclude_unset": True, "mode": "json"}
    bodies = [
        b.model_dump(**dump)
        for b in make_bodies(maker, shape, sequence, 1, stream=True, reuse=args.reuse)
    ]
    warm = [
        b.model_dump(**dump)
        for b in make_bodies(
            maker, shape, sequence[: args.warmup], 10**6, stream=True, reuse=args.reuse
        )
    ]

    summaries: list[dict] = []
    with ExitStack() as stack:
        try:
            redis_url = args.redis_url or start_redis(stack)
            ray_address = start_ray(stack, args, env)
            # Serve's proxy first: a Serve started without one (the replicas' ingress)
            # would not start one later
            for ingress in sorted(args.ingress, key=lambda mode: mode != "serve_proxy"):
                run, metrics, status, cpu = measure_ingress(
                    args, ingress, redis_url, ray_address, env, bodies, warm
                )
                summaries.append(summarize(args, shape, run, metrics, status, cpu, ingress))
        except KeyboardInterrupt:
            log("interrupted: stopping everything")
            return 130
        except RuntimeError as error:  # a service did not start: its output is above
            log(f"error: {error}; stopping everything")
            return 1
    for summary in summaries:
        print(summary_line(summary), flush=True)
        print("\n".join("  " + line for line in breakdown_lines(summary)), flush=True)
        print(summary["chunkserve_status"], flush=True)
    if router_path is not None:
        print(router_path_line(router_path), flush=True)
        for summary in summaries:
            summary["router_path"] = router_path
            print(comparison_line(summary, router_path), flush=True)
    print(json.dumps(summaries, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))
    errors = [e for s in summaries for e in s["first_errors"]]
    if errors:
        log(f"first errors: {errors[:3]}")
    return 1 if errors else 0


def measure_ingress(
    args, ingress: str, redis_url: str, ray_address: str, env: dict, bodies, warm
) -> tuple[Run, dict, str, dict[str, float]]:
    """One app with ``server.ingress=ingress``, started, warmed, measured and stopped:
    the run, the /metrics deltas, ``chunkserve status`` at its end, and each kind of
    process's CPU seconds over the run."""
    sets = config_overrides(args, redis_url, ray_address, args.port or free_port())
    sets.append(f"server.ingress={ingress}")
    serve_log = args.serve_log or Path(tempfile.gettempdir()) / f"http_rag-serve-{os.getpid()}.log"
    serve_log = serve_log.with_name(f"{serve_log.stem}-{ingress}{serve_log.suffix}")
    log(f"starting chunkserve serve ({args.workers} worker(s), {ingress}); log: {serve_log}")
    started = time.monotonic()
    serve = ServeProcess(sets, env, serve_log)
    try:
        try:
            url = wait_healthy(serve, args.workers, args.startup_timeout_s + 300)
        except RuntimeError:
            log("chunkserve serve output (tail):\n" + serve.tail())
            raise
        log(f"serving after {time.monotonic() - started:.1f} s")
        root = url.removesuffix("/v1")
        if warm:
            warm_run = asyncio.run(
                run_clients(url, warm, min(len(warm), 2 * args.workers), "warm-up")
            )
            log(f"warm-up: {len(warm_run.results)} ok, {len(warm_run.errors)} errors")
            if warm_run.errors:
                log(f"warm-up errors: {warm_run.errors[:3]}")
        time.sleep(2)  # replicas push their counts every 0.5 s: let the warm-up's land
        before, cpu_before = scrape(root), cpu_snapshot()
        run = run_client_processes(
            url, bodies, args.concurrency, args.client_processes, f"measured ({ingress})"
        )
        cpu = cpu_by_role(cpu_before, cpu_snapshot()) | {"clients": run.client_cpu_s}
        time.sleep(2)  # likewise the measured run's last counts
        metrics = metrics_delta(before, scrape(root))
        log("chunkserve status ...")
        status = chunkserve_status(sets, env)
    finally:
        serve.stop()
    return run, metrics, status, cpu


def engine_override(item: str) -> bool:
    """Whether a ``--set`` item is an engine setting that ``bench/cluster_rag.py`` takes
    too (not one its own flags set)."""
    key = item.partition("=")[0]
    return key.startswith("engine.") and key not in OWN_FLAGS


def run_router_path(args, env: dict) -> dict:
    """``bench/cluster_rag.py`` on this workload (chunk-aware, the same workers, pages,
    requests, clients per worker and router replicas), in a process of its own: its
    summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "router.json"
        cmd = [
            sys.executable, str(REPO / "bench/cluster_rag.py"), "--model", str(args.model),
            "--workers", str(args.workers), "--gpus-per-worker", str(args.gpus_per_worker),
            "--tensor-parallel-size", str(args.tensor_parallel_size),
            "--load-format", args.load_format, "--policies", "chunk_aware",
            "--reuse", args.reuse, "--docs", str(args.docs),
            "--docs-per-request", str(args.docs_per_request), "--systems", str(args.systems),
            "--zipf", str(args.zipf), "--system-tokens", str(args.system_tokens),
            "--doc-tokens", str(args.doc_tokens), "--max-tokens", str(args.max_tokens),
            "--pages", str(args.pages), "--seed", str(args.seed),
            "--requests-per-worker", str(args.requests // args.workers),
            "--concurrency", str(max(1, args.concurrency // args.workers)),
            "--routers-per-worker", str(args.replicas / args.workers), "--json", str(out),
        ]  # fmt: skip
        # the engine's overrides hold on both paths; the rest configure the HTTP app only
        engine = [item for item in args.set if engine_override(item)]
        cmd += [arg for item in engine for arg in ("--set", item)]
        if len(engine) < len(args.set):
            log("not on the router path (HTTP app only): "
                + " ".join(item for item in args.set if item not in engine))  # fmt: skip
        log("the router path: " + " ".join(cmd[1:]))
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        log("router path output:\n" + done.stdout[-6000:])
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench/cluster_rag.py exited with {done.returncode}")
        (summary,) = json.loads(out.read_text())
    summary.pop("requests", None)  # per-request rows: not wanted in this report
    return summary


def router_path_line(router: dict) -> str:
    t = router["ttft_ms"]
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in router.get("cpu_ms_per_request", {}).items())
    return (
        f"router path (bench/cluster_rag.py, no HTTP): {router['answered']} ok, "
        f"{len(router['errors'])} errors, {router['requests_per_s']:.1f} req/s, TTFT p50 "
        f"{t['0.5']:.0f} ms p90 {t['0.9']:.0f} ms, hit {router['hit_rate']:.1%}; CPU ms a "
        f"request: {cpu}"
    )


def comparison_line(summary: dict, router: dict) -> str:
    """The HTTP path against the router path: the requests/s ratio (target >= 0.95) and
    the TTFT differences (targets p50 <= +10 ms, p90 <= +20 ms)."""
    ratio = summary["requests_per_s"] / router["requests_per_s"]
    http, direct = summary["ttft_ms"], router["ttft_ms"]
    return (
        f"HTTP ({summary['ingress']}) / router path: {ratio:.2f}x req/s; TTFT p50 "
        f"{http['0.5'] - direct['0.5']:+.0f} ms, p90 {http['0.9'] - direct['0.9']:+.0f} ms"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    ap.add_argument("--workers", type=int, default=1, help="worker actors")
    add_worker_gpu_arguments(ap)
    ap.add_argument("--worker-cpus", type=float, default=1.0, help="Ray CPUs per worker")
    ap.add_argument(
        "--replicas", type=int, help="router (HTTP ingress) replicas (default: max(2, workers))"
    )
    ap.add_argument("--requests", type=int, help="measured requests (default: 600 per worker)")
    ap.add_argument(
        "--client-processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 1) // 4)),
        help="processes the clients run in (default: a quarter of the CPUs, at most 8): the "
        "openai client spends about 10 ms of CPU a streamed request, so one process "
        "parsing every stream of 100+ requests/s would bound the measurement (32 "
        "processes on 64 cores measured no better: bench/RESULTS.md, 'HTTP path')",
    )
    ap.add_argument(
        "--concurrency", type=int, help="clients in the closed loop (default: 32 per worker)"
    )
    ap.add_argument(
        "--warmup", type=int, help="warm-up requests, not counted (default: 4 per worker)"
    )
    ap.add_argument("--reuse", choices=("exact", "approximate"), default="exact")
    ap.add_argument("--docs", type=int, default=192)
    ap.add_argument(
        "--docs-per-request", type=int, default=1, help="retrieved documents a request (top-k)"
    )
    ap.add_argument("--systems", type=int, default=3, help="system prompts (tenants, personas)")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--pages",
        type=int,
        help="KV pages per worker (default: bench/cluster_rag.py's, half the documents "
        "plus headroom; 0: sized by the engine)",
    )
    ap.add_argument(
        "--ingress",
        nargs="+",
        choices=("replicas", "serve_proxy"),
        default=["replicas"],
        help="server.ingress of the app, each measured in turn (replicas: each router "
        "replica listens itself; serve_proxy: through Serve's HTTP proxy)",
    )
    ap.add_argument(
        "--router-path",
        action="store_true",
        help="first run bench/cluster_rag.py on the same workload (chunk-aware, the same "
        "clients per worker and router replicas) and print the HTTP path's ratio to it",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--redis-url", help="use this Redis (default: start redis-server on a free port)"
    )
    ap.add_argument("--port", type=int, help="HTTP port (default: a free one)")
    ap.add_argument("--startup-timeout-s", type=float, default=1200, help="workers' start")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="extra config override for chunkserve serve (repeatable); with --router-path "
        "the engine's (engine.*) hold there too",
    )  # fmt: skip
    ap.add_argument("--serve-log", type=Path, help="chunkserve serve's output (default: /tmp)")
    ap.add_argument("--json", type=Path, help="also write the JSON summary here")
    args = ap.parse_args()
    check_worker_gpu_arguments(ap, args)
    return args


if __name__ == "__main__":
    sys.exit(main())
