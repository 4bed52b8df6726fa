"""Naive placement: a measurement mode of the reuse seam, never offered to users
(no config field, request field or HTTP parameter reaches it).

Each placeable chunk of a sequence (``ApproximateState.placeable``) takes its KV from an
entry computed with the chunk alone from position 0; the entry's rows are copied to
the chunk's offset with keys rotated there (``placement.place_chunk``), and nothing
is recomputed. This is the seeds' approach whose output docs/design.md calls gibberish:
a placed chunk never attended to what precedes it. ``bench/reuse_quality.py``
measures how far it lands from full prefill.

Invariants:
- The exactly matched prefix is taken as in exact mode; chunks inside it, and
  chunks that reach the sequence's last token (whose logits must be computed), are
  not placed.
- ``seq.exact_until`` is the first placed position; the pages from there to the
  last placed position are marked inexact, so the pool never keys them.
- Every position below the last placed one that no chunk covers is pending: the
  scheduler computes it before the tail.
- Entries hold a reference on their pages until ``clear``; they are keyed by the
  chunk's token ids only (no namespace: the mode serves one measurement run).
"""

from __future__ import annotations

import sys
from array import array

import numpy as np

from workers.engine.kv_ops import PlaceSpans
from workers.engine.request import Sequence
from workers.engine.reuse import ExactPrefixReuse, publish_exact_pages
from workers.engine.reuse_info import ReuseInfo
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq


class NaivePlacement:
    mode = "naive_placement"

    def __init__(self, engine, recompute_first: int = 0) -> None:
        """``recompute_first``: the first tokens of every placed chunk are computed
        again in context (0: naive; at least every chunk's length: all placed tokens
        recomputed, which must equal plain generation — a check of the wiring)."""
        if recompute_first < 0:
            raise ValueError("recompute_first must be >= 0")
        self.recompute_first = recompute_first
        self.engine = engine
        self.pool = engine.pool
        self._exact = ExactPrefixReuse(engine.pool)
        self._entries: dict[tuple[int, ...], array] = {}

    def admit(self, seq: Sequence, budget: int = sys.maxsize, place: bool = True) -> bool:
        first_admission = seq.reuse is None
        if not self._exact.admit(seq):
            return False
        if not place:  # a measurement mode: its requests compute everything then
            return True
        self.pool.fence_loads(seq.page_ids)  # the placement reads the prefix at once
        matched = seq.num_computed
        last = len(seq.token_ids) - 1  # its logits give the next token
        spans = [(s, e) for s, e in seq.approx.placeable if s >= matched and e <= last and e > s]
        if not spans:
            return True
        page_size = self.pool.page_size
        placed_end = spans[-1][1]
        needed = -(-placed_end // page_size) - len(seq.page_ids)
        chunks = [tuple(seq.token_ids[s:e]) for s, e in spans]
        missing = {c for c in chunks if c not in self._entries}
        room = needed + sum(-(-len(c) // page_size) for c in missing)
        if room > self.pool.num_available:
            self.clear()  # entries are a cache: drop them all before refusing
            room = needed + sum(-(-len(c) // page_size) for c in set(chunks))
        if room > self.pool.num_available:
            self.pool.release(seq.page_ids)
            seq.page_ids, seq.num_computed = array("i"), 0
            return False
        entries = [self._entry(c) for c in chunks]
        seq.page_ids.extend(self.pool.allocate(needed) if needed > 0 else [])
        spans_entries = [(s, e, entry) for (s, e), entry in zip(spans, entries, strict=True)]
        self.engine.runner.apply(PlaceSpans(seq.page_ids, spans_entries, page_size))
        placed = np.zeros(placed_end, dtype=bool)  # KV taken from an entry, as is
        for start, end in spans:
            placed[start + min(self.recompute_first, end - start) : end] = True
        seq.num_computed = placed_end
        pending = ~placed
        pending[:matched] = False
        seq.pending = np.flatnonzero(pending).astype(np.int64)
        if placed.any():
            seq.exact_until = int(np.argmax(placed))
            self.pool.mark_inexact(seq.page_ids[seq.exact_until // page_size :])
        if first_admission:
            recomputed = sum(min(self.recompute_first, e - s) for s, e in spans)
            reused = matched + int(placed.sum()) + recomputed
            seq.reuse = ReuseInfo(self.mode, reused, recomputed)
        return True

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        publish_exact_pages(self.pool, seq, start, end)

    def flush(self) -> None:
        return None

    def clear(self) -> None:
        for pages in self._entries.values():
            self.pool.release(pages)
        self._entries.clear()

    def _entry(self, tokens: tuple[int, ...]) -> array:
        """Pages holding ``tokens`` computed alone from position 0 (computed now if
        missing: one forward pass outside any scheduled step; ``admit`` has checked
        that the pool has room)."""
        if tokens in self._entries:
            return self._entries[tokens]
        pages = self.pool.allocate(-(-len(tokens) // self.pool.page_size))
        assert pages is not None, "admit checks room before computing entries"
        alone = Sequence("naive-entry", -1, list(tokens), SamplingParams(max_tokens=1), None)
        alone.page_ids = array("i", pages)
        self.engine.runner.run([ScheduledSeq(alone, 0, len(tokens))])
        self._entries[tokens] = alone.page_ids
        return alone.page_ids
