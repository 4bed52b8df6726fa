"""Which worker serves a request: a pure function of worker loads and cache holdings.

Policy:
1. Workers at ``max_requests_per_worker`` are full; if all are, the request is
   refused (``OVERLOADED``), if there are none, ``NO_WORKER``.
2. With no directory answer, pick the least-loaded worker (``NO_DIRECTORY``).
3. Otherwise (the holdings being the directory's, raised to what ``recent``, this
   router's memory of its own decisions, says a worker holds: see ``RouteMemory``)
   a worker holding part of the prompt is a candidate unless it carries
   more than ``imbalance_slack`` requests above the least-loaded worker (then load
   is badly imbalanced and balancing wins). Each candidate scores
   ``cached_tokens - load_penalty_tokens * requests``; the best candidate wins if
   it beats the least-loaded worker's score (``-load_penalty_tokens * least``),
   i.e. if its cache saves more than its extra queue costs (``AFFINITY``, or
   ``RECENT`` where only the memory says it holds that much) -- unless rule 4
   sends it to an idle worker.
4. Spill: an idle worker (no request in flight: new, restarted, or drained) takes
   the request instead of the winning holder when the holder's queue costs more
   than its cache saves, in tokens: the holder's queued work, estimated as its
   tokens in flight less the held prefix for each of its requests (they are there
   because they share it), exceeds the prefix this request would not compute
   there (``SPILL``). The idle worker then holds the prefix too, so a hot prefix
   spreads and a restarted worker gets traffic as soon as it is faster for someone.
5. Else the least-loaded worker (``LOAD``).
Ties go to fewer requests, then fewer tokens in flight, then ``rotation`` picks
among the still tied, so equal workers share requests evenly.

``RouteMemory`` is that memory: the prefixes this router sent to each worker in the
last ``lease_s`` seconds count as held there, since the worker computes and keeps
them at once while the directory learns of them only with its next publish. So an
identical prompt sent again at once, or a burst of a new prefix, lands on the same
worker. It reads no clock: callers pass ``now``.

``round_robin`` is the baseline that ignores caches and load: the open workers in id
order, one after another (``rotation`` counts requests).

``prefill_saved`` turns a directory answer into the ``holdings`` above: per worker,
the prompt tokens it would not compute. For an exact request that is its exactly
held prefix; an approximate request adds, for each placeable chunk after that prefix
whose position-free entry the worker holds, the chunk's tokens minus those repair
recomputes (``min(first_tokens, n) + round(deviation_ratio * n)`` of an ``n``-token
chunk; ``placed_saving``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from chunkstore.hashing import PageKey


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    requests: int  # queued + running on the worker
    tokens: int  # prompt + max new tokens of those


@dataclass(frozen=True)
class RoutingWeights:
    load_penalty_tokens: float
    imbalance_slack: int
    max_requests_per_worker: int


class Policy(StrEnum):
    CHUNK_AWARE = "chunk_aware"  # choose_worker: cache holdings against load
    ROUND_ROBIN = "round_robin"  # round_robin: blind rotation (a baseline)


class Reason(StrEnum):
    AFFINITY = "affinity"  # the worker holds a prefix of the prompt
    RECENT = "recent"  # this router just sent it the prefix (RouteMemory); not yet listed
    SPILL = "spill"  # idle, and sooner than the holder whose queue outweighs its cache
    LOAD = "load"  # nobody holds a useful prefix, or load is too imbalanced
    NO_DIRECTORY = "no_directory"  # the directory had no information
    ROTATION = "rotation"  # round-robin: the next worker in turn


class Unroutable(StrEnum):
    NO_WORKER = "no_worker"
    OVERLOADED = "overloaded"


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: Reason
    expected_cached_tokens: int  # prefill the directory says the worker saves (holdings)


def choose_worker(
    workers: Sequence[WorkerView],
    holdings: Mapping[str, int] | None,
    weights: RoutingWeights,
    rotation: int = 0,
    recent: Mapping[str, int] | None = None,
) -> Decision | Unroutable:
    """``holdings``: worker id -> cached prompt tokens (None: no directory answer).
    ``recent``: worker id -> prompt tokens this router recently sent it (``RouteMemory``
    .recall); counted as held where they exceed ``holdings``."""
    open_ = _open_workers(workers, weights.max_requests_per_worker)
    if isinstance(open_, Unroutable):
        return open_
    if holdings is None:
        return _least_loaded(open_, rotation, Reason.NO_DIRECTORY)
    recent = recent or {}
    held = {w: max(holdings.get(w, 0), recent.get(w, 0)) for w in {*holdings, *recent}}
    least = min(w.requests for w in open_)
    candidates = [
        w
        for w in open_
        if held.get(w.worker_id, 0) > 0 and w.requests <= least + weights.imbalance_slack
    ]
    penalty = weights.load_penalty_tokens

    def score(w: WorkerView) -> float:
        return held.get(w.worker_id, 0) - penalty * w.requests

    if candidates:
        best = _pick(candidates, lambda w: (-score(w), w.requests, w.tokens), rotation)
        if score(best) > -penalty * least:
            tokens = held[best.worker_id]
            idle = [w for w in open_ if w.requests == 0 and w is not best]
            if idle and queued_work(best, tokens) > tokens:
                spill = _pick(idle, lambda w: (-held.get(w.worker_id, 0), w.tokens), rotation)
                return Decision(spill.worker_id, Reason.SPILL, held.get(spill.worker_id, 0))
            listed = holdings.get(best.worker_id, 0) >= tokens
            return Decision(best.worker_id, Reason.AFFINITY if listed else Reason.RECENT, tokens)
    return _least_loaded(open_, rotation, Reason.LOAD)


def queued_work(worker: WorkerView, held: int) -> int:
    """Tokens a holder of ``held`` prompt tokens must still work through before a new
    request (rule 4): its tokens in flight less ``held`` for each request in flight
    (never below 0). A stand-in until workers report their queued prefill."""
    return max(0, worker.tokens - worker.requests * held)


class RouteMemory:
    """Which prompt prefixes this router sent to which worker in the last ``lease_s``
    seconds (a decision's lease runs from when it was made; a new decision for the same
    prefix and worker renews it). Holds at most ``max_keys`` keys, dropping the least
    recently sent first. ``lease_s`` 0 remembers nothing."""

    def __init__(self, lease_s: float, max_keys: int = 1 << 18) -> None:
        if lease_s < 0 or max_keys <= 0:
            raise ValueError(f"lease_s must be >= 0 and max_keys > 0, got {lease_s}, {max_keys}")
        self._lease_s = lease_s
        self._max_keys = max_keys
        # key -> worker -> lease end; keys in the order last sent, so the first key's
        # latest lease ends no later than any other key's
        self._leases: OrderedDict[PageKey, dict[str, float]] = OrderedDict()

    def remember(self, keys: Sequence[PageKey], worker_id: str, now: float) -> None:
        """``keys``: the prompt's chunk keys, in prompt order, just sent to the worker."""
        if not self._lease_s:
            return
        until = now + self._lease_s
        for key in keys:
            self._leases.setdefault(key, {})[worker_id] = until
            self._leases.move_to_end(key)
        self._expire(now)

    def recall(
        self, keys: Sequence[PageKey], token_ends: Sequence[int], now: float
    ) -> dict[str, int]:
        """Worker id -> prompt tokens of the longest prefix of ``keys`` (``token_ends``:
        tokens up to each) recently sent to it; workers with none are left out."""
        self._expire(now)
        if not keys:
            return {}
        held: dict[str, int] = {}
        for worker, until in self._leases.get(keys[0], {}).items():
            if until <= now:
                continue
            for key, end in zip(keys, token_ends, strict=True):
                if self._leases.get(key, {}).get(worker, now) <= now:
                    break
                held[worker] = end
        return held

    def forget(self, worker_id: str) -> None:
        """Drop a worker's leases (it died: a restarted one holds nothing)."""
        for workers in self._leases.values():
            workers.pop(worker_id, None)

    def __len__(self) -> int:
        """Keys remembered (some possibly past their lease until the next call)."""
        return len(self._leases)

    def _expire(self, now: float) -> None:
        leases = self._leases
        while leases:
            first = next(iter(leases.values()))
            if len(leases) <= self._max_keys and max(first.values(), default=now) > now:
                return
            leases.popitem(last=False)


def placed_saving(length: int, first_tokens: int, deviation_ratio: float) -> int:
    """Prompt tokens an approximate hit on an ``length``-token chunk saves: its tokens
    less the ones repair recomputes (never below 0)."""
    recomputed = min(first_tokens, length) + round(deviation_ratio * length)
    return max(0, length - recomputed)


def prefill_saved(
    exact_tokens: Mapping[str, int],
    entries: Mapping[str, Collection[int]],
    spans: Sequence[tuple[int, int]],
    first_tokens: int,
    deviation_ratio: float,
) -> dict[str, int]:
    """Worker id -> prompt tokens it would not compute (the ``holdings`` of
    ``choose_worker``). ``exact_tokens``: worker -> exactly held prefix tokens;
    ``entries``: worker -> indices into ``spans`` (placeable chunks, sorted) whose
    entries it holds. A held entry counts only where its span starts at or after the
    worker's exact prefix (the engine places nothing inside that prefix). Workers
    saving nothing are left out."""
    saved = dict(exact_tokens)
    for worker, held in entries.items():
        prefix = exact_tokens.get(worker, 0)
        placed = sum(
            placed_saving(end - start, first_tokens, deviation_ratio)
            for start, end in (spans[i] for i in held)
            if start >= prefix
        )
        saved[worker] = prefix + placed
    return {worker: tokens for worker, tokens in saved.items() if tokens > 0}


def round_robin(
    workers: Sequence[WorkerView], max_requests_per_worker: int, rotation: int
) -> Decision | Unroutable:
    """The ``rotation``-th open worker in id order, whatever it holds or carries."""
    open_ = _open_workers(workers, max_requests_per_worker)
    if isinstance(open_, Unroutable):
        return open_
    in_order = sorted(open_, key=lambda w: w.worker_id)
    return Decision(in_order[rotation % len(in_order)].worker_id, Reason.ROTATION, 0)


def _open_workers(
    workers: Sequence[WorkerView], max_requests_per_worker: int
) -> list[WorkerView] | Unroutable:
    """The workers below their request limit (rule 1 of the module's policy)."""
    if not workers:
        return Unroutable.NO_WORKER
    open_ = [w for w in workers if w.requests < max_requests_per_worker]
    return open_ or Unroutable.OVERLOADED


def _least_loaded(workers: Sequence[WorkerView], rotation: int, reason: Reason) -> Decision:
    chosen = _pick(workers, lambda w: (w.requests, w.tokens), rotation)
    return Decision(chosen.worker_id, reason, 0)


def _pick(
    workers: Sequence[WorkerView], key: Callable[[WorkerView], tuple], rotation: int
) -> WorkerView:
    ordered = sorted(workers, key=lambda w: (key(w), w.worker_id))
    tied = [w for w in ordered if key(w) == key(ordered[0])]
    return tied[rotation % len(tied)]
