"""Continuous-batching scheduler: which sequences run this step, with how many tokens.

Policy (FCFS): running sequences are served first, oldest first — a decode token
each, or the next chunk of an unfinished prefill; then waiting sequences are
admitted in arrival order while the per-step token budget and the sequence limit
allow. A waiting sequence is never overtaken by a later one. When pages run out,
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

from workers.engine.kv_pool import KVPool
from workers.engine.request import Sequence, Status


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # new tokens computed this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """This step reaches the sequence's last token, so it yields a new token."""
        return self.end == len(self.seq.token_ids)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_reuse: bool


class Scheduler:
    def __init__(self, pool: KVPool, limits: SchedulerLimits) -> None:
        self.pool = pool
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
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            num = min(seq.num_uncomputed, budget)
            if self._reserve_pages(seq, num):
                batch.append(ScheduledSeq(seq, seq.num_computed, num))
                budget -= num
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            self.waiting.popleft()
            batch.append(item)
            budget -= item.num_tokens
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release a sequence's pages and drop it from the queues (also for aborts)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.pool.release(seq.page_ids)
        seq.page_ids = array("i")
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    # -- internals -------------------------------------------------------------
    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        page_size = self.pool.page_size
        matched: list[int] = []
        if self.limits.enable_reuse:
            # Keep at least one token to compute: its logits produce the next token.
            usable = (len(seq.token_ids) - 1) // page_size * page_size
            keys = seq.extend_page_keys(page_size, usable)[: usable // page_size]
            token_pages = [seq.page_tokens(i, page_size) for i in range(len(keys))]
            matched = self.pool.match_prefix(keys, token_pages)
            self.pool.acquire(matched)
        seq.page_ids = array("i", matched)
        seq.num_computed = len(matched) * page_size
        num = min(seq.num_uncomputed, budget)
        if not self._allocate(seq, num):
            self.pool.release(matched)
            seq.page_ids, seq.num_computed = array("i"), 0
            return None
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        return ScheduledSeq(seq, seq.num_computed, num)

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
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
