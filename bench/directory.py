"""Benchmark the Redis chunk directory against plain Redis GETs on the same server.

Loads ``--workers`` x ``--keys-per-worker`` page keys (pipelined snapshots), then
times ``--lookups`` sequential lookups of ``--chunks``-chunk requests from one
client, a redis-py GET loop from the same kind of client (the apples-to-apples
baseline), and ``redis-benchmark -t get`` (1 and 50 clients). It counts round
trips per lookup on both ends: packed sends by the client and EVALSHA calls seen
by the server. Starts a private redis-server on a free port unless ``--url``.

Run from the repository root: ``python -m bench.directory [--keys-per-worker 10000]``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import random
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
import redis.connection

from chunkstore.redis_directory import RedisChunkDirectory

SHARED_KEYS = 64  # "system prompts" every worker holds


@dataclass(frozen=True)
class Server:
    calls: int  # EVALSHA calls seen by Redis during the timed lookups
    usec_per_call: float  # Redis's own time per lookup script


@dataclass(frozen=True)
class Row:
    name: str
    clients: int
    ops_per_s: float
    p50_us: float
    p99_us: float
    max_us: float


def main() -> None:
    args = parse_args()
    with redis_server(args.url) as url:
        run(args, url)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing Redis (default: start a private one)")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--keys-per-worker", type=int, default=100_000)
    parser.add_argument("--chunks", type=int, default=10, help="chunks per request")
    parser.add_argument("--lookups", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def run(args: argparse.Namespace, url: str) -> None:
    prefix = f"bench-{random.Random().getrandbits(32):08x}"
    directory = RedisChunkDirectory(url, prefix=prefix, lease_ttl_s=3600)
    client = redis.Redis.from_url(url, socket_timeout=0.05, socket_connect_timeout=0.05)
    try:
        load_s = populate(directory, args)
        requests = make_requests(args)
        lookup_row, sends, server, holders = bench_lookups(directory, client, requests)
        rows = [lookup_row, bench_get_loop(client, len(requests))]
        rows += [redis_benchmark(url, clients) for clients in (1, 50)]
        report(args, client, load_s, rows, sends, server, holders, len(requests))
    finally:
        cleanup(client, prefix)
        directory.close()
        client.close()


def worker_keys(worker: int, count: int) -> list[bytes]:
    return [hashlib.sha256(f"bench:{worker}:{i}".encode()).digest() for i in range(count)]


def shared_keys() -> list[bytes]:
    return [hashlib.sha256(f"bench:shared:{i}".encode()).digest() for i in range(SHARED_KEYS)]


def populate(directory: RedisChunkDirectory, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    for worker in range(args.workers):
        keys = shared_keys() + worker_keys(worker, args.keys_per_worker)
        result = directory.publish_snapshot(f"worker-{worker}", 1, 0, keys)
        if not result.applied:
            raise SystemExit(f"loading worker {worker} failed: {result.status}")
    return time.perf_counter() - started


def make_requests(args: argparse.Namespace) -> list[list[bytes]]:
    """A shared system prompt, then one worker's consecutive chunks, cut at a random
    point after which the chunks are new to everyone (so runs of 1..chunks)."""
    rng = random.Random(args.seed)
    system = shared_keys()
    requests = []
    for n in range(args.lookups + 500):
        worker = rng.randrange(args.workers)
        start = rng.randrange(args.keys_per_worker - args.chunks)
        keys = [system[rng.randrange(SHARED_KEYS)]]
        keys += worker_keys_slice(worker, start, args.chunks - 1)
        cut = rng.randint(1, args.chunks)
        keys[cut:] = [
            hashlib.sha256(f"new:{n}:{i}".encode()).digest() for i in range(cut, len(keys))
        ]
        requests.append(keys)
    return requests


def worker_keys_slice(worker: int, start: int, count: int) -> list[bytes]:
    return [
        hashlib.sha256(f"bench:{worker}:{i}".encode()).digest() for i in range(start, start + count)
    ]


def bench_lookups(
    directory: RedisChunkDirectory, client: redis.Redis, requests: list[list[bytes]]
) -> tuple[Row, int, Server, float]:
    ends = [512 * (i + 1) for i in range(len(requests[0]))]
    for keys in requests[:500]:  # warm up (loads the script, fills the pool)
        directory.lookup(keys, ends)
    timed = requests[500:]
    calls_before, usec_before = evalsha_stats(client)
    holders = 0
    with counting_sends() as sends:
        latencies = timed_calls(lambda keys: directory.lookup(keys, ends), timed)
    calls, usec = evalsha_stats(client)
    server = Server(calls=calls - calls_before, usec_per_call=(usec - usec_before) / len(timed))
    unavailable = 0
    for keys in timed[:1000]:
        result = directory.lookup(keys, ends)
        holders += len(result.holdings)
        unavailable += not result.available
    if unavailable:
        print(f"warning: {unavailable} lookups found Redis unavailable")
    row = row_from(f"directory lookup ({len(ends)} chunks)", 1, latencies)
    return row, sends[0], server, holders / 1000


def bench_get_loop(client: redis.Redis, n: int) -> Row:
    client.set("bench-get-key", b"x" * 32)
    for _ in range(500):
        client.get("bench-get-key")
    latencies = timed_calls(lambda _: client.get("bench-get-key"), range(n))
    client.delete("bench-get-key")
    return row_from("GET, redis-py loop", 1, latencies)


def timed_calls(call: Callable[[object], object], items) -> list[int]:
    latencies = []
    for item in items:
        started = time.perf_counter_ns()
        call(item)
        latencies.append(time.perf_counter_ns() - started)
    return latencies


def row_from(name: str, clients: int, latencies_ns: list[int]) -> Row:
    ordered = sorted(latencies_ns)
    total_s = sum(ordered) / 1e9
    return Row(
        name=name,
        clients=clients,
        ops_per_s=len(ordered) / total_s,
        p50_us=statistics.median(ordered) / 1e3,
        p99_us=ordered[int(0.99 * (len(ordered) - 1))] / 1e3,
        max_us=ordered[-1] / 1e3,
    )


def redis_benchmark(url: str, clients: int) -> Row:
    parts = urlsplit(url)
    command = ["redis-benchmark", "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port)]
    command += ["-t", "get", "-n", "100000", "-c", str(clients), "--csv"]
    if parts.password:
        command += ["-a", parts.password]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    line = next(r for r in csv.DictReader(io.StringIO(out)) if r["test"] == "GET")
    return Row(
        name=f"GET, redis-benchmark -c {clients}",
        clients=clients,
        ops_per_s=float(line["rps"]),
        p50_us=float(line["p50_latency_ms"]) * 1e3,
        p99_us=float(line["p99_latency_ms"]) * 1e3,
        max_us=float(line["max_latency_ms"]) * 1e3,
    )


@contextmanager
def counting_sends() -> Iterator[list[int]]:
    """Counts packed sends of every redis-py connection: one per round trip."""
    sent = [0]
    cls = redis.connection.AbstractConnection
    original = cls.send_packed_command

    def counting(self, command, check_health=True):
        sent[0] += 1
        return original(self, command, check_health)

    cls.send_packed_command = counting
    try:
        yield sent
    finally:
        cls.send_packed_command = original


def evalsha_stats(client: redis.Redis) -> tuple[int, float]:
    """(calls, server microseconds) of EVALSHA so far."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


def report(args, client, load_s, rows, sends, server, holders, n_requests) -> None:
    lookups = n_requests - 500
    entries = args.workers * (args.keys_per_worker + SHARED_KEYS)
    info = client.info()
    print(
        f"\nchunk directory: {args.workers} workers x {args.keys_per_worker:,} keys "
        f"(+{SHARED_KEYS} shared) = {entries:,} entries; Redis {info['redis_version']}, "
        f"used_memory {info['used_memory'] / 2**20:,.0f} MiB"
    )
    print(f"load: {load_s:.1f} s ({entries / load_s:,.0f} keys/s, pipelined snapshots)")
    print(
        f"lookups: {lookups:,} sequential, {args.chunks}-chunk requests, {holders:.1f} holders avg\n"
    )
    print(
        f"| {'operation':<32} | clients | {'ops/s':>9} | {'p50 us':>7} | {'p99 us':>7} | {'max us':>8} |"
    )
    print(f"|{'-' * 34}|---------|{'-' * 11}|{'-' * 9}|{'-' * 9}|{'-' * 10}|")
    for r in rows:
        print(
            f"| {r.name:<32} | {r.clients:>7} | {r.ops_per_s:>9,.0f} | {r.p50_us:>7.0f} "
            f"| {r.p99_us:>7.0f} | {r.max_us:>8.0f} |"
        )
    lookup, get = rows[0], rows[1]
    print(
        f"\nlookup / GET (same client, redis-py): throughput {lookup.ops_per_s / get.ops_per_s:.2f}x, "
        f"p50 {lookup.p50_us / get.p50_us:.2f}x, p99 {lookup.p99_us / get.p99_us:.2f}x"
    )
    print(
        f"round trips per lookup: client sends {sends / lookups:.2f}, "
        f"server EVALSHA calls {server.calls / lookups:.2f}"
    )
    print(f"server time per lookup (Lua, in Redis): {server.usec_per_call:.0f} us")
    verdict = "meets" if lookup.p99_us <= 1000 else "MISSES"
    print(f"p99 target <= 1000 us: {verdict} ({lookup.p99_us:.0f} us)")


def cleanup(client: redis.Redis, prefix: str) -> None:
    batch = []
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            client.unlink(*batch)
            batch.clear()
    if batch:
        client.unlink(*batch)


@contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(
        args + ["--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for(url)
        yield url
    finally:
        proc.kill()
        proc.wait()


def wait_for(url: str) -> None:
    client = redis.Redis.from_url(url, socket_timeout=0.2)
    for _ in range(100):
        try:
            client.ping()
            return
        except redis.RedisError:
            time.sleep(0.05)
    raise SystemExit(f"redis-server at {url} did not answer")


if __name__ == "__main__":
    main()
