"""Continuous-batching scheduler: which sequences run this step, with how many tokens.

Policy (FCFS): running sequences are served first, oldest first — a decode token
each, or the next chunk of an unfinished prefill; then waiting sequences are
admitted in arrival order while the per-step token budget and the sequence limit
allow. A waiting sequence is never overtaken by a later one; while others run, it
waits rather than evict entries that proved their worth (``KVPool.sparing_entries``).
When pages run out,
the most recently arrived running sequence is preempted: its pages are released
(full pages stay cached, so recomputing them is cheap) and it returns to the head
of the queue. A lone sequence always fits: the engine caps the context length at
the pool's capacity.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from dataclasses import dataclass

import numpy as np

from workers.engine.kv_pool import KVPool
from workers.engine.request import Sequence, Status
from workers.engine.reuse import Reuse


@dataclass(frozen=True)
class ScheduledSeq:
    """What one step computes for one sequence: the ``scattered`` positions (sorted,
    all below ``start``: a placed chunk's gaps or repairs), then the contiguous run
    ``[start, end)``. Every query attends causally by position over the sequence's KV
    up to ``end``, so each position below the largest one computed must already hold
    KV or be computed in this step."""

    seq: Sequence
    start: int  # first position of the contiguous run
    num_tokens: int  # length of the contiguous run
    scattered: np.ndarray | None = None  # int64, non-empty when given

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Queries this step: scattered positions plus the contiguous run."""
        return self.num_tokens + (0 if self.scattered is None else len(self.scattered))

    @property
    def first_position(self) -> int:
        return self.start if self.scattered is None else int(self.scattered[0])

    @property
    def samples(self) -> bool:
        """This step reaches the sequence's last token, so it yields a new token
        (never for an entry fill); or admission computes it
        (``ApproximateState.samples_at_admission``) and this step only samples."""
        seq = self.seq
        if self.num_tokens == 0:
            return seq.approx.samples_at_admission and self.scattered is None
        return self.end == len(seq.token_ids) and seq.approx.fill_key is None


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None = None  # a sequence this long computes nothing more


class Scheduler:
    def __init__(self, pool: KVPool, reuse: Reuse, limits: SchedulerLimits) -> None:
        self.pool = pool
        self.reuse = reuse
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.limits.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        self.pool.land_loads()
        with self.pool.batching_evictions():  # pages given here are written by the step
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                    continue
                # With overlapped steps (``Engine``) a sequence whose last token is still
                # being sampled may have all it may have: it finishes when that token is
                # read back, so computing past it would be wasted (and past the context
                # length, out of bounds). Without overlap such a sequence has finished.
                if seq.reached_length(self.limits.max_model_len):
                    continue
                if self.pool.loading(seq.page_ids):  # its prefix is still coming from host
                    continue
                item = self._take(seq, budget)
                if not item.num_computed_tokens:  # its last positions are still being computed
                    continue
                if self._reserve_pages(seq, item.num_tokens):
                    batch.append(item)
                    budget -= item.num_computed_tokens
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            item = self._admit(seq, budget)
            if item is None:
                break
            self.waiting.popleft()
            # what admission's forward computed counts here too: the step's work may
            # then pass the budget by one forward, after which nothing more is admitted
            budget -= item.num_computed_tokens + seq.approx.admission_tokens
            seq.approx.admission_tokens = 0
            if self.pool.loading(seq.page_ids):  # it steps once its prefix landed
                continue
            if item.num_computed_tokens or item.samples:  # else its forward was all
                batch.append(item)
        self.reuse.flush()  # the admissions' selection forwards, as one
        return batch

    def finish(self, seq: Sequence, reason: str, release: bool = True) -> None:
        """Drop a sequence from the queues and release its pages (also for aborts);
        ``release=False``: its page references were handed over (an entry fill)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if release:
            self.pool.release(seq.page_ids, self._cold_from(seq))
        seq.page_ids = array("i")
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    # -- internals -------------------------------------------------------------
    def _cold_from(self, seq: Sequence) -> int | None:
        """Where a finished sequence's own pages start, if they are to be released cold
        (``Sequence.held_elsewhere``): past the exact prefix its admission found cached.
        None: all released as usual."""
        return seq.cached_pages if seq.held_elsewhere else None

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        # While others run, a request can wait for their pages: its admission spares
        # the entries that proved their worth (``KVPool.sparing_entries``).
        with self.pool.sparing_entries(bool(self.running)):
            return self._admit_now(seq, budget)

    def _admit_now(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        # With nothing running, no page will be freed for a placement that found no
        # room: the entries it holds may be all that stands in the way, so the request
        # is admitted computing its chunks in context (else it would wait for ever).
        admitted = self.reuse.admit(seq, budget)
        if not admitted and not self.running:
            admitted = self.reuse.admit(seq, budget, place=False)
        if not admitted:
            return None
        # the budget left beside the forward admission queued (if any)
        item = self._take(seq, max(0, budget - seq.approx.admission_tokens))
        if not self._allocate(seq, item.num_tokens):
            self.pool.release(seq.page_ids)
            seq.page_ids, seq.num_computed = array("i"), 0
            return None
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        return item

    @staticmethod
    def _take(seq: Sequence, budget: int) -> ScheduledSeq:
        """The next positions of ``seq`` within ``budget``: pending ones first, in
        order; the contiguous tail only once none is left (it attends to them)."""
        pending = seq.pending
        if not len(pending):
            return ScheduledSeq(seq, seq.num_computed, min(seq.num_uncomputed, budget))
        if len(pending) >= budget:
            return ScheduledSeq(seq, seq.num_computed, 0, pending[:budget])
        tail = min(seq.num_uncomputed, budget - len(pending))
        return ScheduledSeq(seq, seq.num_computed, tail, pending)

    def _reserve_pages(self, seq: Sequence, num: int) -> bool:
        """Make room for ``num`` more tokens of running ``seq``, preempting later
        arrivals if needed. False if ``seq`` itself had to be preempted."""
        while not self._allocate(seq, num):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _allocate(self, seq: Sequence, num: int) -> bool:
        needed = -(-(seq.num_computed + num) // self.pool.page_size) - len(seq.page_ids)
        if needed <= 0:
            return True
        pages = self.pool.allocate(needed)
        if pages is None:
            return False
        seq.page_ids.extend(pages)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.release(seq.page_ids)
        seq.page_ids = array("i")
        seq.num_computed = 0  # admission starts it over, through the reuse component
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
