"""In-process chunk directory: the single-machine default.

Follows the semantics in ``chunkstore.directory`` exactly. Invariants:
- ``_records`` holds at most one record per worker, for its newest known epoch.
- A record is collected once its lease ended one TTL ago (checked on every call),
  so keys never outlive their worker's lease by more than one TTL.
- Every change to a record (its keys, or the record itself) is logged under the next
  version, for ``changes`` (the feed routers' copies follow, see
  ``chunkstore.directory_mirror``); the log keeps the newest changes whose count plus
  keys stays within ``max_log``.
- Every public method takes ``_lock``: safe to share between threads.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chunkstore import directory as d
from chunkstore.directory_mirror import DirectoryChanges, RecordChange
from chunkstore.events import CacheEvent, EventKind, apply_event
from chunkstore.hashing import PageKey

# changes plus their keys: seconds of a busy cluster's publishes (4 workers storing
# 50,000 pages a second), where a follower asks every 50 ms
DEFAULT_MAX_LOG = 1 << 18

FRESH = -1  # new stream: the next batch must carry seq 0
BROKEN = -2  # a gap was seen: only a snapshot restarts the stream


@dataclass(slots=True)
class _Record:
    epoch: int
    last_seq: int
    lease_until: float
    keys: set[PageKey] = field(default_factory=set)
    host: set[PageKey] = field(default_factory=set)  # of ``keys``, only in host memory


class EmbeddedChunkDirectory:
    """``ChunkDirectory`` kept in this process. ``clock`` is injectable for tests."""

    def __init__(
        self,
        lease_ttl_s: float = d.DEFAULT_LEASE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        max_log: int = DEFAULT_MAX_LOG,
    ) -> None:
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
        if max_log < 0:
            raise ValueError(f"max_log must be >= 0, got {max_log!r}")
        self._ttl = lease_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._lookups = 0
        self._hits = 0
        self._id = uuid.uuid4().hex  # this incarnation, for the feed's followers
        self._version = 0  # of the newest change
        self._log: deque[tuple[int, RecordChange]] = deque()  # oldest first
        self._log_weight = 0  # the log's changes plus their keys (RecordChange.weight)
        self._max_log = max_log

    @property
    def log_weight(self) -> int:
        """The change log's changes plus their keys (at most ``max_log``)."""
        return self._log_weight

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
                record.host.clear()
                record.last_seq = BROKEN
                self._logged(RecordChange(worker_id, reset=True))
                return d.NEEDS_SNAPSHOT
            for event in events:
                apply_event(record.keys, event, record.host)
            record.last_seq = seq
            if events:
                self._logged(RecordChange(worker_id, tuple(events)))
            return d.APPLIED

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
        with self._lock:
            record = self._open(worker_id, epoch)
            if record is None:
                return d.STALE_EPOCH
            record.keys, record.host = set(keys), set(host_keys)
            record.last_seq = seq
            device = tuple(record.keys - record.host)
            added = [CacheEvent(EventKind.STORED, device)] if device else []
            if record.host:
                added.append(CacheEvent(EventKind.OFFLOADED, tuple(record.host)))
            self._logged(RecordChange(worker_id, tuple(added), reset=True))
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
            host = {w: r.host for w, r in self._records.items() if w in live}
            result = d.lookup_in(live, keys, token_ends, entry_keys, host)
            self._lookups += 1
            self._hits += bool(result.holdings)
            return result

    def changes(
        self, directory_id: str, since: int, lookups: int = 0, hits: int = 0
    ) -> DirectoryChanges:
        """What a copy at version ``since`` of incarnation ``directory_id`` lacks: the
        changes after it, or every record if they are not all logged (or the copy
        follows another incarnation, or none: ``since`` < 0). ``lookups`` / ``hits``:
        the asker's own lookups since its last answer, counted into ``stats``."""
        if lookups < 0 or not 0 <= hits <= lookups:
            raise ValueError(f"need 0 <= hits <= lookups, got {hits}, {lookups}")
        with self._lock:
            now = self._collect()
            self._lookups += lookups
            self._hits += hits
            leases = {w: r.lease_until - now for w, r in self._records.items()}
            oldest = self._log[0][0] if self._log else self._version + 1
            if directory_id != self._id or not oldest - 1 <= since <= self._version:
                snapshot = {w: frozenset(r.keys) for w, r in self._records.items()}
                host = {w: frozenset(r.host) for w, r in self._records.items() if r.host}
                return DirectoryChanges(
                    self._id, self._version, leases, snapshot=snapshot, host_snapshot=host
                )
            newer = []
            for version, change in reversed(self._log):
                if version <= since:
                    break
                newer.append(change)
            return DirectoryChanges(self._id, self._version, leases, tuple(reversed(newer)))

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            if self._records.pop(worker_id, None) is not None:
                self._logged(RecordChange(worker_id, removed=True))

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
            for worker_id in list(self._records):
                del self._records[worker_id]
                self._logged(RecordChange(worker_id, removed=True))

    def _open(self, worker_id: str, epoch: int) -> _Record | None:
        """The worker's record for ``epoch`` with a renewed lease; None if epoch is stale."""
        now = self._collect()
        record = self._records.get(worker_id)
        if record is not None and record.epoch > epoch:
            return None
        if record is None or record.epoch < epoch:
            record = _Record(epoch=epoch, last_seq=FRESH, lease_until=now)
            self._records[worker_id] = record
            self._logged(RecordChange(worker_id, reset=True))
        record.lease_until = now + self._ttl
        return record

    def _collect(self) -> float:
        """Drop records whose lease ended one TTL ago; return the current time."""
        now = self._clock()
        dead = [w for w, r in self._records.items() if r.lease_until + self._ttl <= now]
        for worker in dead:
            del self._records[worker]
            self._logged(RecordChange(worker, removed=True))
        return now

    def _logged(self, change: RecordChange) -> None:
        """Log ``change`` under the next version, dropping the oldest changes beyond
        ``max_log`` (a copy older than the log then gets a snapshot)."""
        self._version += 1
        self._log.append((self._version, change))
        self._log_weight += change.weight
        while self._log and self._log_weight > self._max_log:
            _, dropped = self._log.popleft()
            self._log_weight -= dropped.weight
