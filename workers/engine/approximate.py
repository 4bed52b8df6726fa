"""Chunk reuse: exact prefix reuse for every request, and for requests that ask for
``approximate`` reuse, position-free chunk entries placed wherever their chunk
appears, then repaired (DESIGN.md, "Approximate reuse").

Admission of an approximate request:
1. The exactly matched prefix is taken as in exact mode.
2. Each placeable span after it (``Sequence.placeable``: a chunk that does not open
   the prompt and ends before its last token) is looked up by its position-free key.
   A held entry is *placed*: its rows copied into the request's own pages at the
   span's offset, keys rotated there. A missed chunk is computed in context for this
   request; if it has at least ``min_entry_tokens`` tokens its entry is *filled*:
   a separate internal sequence computes it after the engine's entry context (a system
   turn, ``EngineConfig.entry_system_prompt``) and moves it to start at 0, queued behind
   the requests already waiting, and stored as an entry when done.
3. Repair: the first ``first_tokens`` tokens of every placed chunk, and the
   ``deviation_ratio`` share of placed tokens whose K/V at layer ``deviation_layer``
   (``EngineConfig.deviation_layer``) in this context deviates most from the placed
   K/V, are pending: computed again, in context, in the request's first step(s).
   Selecting runs the layers before ``deviation_layer`` over every placed token and
   keeps the KV they write: those layers of the placed tokens are in-context KV.
   Deviating tokens come scattered, and every run of consecutive pending positions is
   one attention row walking the KV before it, so runs a few placed tokens apart are
   joined by recomputing those tokens as well (``bridge_gaps``: gaps of at most
   ``BRIDGE_MAX_GAP`` tokens, smallest first, within ``BRIDGE_SHARE`` of the placed
   tokens). Those tokens get the KV this context gives them, as repaired ones do, and
   count as recomputed.
4. Taint: ``exact_until`` is the first placed token that is not recomputed; pages
   from there on are marked inexact and never keyed.

Invariants: an exact request never receives placed KV (only ``ExactPrefixReuse``
runs for it); entries are held only while being copied; a sequence's reuse info
counts placed tokens as reused and the repaired ones among them as recomputed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import numpy as np

from chunkstore.hashing import Namespace, PageKey, position_free_key
from workers.engine.kv_pool import ChunkEntry, KVPool
from workers.engine.placement import place_spans
from workers.engine.request import Sequence
from workers.engine.reuse import ExactPrefixReuse, publish_exact_pages, start_from
from workers.engine.reuse_info import ReuseInfo

# Joining repair runs: on an H200 (qwen3-0.6b shapes, 8 x 512 placed tokens, r = 0.1)
# TTFT grew from 13 ms with 7 runs to 24-32 ms with 60-79 (bench/approx_speed.py).
BRIDGE_MAX_GAP = 16
BRIDGE_SHARE = 0.05


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
    ) -> None:
        self.pool = pool
        self.runner = runner
        self.fill = fill
        self.min_entry_tokens = min_entry_tokens
        self.deviation_layer = deviation_layer
        self._exact = ExactPrefixReuse(pool)

    def admit(self, seq: Sequence) -> bool:
        if seq.fill_key is not None:  # an entry is computed in pages of its own
            start_from(seq, "exact", [], 0)
            return True
        first_admission = seq.reuse is None
        if not self._exact.admit(seq):
            return False
        if seq.reuse_request.mode != "approximate":
            return True
        matched = seq.num_computed
        last = len(seq.token_ids) - 1  # its logits give the next token
        spans = [(s, e) for s, e in seq.placeable if 0 < s and s >= matched and e <= last]
        hits: list[tuple[int, int, ChunkEntry]] = []
        for start, end in spans:
            tokens = seq.token_ids[start:end]
            key = position_free_key(seq.namespace, tokens)
            entry = self.pool.entry(key)
            if entry is not None and entry.num_tokens == end - start:
                hits.append((start, end, entry))
            elif end - start >= self.min_entry_tokens:
                self.fill(key, tokens, seq.namespace)
        if hits and not self._place(seq, hits):
            return False
        if first_admission:
            placed = sum(e - s for s, e, _ in hits)
            recomputed = len(seq.pending) - self._gaps(seq, hits)
            seq.reuse = ReuseInfo("approximate", matched + placed, recomputed)
        return True

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        if seq.fill_key is None:  # a fill's pages become its entry, never page keys
            publish_exact_pages(self.pool, seq, start, end)

    # -- placement and repair ----------------------------------------------------
    def _place(self, seq: Sequence, hits: list[tuple[int, int, ChunkEntry]]) -> bool:
        page_size = self.pool.page_size
        placed_end = hits[-1][1]
        needed = -(-placed_end // page_size) - len(seq.page_ids)
        for _, _, entry in hits:
            self.pool.hold_entry(entry)  # not evicted by our own allocation
        try:
            pages = self.pool.allocate(needed) if needed > 0 else []
            if pages is None:
                self.pool.release(seq.page_ids)
                seq.page_ids, seq.num_computed = array("i"), 0
                return False
            seq.page_ids.extend(pages)
            runner = self.runner
            place_spans(
                runner.kv_stack,
                runner.model.rope_cache,
                seq.page_ids,
                [(start, end, entry.pages) for start, end, entry in hits],
                page_size,
            )
        finally:
            for _, _, entry in hits:
                self.pool.drop_entry(entry)
        matched = seq.num_computed
        kept = np.zeros(placed_end, dtype=bool)  # KV taken from an entry, as placed
        for start, end, _ in hits:
            kept[start + min(seq.reuse_request.first_tokens, end - start) : end] = True
        pending = ~kept
        pending[:matched] = False
        ratio = seq.reuse_request.deviation_ratio
        if ratio > 0 and kept.any():
            placed_total = sum(e - s for s, e, _ in hits)
            extra = min(int(round(ratio * placed_total)), int(kept.sum()))
            if extra:
                candidates = np.flatnonzero(kept)
                deviation = self.runner.kv_deviation(
                    seq, matched, placed_end, candidates, self.deviation_layer
                )
                worst = candidates[np.argsort(-deviation, kind="stable")[:extra]]
                kept[worst] = False
                pending[worst] = True
                budget = int(BRIDGE_SHARE * placed_total)
                joined = bridge_gaps(pending, matched, budget, BRIDGE_MAX_GAP)
                kept[joined] = False
        seq.num_computed = placed_end
        seq.pending = np.flatnonzero(pending).astype(np.int64)
        if kept.any():
            seq.exact_until = int(np.argmax(kept))
            self.pool.mark_inexact(seq.page_ids[seq.exact_until // page_size :])
        return True

    @staticmethod
    def _gaps(seq: Sequence, hits: list[tuple[int, int, ChunkEntry]]) -> int:
        """Pending positions that no placed chunk covers (computed, not recomputed)."""
        covered = np.zeros(seq.num_computed, dtype=bool)
        for start, end, _ in hits:
            covered[start:end] = True
        return int((~covered[seq.pending]).sum()) if len(seq.pending) else 0


def bridge_gaps(pending: np.ndarray, start: int, budget: int, max_gap: int) -> np.ndarray:
    """Positions to add to ``pending`` (bool over a sequence's first positions, the
    tail after it computed as one run) so that fewer runs remain: the gaps after
    ``start`` between two pending runs, or between the last one and the tail, of at
    most ``max_gap`` positions, smallest first, while their total stays within
    ``budget``. Marks them pending in place and returns them (sorted)."""
    marked = np.append(pending[start:], True)  # the tail is computed: a run
    edges = np.flatnonzero(np.diff(marked.astype(np.int8)))
    # gaps are (first False, first True after it), each after some True
    gap_starts = edges[marked[edges]] + 1
    gap_ends = edges[~marked[edges]] + 1
    if len(gap_ends) and (not len(gap_starts) or gap_ends[0] <= gap_starts[0]):
        gap_ends = gap_ends[1:]  # a leading gap has no run before it
    gap_starts = gap_starts[: len(gap_ends)]
    lengths = gap_ends - gap_starts
    chosen = []
    for i in np.argsort(lengths, kind="stable"):
        if lengths[i] > max_gap or lengths[i] > budget:
            break
        budget -= int(lengths[i])
        chosen.append(np.arange(gap_starts[i], gap_ends[i]) + start)
    joined = np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)
    pending[joined] = True
    return joined
