"""The chunk directory protocol: which live worker holds which page keys.

A directory records, per worker, the set of page keys its KV pool holds, fed by
the worker's cache events (``chunkstore.events``), and answers the router's
question "how many leading chunks of this request does each worker hold?" and,
for approximate reuse, "which of these position-free chunk entries does each worker
hold?" (entry keys, ``hashing.position_free_key``, live in the same key set as page
keys: a key space of their own).

Mutation semantics (every implementation follows them exactly):

- A worker's record is ``(epoch, last_seq, keys, lease)``. Only the record of
  the worker's newest epoch exists: a call carrying a newer epoch voids the
  record of the older one (its keys are forgotten) before anything else. A call
  carrying an older epoch than the recorded one is dropped (``STALE_EPOCH``).
- ``publish`` applies one batch of events in order, only if ``seq`` is exactly
  ``last_seq + 1`` of the worker's current epoch (the first batch of an epoch
  carries seq 0). Otherwise (a gap, or an epoch the directory knows nothing of
  mid-stream) the batch is not applied, the worker's keys are voided (they are
  no longer known to be right) and the result asks for a snapshot.
- ``publish_snapshot`` replaces the worker's keys with exactly the given ones and
  restarts its stream at ``seq``: the next batch must carry ``seq + 1``. Of its keys,
  ``host_keys`` (a subset) are the ones only in host memory.
- ``publish``, ``publish_snapshot`` and ``heartbeat`` each renew the worker's
  lease to ``now + lease_ttl`` (anything that reaches the directory proves the
  worker alive). ``heartbeat`` asks for a snapshot when the directory has no
  stream for the worker's epoch (new worker, new epoch, lost state, or a gap).
- ``lookup(keys, token_ends, entry_keys)`` answers both questions in one call
  (one round trip): per live worker, the leading run of ``keys`` it holds and the
  indices of the ``entry_keys`` it holds (any of them: entries need no prefix).
  A key counts as held in either of the worker's tiers; the answer says which of
  them sit only in host memory (``offloaded`` events put a key there, ``stored``,
  ``reloaded`` and ``removed`` take it out, ``cleared`` empties it): the tokens of
  the run (``WorkerHolding.host_tokens``) and the entries (``host_entries``).
- A worker is *live* while its lease is fresh. ``lookup`` counts live workers
  only; a worker's keys are garbage-collected at most one lease TTL after its
  lease expired, so entries never outlive their worker's lease by more than one
  TTL.
- ``remove_worker`` forgets the worker entirely (record, keys, lease).
- Failures to reach the backing store never raise: ``lookup`` returns
  ``LookupResult(available=False)`` (no information; route by load), mutations
  return ``PublishStatus.UNAVAILABLE`` (the publisher retries; whether the call
  was applied is unknown, and the sequence check resolves it).
- Contract violations (malformed arguments) raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from chunkstore.events import CacheEvent, EventKind
from chunkstore.hashing import PageKey

PAGE_KEY_BYTES = 32
MAX_EPOCH = 2**53  # epochs and seqs must be exact in a Lua number (a double)
MAX_LOOKUP_KEYS = 4096  # chain + entry keys of one lookup: one Lua call unpacks them all
DEFAULT_LEASE_TTL_S = 5.0


class PublishStatus(StrEnum):
    APPLIED = "applied"
    NEEDS_SNAPSHOT = "needs_snapshot"  # gap or unknown stream: re-send a snapshot
    STALE_EPOCH = "stale_epoch"  # a newer epoch of this worker exists: call dropped
    UNAVAILABLE = "unavailable"  # store unreachable: unknown whether applied


@dataclass(frozen=True)
class PublishResult:
    status: PublishStatus

    @property
    def applied(self) -> bool:
        return self.status is PublishStatus.APPLIED

    @property
    def needs_snapshot(self) -> bool:
        return self.status is PublishStatus.NEEDS_SNAPSHOT

    @property
    def available(self) -> bool:
        return self.status is not PublishStatus.UNAVAILABLE


APPLIED = PublishResult(PublishStatus.APPLIED)
NEEDS_SNAPSHOT = PublishResult(PublishStatus.NEEDS_SNAPSHOT)
STALE_EPOCH = PublishResult(PublishStatus.STALE_EPOCH)
UNAVAILABLE = PublishResult(PublishStatus.UNAVAILABLE)


@dataclass(frozen=True)
class WorkerHolding:
    """A live worker holds the request's first ``chunks`` keys consecutively."""

    worker_id: str
    chunks: int  # >= 1
    tokens: int  # token_ends[chunks - 1]
    host_tokens: int = 0  # of ``tokens``, those whose keys sit only in host memory


@dataclass(frozen=True)
class EntryHolding:
    """A live worker holds the position-free entries at these indices of the
    lookup's ``entry_keys`` (ascending, at least one)."""

    worker_id: str
    entries: tuple[int, ...]
    host_entries: tuple[int, ...] = ()  # of ``entries``, those only in host memory


@dataclass(frozen=True)
class LookupResult:
    """``available=False`` means "no information" (not "nobody holds anything")."""

    available: bool
    holdings: tuple[WorkerHolding, ...] = ()  # most chunks first, then by worker id
    entries: tuple[EntryHolding, ...] = ()  # by worker id; workers holding no entry omitted

    def holding(self, worker_id: str) -> WorkerHolding | None:
        return next((h for h in self.holdings if h.worker_id == worker_id), None)

    def entries_of(self, worker_id: str) -> tuple[int, ...]:
        """Indices of the entry keys ``worker_id`` holds (empty if none)."""
        return next((e.entries for e in self.entries if e.worker_id == worker_id), ())


NO_INFORMATION = LookupResult(available=False)


@dataclass(frozen=True)
class DirectoryStats:
    available: bool
    entries: int | None  # (live worker, key) pairs recorded; None when unavailable
    live_workers: int | None  # None when unavailable
    lookups: int  # by this directory object
    hits: int  # lookups where some live worker held the first key
    failures: int  # calls that could not reach the store

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class ChunkDirectory(Protocol):
    """Chunk key -> live workers holding it. See the module docstring for semantics."""

    def publish(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[CacheEvent]
    ) -> PublishResult: ...

    def publish_snapshot(
        self,
        worker_id: str,
        epoch: int,
        seq: int,
        keys: Sequence[PageKey],
        host_keys: Sequence[PageKey] = (),
    ) -> PublishResult: ...

    def heartbeat(self, worker_id: str, epoch: int) -> PublishResult: ...

    def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> LookupResult: ...

    def remove_worker(self, worker_id: str) -> None: ...

    def stats(self) -> DirectoryStats: ...

    def close(self) -> None: ...


def check_worker(worker_id: str, epoch: int) -> None:
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")
    _check_counter("epoch", epoch)


def check_stream(worker_id: str, epoch: int, seq: int) -> None:
    check_worker(worker_id, epoch)
    _check_counter("seq", seq)


def _check_counter(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_EPOCH:
        raise ValueError(
            f"{name} must be an int in [0, 2**53), got {value!r}; "
            "use a counter or milliseconds, not nanoseconds"
        )


def check_keys(keys: Sequence[PageKey]) -> None:
    for key in keys:
        if not isinstance(key, bytes) or len(key) != PAGE_KEY_BYTES:
            raise ValueError(
                f"page keys must be {PAGE_KEY_BYTES}-byte digests from chunkstore.hashing, "
                f"got {key!r:.60}; drop chunks whose key is None before calling"
            )


def check_snapshot(keys: Sequence[PageKey], host_keys: Sequence[PageKey]) -> None:
    check_keys(keys)
    check_keys(host_keys)
    if host_keys and not set(host_keys) <= set(keys):
        raise ValueError("a snapshot's host_keys must be among its keys")


@dataclass(frozen=True)
class KeySnapshot:
    """A worker's keys at one moment (``publish_snapshot``'s arguments)."""

    keys: Sequence[PageKey]  # every key it holds, in either tier
    host_keys: Sequence[PageKey] = ()  # of those, the ones only in host memory


def check_events(events: Sequence[CacheEvent]) -> None:
    for event in events:
        if not isinstance(event, CacheEvent) or not isinstance(event.kind, EventKind):
            raise ValueError(f"events must be CacheEvent objects, got {event!r:.80}")
        check_keys(event.keys)


def check_lookup(
    keys: Sequence[PageKey], token_ends: Sequence[int], entry_keys: Sequence[PageKey] = ()
) -> None:
    if len(keys) + len(entry_keys) > MAX_LOOKUP_KEYS:
        raise ValueError(
            f"a lookup takes at most {MAX_LOOKUP_KEYS} chunk and entry keys in all, got "
            f"{len(keys)} + {len(entry_keys)}; merge small chunks or look up a leading part"
        )
    check_keys(keys)
    check_keys(entry_keys)
    if len(keys) != len(token_ends):
        raise ValueError(
            f"token_ends must give one count per key: {len(keys)} keys, "
            f"{len(token_ends)} token_ends"
        )
    previous = 0
    for end in token_ends:
        if not isinstance(end, int) or end < previous:
            raise ValueError(f"token_ends must be non-decreasing ints >= 0, got {token_ends!r}")
        previous = end


def leading_run(held: Iterable[bool]) -> int:
    """How many leading entries of ``held`` are true (stops at the first false)."""
    n = 0
    for flag in held:
        if not flag:
            break
        n += 1
    return n


def lookup_in(
    live: Mapping[str, Collection[PageKey]],
    keys: Sequence[PageKey],
    token_ends: Sequence[int],
    entry_keys: Sequence[PageKey] = (),
    host: Mapping[str, Collection[PageKey]] | None = None,
) -> LookupResult:
    """``lookup`` over ``live``: each live worker's held keys (page and entry keys,
    either tier); ``host``: of those, each worker's keys only in host memory."""
    runs = {w: leading_run(key in held for key in keys) for w, held in live.items()}
    entries = {
        w: [i for i, key in enumerate(entry_keys) if key in held] for w, held in live.items()
    }
    offloaded = {w: held for w, held in (host or {}).items() if w in live and held}
    host_chain = {
        w: [i for i in range(runs[w]) if keys[i] in held] for w, held in offloaded.items()
    }
    host_entries = {
        w: [i for i in entries[w] if entry_keys[i] in held] for w, held in offloaded.items()
    }
    return lookup_result(runs, token_ends, entries, host_chain, host_entries)


def lookup_result(
    runs: Mapping[str, int],
    token_ends: Sequence[int],
    entries: Mapping[str, Iterable[int]] | None = None,
    host_chain: Mapping[str, Iterable[int]] | None = None,
    host_entries: Mapping[str, Iterable[int]] | None = None,
) -> LookupResult:
    """Build a result from worker -> leading run and worker -> indices of held entry
    keys (runs of 0 and empty index sets are dropped), and of those, worker -> the
    indices of the run's chain keys and of the entry keys held only in host memory."""
    host_chain, host_entries = host_chain or {}, host_entries or {}
    holdings = [
        WorkerHolding(
            worker_id=w,
            chunks=n,
            tokens=token_ends[n - 1],
            host_tokens=sum(
                token_ends[i] - (token_ends[i - 1] if i else 0) for i in host_chain.get(w, ())
            ),
        )
        for w, n in runs.items()
        if n > 0
    ]
    holdings.sort(key=lambda h: (-h.chunks, h.worker_id))
    held = [
        EntryHolding(
            worker_id=w,
            entries=tuple(sorted(indices)),
            host_entries=tuple(sorted(host_entries.get(w, ()))),
        )
        for w, indices in (entries or {}).items()
    ]
    held = sorted((e for e in held if e.entries), key=lambda e: e.worker_id)
    return LookupResult(available=True, holdings=tuple(holdings), entries=tuple(held))
