"""The reuse component: which cached KV a sequence starts from, and which computed
pages are offered to later sequences. The scheduler asks it on admission and the
engine after every step; nothing else in the engine knows which mode runs.

Implementations:
- ``NoReuse`` (mode ``off``): every prompt is computed; nothing is published.
- ``ExactPrefixReuse`` (mode ``exact``): the longest run of cached full pages whose
  chain keys equal the sequence's own (same tokens after the same tokens), continued
  from the host tier where it holds more (``KVPool.load_chain``), and every full
  *exact* page computed is published under its chain key.
- ``approximate.chunk_reuse.ChunkReuse``: exact for every request, plus position-free entries
  placed and repaired for requests that ask for approximate reuse (the default of
  an engine with reuse on).
- ``approximate.naive.NaivePlacement``: a measurement mode, never offered to users.

Invariants every implementation keeps:
- ``admit`` leaves the sequence with references on exactly ``seq.page_ids``, KV for
  positions ``[0, seq.num_computed)`` except ``seq.pending`` (sorted positions still to
  compute), at least one token uncomputed (its logits give the next token), and
  ``seq.exact_until`` set: positions before it hold the KV plain generation computes.
  "Holds KV" includes KV whose computation is queued on the device's stream (an
  approximate request's selection forward) by the end of the scheduling pass that
  admits it (``flush``): every later reader of the pages runs on that stream after it.
  Until then nothing reads the pages: they are published (keyed) only once queued.
- Only pages lying wholly before ``seq.exact_until`` are published under chain keys;
  the pool refuses to key a page marked inexact.
"""

from __future__ import annotations

import sys
from array import array
from typing import Protocol

import numpy as np

from chunkstore.hashing import root_key
from workers.engine.kv_pool import KVPool
from workers.engine.request import ALL_EXACT, Sequence
from workers.engine.reuse_info import ReuseInfo


class Reuse(Protocol):
    mode: str

    def admit(self, seq: Sequence, budget: int = sys.maxsize, place: bool = True) -> bool:
        """Give ``seq`` its cached KV (references taken, ``page_ids``,
        ``num_computed``, ``pending``, ``exact_until`` set). False when the pool has
        no room for what this mode must write; the sequence is then left as it was.
        ``budget``: prompt tokens the admitting step may still compute. A mode that
        computes some at admission says how many in ``ApproximateState.admission_tokens`` (the
        scheduler charges them to the step). ``place=False``: place no position-free
        entry that could be evicted for room (the request's chunks are computed in
        context; pinned entries, registered chunks, are still placed): what the
        scheduler asks when a placement found no room while nothing else runs, since
        the entries that placement holds may be all that stands in the way."""
        ...

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        """Positions ``[start, end)`` of ``seq`` were just computed: offer the full
        exact pages among them to later sequences."""
        ...

    def flush(self) -> None:
        """Queue the device work the admissions of this scheduling pass deferred (the
        scheduler calls it once the pass has admitted all it will)."""
        ...


def start_from(seq: Sequence, mode: str, page_ids: list[int], num_computed: int) -> None:
    """Admit ``seq`` on ``page_ids`` (references already taken) holding the exact KV
    of its first ``num_computed`` tokens."""
    seq.page_ids = array("i", page_ids)
    seq.cached_pages = len(page_ids)
    seq.num_computed = num_computed
    seq.pending = np.empty(0, dtype=np.int64)
    seq.exact_until = ALL_EXACT
    if seq.reuse is None:  # the first admission is what the caller is told
        seq.reuse = ReuseInfo(mode, num_computed, 0)


class NoReuse:
    mode = "off"

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def admit(self, seq: Sequence, budget: int = sys.maxsize, place: bool = True) -> bool:
        start_from(seq, self.mode, [], 0)
        return True

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        return None

    def flush(self) -> None:
        return None


class ExactPrefixReuse:
    mode = "exact"

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def admit(self, seq: Sequence, budget: int = sys.maxsize, place: bool = True) -> bool:
        page_size = self.pool.page_size
        # Keep at least one token to compute: its logits produce the next token.
        usable_pages = (len(seq.token_ids) - 1) // page_size
        # Matched through the pool's chain index (no hashing); the matched pages'
        # keys are this sequence's own chain keys, so later pages hash from them.
        packed = seq.packed_tokens(usable_pages * page_size)
        root = root_key(seq.namespace)
        matched = self.pool.match_chain(root, packed, usable_pages)
        self.pool.acquire(matched)
        # then what the host tier holds after it, loaded into fresh pages (loading:
        # the scheduler runs the sequence once they land)
        parent = self.pool.keys_of(matched[-1:])[0] if matched else root
        matched += self.pool.load_chain(
            parent, packed[len(matched) * 4 * page_size :], usable_pages - len(matched)
        )
        if len(seq.page_keys) < len(matched):
            seq.page_keys = self.pool.keys_of(matched)
        start_from(seq, self.mode, matched, len(matched) * page_size)
        return True

    def publish(self, seq: Sequence, start: int, end: int) -> None:
        publish_exact_pages(self.pool, seq, start, end)

    def flush(self) -> None:
        return None


def publish_exact_pages(pool: KVPool, seq: Sequence, start: int, end: int) -> None:
    """Key the full pages among positions ``[start, end)`` that lie wholly before
    ``seq.exact_until``; pages from there to ``end`` are marked inexact in the pool.
    Every position in ``[start, end)`` must hold its final KV (or have it queued on the
    device's stream: see the invariants above)."""
    page_size = pool.page_size
    first, last = start // page_size, end // page_size
    exact_pages = min(last, seq.exact_until // page_size)
    if exact_pages > first:
        keys = seq.extend_page_keys(page_size, exact_pages * page_size)
        packed, width = seq.packed_tokens(exact_pages * page_size), 4 * page_size
        for index in range(first, exact_pages):
            parent = keys[index - 1] if index else root_key(seq.namespace)
            tokens = packed[index * width : (index + 1) * width]
            pool.publish(seq.page_ids[index], keys[index], tokens, parent)
    if seq.exact_until >= end:
        return
    inexact_from = max(first, seq.exact_until // page_size)
    upto = -(-end // page_size)
    if upto > inexact_from:
        pool.mark_inexact(seq.page_ids[inexact_from:upto])
