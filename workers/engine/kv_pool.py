"""Page bookkeeping for the paged KV cache (the tensors live in the model runner):
pages keyed by exact chain keys, and position-free chunk entries.

Every page is in exactly one of three states:
- *free*: no key, ref count 0 — in ``_free``;
- *cached*: keyed, ref count 0 — in ``_lru`` (evictable, least recently used first;
  pages released cold come first, see ``release``);
- *in use*: ref count > 0, keyed or not. Pages of a running request are never evicted.

A pin is a reference that outlives requests (a registered chunk's pages): pinning
takes one reference and unpinning drops it, so a pinned page is in use and never
evicted. Pins nest; ``pins <= ref_count`` always.

A key names a full page's tokens and everything before them (see
``chunkstore.hashing``); at most one page holds a given key. A keyed page is also
found by its parent's key and its own tokens (``match_chain``): the pair names it as
its key does, and matching a cached prefix that way hashes nothing. A page marked *inexact*
(its KV differs from what plain generation computes, e.g. after approximate reuse)
is never keyed, so it is never matched and never reaches the directory; the mark
lasts until the page is freed.

A *position-free entry* holds one chunk's KV (computed in some context, its rows
starting at position 0) in pages it owns (one reference each), under a key of its own
kind (see ``chunkstore.hashing.position_free_key``). Entries follow the pages' rules as
a unit: a request placing from an entry, or a pin, holds it (``users``); an entry nobody
holds is evictable, after the cached pages; a pinned entry is never evicted. Entry
changes are queued as ``ENTRY_STORED`` / ``ENTRY_REMOVED`` events. Key changes are
queued as ``CacheEvent``s for the chunk directory.

Which entry goes first is decided by value, not recency alone (GreedyDual-Frequency):
an entry's priority is the pool's clock when it was stored or last placed plus its
uses (1 + ``hits``, the placements ``note_hit`` reported); the evictable entry of
lowest priority is evicted (least recently used among equals) and the clock rises to
its priority. An entry placed often outlives many entries placed once; one not placed
for long enough is overtaken by the clock and goes.

With a host tier (``attach_host``, ``host_tier.HostTier``), what this pool evicts for
room (``allocate``) is written there instead of dropped: a cached page's key then
reports ``offloaded`` (the worker still holds it, in host memory), and only a key
neither tier holds reports ``removed``. ``load_chain`` and ``load_entry`` bring pages
and entries back into fresh pages (``reloaded``), under the same keys. An explicit
``evict`` or ``evict_entry`` writes nothing (the key stays offloaded only where the
tier held it already). Pinned pages and entries are never evicted, so never leave.
Which evictions are written is the tier's *write policy* (``attach_host``): ``all``
writes every one; ``reused`` writes a page only once it has been acquired while keyed
(a request after the one that computed it matched it; also a pin, and a preempted
request readmitted onto its own pages: those err towards writing) or loaded back from
the tier, an entry only once placed, or either on its second eviction (the keys evicted
unwritten are remembered, as many as the tier has slots), so KV seen once costs the
tier nothing.
A chain's pages are *loading* until their copy lands (``loading``): no step may use
them before (the scheduler leaves their requests out), or ``fence_loads`` makes the
device's compute wait for the copies. Released while loading, they are fenced first,
so a page's next owner never races its load.

*Proven* entries (placed at least once) may be spared: while ``sparing_entries`` is on
(the scheduler admits a request while others run, so the request can wait for their
pages), ``allocate`` leaves up to ``entry_reserve_pages`` pages of evictable proven
entries alone, taking unproven entries first, and fails rather than go below.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from chunkstore.events import CacheEvent, EventKind, EventRuns
from chunkstore.hashing import PageKey
from workers.engine.host_tier import Dropped, HostTier

# What the host tier is given of the pool's evictions (module docstring)
HOST_WRITE_POLICIES = ("all", "reused")


@dataclass
class _Page:
    ref_count: int = 0  # running requests' references + pins
    pins: int = 0
    key: PageKey | None = None
    parent: PageKey = b""  # the key of the page before it in its chain (keyed pages)
    tokens: bytes = b""  # its token ids packed (``pack_tokens``; keyed pages)
    exact: bool = True  # False: never keyed (see mark_inexact)
    reused: bool = False  # matched since it was keyed (acquired while keyed)


@dataclass(eq=False)
class ChunkEntry:
    """A position-free entry: tokens ``[0, num_tokens)`` of a chunk, starting at
    position 0, in ``pages`` (position p at ``pages[p // page_size]``, offset ``p % page_size``).
    A handle stays valid while held, even after ``clear`` forgets its key."""

    key: PageKey
    pages: tuple[int, ...]
    num_tokens: int
    users: int = 0  # holders: requests placing from it, plus pins
    pins: int = 0
    listed: bool = True  # still findable by key (False once cleared while held)
    hits: int = 0  # placements reported by ``KVPool.note_hit``
    priority: float = 0.0  # eviction order: lowest first (see the module docstring)


class KVPool:
    def __init__(self, num_pages: int, page_size: int, entry_reserve_pages: int = 0) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        if entry_reserve_pages < 0:
            raise ValueError(f"entry_reserve_pages must be >= 0, got {entry_reserve_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.entry_reserve_pages = entry_reserve_pages
        self._sparing = False  # see sparing_entries
        self._clock = 0.0  # GreedyDual clock: the priority of the last entry evicted
        self._pages = [_Page() for _ in range(num_pages)]
        self._free: deque[int] = deque(range(num_pages))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._by_key: dict[PageKey, int] = {}
        # every keyed page, also under (its parent's key, its packed tokens)
        self._by_chain: dict[tuple[PageKey, bytes], int] = {}
        self._events = EventRuns()  # key changes in order, runs of one kind as one event
        self._num_pinned = 0  # pages with pins > 0
        self._entries: dict[PageKey, ChunkEntry] = {}
        self._entry_lru: OrderedDict[PageKey, None] = OrderedDict()  # listed, users == 0
        self._evictable_entry_pages = 0  # pages of the entries in _entry_lru
        self._proven_entry_pages = 0  # ... of those with hits > 0
        self._pinned_entry_pages = 0  # pages of the entries with pins > 0
        self.entry_evictions = 0  # entries dropped since the pool was made
        self.host: HostTier | None = None  # see attach_host
        self._loading: dict[int, object] = {}  # page -> its unfinished load's event
        # see batching_evictions
        self._evicted: list[tuple[int, PageKey, PageKey, bytes]] | None = None
        self._host_write = "all"  # see attach_host
        # keys evicted unwritten under the "reused" policy, oldest first (bounded)
        self._unwritten: OrderedDict[PageKey, None] = OrderedDict()

    def attach_host(self, host: HostTier, write: str = "all") -> None:
        """Evict into ``host`` from now on, and load back from it; ``write`` is the
        write policy (``HOST_WRITE_POLICIES``, module docstring)."""
        if write not in HOST_WRITE_POLICIES:
            raise ValueError(
                f"host write policy must be one of {HOST_WRITE_POLICIES}, got {write!r}"
            )
        self.host = host
        self._host_write = write

    # -- queries -------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Pages that ``allocate`` can hand out (free + evictable cached pages and
        entries; while sparing entries, less the proven entries' pages it spares)."""
        available = len(self._free) + len(self._lru) + self._evictable_entry_pages
        if self._sparing:
            available -= min(self._proven_entry_pages, self.entry_reserve_pages)
        return available

    @contextmanager
    def batching_evictions(self) -> Iterator[None]:
        """Within: the cached pages ``allocate`` evicts are written to the host tier
        (and reported) together on the way out, one copy instead of one per allocation;
        those the write policy does not write are reported at once.
        Invariant: nothing within writes a page it was given (its new owner's writes
        are queued after the block, behind the copy's gather); the scheduler's running
        requests growing by a page each are the use."""
        if self._evicted is not None or self.host is None:
            yield
            return
        self._evicted = []
        try:
            yield
        finally:
            evicted, self._evicted = self._evicted, None
            if evicted:
                self._gone_for_room(evicted)

    @contextmanager
    def sparing_entries(self, spare: bool = True) -> Iterator[None]:
        """Within: allocations leave proven entries alone, up to ``entry_reserve_pages``
        of their pages (see the module docstring); ``spare=False`` changes nothing."""
        before, self._sparing = self._sparing, spare and self.entry_reserve_pages > 0
        try:
            yield
        finally:
            self._sparing = before

    def is_private(self, page_ids: Sequence[int]) -> bool:
        """Whether each of ``page_ids`` is in use exactly once and unkeyed (nobody else
        can read it)."""
        return all(self._pages[p].ref_count == 1 and self._pages[p].key is None for p in page_ids)

    def entry(self, key: PageKey) -> ChunkEntry | None:
        """The position-free entry under ``key``, if held here (takes no hold)."""
        return self._entries.get(key)

    def occupancy(self) -> tuple[int, int, int]:
        """(cached pages: keyed, unused by any request; position-free entries; pages
        those entries hold)."""
        entry_pages = sum(len(entry.pages) for entry in self._entries.values())
        return len(self._lru), len(self._entries), entry_pages

    @property
    def num_pinned(self) -> int:
        """Pages pinned at least once (an entry's pages count while it is pinned)."""
        return self._num_pinned + self._pinned_entry_pages

    def ref_count(self, page_id: int) -> int:
        return self._pages[page_id].ref_count

    def pin_count(self, page_id: int) -> int:
        return self._pages[page_id].pins

    def is_exact(self, page_id: int) -> bool:
        return self._pages[page_id].exact

    def match_chain(self, parent: PageKey, packed: bytes, max_pages: int) -> list[int]:
        """Pages holding the longest prefix of the first ``max_pages`` full pages of
        ``packed`` (token ids as ``pack_tokens`` packs them) whose chain starts after
        the page keyed ``parent`` (``root_key`` for a sequence's start). Each page is
        found by the key of the one before it and its own tokens: no hashing, and the
        tokens compared exactly. Takes no references (``acquire`` the result)."""
        width = 4 * self.page_size
        hits: list[int] = []
        by_chain, pages = self._by_chain, self._pages
        for start in range(0, min(max_pages * width, len(packed) - width + 1), width):
            page_id = by_chain.get((parent, packed[start : start + width]))
            if page_id is None:
                break
            hits.append(page_id)
            parent = pages[page_id].key
        return hits

    def keys_of(self, page_ids: Sequence[int]) -> list[PageKey]:
        """The keys of keyed pages, in order."""
        return [self._pages[p].key for p in page_ids]

    def cached_keys(self) -> list[PageKey]:
        """Every key this pool holds, page keys and entry keys, in either tier (a
        snapshot for the directory)."""
        keys = [*self._by_key, *self._entries]
        if self.host is not None:
            keys.extend(
                k for k in self.host.keys() if k not in self._by_key and k not in self._entries
            )
        return keys

    # -- mutations -----------------------------------------------------------
    def acquire(self, page_ids: Sequence[int]) -> None:
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.ref_count == 0:
                self._lru.pop(page_id, None)
            page.ref_count += 1
            page.reused |= page.key is not None

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh pages with ref count 1, evicting least recently used cached
        pages as needed; ``None`` (and no change) if there are not enough."""
        if count > self.num_available:
            return None
        taken: list[int] = []
        evicted: list[tuple[int, PageKey, PageKey, bytes]] = []
        unwritten: list[PageKey] = []  # evicted, not written (the write policy)
        for _ in range(count):
            if not self._free and not self._lru:
                self._evict_entry(self._entry_to_evict(), offload=True)
            if self._free:
                page_id = self._free.popleft()
            else:
                page_id, _ = self._lru.popitem(last=False)
                page = self._pages[page_id]
                if self._worth_writing(page.key, page.reused, is_entry=False):
                    evicted.append((page_id, page.key, page.parent, page.tokens))
                else:
                    unwritten.append(page.key)
                self._unkey(page_id)
            page = self._pages[page_id]
            page.ref_count, page.exact = 1, True
            taken.append(page_id)
        if unwritten:
            self._report_gone(unwritten)
        if self._evicted is not None:
            self._evicted += evicted
        elif evicted:
            self._gone_for_room(evicted)
        return taken

    def _worth_writing(self, key: PageKey, reused: bool, is_entry: bool) -> bool:
        """Whether a page or entry evicted for room goes to the host tier, by the write
        policy; one that does not is remembered, so its next eviction writes it."""
        if self.host is None:
            return False
        if self._host_write == "all":
            return True
        if reused:
            self._unwritten.pop(key, None)
            return True
        if self.host.has_entry(key) if is_entry else self.host.has_page(key):
            return True  # already there: made recent, nothing copied
        if key in self._unwritten:  # its second eviction
            del self._unwritten[key]
            return True
        self._unwritten[key] = None
        if len(self._unwritten) > self.host.num_slots:
            self._unwritten.popitem(last=False)
        return False

    def _gone_for_room(self, evicted: list[tuple[int, PageKey, PageKey, bytes]]) -> None:
        """Cached pages evicted for room: written to the host tier (queued before any
        later write of the pages, the copier's ordering) and reported."""
        if self.host is not None:
            self._note_dropped(self.host.put_pages(evicted))
        self._report_gone([key for _, key, _, _ in evicted])

    def _report_gone(self, keys: Sequence[PageKey], entries: bool = False) -> None:
        """Keys this device pool no longer holds: offloaded where the host tier holds
        them, else removed."""
        offloaded, removed = [], list(keys)
        if self.host is not None:
            has = self.host.has_entry if entries else self.host.has_page
            offloaded = [key for key in keys if has(key)]
            removed = [key for key in keys if not has(key)]
        if offloaded:
            self._events.append(EventKind.OFFLOADED, offloaded)
        if removed:
            kind = EventKind.ENTRY_REMOVED if entries else EventKind.REMOVED
            self._events.append(kind, removed)

    def _note_dropped(self, dropped: Dropped) -> None:
        """The host tier let go of these keys: removed where this pool holds none."""
        pages = [key for key in dropped.pages if key not in self._by_key]
        entries = [key for key in dropped.entries if key not in self._entries]
        if pages:
            self._events.append(EventKind.REMOVED, pages)
        if entries:
            self._events.append(EventKind.ENTRY_REMOVED, entries)

    def release(self, page_ids: Sequence[int], cold_from: int | None = None) -> None:
        """Drop one reference from each page. Released pages are freed in reverse so
        a sequence's tail pages are evicted before its head (heads are shared more).

        ``cold_from``: cached pages from this index on go to the cold end of the LRU
        order instead (evicted before every other cached page, tail first), for KV
        that is probably held elsewhere too (a spilled request's): it stays
        findable, and a later hit makes it as recent as any (``acquire``)."""
        if self.loading(page_ids):
            self.fence_loads()  # their next owner's writes come after the copies
        cold = len(page_ids) if cold_from is None else max(0, cold_from)
        for page_id in reversed(page_ids[:cold]):
            self._drop_reference(page_id)
        for page_id in page_ids[cold:]:  # each before the last: the tail ends up first
            if self._drop_reference(page_id):
                self._lru.move_to_end(page_id, last=False)

    def _drop_reference(self, page_id: int) -> bool:
        """True if the page became cached (keyed and unreferenced: in ``_lru``)."""
        page = self._pages[page_id]
        if page.ref_count <= 0:
            raise ValueError(f"page {page_id} released more often than acquired")
        page.ref_count -= 1
        if page.ref_count:
            return False
        if page.key is None:
            self._free.append(page_id)
            return False
        self._lru[page_id] = None
        return True

    def publish(
        self,
        page_id: int,
        key: PageKey,
        tokens: bytes,
        parent: PageKey,
        event: EventKind = EventKind.STORED,
    ) -> bool:
        """Record that in-use ``page_id`` now holds the full page named ``key``: the
        page of ``tokens`` (its token ids as ``pack_tokens`` packs them) after the page
        keyed ``parent`` (``key`` is their chain key, ``chunkstore.hashing``).

        Returns False (page stays unkeyed) when another page already holds the key,
        e.g. two requests computed the same prefix in one step.
        """
        page = self._pages[page_id]
        if page.ref_count == 0:
            raise ValueError(f"page {page_id} must be in use to be published")
        if len(tokens) != 4 * self.page_size:
            raise ValueError("only full pages can be published")
        if not page.exact:
            raise ValueError(f"page {page_id} holds inexact KV and can never be published")
        if key in self._by_key or page.key is not None:
            return False
        page.key, page.parent, page.tokens = key, parent, tokens
        self._by_key[key] = page_id
        self._by_chain[(parent, page.tokens)] = page_id
        self._events.append(event, (key,))
        return True

    def mark_inexact(self, page_ids: Sequence[int]) -> None:
        """Record that these in-use, unkeyed pages hold KV that plain generation would
        not compute: they are never keyed (so never matched or announced)."""
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.ref_count == 0 or page.key is not None:
                raise ValueError(f"page {page_id} must be in use and unkeyed to be marked inexact")
        for page_id in page_ids:
            self._pages[page_id].exact = False

    def pin(self, page_ids: Sequence[int]) -> None:
        """Pin cached or in-use pages: each pin is one more reference, so the page is
        never evicted until unpinned. Atomic: a free page anywhere pins nothing."""
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.ref_count == 0 and page.key is None:
                raise ValueError(
                    f"page {page_id} is free: only cached or in-use pages can be pinned"
                )
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.pins == 0:
                self._num_pinned += 1
            page.pins += 1
        self.acquire(page_ids)

    def unpin(self, page_ids: Sequence[int]) -> None:
        """Drop one pin (and its reference) from each page. Atomic: a page unpinned
        more often than pinned unpins nothing."""
        for page_id, count in Counter(page_ids).items():
            if self._pages[page_id].pins < count:
                raise ValueError(f"page {page_id} unpinned more often than pinned")
        for page_id in page_ids:
            page = self._pages[page_id]
            page.pins -= 1
            if page.pins == 0:
                self._num_pinned -= 1
        self.release(page_ids)

    def evict(self, page_ids: Sequence[int]) -> list[PageKey]:
        """Free those of ``page_ids`` that are cached and unreferenced (pages in use,
        pinned ones included, are kept); returns the keys dropped."""
        evicted: list[PageKey] = []
        for page_id in page_ids:
            if page_id in self._lru:
                del self._lru[page_id]
                evicted.append(self._unkey(page_id))
                self._free.append(page_id)
        if evicted:
            self._report_gone(evicted)
        return evicted

    # -- the host tier ---------------------------------------------------------
    def load_chain(self, parent: PageKey, packed: bytes, max_pages: int) -> list[int]:
        """Continue a chain from the host tier: fresh pages (ref count 1 each, keyed
        again) holding the longest run of the first ``max_pages`` full pages of
        ``packed`` that the tier holds after the page keyed ``parent`` (as
        ``match_chain``, which the caller ran first). Fewer where the pool has no room
        for all; the run stops at a key this pool holds already (``match_chain``
        finds it). The pages' KV is queued on the copier's stream (``host_tier``)."""
        if self.host is None or max_pages < 1:
            return []
        found = self.host.chain(parent, packed, self.page_size, max_pages)
        for i, page in enumerate(found):
            if page.key in self._by_key:
                found = found[:i]
                break
        if not found:
            return []
        with self.host.holding([page.slot for page in found]):
            pages = self.allocate(min(len(found), self.num_available))
        if not pages:
            return []
        found = found[: len(pages)]
        done = self.host.load_pages(found, pages, fence=False)
        if done is not None:
            self._loading.update(dict.fromkeys(pages, done))
        for page_id, page in zip(pages, found, strict=True):
            self.publish(page_id, page.key, page.tokens, page.parent, EventKind.RELOADED)
            self._pages[page_id].reused = True  # a request matched it in the tier
        return pages

    def land_loads(self) -> None:
        """Stop counting as loading the pages whose copies have landed (once a step:
        it asks the device about each unfinished load)."""
        if self._loading:
            landed = {done for done in set(self._loading.values()) if done.query()}
            if landed:
                self._loading = {p: d for p, d in self._loading.items() if d not in landed}
                self.host.copier.landed(landed)

    def loading(self, page_ids: Sequence[int]) -> bool:
        """Whether a load into any of ``page_ids`` was still copying at the last
        ``land_loads`` (or was queued since): module docstring."""
        return bool(self._loading) and not self._loading.keys().isdisjoint(page_ids)

    def fence_loads(self, page_ids: Sequence[int] | None = None) -> None:
        """Make the device's compute wait for the loads (all of them; or, given
        ``page_ids``, only if one of those is loading): every page is usable after."""
        if self._loading and (page_ids is None or self.loading(page_ids)):
            self.host.copier.fence()
            self._loading.clear()

    def load_entry(self, key: PageKey) -> ChunkEntry | None:
        """The entry ``key`` brought back from the host tier into fresh pages (unheld,
        with its uses), or None where the tier has none or this pool no room."""
        held = self.host.entry(key) if self.host is not None else None
        if held is None:
            return None
        with self.host.holding(held.slots):
            pages = self.allocate(len(held.slots))
        if pages is None:
            return None
        self.host.load_entry(held, pages)
        self.store_entry(key, pages, held.num_tokens, held.hits, EventKind.RELOADED)
        return self._entries[key]

    def find_entry(self, key: PageKey) -> ChunkEntry | None:
        """The entry ``key`` held here, else loaded back from the host tier (takes no
        hold: hold the entries found before finding more, or a load may evict them)."""
        return self._entries.get(key) or self.load_entry(key)

    # -- position-free entries ------------------------------------------------
    def store_entry(
        self,
        key: PageKey,
        page_ids: Sequence[int],
        num_tokens: int,
        hits: int = 0,
        event: EventKind = EventKind.ENTRY_STORED,
    ) -> bool:
        """Make in-use ``page_ids`` (one reference each, which the entry takes over)
        the entry ``key``; it starts unheld, with ``hits`` uses (one reloaded keeps
        its own). False (nothing changes, the caller keeps its references) when an
        entry with that key exists already."""
        if key in self._entries:
            return False
        if -(-num_tokens // self.page_size) != len(page_ids) or num_tokens < 1:
            raise ValueError(f"{len(page_ids)} pages cannot hold exactly {num_tokens} tokens")
        for page_id in page_ids:
            page = self._pages[page_id]
            if page.ref_count != 1 or page.key is not None:
                raise ValueError(f"page {page_id} must be in use once and unkeyed")
        priority = self._clock + 1 + hits
        entry = ChunkEntry(key, tuple(page_ids), num_tokens, hits=hits, priority=priority)
        self._entries[key] = entry
        self._make_evictable(entry)
        self._events.append(event, (key,))
        return True

    def hold_entry(self, entry: ChunkEntry, pin: bool = False) -> None:
        """One more holder (a placing request, or a pin): never evicted while held."""
        if entry.users == 0 and entry.listed:
            del self._entry_lru[entry.key]
            self._evictable_entry_pages -= len(entry.pages)
            if entry.hits:
                self._proven_entry_pages -= len(entry.pages)
        entry.users += 1
        if pin and entry.pins == 0:
            self._pinned_entry_pages += len(entry.pages)
        entry.pins += pin

    def drop_entry(self, entry: ChunkEntry, pin: bool = False) -> None:
        if entry.users <= 0 or (pin and entry.pins <= 0):
            raise ValueError("entry dropped more often than held")
        entry.users -= 1
        entry.pins -= pin
        if pin and entry.pins == 0:
            self._pinned_entry_pages -= len(entry.pages)
        if entry.users == 0:
            if entry.listed:
                self._make_evictable(entry)
            else:  # cleared while held: nothing can find it, free its pages
                self.release(entry.pages)

    def evict_entry(self, key: PageKey) -> bool:
        """Drop the entry ``key`` if nobody holds it; True if it was dropped."""
        entry = self._entries.get(key)
        if entry is None or entry.users:
            return False
        self._evict_entry(key)
        return True

    def note_hit(self, entry: ChunkEntry) -> None:
        """A request placed ``entry``: one more use, and as recent as the clock."""
        if entry.hits == 0 and entry.users == 0 and entry.listed:
            self._proven_entry_pages += len(entry.pages)
        entry.hits += 1
        entry.priority = self._clock + 1 + entry.hits
        if entry.key in self._entry_lru:  # the most recent among equals
            self._entry_lru.move_to_end(entry.key)

    def _entry_to_evict(self) -> PageKey:
        """The evictable entry of lowest priority (least recently used among equals);
        while sparing, an unproven one if any is left."""
        entries = self._entries
        candidates = self._entry_lru
        if self._sparing:
            unproven = [key for key in candidates if not entries[key].hits]
            candidates = unproven or candidates
        return min(candidates, key=lambda key: entries[key].priority)

    def _make_evictable(self, entry: ChunkEntry) -> None:
        self._entry_lru[entry.key] = None
        self._evictable_entry_pages += len(entry.pages)
        if entry.hits:
            self._proven_entry_pages += len(entry.pages)

    def _evict_entry(self, key: PageKey, offload: bool = False) -> None:
        """``offload``: write it to the host tier first (an eviction for room)."""
        self.entry_evictions += 1
        entry = self._entries.pop(key)
        del self._entry_lru[key]
        self._evictable_entry_pages -= len(entry.pages)
        if entry.hits:
            self._proven_entry_pages -= len(entry.pages)
        self._clock = max(self._clock, entry.priority)
        entry.listed = False
        if offload and self._worth_writing(key, entry.hits > 0, is_entry=True):
            self._note_dropped(self.host.put_entry(key, entry.pages, entry.num_tokens, entry.hits))
        self.release(entry.pages)
        self._report_gone((key,), entries=True)

    def clear(self) -> None:
        """Forget every key and entry. Pages in use stay allocated but become
        unshareable; held entries free their pages when their last holder drops."""
        for key in list(self._entry_lru):
            self._evict_entry(key)
        for entry in self._entries.values():
            entry.listed = False
        self._entries.clear()
        for page_id in list(self._lru):
            self._unkey(page_id)
            self._free.append(page_id)
        self._lru.clear()
        for page_id in list(self._by_key.values()):
            self._unkey(page_id)
        if self.host is not None:
            self.host.clear()
        self._unwritten.clear()
        self._events.append(EventKind.CLEARED)

    def drain_events(self) -> list[CacheEvent]:
        """The key changes since the last drain, in order (adjacent ones of a kind as one
        event)."""
        return self._events.drain()

    def _unkey(self, page_id: int) -> PageKey:
        page = self._pages[page_id]
        key = page.key
        assert key is not None
        del self._by_key[key]
        del self._by_chain[(page.parent, page.tokens)]
        page.key, page.parent, page.tokens, page.reused = None, b"", b"", False
        return key
