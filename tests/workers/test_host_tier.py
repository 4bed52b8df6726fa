"""The host-memory KV tier (CPU workers: a second pool in RAM, the code path a GPU
worker runs with pinned memory and a copy stream): what the device pool evicts for
room is kept and loaded back byte for byte; exact reuse through it equals plain
generation; entries come back with their uses; the directory's view follows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from chunkstore.events import EventKind, apply_event
from chunkstore.hashing import position_free_key
from tests.workers.test_approximate import APPROX, DOCS, _layout, _run
from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.host_tier import COPY_BATCH_PAGES, HostTier, PageCopier, host_slots

PAGE = 16
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
TIER_GIB = 0.01  # about 80 pages of the tiny model: far more than its device pool


def _tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(range(10, 500), k=n)


def _page_bytes(engine: Engine, pages) -> list[torch.Tensor]:
    return [engine.runner.kv_stack[:, p].clone() for p in pages]


def _push_out(engine: Engine) -> None:
    """Take every page the pool can give, then give them back: whatever was cached
    is evicted for room (into the host tier, where there is one). On a GPU a batch at
    a time, each written before the next, so that no page finds the staged writes
    full (``PageCopier.writable``)."""
    pool, taken = engine.pool, []
    batch = pool.host.copier.staging_pages if pool.host is not None else pool.num_available
    while pool.num_available:
        taken += pool.allocate(min(batch, pool.num_available))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    pool.release(taken)


def _kinds(events) -> dict[EventKind, set]:
    out: dict[EventKind, set] = {}
    for event in events:
        out.setdefault(event.kind, set()).update(event.keys)
    return out


@pytest.fixture(scope="module")
def off(tiny_qwen3):
    return LLM(tiny_qwen3, page_size=PAGE, enable_reuse=False)


def test_a_page_loaded_back_is_byte_identical_to_the_page_written(tiny_qwen3):
    llm = LLM(tiny_qwen3, page_size=PAGE, num_pages=40, host_kv_gib=TIER_GIB)
    engine, pool = llm.engine, llm.engine.pool
    prompt = _tokens(random.Random(1), 5 * PAGE + 3)
    first = llm.generate([prompt], GREEDY)[0]
    cached = pool.match_chain(engine.namespace().root_key, _packed(prompt), 5)
    assert len(cached) == 5
    keys, written = pool.keys_of(cached), _page_bytes(engine, cached)
    pool.drain_events()

    _push_out(engine)
    kinds = _kinds(pool.drain_events())
    assert set(keys) <= kinds[EventKind.OFFLOADED]
    assert not set(keys) & kinds.get(EventKind.REMOVED, set())
    assert pool.match_chain(engine.namespace().root_key, _packed(prompt), 5) == []

    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 5 * PAGE  # every full page, from host memory
    assert again.token_ids == first.token_ids
    loaded = pool.match_chain(engine.namespace().root_key, _packed(prompt), 5)
    assert pool.keys_of(loaded) == keys
    for page, before in zip(loaded, written, strict=True):
        assert torch.equal(engine.runner.kv_stack[:, page], before)
    assert set(keys) <= _kinds(pool.drain_events())[EventKind.RELOADED]
    stats = pool.host.stats()
    assert (stats.hits, stats.pages_loaded) == (1, 5)
    size = pool.host.copier.bytes_per_slot
    assert (stats.bytes_written, stats.bytes_loaded) == (stats.pages_written * size, 5 * size)


def test_evictions_batched_in_a_block_are_written_and_reported_together(tiny_qwen3):
    """``KVPool.batching_evictions`` (the scheduler's running requests growing): pages
    evicted within are neither in the host tier nor reported until the block ends,
    then all of them are, in one write."""
    llm = LLM(tiny_qwen3, page_size=PAGE, num_pages=12, host_kv_gib=TIER_GIB)
    pool = llm.engine.pool
    llm.generate([_tokens(random.Random(2), 6 * PAGE + 1)], GREEDY)
    keys = pool.cached_keys()  # the prompt's full pages and the output's
    assert len(keys) >= 6
    pool.drain_events()
    writes = []
    put_pages = pool.host.put_pages
    pool.host.put_pages = lambda pages: writes.append(len(pages)) or put_pages(pages)
    taken = []
    with pool.batching_evictions():
        for _ in range(pool.num_available):
            taken += pool.allocate(1)
        assert not any(pool.host.has_page(k) for k in keys) and not pool.drain_events()
    assert writes == [len(keys)]
    assert all(pool.host.has_page(k) for k in keys)
    assert _kinds(pool.drain_events())[EventKind.OFFLOADED] == set(keys)
    pool.release(taken)


def test_a_snapshot_tells_the_directory_which_keys_sit_in_host_memory(tiny_qwen3):
    """A publisher's resync (its first call is one) carries the tiers: a prefix pushed
    out to host memory is looked up as held, and host-only."""
    from chunkstore import directory as d
    from chunkstore.embedded_directory import EmbeddedChunkDirectory
    from chunkstore.publisher import EventPublisher
    from workers.runtime.cache_mirror import CacheMirror

    llm = LLM(tiny_qwen3, page_size=PAGE, num_pages=40, host_kv_gib=TIER_GIB)
    engine, pool = llm.engine, llm.engine.pool
    prompt = _tokens(random.Random(4), 5 * PAGE + 3)
    llm.generate([prompt], GREEDY)
    keys = pool.keys_of(pool.match_chain(engine.namespace().root_key, _packed(prompt), 5))
    _push_out(engine)
    mirror, directory = CacheMirror(), EmbeddedChunkDirectory(lease_ttl_s=30)
    mirror.absorb(pool.drain_events())
    assert set(mirror.snapshot().host_keys) >= set(keys)
    EventPublisher(directory, "w", 1, mirror.drain, mirror.snapshot).flush()
    held = directory.lookup(keys, [PAGE * (i + 1) for i in range(5)]).holding("w")
    assert held == d.WorkerHolding("w", 5, 5 * PAGE, host_tokens=5 * PAGE)


def _packed(tokens):
    from chunkstore.hashing import pack_tokens

    return pack_tokens(tokens)


def test_exact_reuse_through_host_memory_equals_plain_generation(tiny_qwen3, off):
    """A pool of 24 pages under 12 prompts sharing a system prompt: pages are evicted,
    requests preempted and prefixes loaded back, and every output is plain generation's."""
    rng = random.Random(15)
    small = LLM(
        tiny_qwen3, page_size=PAGE, num_pages=24, max_num_batched_tokens=64,
        host_kv_gib=TIER_GIB,
    )  # fmt: skip
    system = _tokens(rng, 40)
    prompts = [system + _tokens(rng, rng.randint(20, 120)) for _ in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second round finds the first's prefixes in host memory
        outs = small.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in off.generate(prompts, params)]
    stats = small.engine.pool.host.stats()
    assert stats.hits > 0 and stats.pages_loaded > 0 and stats.pages_written > 0
    assert small.engine.pool.num_available == small.engine.pool.num_pages


def test_a_prefix_evicted_and_reloaded_mid_stream_continues_as_plain_generation(tiny_qwen3, off):
    llm = LLM(tiny_qwen3, page_size=PAGE, num_pages=40, host_kv_gib=TIER_GIB)
    engine = llm.engine
    prompt = _tokens(random.Random(3), 3 * PAGE + 5)
    expected = off.generate([prompt], GREEDY)[0].token_ids
    engine.add_request("mid", prompt, GREEDY)
    tokens: list[int] = []
    for step in range(200):
        for out in engine.step():
            tokens += out.new_token_ids
        if step == 6:  # mid-stream: preempted, its pages pushed out to host memory
            assert not engine.overlap and len(tokens) == 7  # no step in flight
            seq = engine.scheduler.running[0]
            engine.scheduler._preempt(seq)  # noqa: SLF001 - what a full pool does
            _push_out(engine)
            assert not engine.pool.match_chain(engine.namespace().root_key, _packed(prompt), 3)
        if not engine.has_unfinished():
            break
    assert tokens == list(expected)
    assert engine.pool.host.stats().hits == 1


def test_an_entry_placed_after_a_reload_equals_one_never_evicted(model_factory):
    model = model_factory("qwen3")
    config = dict(page_size=PAGE, num_pages=60, device="cpu", min_entry_tokens=32)
    tiered = Engine(EngineConfig(str(model), host_kv_gib=TIER_GIB, **config))
    plain = Engine(EngineConfig(str(model), **config))
    rng = np.random.default_rng(7)
    vocab = plain.model_config.vocab_size
    system, question = rng.integers(10, vocab - 1, 23).tolist(), rng.integers(10, vocab - 1, 9)
    docs = [rng.integers(10, vocab - 1, n).tolist() for n in DOCS]
    prompt, spans = _layout(system, docs, question.tolist())
    moved, reordered = _layout(system, docs[::-1], question.tolist())
    for engine in (tiered, plain):
        _run(engine, prompt, spans, APPROX)  # the entries are taken
    keys = [position_free_key(tiered.namespace(), doc) for doc in docs]
    hits = [tiered.pool.entry(key).hits for key in keys]
    tiered.pool.drain_events()
    _push_out(tiered)
    kinds = _kinds(tiered.pool.drain_events())
    assert set(keys) <= kinds[EventKind.OFFLOADED]
    assert all(tiered.pool.entry(key) is None for key in keys)

    got = _run(tiered, moved, reordered, APPROX)
    want = _run(plain, moved, reordered, APPROX)
    assert got[2] == want[2] and got[2].reused_tokens > sum(DOCS) // 2  # placed
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    assert set(keys) <= _kinds(tiered.pool.drain_events())[EventKind.RELOADED]
    assert [tiered.pool.entry(key).hits for key in keys] == [h + 1 for h in hits]


def test_the_directory_view_follows_the_tiers(tiny_qwen3):
    """Applying the pool's events (as the directory and the worker's mirror do) gives
    exactly the keys either tier holds, and the host-only ones among them."""
    llm = LLM(tiny_qwen3, page_size=PAGE, num_pages=24, host_kv_gib=0.0015)  # 12 slots
    pool, rng = llm.engine.pool, random.Random(5)
    keys: set = set()
    host: set = set()
    for _ in range(12):
        prompts = [_tokens(rng, rng.randint(PAGE, 5 * PAGE)) for _ in range(3)]
        if rng.random() < 0.5:
            prompts.append(prompts[0] + _tokens(rng, PAGE))  # some prefixes come back
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
        if rng.random() < 0.5:
            _push_out(llm.engine)
        for event in pool.drain_events():
            apply_event(keys, event, host)
        assert keys == set(pool.cached_keys())
        on_device = {k for k in keys if k in pool._by_key}  # noqa: SLF001
        assert host == keys - on_device
        assert all(pool.host.has_page(k) for k in host)
    assert pool.host.stats().pages_written > 12  # the tier made room too


def test_the_host_tier_makes_room_by_the_device_pools_rule():
    """Pages least recently used first, then the entry of lowest priority (an entry
    loaded again outlives one never used); slots being read are never taken."""
    kv = torch.arange(8 * 2 * 4 * 2, dtype=torch.float32).reshape(1, 8, 2, 4, 1, 2)
    tier = HostTier(PageCopier(kv, 6))
    key = lambda i: bytes([i]) * 32  # noqa: E731
    tier.put_pages([(0, key(1), b"", b"aaaa"), (1, key(2), key(1), b"bbbb")])
    tier.put_entry(key(10), [2, 3], 7, hits=0)
    tier.put_entry(key(11), [4], 3, hits=0)
    tier.load_entry(tier.entry(key(10)), [5, 6])
    tier.put_entry(key(10), [5, 6], 7, hits=1)  # evicted again after one use
    assert torch.equal(kv[:, 5], kv[:, 2]) and torch.equal(kv[:, 6], kv[:, 3])
    dropped = tier.put_pages([(7, key(3), b"", b"cccc")])  # one free slot: nothing dropped
    assert dropped.pages == dropped.entries == []
    with tier.holding([tier.chain(b"", b"aaaa", 1, 1)[0].slot]):
        dropped = tier.put_pages([(6, key(4), b"", b"dddd")])
    assert dropped.pages == [key(2)]  # key(1) is being read: the next least recent goes
    dropped = tier.put_pages([(5, key(5), b"", b"eeee"), (4, key(6), b"", b"ffff")])
    assert dropped.pages == [key(1), key(3)] and dropped.entries == []
    dropped = tier.put_pages([(3, key(7), b"", b"gggg")])
    assert dropped.pages == [key(4)]
    new = [(i, key(20 + i), b"", bytes([65 + i]) * 4) for i in range(4)]
    dropped = tier.put_pages(new)  # the three pages left, then one entry: the unused one
    assert dropped.pages == [key(5), key(6), key(7)] and dropped.entries == [key(11)]
    assert tier.has_entry(key(10))


def test_a_tier_larger_than_the_hosts_memory_is_refused(tiny_qwen3):
    with pytest.raises(ValueError, match="host_kv_gib is 1000000.0 GiB but this host has"):
        host_slots(1e6, 4096)
    with pytest.raises(ValueError, match="host_kv_gib"):
        EngineConfig(str(tiny_qwen3), host_kv_gib=-1)
    with pytest.raises(ValueError, match="holds no KV page"):
        LLM(tiny_qwen3, page_size=PAGE, num_pages=24, host_kv_gib=1e-9)


def test_an_abort_right_after_a_load_loses_nothing(tiny_qwen3, off):
    llm = LLM(tiny_qwen3, page_size=PAGE, num_pages=40, host_kv_gib=TIER_GIB)
    engine = llm.engine
    prompt = _tokens(random.Random(8), 4 * PAGE + 1)
    llm.generate([prompt], GREEDY)
    _push_out(engine)
    engine.add_request("gone", prompt, GREEDY)
    engine.step()  # admitted: its prefix loaded back
    assert engine.pool.host.stats().hits == 1
    assert engine.abort("gone")
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_available == engine.pool.num_pages
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 4 * PAGE
    assert out.token_ids == off.generate([prompt], GREEDY)[0].token_ids


def test_the_copier_moves_more_pages_than_one_batch_to_scattered_slots():
    """Copies stage at most ``COPY_BATCH_PAGES`` on the device at once; pages come back
    byte for byte whatever the batches and the runs of slots."""
    kv = torch.randn(2, 3 * COPY_BATCH_PAGES, 2, 4, 1, 2)
    copier = PageCopier(kv, 3 * COPY_BATCH_PAGES)
    pages = list(range(0, 3 * COPY_BATCH_PAGES, 2)) + [1, 3]
    slots = random.Random(0).sample(range(3 * COPY_BATCH_PAGES), len(pages))
    copier.write(pages, slots)
    before = kv.clone()
    kv.zero_()
    copier.read(slots, pages)
    assert torch.equal(kv[:, pages], before[:, pages])
    untouched = [p for p in range(kv.shape[1]) if p not in pages]
    assert not kv[:, untouched].any()


def test_a_chain_written_tail_first_loads_in_one_copy_a_batch():
    """The pool evicts a sequence's tail before its head, so a chain's slots descend in
    the chain's order: the load still copies each batch's run of slots at once."""
    kv = torch.randn(2, 2 * COPY_BATCH_PAGES, 2, 4, 1, 2)
    copier = PageCopier(kv, 2 * COPY_BATCH_PAGES)
    chain = list(range(COPY_BATCH_PAGES))
    copier.write(chain[::-1], list(range(COPY_BATCH_PAGES)))  # tail first
    assert copier.host_copies == 1
    before = kv[:, chain].clone()
    into = list(range(COPY_BATCH_PAGES, 2 * COPY_BATCH_PAGES))
    copier.read(list(range(COPY_BATCH_PAGES))[::-1], into)  # the chain's order
    assert copier.host_copies == 2
    assert torch.equal(kv[:, into], before)


def test_the_reused_write_policy_writes_what_was_used_again_or_evicted_twice():
    """``engine.host_kv_write: reused``: a page evicted before any later request
    matched it, or an entry never placed, is not written (reported removed); matched or
    placed, or evicted a second time, it is."""
    from workers.engine.kv_pool import KVPool

    kv = torch.arange(4 * 2 * 2, dtype=torch.float32).reshape(1, 4, 2, 1, 1, 2)
    pool = KVPool(4, 1)
    tier = HostTier(PageCopier(kv, 8))
    pool.attach_host(tier, "reused")
    key = lambda i: bytes([i]) * 32  # noqa: E731

    def computed(i: int) -> int:
        [page] = pool.allocate(1)
        pool.publish(page, key(i), bytes([i]) * 4, b"")
        pool.release([page])
        return page

    def push_out() -> None:
        pool.release(pool.allocate(pool.num_available))

    matched = computed(1)
    computed(2)
    pool.acquire([matched])  # a later request matched page 1
    pool.release([matched])
    pool.drain_events()
    push_out()
    assert tier.has_page(key(1)) and not tier.has_page(key(2))
    kinds = _kinds(pool.drain_events())
    assert kinds[EventKind.OFFLOADED] == {key(1)} and kinds[EventKind.REMOVED] == {key(2)}
    computed(2)  # seen again, computed again: its second eviction writes it
    push_out()
    assert tier.has_page(key(2)) and tier.stats().pages_written == 2
    # a page's mark goes with its key: the page given out again, under a key never
    # matched, is evicted unwritten (a pool of one page gives out the same page)
    solo, solo_tier = KVPool(1, 1), HostTier(PageCopier(kv, 8))
    solo.attach_host(solo_tier, "reused")
    [first] = solo.allocate(1)
    solo.publish(first, key(3), bytes([3]) * 4, b"")
    solo.release([first])
    solo.acquire([first])  # matched
    solo.release([first])
    [second] = solo.allocate(1)  # evicts key 3: written
    solo.publish(second, key(4), bytes([4]) * 4, b"")
    solo.release([second])
    solo.release(solo.allocate(1))  # evicts key 4, never matched
    assert solo_tier.has_page(key(3)) and not solo_tier.has_page(key(4))
    # a key loaded back from the tier and evicted again is only made recent there
    written = tier.stats().pages_written
    [loaded] = pool.load_chain(b"", bytes([1]) * 4, 1)
    pool.release([loaded])
    push_out()
    assert tier.has_page(key(1)) and tier.stats().pages_written == written

    for k, placed in ((10, True), (11, False)):
        pages = pool.allocate(1)
        pool.store_entry(key(k), pages, 1)
        if placed:
            pool.note_hit(pool.find_entry(key(k)))
    push_out()
    assert tier.has_entry(key(10)) and not tier.has_entry(key(11))
    with pytest.raises(ValueError, match="write policy"):
        KVPool(4, 1).attach_host(tier, "sometimes")


def test_reused_writes_keep_exact_reuse_through_host_memory_equal_to_plain_generation(
    tiny_qwen3, off
):
    """The policy through the engine: a prompt used twice (matched once) is written at
    its eviction and its later run, loaded back, equals plain generation; a prompt seen
    once writes nothing."""
    rng = random.Random(7)
    used_twice, once = _tokens(rng, 5 * PAGE + 3), _tokens(rng, 4 * PAGE + 5)
    written = {}
    for policy in ("all", "reused"):
        llm = LLM(tiny_qwen3, page_size=PAGE, host_kv_gib=TIER_GIB, host_kv_write=policy)
        llm.generate([used_twice], GREEDY)
        llm.generate([used_twice], GREEDY)
        llm.generate([once], GREEDY)
        _push_out(llm.engine)
        written[policy] = llm.engine.pool.host.stats().pages_written
        again = llm.generate([used_twice], GREEDY)[0]
        assert llm.engine.pool.host.stats().pages_loaded >= 5
        assert list(again.token_ids) == list(off.generate([used_twice], GREEDY)[0].token_ids)
    # "all" also wrote the other prompt's pages (4 full ones, and its output's)
    assert 5 <= written["reused"] <= written["all"] - 4, written


def test_the_entry_reserve_defaults_to_0_beside_a_host_tier(tiny_qwen3):
    """Without a tier, proven entries keep half the pool against new requests; with
    one, an evicted entry comes back from host memory, so by default they keep none; a
    reserve given is kept either way."""
    config = dict(model_dir=str(tiny_qwen3), page_size=PAGE, num_pages=40, device="cpu")
    reserved = {
        (tier, reserve): Engine(
            EngineConfig(**config, host_kv_gib=tier, entry_reserve=reserve)
        ).pool.entry_reserve_pages
        for tier in (0.0, TIER_GIB)
        for reserve in (None, 0.25)
    }
    assert reserved == {(0.0, None): 20, (TIER_GIB, None): 0, (0.0, 0.25): 10, (TIER_GIB, 0.25): 10}
