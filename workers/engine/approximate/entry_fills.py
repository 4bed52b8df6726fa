"""Entry fills: a chunk's position-free entry computed as a sequence of its own.

A fill is the chunk's tokens after the entry context (``chunking.entry_context``),
scheduled like a request behind those already waiting, sampling nothing of use. Once
its prompt is computed, ``store`` moves the chunk's rows to the start of the fill's
pages, their keys rotated back by the context's length, so an entry always starts at
position 0, and keeps them as the entry (``KVPool.store_entry``).

Invariants: one fill per key at a time (``queue`` ignores a key queued, running or
held); a fill's pages are its own (unkeyed, used once), so moving its rows corrupts
no sharer; a chunk too long to compute after the context is never queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from chunkstore.hashing import Namespace, PageKey
from workers.engine.kv_ops import ShiftToStart
from workers.engine.request import ApproximateState, Sequence
from workers.engine.sampling_params import SamplingParams
from workers.engine.workload_tally import WorkloadTally

if TYPE_CHECKING:
    from workers.engine.kv_pool import KVPool
    from workers.engine.model_runner import ModelRunner
    from workers.engine.scheduler import Scheduler


class EntryFills:
    def __init__(
        self,
        pool: KVPool,
        runner: ModelRunner,
        scheduler: Scheduler,
        entry_context: tuple[int, ...],
        max_model_len: int,
        tally: WorkloadTally,
        arrival: Callable[[], int],
    ) -> None:
        """``arrival``: the next arrival number (the engine's, shared with requests)."""
        self._pool = pool
        self._runner = runner
        self._scheduler = scheduler
        self._context = entry_context
        self._max_model_len = max_model_len
        self._tally = tally
        self._arrival = arrival
        self._filling: set[PageKey] = set()  # keys of fills queued or running

    def queue(self, key: PageKey, tokens: list[int], namespace: Namespace) -> None:
        """Queue the computation of ``key``'s entry (``tokens`` after the entry
        context) behind the requests already waiting; nothing if it is queued,
        running or held, or too long to compute after the context."""
        if key in self._filling or self._pool.entry(key) is not None:
            return
        if len(self._context) + len(tokens) >= self._max_model_len:
            return  # too long to compute after the context: the chunk stays computed
        self._filling.add(key)
        self._tally.fills_queued += 1
        fill = Sequence(
            request_id=f"entry-fill-{key.hex()[:16]}",
            arrival=self._arrival(),
            prompt_token_ids=[*self._context, *tokens],
            params=SamplingParams(max_tokens=1),
            namespace=namespace,
            approx=ApproximateState(fill_key=key, fill_context=len(self._context)),
        )
        self._scheduler.add(fill)

    def store(self, fill: Sequence) -> None:
        """``fill`` computed its chunk: its pages become the entry (or are released if
        an entry with that key appeared meanwhile); the pages left over are released."""
        self._filling.discard(fill.approx.fill_key)
        context, page_size = fill.approx.fill_context, self._pool.page_size
        length = len(fill.token_ids) - context
        if not self._pool.is_private(fill.page_ids):  # moving rows would corrupt a sharer
            raise RuntimeError("an entry fill's pages must be its own (unkeyed, used once)")
        if context:
            self._runner.apply(ShiftToStart(fill.page_ids, context, length, page_size))
            keep = -(-length // page_size)
            self._pool.release(fill.page_ids[keep:])
            fill.page_ids = fill.page_ids[:keep]
        stored = self._pool.store_entry(fill.approx.fill_key, fill.page_ids, length)
        self._tally.fills_stored += stored
        self._scheduler.finish(fill, "entry", release=not stored)
