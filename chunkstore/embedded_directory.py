"""In-process chunk directory: the single-machine default.

Follows the semantics in ``chunkstore.directory`` exactly. Invariants:
- ``_records`` holds at most one record per worker, for its newest known epoch.
- A record is collected once its lease ended one TTL ago (checked on every call),
  so keys never outlive their worker's lease by more than one TTL.
- Every public method takes ``_lock``: safe to share between threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chunkstore import directory as d
from chunkstore.events import CacheEvent
from chunkstore.hashing import PageKey

FRESH = -1  # new stream: the next batch must carry seq 0
BROKEN = -2  # a gap was seen: only a snapshot restarts the stream


@dataclass(slots=True)
class _Record:
    epoch: int
    last_seq: int
    lease_until: float
    keys: set[PageKey] = field(default_factory=set)


class EmbeddedChunkDirectory:
    """``ChunkDirectory`` kept in this process. ``clock`` is injectable for tests."""

    def __init__(
        self,
        lease_ttl_s: float = d.DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
        self._ttl = lease_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._lookups = 0
        self._hits = 0

    def publish(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[CacheEvent]
    ) -> d.PublishResult:
        d.check_stream(worker_id, epoch, seq)
        d.check_events(events)
        with self._lock:
            record = self._open(worker_id, epoch)
            if record is None:
                return d.STALE_EPOCH
            if seq != record.last_seq + 1:  # BROKEN + 1 never matches a seq >= 0
                record.keys.clear()
                record.last_seq = BROKEN
                return d.NEEDS_SNAPSHOT
            for event in events:
                _apply(record.keys, event)
            record.last_seq = seq
            return d.APPLIED

    def publish_snapshot(
        self, worker_id: str, epoch: int, seq: int, keys: Sequence[PageKey]
    ) -> d.PublishResult:
        d.check_stream(worker_id, epoch, seq)
        d.check_keys(keys)
        with self._lock:
            record = self._open(worker_id, epoch)
            if record is None:
                return d.STALE_EPOCH
            record.keys = set(keys)
            record.last_seq = seq
            return d.APPLIED

    def heartbeat(self, worker_id: str, epoch: int) -> d.PublishResult:
        d.check_worker(worker_id, epoch)
        with self._lock:
            record = self._open(worker_id, epoch)
            if record is None:
                return d.STALE_EPOCH
            return d.NEEDS_SNAPSHOT if record.last_seq < 0 else d.APPLIED

    def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        d.check_lookup(keys, token_ends, entry_keys)
        with self._lock:
            now = self._collect()
            live = {w: r.keys for w, r in self._records.items() if r.lease_until > now}
            runs = {w: d.leading_run(key in held for key in keys) for w, held in live.items()}
            entries = {
                w: [i for i, key in enumerate(entry_keys) if key in held]
                for w, held in live.items()
            }
            result = d.lookup_result(runs, token_ends, entries)
            self._lookups += 1
            self._hits += bool(result.holdings)
            return result

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._records.pop(worker_id, None)

    def stats(self) -> d.DirectoryStats:
        with self._lock:
            now = self._collect()
            live = [r for r in self._records.values() if r.lease_until > now]
            return d.DirectoryStats(
                available=True,
                entries=sum(len(r.keys) for r in live),
                live_workers=len(live),
                lookups=self._lookups,
                hits=self._hits,
                failures=0,
            )

    def close(self) -> None:
        with self._lock:
            self._records.clear()

    def _open(self, worker_id: str, epoch: int) -> _Record | None:
        """The worker's record for ``epoch`` with a renewed lease; None if epoch is stale."""
        now = self._collect()
        record = self._records.get(worker_id)
        if record is not None and record.epoch > epoch:
            return None
        if record is None or record.epoch < epoch:
            record = _Record(epoch=epoch, last_seq=FRESH, lease_until=now)
            self._records[worker_id] = record
        record.lease_until = now + self._ttl
        return record

    def _collect(self) -> float:
        """Drop records whose lease ended one TTL ago; return the current time."""
        now = self._clock()
        dead = [w for w, r in self._records.items() if r.lease_until + self._ttl <= now]
        for worker in dead:
            del self._records[worker]
        return now


def _apply(keys: set[PageKey], event: CacheEvent) -> None:
    if event.adds:
        keys.update(event.keys)
    elif event.drops:
        keys.difference_update(event.keys)
    else:
        keys.clear()
