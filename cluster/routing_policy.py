"""Which worker serves a request: a pure function of worker loads and cache holdings.

Policy:
1. Workers at ``max_requests_per_worker`` are full; if all are, the request is
   refused (``OVERLOADED``), if there are none, ``NO_WORKER``.
2. With no directory answer, pick the least-loaded worker (``NO_DIRECTORY``).
3. Otherwise a worker holding part of the prompt is a candidate unless it carries
   more than ``imbalance_slack`` requests above the least-loaded worker (then load
   is badly imbalanced and balancing wins). Each candidate scores
   ``cached_tokens - load_penalty_tokens * requests``; the best candidate wins if
   it beats the least-loaded worker's score (``-load_penalty_tokens * least``),
   i.e. if its cache saves more than its extra queue costs (``AFFINITY``).
4. Else the least-loaded worker (``LOAD``).
Ties go to fewer requests, then fewer tokens in flight, then ``rotation`` picks
among the still tied, so equal workers share requests evenly.

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

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


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
) -> Decision | Unroutable:
    """``holdings``: worker id -> cached prompt tokens (None: no directory answer)."""
    open_ = _open_workers(workers, weights.max_requests_per_worker)
    if isinstance(open_, Unroutable):
        return open_
    if holdings is None:
        return _least_loaded(open_, rotation, Reason.NO_DIRECTORY)
    least = min(w.requests for w in open_)
    candidates = [
        w
        for w in open_
        if holdings.get(w.worker_id, 0) > 0 and w.requests <= least + weights.imbalance_slack
    ]
    penalty = weights.load_penalty_tokens

    def score(w: WorkerView) -> float:
        return holdings.get(w.worker_id, 0) - penalty * w.requests

    if candidates:
        best = _pick(candidates, lambda w: (-score(w), w.requests, w.tokens), rotation)
        if score(best) > -penalty * least:
            return Decision(best.worker_id, Reason.AFFINITY, holdings[best.worker_id])
    return _least_loaded(open_, rotation, Reason.LOAD)


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
