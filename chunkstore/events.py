"""Cache events a worker's KV pool emits, consumed by the chunk directory.

Mutation semantics (what a consumer must do):
- ``stored``: the worker now holds the pages with these keys (full pages, verified).
- ``removed``: the worker no longer holds these keys (evicted or overwritten).
- ``cleared``: the worker holds nothing any more; forget every key it published.
- ``entry_stored`` / ``entry_removed``: the same for position-free chunk entries
  (keys from ``hashing.position_free_key``; a key space of their own, so a consumer
  may keep them beside page keys).
Events of one worker are applied in order; order across workers does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from chunkstore.hashing import PageKey


class EventKind(StrEnum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    ENTRY_STORED = "entry_stored"
    ENTRY_REMOVED = "entry_removed"


@dataclass(frozen=True)
class CacheEvent:
    kind: EventKind
    keys: tuple[PageKey, ...] = ()

    @property
    def adds(self) -> bool:
        """The worker now holds ``keys`` (page keys or position-free entry keys)."""
        return self.kind in (EventKind.STORED, EventKind.ENTRY_STORED)

    @property
    def drops(self) -> bool:
        return self.kind in (EventKind.REMOVED, EventKind.ENTRY_REMOVED)


def apply_event(keys: set[PageKey], event: CacheEvent) -> None:
    """What a consumer does with one event of a worker: ``keys`` is what it holds."""
    if event.adds:
        keys.update(event.keys)
    elif event.drops:
        keys.difference_update(event.keys)
    else:
        keys.clear()
