"""The host-memory KV tier on a GPU (pinned memory, the copy stream): a prefix pushed
out to host memory and loaded back serves exactly as the same prefix hit in device
memory, and its pages come back byte for byte."""

from __future__ import annotations

import torch

from chunkstore.hashing import pack_tokens
from tests.gpu.test_engine_gpu import _prompts
from tests.workers.test_host_tier import _push_out
from workers import LLM, SamplingParams


def test_a_prefix_loaded_back_from_host_memory_serves_as_a_device_hit(qwen3_06b):
    """One prompt at a time, so a device hit and a host hit run the same batch shapes
    (in bf16, another batch composition alone may flip a greedy token); the host hit's
    request waits out of the steps until its load lands (``KVPool.loading``)."""
    llm = LLM(qwen3_06b, page_size=16, num_pages=1024, host_kv_gib=1.0)
    engine, pool = llm.engine, llm.engine.pool
    prompts = _prompts(8, 200, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params)
    hit = [llm.generate([prompt], params)[0] for prompt in prompts]  # from device memory
    root = engine.namespace().root_key
    pages = pool.match_chain(root, pack_tokens(prompts[0]), len(prompts[0]) // 16)
    written = [engine.runner.kv_stack[:, p].clone() for p in pages]

    _push_out(engine)
    assert pool.match_chain(root, pack_tokens(prompts[0]), len(pages)) == []
    loaded = [llm.generate([prompt], params)[0] for prompt in prompts]  # from host memory
    assert [o.num_cached_tokens for o in loaded] == [o.num_cached_tokens for o in hit]
    assert [o.token_ids for o in loaded] == [o.token_ids for o in hit]
    back = pool.match_chain(root, pack_tokens(prompts[0]), len(pages))
    assert len(back) == len(pages)
    for page, before in zip(back, written, strict=True):
        assert torch.equal(engine.runner.kv_stack[:, page], before)
    stats = pool.host.stats()
    assert stats.hits >= 8 and stats.load_s > 0


def test_evictions_beyond_the_staging_bound_are_dropped_not_waited_for():
    """One eviction of three copies' worth through a staging bound of one: the first
    copy's pages are written and come back byte for byte, the rest are dropped and
    counted, and once the copy ends the bound is free again."""
    from chunkstore.hashing import PageKey
    from workers.engine.host_tier import COPY_BATCH_PAGES, HostTier, PageCopier

    pages = 3 * COPY_BATCH_PAGES
    kv = torch.randn(2, pages + 8, 2, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    copier = PageCopier(kv, pages, staging_bytes=1)  # the floor: one copy's worth
    tier = HostTier(copier)
    keys = [PageKey(i.to_bytes(16, "big")) for i in range(pages)]
    root = PageKey(b"root")
    parents = [root, *keys[:-1]]  # one chain, each page of the same 16 tokens
    evicted = [(p, keys[p], parents[p], bytes(4 * 16)) for p in range(pages)]
    before = kv.clone()
    tier.put_pages(evicted)
    kept = [k for k in keys if tier.has_page(k)]
    assert kept == keys[:COPY_BATCH_PAGES]
    stats = tier.stats()
    assert (stats.pages_written, stats.pages_skipped) == (
        COPY_BATCH_PAGES,
        pages - COPY_BATCH_PAGES,
    )
    torch.cuda.synchronize()
    assert copier.writable() == COPY_BATCH_PAGES
    kv.zero_()
    found = tier.chain(root, bytes(4 * 16 * pages), 16, pages)
    assert [page.key for page in found] == kept
    tier.load_pages(found, list(range(COPY_BATCH_PAGES)))
    torch.cuda.synchronize()
    assert torch.equal(kv[:, :COPY_BATCH_PAGES], before[:, :COPY_BATCH_PAGES])


def test_a_prefix_loads_while_another_request_steps(qwen3_06b):
    """Admitted beside another request, a host hit's prefix loads while the other steps
    (its request waits out of the steps until the load lands), and the pages come back
    byte for byte."""
    llm = LLM(qwen3_06b, page_size=16, num_pages=1024, host_kv_gib=1.0)
    engine, pool = llm.engine, llm.engine.pool
    (other,), (prompt,) = _prompts(1, 200, seed=6), _prompts(1, 200, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)
    root = engine.namespace().root_key
    pages = pool.match_chain(root, pack_tokens(prompt), len(prompt) // 16)
    written = [engine.runner.kv_stack[:, p].clone() for p in pages]
    _push_out(engine)
    loads = pool.host.stats().hits
    both = llm.generate([other, prompt], params)  # ``other`` is admitted first: a miss
    assert pool.host.stats().hits == loads + 1
    cached = min(len(pages), (len(prompt) - 1) // 16) * 16  # one token is computed
    assert (both[0].num_cached_tokens, both[1].num_cached_tokens) == (0, cached)
    back = pool.match_chain(root, pack_tokens(prompt), len(pages))
    for page, before in zip(back, written, strict=True):
        assert torch.equal(engine.runner.kv_stack[:, page], before)
