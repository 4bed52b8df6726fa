"""Worker side of the directory: ships a KV pool's cache events off the hot path.

Invariants:
- Each cycle (every ``interval_s`` on a background thread, or ``flush()``) drains
  the pool's event queue and makes one directory call: the pending batch, or a
  snapshot. The batch is sent even when empty: it renews the lease (it *is* the
  heartbeat) and its seq lets the directory detect a gap while the pool is idle.
  A second call follows only when the directory asks for a snapshot.
- ``_pending`` holds, in order, every drained event not yet confirmed applied, with
  adjacent events of one kind merged into one (the pool emits one per page stored;
  applying them together is applying them in turn).
  While the directory is unreachable it is retried with the same seq, so a batch
  that did land before the failure shows up as a gap (the directory then asks
  for a snapshot) and is never applied twice.
- ``_pending`` holds at most ``max_buffered_keys`` keys; past that it is dropped
  and a snapshot is sent once the directory answers again.
- A snapshot is taken *after* draining, so it reflects every event already
  drained; events drained later replay on top of it harmlessly (stored, removed
  and cleared are idempotent in order).
- ``_next_seq`` advances only on a confirmed apply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from chunkstore import directory as d
from chunkstore.events import CacheEvent, EventKind, EventRuns

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Counts:
    batches: int = 0
    snapshots: int = 0
    unavailable: int = 0
    dropped_buffers: int = 0


@dataclass(frozen=True)
class PublisherStats:
    batches: int  # batches confirmed applied
    snapshots: int  # snapshots confirmed applied
    unavailable: int  # calls that found the directory unreachable
    dropped_buffers: int  # times the pending buffer overflowed and was dropped
    next_seq: int
    in_sync: bool  # nothing pending and no snapshot owed
    superseded: bool  # a newer epoch of this worker exists; publishing stopped


class EventPublisher:
    """Publishes ``drain()``-ed events of one worker incarnation (worker id + epoch).

    ``drain`` returns and forgets the pool's queued events; ``snapshot`` returns
    every page key the pool holds, reflecting at least every event already drained.
    Call ``start()`` for the background thread, ``flush()`` for one cycle now.
    """

    def __init__(
        self,
        directory: d.ChunkDirectory,
        worker_id: str,
        epoch: int,
        drain: Callable[[], list[CacheEvent]],
        snapshot: Callable[[], d.KeySnapshot],
        *,
        interval_s: float = 0.25,
        max_buffered_keys: int = 20_000,
    ) -> None:
        d.check_worker(worker_id, epoch)
        if not interval_s > 0 or max_buffered_keys < 1:
            raise ValueError(
                f"interval_s must be > 0 and max_buffered_keys >= 1, "
                f"got {interval_s!r} and {max_buffered_keys!r}"
            )
        self._directory = directory
        self._worker_id = worker_id
        self._epoch = epoch
        self._drain = drain
        self._snapshot = snapshot
        self._interval_s = interval_s
        self._max_buffered_keys = max_buffered_keys
        self._lock = threading.Lock()  # one cycle at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending = EventRuns()
        self._need_snapshot = True  # the first call establishes the stream
        self._next_seq = 0
        self._superseded = False
        self._counts = _Counts()

    def start(self) -> None:
        if self._thread is not None:
            raise ValueError("EventPublisher.start() was already called")
        self._thread = threading.Thread(
            target=self._run, name=f"chunk-publisher-{self._worker_id}", daemon=True
        )
        self._thread.start()

    def stop(self, flush: bool = True) -> None:
        """Stop the thread; with ``flush``, ship what is queued with one last cycle."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if flush:
            self.flush()

    def flush(self) -> d.PublishResult:
        """Run one cycle now; return the directory's answer to its last call."""
        with self._lock:
            self._buffer(self._drain())
            if self._superseded:
                return d.STALE_EPOCH
            result = self._send_snapshot() if self._need_snapshot else self._send_batch()
            if result.needs_snapshot:  # the directory voided our keys: re-sync now
                result = self._send_snapshot()
            return result

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                batches=self._counts.batches,
                snapshots=self._counts.snapshots,
                unavailable=self._counts.unavailable,
                dropped_buffers=self._counts.dropped_buffers,
                next_seq=self._next_seq,
                in_sync=not self._pending and not self._need_snapshot,
                superseded=self._superseded,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.flush()
            except Exception:  # the thread must survive a faulty pool or directory
                logger.exception("chunk publisher %s: cycle failed", self._worker_id)
                with self._lock:
                    self._drop_pending()
            if self._superseded:
                return
            self._stop.wait(self._interval_s)

    def _buffer(self, events: list[CacheEvent]) -> None:
        if self._need_snapshot:
            return  # the snapshot owed supersedes these events
        for event in events:
            if event.kind is EventKind.CLEARED:
                self._pending.clear()  # a clear makes every earlier event moot
            self._pending.append(event.kind, event.keys)
        if self._pending.num_keys > self._max_buffered_keys:
            self._counts.dropped_buffers += 1
            self._drop_pending()

    def _drop_pending(self) -> None:
        self._pending.clear()
        self._need_snapshot = True

    def _send_batch(self) -> d.PublishResult:
        events = self._pending.events()
        result = self._directory.publish(self._worker_id, self._epoch, self._next_seq, events)
        if result.applied:
            self._counts.batches += 1
            self._pending.clear()
            self._next_seq += 1
        else:
            self._note_failure(result)
        return result

    def _send_snapshot(self) -> d.PublishResult:
        self._drop_pending()
        held = self._snapshot()
        result = self._directory.publish_snapshot(
            self._worker_id, self._epoch, self._next_seq, held.keys, held.host_keys
        )
        if result.applied:
            self._counts.snapshots += 1
            self._need_snapshot = False
            self._next_seq += 1
        else:
            self._note_failure(result)
        return result

    def _note_failure(self, result: d.PublishResult) -> None:
        if result.needs_snapshot:
            self._drop_pending()
        elif not result.available:
            self._counts.unavailable += 1
        elif result.status is d.PublishStatus.STALE_EPOCH and not self._superseded:
            self._superseded = True
            logger.warning(
                "chunk publisher %s: epoch %d superseded by a newer one; stopping",
                self._worker_id,
                self._epoch,
            )
