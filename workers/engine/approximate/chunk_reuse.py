"""Chunk reuse: exact prefix reuse for every request, and for requests that ask for
``approximate`` reuse, position-free chunk entries placed wherever their chunk
appears, then repaired (docs/design.md, "Approximate reuse").

Admission of an approximate request:
1. The exactly matched prefix is taken as in exact mode.
2. Each placeable span after it (``ApproximateState.placeable``: a chunk that does not open
   the prompt and ends before its last token) is looked up by its position-free key.
   A held entry is *placed*: its rows copied into the request's own pages at the
   span's offset, keys rotated there. A missed chunk is computed in context for this
   request; if it has at least ``min_entry_tokens`` tokens it becomes an entry:
   - *taken* (``EngineConfig.entries_from_context``, the default): once the request
     has computed it (``publish``), its rows are copied to fresh pages, keys rotated
     back to position 0, and stored as the entry. A first sight costs no more forward
     work than exact reuse; where the entry is placed, repair recomputes its first
     tokens and most deviating ones as for any entry. When the pool has no pages for
     the copy, the entry is filled instead;
   - *filled*: a separate internal sequence computes it after the engine's entry
     context (a system turn, ``EngineConfig.entry_system_prompt``) and moves it to
     start at 0, queued behind the requests already waiting, and stored when done.
3. Repair: the first ``first_tokens`` tokens of every placed chunk, and the
   ``deviation_ratio`` share of placed tokens whose K/V at layer ``deviation_layer``
   (``EngineConfig.deviation_layer``) in this context deviates most from the placed
   K/V, are computed again, in context. With a deviation ratio, admission sets up one
   forward over the positions from the end of the exact prefix to the end of the last
   placed chunk, queued with those of every request the same step admits as one
   forward once the scheduler has admitted all it will (``flush``,
   ``ModelRunner.repair_selecting_batch``; nothing waits for it): the layers
   before ``deviation_layer`` run over all of them, keeping the KV they write (those
   layers of the placed tokens are in-context KV, so entries are placed only from
   that layer on, queued while the device runs the layers below it; with
   ``EngineConfig.placed_low_layers`` ``entries`` the tokens not recomputed take the
   entries' KV in those layers too, once the forward is queued); at that layer
   the deviating tokens
   are chosen on the device, and only they and the positions not placed (an unmatched
   system prompt, first tokens, missed chunks) go on through the rest of the model,
   attending by position to scattered KV. The rest of the prompt (the question) goes
   through the same forward, which returns its last token's logits
   (``ApproximateState.ready_logits``): the step that admits the request only samples.
   Until the forward is queued, the request's pages are not published and the entries
   it places stay held. The
   forward's rows (those past the selection layer, tail included) count in that
   step's token budget, which may pass the budget by one forward and then admits
   nothing more. (A tail that does not fit beside the rows, or a resumed request's,
   is computed in steps, as usual.) Without a deviation ratio, the first tokens are
   ``pending``: computed in the request's first step(s), one attention row per run.
4. Taint: ``exact_until`` is the first placed token that is not recomputed (with a
   deviation ratio, the first candidate for selection: which ones the device kept is
   never read back); pages from there on are marked inexact and never keyed.

Invariants: an exact request never receives placed KV (only ``ExactPrefixReuse``
runs for it); entries are held only until their copies are queued; a sequence's reuse info
counts placed tokens as reused and the repaired ones among them as recomputed.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from chunkstore.hashing import Namespace, PageKey, packed_position_free_key
from workers.engine.kv_ops import PlaceSpans, TakeSpans
from workers.engine.kv_pool import ChunkEntry, KVPool
from workers.engine.model_runner import Selection
from workers.engine.request import Sequence
from workers.engine.reuse import ExactPrefixReuse, publish_exact_pages, start_from
from workers.engine.reuse_info import ReuseInfo
from workers.engine.workload_tally import WorkloadTally


@dataclass(frozen=True)
class _DeferredSelection:
    selection: Selection
    entries: list[ChunkEntry]  # held until the forward has queued their placement


class ChunkReuse:
    """The reuse component of an engine with reuse on (exact, and approximate on
    request). ``fill`` queues the computation of a missed chunk's entry."""

    mode = "exact"  # what every request gets; approximate is per request

    def __init__(
        self,
        pool: KVPool,
        runner,
        fill: Callable[[PageKey, list[int], Namespace], None],
        min_entry_tokens: int,
        deviation_layer: int,
        tally: WorkloadTally | None = None,
        entries_from_context: bool = True,
        batch_admissions: bool = True,
        low_layers_from_entries: bool = False,
    ) -> None:
        self.tally = WorkloadTally() if tally is None else tally
        self.pool = pool
        self.runner = runner
        self.fill = fill
        self.min_entry_tokens = min_entry_tokens
        self.entries_from_context = entries_from_context
        self.batch_admissions = batch_admissions
        self.low_layers_from_entries = low_layers_from_entries  # PlaceSpans.below_selection
        self.deviation_layer = deviation_layer
        self._exact = ExactPrefixReuse(pool)
        # selection forwards of this scheduling pass's admissions, queued by ``flush``
        self._deferred: list[_DeferredSelection] = []
        runner.use_admission_graphs(deviation_layer)

    def admit(self, seq: Sequence, budget: int = sys.maxsize, place: bool = True) -> bool:
        if seq.approx.fill_key is not None:  # an entry is computed in pages of its own
            start_from(seq, "exact", [], 0)
            return True
        first_admission = seq.reuse is None
        if not self._exact.admit(seq):
            return False
        if seq.approx.request.mode != "approximate":
            return True
        self.pool.fence_loads(seq.page_ids)  # the admission forward reads the prefix
        matched = seq.num_computed
        last = len(seq.token_ids) - 1  # its logits give the next token
        spans = [(s, e) for s, e in seq.approx.placeable if 0 < s and s >= matched and e <= last]
        hits: list[tuple[int, int, ChunkEntry]] = []
        harvests: list[tuple[int, int, PageKey]] = []
        packed = seq.packed_tokens(spans[-1][1]) if spans else b""
        found: list[ChunkEntry] = []  # held while looking: a load evicts no entry found
        try:
            for start, end in spans:
                key = packed_position_free_key(seq.namespace, packed[4 * start : 4 * end])
                entry = self.pool.find_entry(key)  # here, or loaded from the host tier
                if entry is not None:
                    self.pool.hold_entry(entry)
                    found.append(entry)
                if entry is not None and entry.num_tokens == end - start:
                    hits.append((start, end, entry))
                elif end - start < self.min_entry_tokens:
                    continue
                elif self.entries_from_context:
                    harvests.append((start, end, key))
                else:
                    self.fill(key, seq.token_ids[start:end], seq.namespace)
            if not place and not any(entry.pins for _, _, entry in hits):
                hits = []  # computed in context: the entries may then be evicted for room
            seq.approx.harvests = harvests  # the admission forward may compute them (``_place``)
            recomputed = self._place(seq, hits, budget) if hits else 0
        finally:
            for entry in found:
                self.pool.drop_entry(entry)
        if recomputed is None:
            seq.approx.harvests = []
            return False
        if first_admission:
            for _, _, entry in hits:
                self.pool.note_hit(entry)
            placed = sum(e - s for s, e, _ in hits)
            seq.reuse = ReuseInfo("approximate", matched + placed, recomputed)
            self.tally.entry_hits += len(hits)
            self.tally.entry_misses += len(spans) - len(hits)
        return True

    def flush(self) -> None:
        """Queue the selection forwards of the admissions since the last call, as one
        forward (``ModelRunner.repair_selecting_batch``), then publish what each
        computes and let go of the entries they place."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        selections = [d.selection for d in deferred]
        batches = [selections] if self.batch_admissions else [[s] for s in selections]
        try:
            logits = [
                ready
                for batch in batches
                for ready in self.runner.repair_selecting_batch(batch, self.deviation_layer)
            ]
        finally:
            for d in deferred:
                for entry in d.entries:
                    self.pool.drop_entry(entry)
        for d, ready in zip(deferred, logits, strict=True):
            seq = d.selection.seq
            seq.approx.ready_logits = ready
            # queued on the device's one stream before any later step: every reader
            # of these pages runs after it
            self.publish(seq, d.selection.start, d.selection.end)

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        if seq.approx.fill_key is None:  # a fill's pages become its entry, never page keys
            publish_exact_pages(self.pool, seq, start, end)
            if seq.approx.harvests and seq.approx.harvests[0][1] <= end:
                self._take_entries(seq, end)

    def _take_entries(self, seq: Sequence, end: int) -> None:
        """The missed chunks of ``seq`` that end by ``end`` hold their final KV (or have
        it queued on the device's stream, which runs the copy after it): copy each into
        fresh pages at position 0, keys rotated back, and store them as entries. A chunk
        whose entry appeared meanwhile is skipped; one the pool has no pages for is
        filled instead (computed again, later), so no entry is lost to a busy pool."""
        ready = [h for h in seq.approx.harvests if h[1] <= end]
        seq.approx.harvests = [h for h in seq.approx.harvests if h[1] > end]
        page_size = self.pool.page_size
        taken: dict[PageKey, tuple[int, int, list[int]]] = {}
        with self.pool.sparing_entries():  # an unproven entry displaces no proven one
            for start, stop, key in ready:
                if key in taken or self.pool.entry(key) is not None:
                    continue  # a chunk repeated in the prompt, or an entry stored meanwhile
                pages = self.pool.allocate(-(-(stop - start) // page_size))
                if pages is None:
                    self.fill(key, seq.token_ids[start:stop], seq.namespace)
                    continue
                taken[key] = (start, stop, pages)
        if not taken:
            return
        self.runner.apply(TakeSpans(seq.page_ids, list(taken.values()), page_size))
        for key, (start, stop, pages) in taken.items():  # none stored since the check
            self.pool.store_entry(key, pages, stop - start)
        self.tally.entries_taken += len(taken)

    # -- placement and repair ----------------------------------------------------
    def _place(
        self, seq: Sequence, hits: list[tuple[int, int, ChunkEntry]], budget: int
    ) -> int | None:
        """Place ``hits`` and set up their repair; the number of placed tokens
        recomputed, or None (``seq`` left as it was) when the pool has no room.
        ``budget``: tokens the admitting step may still compute: the forward runs
        through the tail only when its rows and the tail fit in it."""
        page_size = self.pool.page_size
        matched = seq.num_computed
        placed_end = hits[-1][1]
        kept = np.zeros(placed_end, dtype=bool)  # KV taken from an entry, as placed
        for start, end, _ in hits:
            kept[start + min(seq.approx.request.first_tokens, end - start) : end] = True
        placed_total = sum(e - s for s, e, _ in hits)
        num_kept = int(kept.sum())  # the candidates for selection (all after ``matched``)
        recomputed = placed_total - num_kept
        ratio = seq.approx.request.deviation_ratio
        keep = min(int(round(ratio * placed_total)), num_kept) if ratio > 0 else 0
        # selecting: pages for the whole prompt, so that nothing fails after the forward
        # is queued (the scheduler's allocation for the first step then needs none)
        covered = len(seq.token_ids) if keep else placed_end
        # the forward's rows from the selection layer on: what is not a candidate for
        # selection (an unmatched system prompt, first tokens, missed chunks) and the kept
        rows = (placed_end - matched) - num_kept + keep
        # ... and the tail too (the question), when it fits the step's budget beside
        # them, so that the step admitting the sequence only samples its first token
        # (a first admission: a resumed one's last token may still be on the device)
        tail = covered - placed_end
        to_end = keep > 0 and seq.num_output_tokens == 0 and rows + tail <= budget
        forward_end = covered if to_end else placed_end
        needed = -(-covered // page_size) - len(seq.page_ids)
        for _, _, entry in hits:
            self.pool.hold_entry(entry)  # not evicted by our own allocation (nor by later
            # admissions' before a deferred forward places it)
        deferred = False
        try:
            pages = self.pool.allocate(needed) if needed > 0 else []
            if pages is None:
                self.pool.release(seq.page_ids)
                seq.page_ids, seq.num_computed = array("i"), 0
                return None
            seq.page_ids.extend(pages)
            place = PlaceSpans(
                seq.page_ids,
                [(start, end, entry.pages) for start, end, entry in hits],
                page_size,
                self.low_layers_from_entries,
            )
            if keep:  # the forward places the entries between its layers (``flush``)
                candidates = np.flatnonzero(kept)
                selection = Selection(seq, matched, forward_end, candidates, keep, to_end, place)
                self._deferred.append(_DeferredSelection(selection, [e for _, _, e in hits]))
                deferred = True
            else:
                self.runner.apply(place)
        finally:
            if not deferred:
                for _, _, entry in hits:
                    self.pool.drop_entry(entry)
        if keep:
            self.tally.selection_only_positions += num_kept - keep
            seq.approx.admission_tokens = rows + (tail if to_end else 0)
            seq.approx.samples_at_admission = to_end
            seq.num_computed, seq.pending = forward_end, np.empty(0, dtype=np.int64)
            # which candidates were kept is known only on the device: from the first
            # one on, the KV may be placed (unless every one was kept)
            if keep < len(candidates):
                seq.exact_until = int(candidates[0])
            return recomputed + keep  # published once the forward is queued (``flush``)
        pending = ~kept
        pending[:matched] = False
        seq.num_computed = placed_end
        seq.pending = np.flatnonzero(pending).astype(np.int64)
        if kept.any():
            seq.exact_until = int(np.argmax(kept))
            self.pool.mark_inexact(seq.page_ids[seq.exact_until // page_size :])
        return recomputed
