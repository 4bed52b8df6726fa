"""The host-memory KV tier: what the device pool evicts for room goes here instead of
being dropped, and a request whose prefix or chunk entries sit here loads them back
into fresh device pages instead of computing them again.

Two parts:
- ``PageCopier`` owns the host tensor (one *slot* per page: every layer's K and V of
  ``page_size`` positions, contiguous) and copies pages between it and the model
  runner's KV stack. On CUDA the host tensor is pinned and every host copy runs on one
  copy stream, in the order asked: a slot written and then read (or freed and written
  again) is read after its write, whatever the host thread does meanwhile.
  A write gathers the evicted pages into a staging buffer on the compute stream (after
  the pages' last writers, before their new owner overwrites them) and copies that to
  host memory on the copy stream, which the compute stream never waits for: an idle
  tier costs the steps only the gather. A staging buffer is the copy stream's until its
  copy ends. Staged writes hold at most ``staging_bytes`` of device memory (the engine
  takes it from the pool's budget); an eviction that finds them full, because
  evictions outrun the host link, is not written (the pages are dropped, as without a
  tier, and counted in ``TierStats.pages_skipped``): no step ever waits for a write.
  A load copies on the copy stream after the work queued on the compute stream. Where
  ``fence`` is asked, the compute stream waits for it (an admission forward reads the
  pages at once); else the pool counts the pages as loading until the load's event has
  completed, and the scheduler leaves the requests using them out of the steps until
  then (``KVPool.loading``): the other requests step on meanwhile. On CPU the copies
  run at once, on the same code path.
- ``HostTier`` keeps the slots' bookkeeping, under the device pool's rules: keyed pages
  (exact prefixes; found by their parent's key and their tokens, as
  ``KVPool.match_chain`` finds them) and position-free entries (a chunk's pages as a
  unit). Room is made as the device pool makes it: least recently used pages first,
  then the entry of lowest GreedyDual-Frequency priority (its clock when stored or
  last loaded plus its uses). Slots being loaded from (``held``) are never taken.

The tier is *inclusive*: a key loaded back stays here too, so evicting it from the
device again writes nothing. What the pool tells the chunk directory follows from
that (``KVPool``): a device eviction whose key the tier holds is ``offloaded``; a key
the tier drops while the device has none is ``removed``.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from chunkstore.hashing import PageKey


@dataclass(frozen=True)
class TierStats:
    """The host tier's counters since the worker started (``chunkserve status``,
    ``/metrics``)."""

    slots: int  # pages the tier can hold
    pages: int  # slots holding keyed pages
    entry_pages: int  # slots holding position-free entries' pages
    hits: int  # admissions that loaded pages or an entry back
    pages_written: int  # device -> host
    pages_loaded: int  # host -> device
    pages_skipped: int  # evicted while staged writes were full: dropped, not written
    bytes_written: int
    bytes_loaded: int
    load_s: float  # time the loads took (their copies' span on the device; on CPU, the copy)

    @property
    def load_s_per_page(self) -> float:
        """Measured; 0.0 before any load."""
        return self.load_s / self.pages_loaded if self.pages_loaded else 0.0


def available_host_bytes() -> int | None:
    """The host's available memory (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_slots(host_kv_gib: float, bytes_per_page: int) -> int:
    """Pages a tier of ``host_kv_gib`` holds; refuses a size the host cannot give."""
    wanted = int(host_kv_gib * 2**30)
    available = available_host_bytes()
    if available is not None and wanted > available:
        raise ValueError(
            f"engine.host_kv_gib is {host_kv_gib} GiB but this host has "
            f"{available / 2**30:.1f} GiB of memory available; lower it (0 turns the "
            "host KV tier off)"
        )
    slots = wanted // bytes_per_page
    if slots < 1:
        raise ValueError(
            f"engine.host_kv_gib {host_kv_gib} GiB holds no KV page of this model "
            f"({bytes_per_page} bytes each); give it at least {bytes_per_page / 2**30:.6f}"
        )
    return slots


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(index in ``slots``, first slot, count) of each run of consecutive slots."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield start, slots[start], i - start
            start = i


# Pages a copy stages on the device at once: a long load needs no more scratch memory
# than this many pages (an 8B model's: 128 MiB).
COPY_BATCH_PAGES = 64
# Device memory that writes on their way to host memory may hold (``PageCopier``): at
# the host link's 40-50 GB/s, about 20 ms of evictions queued ahead of the copy stream.
WRITE_STAGING_BYTES = 2**30


class PageCopier:
    """Copies pages between ``kv_stack`` (the model runner's [layers, pages, 2,
    page_size, kv_heads, head_dim]) and ``num_slots`` host slots (module docstring)."""

    def __init__(
        self, kv_stack: torch.Tensor, num_slots: int, staging_bytes: int = WRITE_STAGING_BYTES
    ) -> None:
        self.kv = kv_stack
        # one row a (layer, page): a page's rows for every layer, gathered in the
        # order of the host slot (page-major), are the slot's bytes
        layers, num_pages = kv_stack.shape[:2]
        self._rows = kv_stack.view(layers * num_pages, -1)
        self._layer_rows = np.arange(layers, dtype=np.int64) * num_pages
        self.device = kv_stack.device
        cuda = self.device.type == "cuda"
        shape = (num_slots, kv_stack.shape[0], *kv_stack.shape[2:])
        self.host = torch.empty(shape, dtype=kv_stack.dtype, pin_memory=cuda)
        self.bytes_per_slot = self.host[0].numel() * self.host.element_size()
        # pages staged writes may hold: at least one copy's worth
        self.staging_pages = max(COPY_BATCH_PAGES, staging_bytes // self.bytes_per_slot)
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self.load_s = 0.0  # resolved loads' time
        self.host_copies = 0  # copies to or from host slots issued (a run of slots each)
        self._timing: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._writes: deque[tuple[torch.cuda.Event, int]] = deque()  # (end, pages)
        self._pages_in_flight = 0  # pages of the writes in ``_writes``

    def writable(self) -> int:
        """Pages a write may take now without waiting for an earlier one (unbounded on
        CPU, where a write is done when it returns). Never waits."""
        if self._stream is None:
            return sys.maxsize
        while self._writes and self._writes[0][0].query():
            self._pages_in_flight -= self._writes.popleft()[1]
        return self.staging_pages - self._pages_in_flight

    def write(self, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Device pages -> host slots (on CUDA, the compute stream never waits for it).
        Invariant: at most ``writable()`` pages (asked just before)."""
        for start in range(0, len(pages), COPY_BATCH_PAGES):
            batch = slice(start, start + COPY_BATCH_PAGES)
            count = len(pages[batch])
            staged = self._rows.index_select(0, self._index(pages[batch]))
            staged = staged.view(count, *self.host.shape[1:])
            if self._stream is None:
                self._copy_out(staged, slots[batch])
                continue
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # staged
            with torch.cuda.stream(self._stream):
                self._copy_out(staged, slots[batch])
                done = torch.cuda.Event()
                done.record()
            staged.record_stream(self._stream)  # freed once the copy stream is past it
            self._writes.append((done, count))
            self._pages_in_flight += count

    def _index(self, pages: Sequence[int]) -> torch.Tensor:
        """The rows of ``pages`` (page-major: each page's layers in order) as a device
        index, copied from pinned memory: the host never waits for the device's queued
        work (a plain ``torch.tensor(..., device=)`` would)."""
        rows = (np.asarray(pages, dtype=np.int64)[:, None] + self._layer_rows).ravel()
        index = torch.from_numpy(rows)
        if self._stream is not None:
            index = index.pin_memory()
        return index.to(self.device, non_blocking=True)

    def _copy_out(self, staged: torch.Tensor, slots: Sequence[int]) -> None:
        for at, first, count in _runs(slots):
            self.host_copies += 1
            self.host[first : first + count].copy_(
                staged[at : at + count], non_blocking=self._stream is not None
            )

    def read(
        self, slots: Sequence[int], pages: Sequence[int], fence: bool = True
    ) -> torch.cuda.Event | None:
        """Host slots -> device pages (byte for byte what was written). ``fence``: the
        compute stream waits for the copy; else the returned event tells when it is
        done (None: done already, on CPU)."""
        if not slots:
            return None
        # in slot order, each run of consecutive slots one copy: a chain's pages are
        # written tail first (the pool frees a sequence's tail before its head), so in
        # the chain's order its slots descend, a copy each (14 us of host time apiece)
        order = np.argsort(np.asarray(slots), kind="stable")
        slots, pages = [slots[i] for i in order], [pages[i] for i in order]
        started = time.perf_counter()
        with self._on_copy_stream(fence) as (begin, end):
            for start in range(0, len(slots), COPY_BATCH_PAGES):
                batch = slice(start, start + COPY_BATCH_PAGES)
                index = self._index(pages[batch])
                staged = torch.empty(
                    (len(slots[batch]), *self.host.shape[1:]),
                    dtype=self.kv.dtype,
                    device=self.device,
                )
                for at, first, count in _runs(slots[batch]):
                    self.host_copies += 1
                    staged[at : at + count].copy_(
                        self.host[first : first + count], non_blocking=self._stream is not None
                    )
                self._rows.index_copy_(0, index, staged.view(len(index), -1))
        if begin is None:
            self.load_s += time.perf_counter() - started
            return None
        self._timing.append((begin, end))
        return end

    def landed(self, events) -> None:
        """The pool's unfenced loads that ``events`` end have landed; nothing to do on
        one rank (a tensor-parallel worker's ``tp.group.MirroredCopier`` has the other
        ranks wait for theirs)."""

    def fence(self) -> None:
        """The compute stream waits for every copy queued so far."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def resolve_timing(self) -> None:
        """Add the finished loads' device time to ``load_s`` (never waits)."""
        while self._timing and self._timing[0][1].query():
            begin, end = self._timing.popleft()
            self.load_s += begin.elapsed_time(end) / 1000

    @contextmanager
    def _on_copy_stream(
        self, fence: bool
    ) -> Iterator[tuple[torch.cuda.Event | None, torch.cuda.Event | None]]:
        if self._stream is None:
            yield None, None
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._stream):
            begin.record()
            yield begin, end
            end.record()
        if fence:
            compute.wait_stream(self._stream)


@dataclass
class HostPage:
    key: PageKey
    parent: PageKey
    tokens: bytes  # packed token ids (``pack_tokens``)
    slot: int


@dataclass(eq=False)
class HostEntry:
    key: PageKey
    slots: tuple[int, ...]
    num_tokens: int
    hits: int
    priority: float = 0.0


@dataclass
class _Counts:
    hits: int = 0
    pages_written: int = 0
    pages_loaded: int = 0
    pages_skipped: int = 0


@dataclass
class Dropped:
    """Keys the tier let go of to make room (page keys, entry keys)."""

    pages: list[PageKey] = field(default_factory=list)
    entries: list[PageKey] = field(default_factory=list)


class HostTier:
    def __init__(self, copier: PageCopier) -> None:
        self.copier = copier
        self.num_slots = copier.host.shape[0]
        self._free: deque[int] = deque(range(self.num_slots))
        self._pages: dict[PageKey, HostPage] = {}
        self._by_chain: dict[tuple[PageKey, bytes], PageKey] = {}
        self._page_lru: OrderedDict[PageKey, None] = OrderedDict()
        self._entries: dict[PageKey, HostEntry] = {}
        self._entry_slots = 0  # slots the entries hold
        self._clock = 0.0  # GreedyDual clock, as the device pool's
        self._held: Counter[int] = Counter()  # slots being loaded from: never taken
        self._counts = _Counts()

    # -- queries -------------------------------------------------------------
    def has_page(self, key: PageKey) -> bool:
        return key in self._pages

    def has_entry(self, key: PageKey) -> bool:
        return key in self._entries

    def keys(self) -> list[PageKey]:
        return [*self._pages, *self._entries]

    def chain(
        self, parent: PageKey, packed: bytes, page_size: int, max_pages: int
    ) -> list[HostPage]:
        """The held pages continuing the chain after the page keyed ``parent`` with the
        tokens of ``packed``, page by page (at most ``max_pages``)."""
        width = 4 * page_size
        found: list[HostPage] = []
        for start in range(0, min(max_pages * width, len(packed) - width + 1), width):
            key = self._by_chain.get((parent, packed[start : start + width]))
            if key is None:
                break
            found.append(self._pages[key])
            parent = key
        return found

    def entry(self, key: PageKey) -> HostEntry | None:
        return self._entries.get(key)

    def stats(self) -> TierStats:
        self.copier.resolve_timing()
        counts = self._counts
        size = self.copier.bytes_per_slot
        return TierStats(
            self.num_slots, len(self._pages), self._entry_slots, counts.hits,
            counts.pages_written, counts.pages_loaded, counts.pages_skipped,
            counts.pages_written * size,
            counts.pages_loaded * size, self.copier.load_s,
        )  # fmt: skip

    # -- writes ----------------------------------------------------------------
    def put_pages(self, pages: Sequence[tuple[int, PageKey, PageKey, bytes]]) -> Dropped:
        """Write device pages ``(page id, key, parent key, packed tokens)`` evicted from
        the device; those already here are only made recent. A page that finds no room,
        or no room among the staged writes (the first ones given are written), is not
        kept (``has_page`` says which are)."""
        dropped = Dropped()
        new = []
        for page in pages:
            key = page[1]
            if key in self._pages:
                self._page_lru.move_to_end(key)
            else:
                new.append(page)
        writable = self.copier.writable()
        if len(new) > writable:
            self._counts.pages_skipped += len(new) - max(writable, 0)
            new = new[: max(writable, 0)]
        slots = self._take(len(new), dropped)
        new = new[: len(slots)]
        for (_, key, parent, tokens), slot in zip(new, slots, strict=True):
            self._pages[key] = HostPage(key, parent, tokens, slot)
            self._by_chain[(parent, tokens)] = key
            self._page_lru[key] = None
        self.copier.write([page[0] for page in new], slots)
        self._counts.pages_written += len(slots)
        return dropped

    def put_entry(self, key: PageKey, pages: Sequence[int], num_tokens: int, hits: int) -> Dropped:
        """Write a device entry evicted from the device (already here: only its uses and
        priority are brought up to date); not where the staged writes have no room for
        all of its pages."""
        dropped = Dropped()
        held = self._entries.get(key)
        if held is not None:
            held.hits = max(held.hits, hits)
            held.priority = self._clock + 1 + held.hits
            return dropped
        if len(pages) > self.copier.writable():
            self._counts.pages_skipped += len(pages)
            return dropped
        slots = self._take(len(pages), dropped) if len(pages) <= self.num_slots else []
        if len(slots) < len(pages):
            self._free.extend(slots)
            return dropped
        priority = self._clock + 1 + hits
        self._entries[key] = HostEntry(key, tuple(slots), num_tokens, hits, priority)
        self._entry_slots += len(slots)
        self.copier.write(pages, slots)
        self._counts.pages_written += len(slots)
        return dropped

    # -- loads -----------------------------------------------------------------
    @contextmanager
    def holding(self, slots: Sequence[int]) -> Iterator[None]:
        """Within: ``slots`` are never taken for room (a load reads them)."""
        held = self._held
        held.update(slots)
        try:
            yield
        finally:
            for slot in slots:  # no zero stays (not the whole Counter rebuilt: a load's)
                if held[slot] == 1:
                    del held[slot]
                else:
                    held[slot] -= 1

    def load_pages(
        self, found: Sequence[HostPage], pages: Sequence[int], fence: bool = True
    ) -> torch.cuda.Event | None:
        """Read ``found`` into device ``pages`` (``PageCopier.read``: ``fence``, and
        the event returned)."""
        for page in found:
            self._page_lru.move_to_end(page.key)
        done = self.copier.read([page.slot for page in found], pages, fence)
        self._counts.pages_loaded += len(found)
        self._counts.hits += 1
        return done

    def load_entry(self, entry: HostEntry, pages: Sequence[int]) -> None:
        """Read ``entry`` into device ``pages``; it is as recent as the clock (the
        placement that loaded it counts its use on the device)."""
        entry.priority = self._clock + 1 + entry.hits
        self.copier.read(entry.slots, pages)
        self._counts.pages_loaded += len(entry.slots)
        self._counts.hits += 1

    def clear(self) -> None:
        self._pages.clear()
        self._by_chain.clear()
        self._page_lru.clear()
        self._entries.clear()
        self._entry_slots = 0
        self._free = deque(range(self.num_slots))

    # -- internals -------------------------------------------------------------
    def _take(self, count: int, dropped: Dropped) -> list[int]:
        """Up to ``count`` free slots, dropping pages (least recent first), then entries
        (lowest priority first), for room; held slots are never taken."""
        while len(self._free) < count and self._drop_one(dropped):
            pass
        count = min(count, len(self._free))
        return [self._free.popleft() for _ in range(count)]

    def _drop_one(self, dropped: Dropped) -> bool:
        for key in self._page_lru:
            page = self._pages[key]
            if not self._held[page.slot]:
                del self._page_lru[key], self._pages[key]
                del self._by_chain[(page.parent, page.tokens)]
                self._free.append(page.slot)
                dropped.pages.append(key)
                return True
        candidates = [e for e in self._entries.values() if not any(self._held[s] for s in e.slots)]
        if not candidates:
            return False
        entry = min(candidates, key=lambda e: e.priority)
        del self._entries[entry.key]
        self._entry_slots -= len(entry.slots)
        self._clock = max(self._clock, entry.priority)
        self._free.extend(entry.slots)
        dropped.entries.append(entry.key)
        return True
