"""Test helpers: a simulated KV pool, a lossy directory wrapper, a private redis-server."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

import redis

from chunkstore import directory as d
from chunkstore.events import CacheEvent, EventKind
from chunkstore.hashing import PageKey


def make_keys(n: int, tag: str = "k") -> list[PageKey]:
    return [hashlib.sha256(f"{tag}:{i}".encode()).digest() for i in range(n)]


class SimPool:
    """A worker's KV pool reduced to what the directory sees: a set of keys + events."""

    def __init__(self) -> None:
        self.keys: set[PageKey] = set()
        self._events: list[CacheEvent] = []

    def store(self, keys: Sequence[PageKey]) -> None:
        self.keys.update(keys)
        self._events.append(CacheEvent(EventKind.STORED, tuple(keys)))

    def remove(self, keys: Sequence[PageKey]) -> None:
        self.keys.difference_update(keys)
        self._events.append(CacheEvent(EventKind.REMOVED, tuple(keys)))

    def clear(self) -> None:
        self.keys.clear()
        self._events.append(CacheEvent(EventKind.CLEARED))

    def drain(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> d.KeySnapshot:
        return d.KeySnapshot(sorted(self.keys))


class LossyDirectory:
    """Wraps a directory; can lose batches in transit (reported applied) or be down."""

    def __init__(self, inner: d.ChunkDirectory) -> None:
        self.inner = inner
        self.lose_next: set[str] = set()  # worker ids whose next batch is lost
        self.down = False

    def publish(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[CacheEvent]
    ) -> d.PublishResult:
        if self.down:
            return d.UNAVAILABLE
        if worker_id in self.lose_next:
            self.lose_next.discard(worker_id)
            return d.APPLIED
        return self.inner.publish(worker_id, epoch, seq, events)

    def publish_snapshot(
        self,
        worker_id: str,
        epoch: int,
        seq: int,
        keys: Sequence[PageKey],
        host_keys: Sequence[PageKey] = (),
    ) -> d.PublishResult:
        if self.down:
            return d.UNAVAILABLE
        return self.inner.publish_snapshot(worker_id, epoch, seq, keys, host_keys)

    def heartbeat(self, worker_id: str, epoch: int) -> d.PublishResult:
        return d.UNAVAILABLE if self.down else self.inner.heartbeat(worker_id, epoch)

    def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        return d.NO_INFORMATION if self.down else self.inner.lookup(keys, token_ends, entry_keys)

    def remove_worker(self, worker_id: str) -> None:
        self.inner.remove_worker(worker_id)

    def stats(self) -> d.DirectoryStats:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def holders(directory: d.ChunkDirectory, key: PageKey) -> set[str]:
    result = directory.lookup([key], [1])
    assert result.available
    return {h.worker_id for h in result.holdings}


def wait_until(condition: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step_s)
    return condition()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: every socket stays bound until all are chosen (ports
    picked one after another may repeat once each socket is closed)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


class RedisProcess:
    """A private redis-server on a free port; tests may kill and restart it."""

    def __init__(self, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_until(lambda: answers(self.url), timeout_s=10, step_s=0.05):
            self.kill()
            raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
