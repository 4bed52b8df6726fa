"""Cache events a worker's KV pool emits, consumed by the chunk directory.

Mutation semantics (what a consumer must do):
- ``stored``: the worker now holds the pages with these keys (full pages, verified).
- ``removed``: the worker no longer holds these keys (evicted or overwritten).
- ``cleared``: the worker holds nothing any more; forget every key it published.
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


@dataclass(frozen=True)
class CacheEvent:
    kind: EventKind
    keys: tuple[PageKey, ...] = ()
