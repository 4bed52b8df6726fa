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
