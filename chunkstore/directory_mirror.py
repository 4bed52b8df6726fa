"""A router's own copy of the embedded chunk directory, kept current from the
directory's change feed, so that a lookup costs no round trip.

The feed (``EmbeddedChunkDirectory.changes``): every change to a worker's record (its
keys, or the record itself) takes the next version number. Asked for the changes
after version ``since`` of one directory incarnation, the directory answers with
them, or with a copy of every record when it no longer keeps them all (its log is
bounded) or when the asker followed another incarnation (a restarted host starts
empty, at version 0). Every answer carries each record's lease as seconds left (the
clocks of two processes never compare), so the copy counts the same workers live.

Invariants:
- After every answer is applied in order, the mirror's records (workers and their
  keys) equal the directory's at the answer's version.
- A mirror lookup is ``directory.lookup_in`` over the workers whose lease, as the
  last answer gave it, has not ended: the directory's own lookup at that version.
- ``hide_worker`` leaves a worker out of lookups at once (a router that found it dead
  stops routing by its keys before the directory confirms), without touching its
  record, which keeps following the feed; it shows again once the directory removes
  the record or resets it (a new incarnation), or when the hiding ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from chunkstore import directory as d
from chunkstore.events import CacheEvent, apply_event
from chunkstore.hashing import PageKey


@dataclass(frozen=True)
class RecordChange:
    """One change to one worker's record: ``reset`` forgets its keys (a new record or
    epoch, a gap in its stream, a snapshot), then ``events`` apply in order;
    ``removed``: the record is gone (removed, or collected after its lease)."""

    worker_id: str
    events: tuple[CacheEvent, ...] = ()
    reset: bool = False
    removed: bool = False

    @property
    def weight(self) -> int:
        """What it costs the directory's log: one, plus a key's worth per key."""
        return 1 + sum(len(event.keys) for event in self.events)


@dataclass(frozen=True)
class DirectoryChanges:
    """An answer of the feed: the changes after the asker's version, or (``snapshot``
    not None) every record's keys, replacing the asker's copy."""

    directory_id: str  # the directory's incarnation
    version: int  # the directory's version this answer brings the asker to
    lease_left_s: Mapping[str, float]  # every record's lease, in seconds left (<= 0: ended)
    changes: tuple[RecordChange, ...] = ()
    snapshot: Mapping[str, frozenset[PageKey]] | None = None
    # with a snapshot: of each record's keys, those only in host memory (workers with none
    # left out)
    host_snapshot: Mapping[str, frozenset[PageKey]] = field(default_factory=dict)


@dataclass
class DirectoryMirror:
    """The copy. ``directory_id`` and ``version`` are what to ask the feed next."""

    directory_id: str = ""
    version: int = -1  # nothing applied yet: the first answer is a snapshot
    _records: dict[str, set[PageKey]] = field(default_factory=dict)
    _host: dict[str, set[PageKey]] = field(default_factory=dict)  # of those, host-only keys
    _lease_until: dict[str, float] = field(default_factory=dict)  # on the caller's clock
    _hidden_until: dict[str, float] = field(default_factory=dict)  # hide_worker's, ditto

    def apply(self, answer: DirectoryChanges, now: float) -> None:
        """Bring the copy to ``answer.version``; ``now``: when the answer arrived."""
        if answer.snapshot is not None:
            self._records = {w: set(keys) for w, keys in answer.snapshot.items()}
            self._host = {w: set(answer.host_snapshot.get(w, ())) for w in self._records}
            for worker in [w for w in self._hidden_until if w not in self._records]:
                del self._hidden_until[worker]
        elif answer.directory_id != self.directory_id or not self._follows(answer):
            raise ValueError(
                f"changes after version {answer.version - len(answer.changes)} of directory "
                f"{answer.directory_id!r} cannot follow version {self.version} of "
                f"{self.directory_id!r}"
            )
        for change in answer.changes:
            if change.removed or change.reset:  # the hidden incarnation's record is gone
                self._hidden_until.pop(change.worker_id, None)
            if change.removed:
                self._records.pop(change.worker_id, None)
                self._host.pop(change.worker_id, None)
                continue
            keys = self._records.setdefault(change.worker_id, set())
            host = self._host.setdefault(change.worker_id, set())
            if change.reset:
                keys.clear()
                host.clear()
            for event in change.events:
                apply_event(keys, event, host)
        self.directory_id, self.version = answer.directory_id, answer.version
        self._lease_until = {w: now + left for w, left in answer.lease_left_s.items()}

    def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey],
        now: float,
    ) -> d.LookupResult:
        """The directory's answer as of the last ``apply``; no information before the
        first."""
        d.check_lookup(keys, token_ends, entry_keys)
        if self.version < 0:
            return d.NO_INFORMATION
        live = {
            w: held
            for w, held in self._records.items()
            if self._lease_until.get(w, float("-inf")) > now
            and self._hidden_until.get(w, float("-inf")) <= now
        }
        return d.lookup_in(live, keys, token_ends, entry_keys, self._host)

    def hide_worker(self, worker_id: str, until: float) -> None:
        """Leave ``worker_id`` out of lookups until ``until`` (the caller's clock), or
        until the directory removes or resets its record, whichever comes first."""
        self._hidden_until[worker_id] = until

    def _follows(self, answer: DirectoryChanges) -> bool:
        return answer.version == self.version + len(answer.changes)
