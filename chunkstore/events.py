"""Cache events a worker's KV pool emits, consumed by the chunk directory.

Mutation semantics (what a consumer must do):
- ``stored``: the worker now holds the pages with these keys (full pages, verified).
- ``removed``: the worker no longer holds these keys (evicted or overwritten).
- ``cleared``: the worker holds nothing any more; forget every key it published.
- ``offloaded``: the worker still holds these keys (pages or entries), now in its
  host-memory tier: loading them back costs less than computing them, more than a
  device hit. ``reloaded``: they are back in device memory. A key that is offloaded
  and then dropped from the host tier reports ``removed`` / ``entry_removed``.
- ``entry_stored`` / ``entry_removed``: the same for position-free chunk entries
  (keys from ``hashing.position_free_key``; a key space of their own, so a consumer
  may keep them beside page keys).
Events of one worker are applied in order; order across workers does not matter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from chunkstore.hashing import PageKey


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    ENTRY_STORED = "entry_stored"
    ENTRY_REMOVED = "entry_removed"
    OFFLOADED = "offloaded"
    RELOADED = "reloaded"


@dataclass(frozen=True)
class CacheEvent:
    kind: EventKind
    keys: tuple[PageKey, ...] = ()

    @property
    def adds(self) -> bool:
        """The worker now holds ``keys`` (page keys or position-free entry keys)."""
        return self.kind in (EventKind.STORED, EventKind.ENTRY_STORED, EventKind.RELOADED)

    @property
    def drops(self) -> bool:
        return self.kind in (EventKind.REMOVED, EventKind.ENTRY_REMOVED)


def apply_event(keys: set[PageKey], event: CacheEvent, host: set[PageKey] | None = None) -> None:
    """What a consumer does with one event of a worker: ``keys`` is what it holds, in
    either tier; ``host``, the part of it only in host memory (None: not tracked)."""
    if event.kind is EventKind.OFFLOADED:
        keys.update(event.keys)
        if host is not None:
            host.update(event.keys)
        return
    if event.adds:
        keys.update(event.keys)
    elif event.drops:
        keys.difference_update(event.keys)
    elif event.kind is EventKind.CLEARED:
        keys.clear()
        if host is not None:
            host.clear()
    if host is not None and event.keys:  # stored, reloaded or dropped: not in host only
        host.difference_update(event.keys)


class EventRuns:
    """Cache events in order, each run of adjacent events of one kind kept as one
    (applying them together is applying them in turn). A KV pool emits one event per
    page it stores: a pool's queue and a publisher's batch hold runs, so whoever ships
    or applies them handles one event per run, not per page."""

    def __init__(self) -> None:
        self._runs: list[tuple[EventKind, list[PageKey]]] = []
        self.num_keys = 0

    def __bool__(self) -> bool:
        return bool(self._runs)

    def append(self, kind: EventKind, keys: Sequence[PageKey] = ()) -> None:
        if self._runs and self._runs[-1][0] is kind and keys:
            self._runs[-1][1].extend(keys)
        else:
            self._runs.append((kind, list(keys)))
        self.num_keys += len(keys)

    def events(self) -> list[CacheEvent]:
        return [CacheEvent(kind, tuple(keys)) for kind, keys in self._runs]

    def clear(self) -> None:
        self._runs.clear()
        self.num_keys = 0

    def drain(self) -> list[CacheEvent]:
        """``events()``, then ``clear()``."""
        events = self.events()
        self.clear()
        return events
