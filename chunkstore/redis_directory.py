"""Chunk directory in Redis, shared by every router and worker of a cluster.

Follows the semantics in ``chunkstore.directory``; the key layout and its
invariants are in ``chunkstore.redis_scripts``. Invariants of this client:
- Every call is one Lua script (a lookup is one EVALSHA: one round trip), except
  a snapshot, which stages its keys in one pipeline and commits with a script.
- Every socket operation has a short timeout, redis-py retries at most once and
  only on a broken connection, and after a failure calls fail fast for
  ``retry_after_s``: no caller ever waits on Redis for long.
- No Redis error escapes: lookups return ``NO_INFORMATION``, mutations
  ``UNAVAILABLE``, ``remove_worker`` gives up (the lease TTL cleans up).
- Stored keys and values are the prefix, worker ids, page-key and entry-key digests, epochs,
  sequence numbers, times and counts: never client text.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlsplit

import msgpack
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from chunkstore import directory as d
from chunkstore import redis_scripts as lua
from chunkstore.events import CacheEvent, EventKind
from chunkstore.hashing import PageKey

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_URL = "redis://127.0.0.1:6380/0"  # 6379 is Ray's GCS on a `ray start --head`
DEFAULT_TIMEOUT_S = 0.05
SNAPSHOT_BATCH = 2000  # keys per staging command: each stays a short server call

# Position-free entry keys share the worker's key set: a key space of their own.
_KIND_CODES = {
    EventKind.STORED: 0,
    EventKind.ENTRY_STORED: 0,
    EventKind.REMOVED: 1,
    EventKind.ENTRY_REMOVED: 1,
    EventKind.CLEARED: 2,
    EventKind.OFFLOADED: 3,
    EventKind.RELOADED: 0,  # held again in device memory: no longer host-only
}
_STATUS = {
    lua.STATUS_APPLIED: d.APPLIED,
    lua.STATUS_NEEDS_SNAPSHOT: d.NEEDS_SNAPSHOT,
    lua.STATUS_STALE_EPOCH: d.STALE_EPOCH,
}


class _Breaker:
    """Runs Redis calls; after a failure, fails fast for ``retry_after_s``."""

    def __init__(self, retry_after_s: float) -> None:
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._open_until = 0.0  # monotonic time before which calls fail fast
        self._down = False
        self.failures = 0

    def call(self, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None when Redis is unreachable (``fn`` never returns None)."""
        if time.monotonic() < self._open_until:
            with self._lock:
                self.failures += 1
            return None
        try:
            result = fn()
        except (redis.RedisError, OSError) as error:
            self._failed(error)
            return None
        if self._down:
            self._down = False
            logger.info("chunk directory: Redis reachable again")
        return result

    def _failed(self, error: Exception) -> None:
        with self._lock:
            self.failures += 1
            self._open_until = time.monotonic() + self._retry_after_s
            if not self._down:
                self._down = True
                logger.warning("chunk directory: Redis unreachable (%s); degrading", error)


class RedisChunkDirectory:
    """``ChunkDirectory`` in Redis under ``prefix`` (several clusters can share one Redis).

    ``url``: ``redis://[[user]:password@]host:port/db`` or ``rediss://...`` for TLS.
    Every client of one prefix must use the same ``lease_ttl_s``.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        prefix: str = "chunkserve",
        lease_ttl_s: float = d.DEFAULT_LEASE_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_after_s: float = 0.25,
    ) -> None:
        _check_config(url, prefix, lease_ttl_s, timeout_s, retry_after_s)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        self._prefix = prefix + ":"
        self._ttl_ms = max(1, round(lease_ttl_s * 1000))
        self._breaker = _Breaker(retry_after_s)
        self._publish = self._client.register_script(lua.PUBLISH)
        self._commit_snapshot = self._client.register_script(lua.COMMIT_SNAPSHOT)
        self._heartbeat = self._client.register_script(lua.HEARTBEAT)
        self._stage_add = self._client.register_script(lua.STAGE_ADD)
        self._lookup = self._client.register_script(lua.LOOKUP)
        self._stats = self._client.register_script(lua.STATS)
        self._remove_worker = self._client.register_script(lua.REMOVE_WORKER)
        self._counter_lock = threading.Lock()
        self._lookups = 0
        self._hits = 0

    @property
    def prefix(self) -> str:
        """Every key this directory writes starts with this."""
        return self._prefix

    def publish(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[CacheEvent]
    ) -> d.PublishResult:
        d.check_stream(worker_id, epoch, seq)
        d.check_events(events)
        payload = msgpack.packb(
            [[_KIND_CODES[e.kind], list(e.keys)] for e in events], use_bin_type=False
        )  # raw strings: Redis's cmsgpack predates the bin type
        args = [*self._worker_args(worker_id, epoch), seq, payload]
        return self._status(self._breaker.call(lambda: self._publish(args=args)))

    def publish_snapshot(
        self,
        worker_id: str,
        epoch: int,
        seq: int,
        keys: Sequence[PageKey],
        host_keys: Sequence[PageKey] = (),
    ) -> d.PublishResult:
        d.check_stream(worker_id, epoch, seq)
        d.check_snapshot(keys, host_keys)
        return self._status(
            self._breaker.call(lambda: self._snapshot(worker_id, epoch, seq, keys, host_keys))
        )

    def heartbeat(self, worker_id: str, epoch: int) -> d.PublishResult:
        d.check_worker(worker_id, epoch)
        args = self._worker_args(worker_id, epoch)
        return self._status(self._breaker.call(lambda: self._heartbeat(args=args)))

    def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        d.check_lookup(keys, token_ends, entry_keys)
        if keys or entry_keys:
            result = self._query(keys, token_ends, entry_keys)
        else:
            result = d.LookupResult(available=True)
        with self._counter_lock:
            self._lookups += 1
            self._hits += bool(result.holdings)
        return result

    def remove_worker(self, worker_id: str) -> None:
        d.check_worker(worker_id, 0)
        self._breaker.call(lambda: self._remove_worker(args=[self._prefix, worker_id]))

    def stats(self) -> d.DirectoryStats:
        counts = self._breaker.call(lambda: self._stats(args=[self._prefix]))
        with self._counter_lock:
            return d.DirectoryStats(
                available=counts is not None,
                entries=None if counts is None else int(counts[1]),
                live_workers=None if counts is None else int(counts[0]),
                lookups=self._lookups,
                hits=self._hits,
                failures=self._breaker.failures,
            )

    def close(self) -> None:
        self._client.close()

    def _query(
        self, keys: Sequence[PageKey], token_ends: Sequence[int], entry_keys: Sequence[PageKey]
    ) -> d.LookupResult:
        args = [self._prefix, len(keys), *keys, *entry_keys]
        packed = self._breaker.call(lambda: self._lookup(args=args))
        if packed is None:
            return d.NO_INFORMATION
        # [worker, run, [entry index, ...], [host-only chain index, ...],
        #  [host-only entry index, ...], ...]
        flat = msgpack.unpackb(packed, raw=False)
        workers = flat[::5]
        runs = dict(zip(workers, flat[1::5], strict=True))
        entries = dict(zip(workers, flat[2::5], strict=True))
        host_chain = dict(zip(workers, flat[3::5], strict=True))
        host_entries = dict(zip(workers, flat[4::5], strict=True))
        return d.lookup_result(runs, token_ends, entries, host_chain, host_entries)

    def _worker_args(self, worker_id: str, epoch: int) -> list[str | int]:
        return [self._prefix, worker_id, epoch, self._ttl_ms]

    def _snapshot(
        self,
        worker_id: str,
        epoch: int,
        seq: int,
        keys: Sequence[PageKey],
        host_keys: Sequence[PageKey],
    ) -> int:
        """Stage the keys (and the host-only ones) in batches, then swap them in
        atomically if the epoch still holds."""
        stage = f"{self._prefix}stage:{worker_id}:{uuid.uuid4().hex}"
        pipe = self._client.pipeline(transaction=False)
        for staged, members in ((stage, keys), (f"{stage}:h", host_keys)):
            for start in range(0, len(members), SNAPSHOT_BATCH):
                batch = members[start : start + SNAPSHOT_BATCH]
                self._stage_add(keys=[staged], args=[2 * self._ttl_ms, *batch], client=pipe)
        args = [*self._worker_args(worker_id, epoch), seq, stage, f"{stage}:h"]
        self._commit_snapshot(args=args, client=pipe)
        return pipe.execute()[-1]

    @staticmethod
    def _status(code: int | None) -> d.PublishResult:
        return d.UNAVAILABLE if code is None else _STATUS[int(code)]


def _check_config(
    url: str, prefix: str, lease_ttl_s: float, timeout_s: float, retry_after_s: float
) -> None:
    scheme = urlsplit(url).scheme
    if scheme not in ("redis", "rediss"):  # the URL itself may hold a password: never echo it
        raise ValueError(
            "Redis URL must be redis://[:password@]host:port/db or rediss://... (TLS), "
            f"got scheme {scheme!r}"
        )
    if not prefix or any(c.isspace() for c in prefix):
        raise ValueError(f"key prefix must be non-empty without whitespace, got {prefix!r}")
    if not lease_ttl_s > 0:
        raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
    if not 0 < timeout_s <= 1:
        raise ValueError(
            f"timeout_s must be in (0, 1] (Redis calls must be short), got {timeout_s!r}"
        )
    if retry_after_s < 0:
        raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s!r}")
