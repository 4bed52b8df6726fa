"""Which worker serves a request: a pure function of worker loads and cache holdings.

Policy (``choose_worker``): the worker expected to give the first token soonest.
1. Workers at ``max_requests_per_worker`` are full; if all are, the request is
   refused (``OVERLOADED``), if there are none, ``NO_WORKER``.
2. Each open worker's expected wait, in seconds (``expected_wait_s``): the prefill
   queued ahead of the request there plus the request's own uncached tokens there,
   at that worker's measured prefill rate, plus one engine step where requests are
   in flight (the decode batch the request joins; the measured rate already includes
   the decode steps interleaved with prefill). A cache hit lowers the estimate only by the prefill it saves: the
   holdings are saved tokens (``prefill_saved``: an exact prefix, or placed chunks
   less what repair recomputes), raised to what ``recent``, this router's memory of
   its own decisions, says a worker holds (see ``RouteMemory``). A worker that has
   not measured its rate yet (new, restarted) is assumed as fast as the median
   measured worker, or ``default_prefill_tokens_per_s`` if none has measured; one
   that measured less than ``MIN_RATE_SHARE`` of that median is assumed that fast.
3. The workers whose wait is within ``WAIT_TOLERANCE`` (relative) plus
   ``WAIT_SLACK_S`` of the smallest are as good: measured rates are noisy, and a
   spill copies the prefix, so a holder keeps its requests until a colder worker is
   clearly sooner. Among them the one holding the most of the prompt wins, then
   fewer requests, then fewer tokens in flight, then ``rotation`` picks among the
   still tied, so equal workers share requests evenly.
4. The reason: ``NO_DIRECTORY`` without a directory answer (waits then count no
   hits); ``SPILL`` if another open worker holds more of the prompt (its queue costs
   more than its cache saves: the chosen worker then holds the prefix too, so a hot
   prefix spreads); ``AFFINITY`` if the chosen worker holds part of the prompt
   (``RECENT`` where only the memory says it holds that much); else ``LOAD``. The
   memory counts even without a directory answer. (The router records ``SOLE`` where
   only one worker was open and it looked nothing up.)

So a restarted or new worker, with nothing queued, gets traffic as soon as it is
faster for someone, and a holder keeps a prefix's requests only while its queue is
shorter than the prefill the hit saves.

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
chunk), less, with a deviation ratio, the selection layers its other tokens still run
through (``selection_share`` of a computed token's cost each: the engine's deviation
layer over the model's layers; ``placed_saving``). What the worker holds only in host
memory saves less: each such token costs its load, as a share of computing it
(``host_load_shares``: the worker's measured load time per token times its prefill
rate; ``HostHeld``).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from chunkstore.hashing import PageKey


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    requests: int  # queued + running on the worker
    tokens: int  # prompt + max new tokens of those
    prefill_backlog: int = 0  # prompt tokens queued for prefill there, not yet computed
    prefill_tokens_per_s: float = 0.0  # its measured prefill rate; 0: not measured yet
    step_s: float = 0.0  # its measured engine step time; 0: not measured yet
    host_load_s_per_token: float = 0.0  # its host tier's measured load time; 0: none yet


DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0  # assumed until a worker measures its own
# A token's KV loaded back from host memory, as a share of computing it, until the
# worker measured its loads: an 8B model's 128 KiB per token over PCIe 5 (about 2.6 us)
# against a prefill of 20-40K tokens/s on one H200 (25-50 us) is 0.05-0.1.
DEFAULT_HOST_LOAD_SHARE = 0.1


@dataclass(frozen=True)
class RoutingWeights:
    max_requests_per_worker: int
    default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S


# A worker's measured rate counts as at least this share of the median measured one.
# A rate is measured only where requests run: a worker once measured slow (a cold
# first step) that then gets no requests never measures again. On 4 H200s through the
# HTTP app, one worker served 1 of 2,400 requests, most likely that way (its rate was not
# logged; bench/RESULTS.md).
MIN_RATE_SHARE = 0.5
WAIT_TOLERANCE = 0.25  # waits within 25% of the smallest (plus the slack) are as good
WAIT_SLACK_S = 0.005


class Policy(StrEnum):
    CHUNK_AWARE = "chunk_aware"  # choose_worker: cache holdings against load
    ROUND_ROBIN = "round_robin"  # round_robin: blind rotation (a baseline)


class Reason(StrEnum):
    AFFINITY = "affinity"  # the worker holds a prefix of the prompt
    RECENT = "recent"  # this router just sent it the prefix (RouteMemory); not yet listed
    SPILL = "spill"  # idle, and sooner than the holder whose queue outweighs its cache
    LOAD = "load"  # nobody holds a useful prefix, or load is too imbalanced
    NO_DIRECTORY = "no_directory"  # the directory had no information
    SOLE = "sole"  # the only worker open: the router asked the directory nothing
    ROTATION = "rotation"  # round-robin: the next worker in turn


class Unroutable(StrEnum):
    NO_WORKER = "no_worker"
    OVERLOADED = "overloaded"


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: Reason
    expected_cached_tokens: int  # prefill the directory says the worker saves (holdings)
    expected_wait_s: float = 0.0  # until the first token, as rule 2 estimates it
    # the chosen worker as the router saw it (diagnostics: bench/cluster_rag.py)
    view: WorkerView | None = field(default=None, compare=False)


def choose_worker(
    workers: Sequence[WorkerView],
    holdings: Mapping[str, int] | None,
    weights: RoutingWeights,
    prompt_tokens: int,
    rotation: int = 0,
    recent: Mapping[str, int] | None = None,
) -> Decision | Unroutable:
    """``holdings``: worker id -> prompt tokens it would not compute (None: no directory
    answer). ``recent``: worker id -> prompt tokens this router recently sent it
    (``RouteMemory.recall``); counted as held where they exceed ``holdings``."""
    open_ = _open_workers(workers, weights.max_requests_per_worker)
    if isinstance(open_, Unroutable):
        return open_
    known = holdings or {}
    recent = recent or {}
    held = {
        w: min(prompt_tokens, max(known.get(w, 0), recent.get(w, 0))) for w in {*known, *recent}
    }
    rate, step_s = _assumed_speed(open_, weights)
    waits = {
        w.worker_id: expected_wait_s(w, prompt_tokens - held.get(w.worker_id, 0), rate, step_s)
        for w in open_
    }
    soonest = min(waits.values())
    as_good = [
        w for w in open_ if waits[w.worker_id] <= soonest * (1 + WAIT_TOLERANCE) + WAIT_SLACK_S
    ]
    chosen = _pick(as_good, lambda w: (-held.get(w.worker_id, 0), w.requests, w.tokens), rotation)
    tokens = held.get(chosen.worker_id, 0)
    if holdings is None:
        reason = Reason.NO_DIRECTORY
    elif max((held.get(w.worker_id, 0) for w in open_), default=0) > tokens:
        reason = Reason.SPILL
    elif tokens > 0:
        reason = Reason.AFFINITY if known.get(chosen.worker_id, 0) >= tokens else Reason.RECENT
    else:
        reason = Reason.LOAD
    return Decision(chosen.worker_id, reason, tokens, waits[chosen.worker_id], chosen)


def expected_wait_s(
    worker: WorkerView, uncached_tokens: int, assumed_rate: float, assumed_step_s: float
) -> float:
    """Seconds until a request with ``uncached_tokens`` to prefill on ``worker`` gets
    its first token (rule 2); the assumed rate and step stand in where the worker has
    measured none. An idle worker adds no step: no decode batch runs beside the
    request's prefill there."""
    measured = worker.prefill_tokens_per_s
    rate = max(measured, MIN_RATE_SHARE * assumed_rate) if measured else assumed_rate
    step_s = (worker.step_s or assumed_step_s) if worker.requests else 0.0
    return (worker.prefill_backlog + max(0, uncached_tokens)) / rate + step_s


def host_load_shares(workers: Sequence[WorkerView], weights: RoutingWeights) -> dict[str, float]:
    """Worker id -> what loading a token's KV back from its host tier costs, as a share
    of computing the token there (at most 1): its measured load time per token times
    its prefill rate (the assumed rate where it measured none);
    ``DEFAULT_HOST_LOAD_SHARE`` before it measured a load."""
    assumed_rate, _ = _assumed_speed(workers, weights)
    shares = {}
    for worker in workers:
        measured = worker.prefill_tokens_per_s
        rate = max(measured, MIN_RATE_SHARE * assumed_rate) if measured else assumed_rate
        load = worker.host_load_s_per_token
        shares[worker.worker_id] = min(1.0, load * rate) if load > 0 else DEFAULT_HOST_LOAD_SHARE
    return shares


def _assumed_speed(workers: Sequence[WorkerView], weights: RoutingWeights) -> tuple[float, float]:
    """(prefill rate, step time) for workers that measured none: the median of those
    that did (workers of one deployment run alike); the default rate and no step
    time if none did."""
    rates = [w.prefill_tokens_per_s for w in workers if w.prefill_tokens_per_s > 0]
    steps = [w.step_s for w in workers if w.step_s > 0]
    rate = statistics.median(rates) if rates else weights.default_prefill_tokens_per_s
    return rate, statistics.median(steps) if steps else 0.0


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


def placed_saving(
    length: int, first_tokens: int, deviation_ratio: float, selection_share: float = 0.0
) -> int:
    """Prompt tokens an approximate hit on an ``length``-token chunk saves: its tokens
    less the ones repair recomputes (never below 0), each of the others counted
    ``1 - selection_share`` of a token where a deviation ratio makes them run through
    the selection layers (``selection_share``: those layers' share of the model's)."""
    recomputed = min(first_tokens, length) + round(deviation_ratio * length)
    placed = max(0, length - recomputed)
    return round(placed * (1 - selection_share)) if deviation_ratio > 0 else placed


@dataclass(frozen=True)
class HostHeld:
    """What a worker holds only in its host-memory tier, and what loading costs there."""

    prefix_tokens: int  # of its exactly held prefix
    entries: frozenset[int] = frozenset()  # indices into the placeable spans
    share: float = DEFAULT_HOST_LOAD_SHARE  # a loaded token's cost / a computed one's


def prefill_saved(
    exact_tokens: Mapping[str, int],
    entries: Mapping[str, Collection[int]],
    spans: Sequence[tuple[int, int]],
    first_tokens: int,
    deviation_ratio: float,
    selection_share: float = 0.0,
    host: Mapping[str, HostHeld] | None = None,
) -> dict[str, int]:
    """Worker id -> prompt tokens it would not compute (the ``holdings`` of
    ``choose_worker``). ``exact_tokens``: worker -> exactly held prefix tokens;
    ``entries``: worker -> indices into ``spans`` (placeable chunks, sorted) whose
    entries it holds. A held entry counts only where its span starts at or after the
    worker's exact prefix (the engine places nothing inside that prefix). ``host``:
    what of those sits in the worker's host tier; such a hit saves a token less its
    load's share of a token's compute (neither free nor a miss). Workers saving
    nothing are left out."""
    host = host or {}
    saved = {
        worker: tokens
        - (round(host[worker].prefix_tokens * host[worker].share) if worker in host else 0)
        for worker, tokens in exact_tokens.items()
    }
    for worker, held in entries.items():
        prefix = exact_tokens.get(worker, 0)
        offloaded = host.get(worker, HostHeld(0))
        placed = 0.0
        for i in held:
            start, end = spans[i]
            if start >= prefix:
                saving = placed_saving(end - start, first_tokens, deviation_ratio, selection_share)
                placed += saving * (1 - offloaded.share) if i in offloaded.entries else saving
        saved[worker] = saved.get(worker, 0) + round(placed)
    return {worker: tokens for worker, tokens in saved.items() if tokens > 0}


def round_robin(
    workers: Sequence[WorkerView], max_requests_per_worker: int, rotation: int
) -> Decision | Unroutable:
    """The ``rotation``-th open worker in id order, whatever it holds or carries."""
    open_ = _open_workers(workers, max_requests_per_worker)
    if isinstance(open_, Unroutable):
        return open_
    in_order = sorted(open_, key=lambda w: w.worker_id)
    chosen = in_order[rotation % len(in_order)]
    return Decision(chosen.worker_id, Reason.ROTATION, 0, view=chosen)


def _open_workers(
    workers: Sequence[WorkerView], max_requests_per_worker: int
) -> list[WorkerView] | Unroutable:
    """The workers below their request limit (rule 1 of the module's policy)."""
    if not workers:
        return Unroutable.NO_WORKER
    open_ = [w for w in workers if w.requests < max_requests_per_worker]
    return open_ or Unroutable.OVERLOADED


def _pick(
    workers: Sequence[WorkerView], key: Callable[[WorkerView], tuple], rotation: int
) -> WorkerView:
    ordered = sorted(workers, key=lambda w: (key(w), w.worker_id))
    tied = [w for w in ordered if key(w) == key(ordered[0])]
    return tied[rotation % len(tied)]
