"""A thread-safe mirror of a KV pool's keys, between the engine thread and the
event publisher's thread (the pool itself is touched by the engine thread only).

Invariants:
- ``absorb`` is called by the engine thread with events drained from the pool, in
  order; ``drain`` and ``snapshot`` may be called from any thread.
- ``_keys`` reflects every event ever absorbed, so a snapshot taken after a drain
  reflects every event that drain returned (what ``EventPublisher`` requires).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from chunkstore.directory import KeySnapshot
from chunkstore.events import CacheEvent, apply_event
from chunkstore.hashing import PageKey


class CacheMirror:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[PageKey] = set()
        self._host: set[PageKey] = set()  # of those, the ones only in host memory
        self._pending: list[CacheEvent] = []

    def absorb(self, events: Sequence[CacheEvent]) -> None:
        if not events:
            return
        with self._lock:
            for event in events:
                apply_event(self._keys, event, self._host)
            self._pending.extend(events)

    def drain(self) -> list[CacheEvent]:
        with self._lock:
            events, self._pending = self._pending, []
            return events

    def snapshot(self) -> KeySnapshot:
        with self._lock:
            return KeySnapshot(list(self._keys), list(self._host))

    def size(self) -> int:
        with self._lock:
            return len(self._keys)
