"""The Triton kernels on the CPU, under Triton's interpreter (``TRITON_INTERPRET=1``,
set before Triton is imported: run by ``test_triton_interpreted.py`` in a process of
its own): each kernel against the torch path it replaces, at small shapes. These check
indexing, masking and the math; speed and the compiled code need a GPU (tests/gpu)."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_interpreted.py"


@pytest.fixture(autouse=True)
def _sm_count(monkeypatch):
    from workers.engine import device_properties

    monkeypatch.setattr(device_properties, "sm_count", lambda device: 132)  # an H200's


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_skinny_matmul(gated, rows):
    from workers.engine.layers.skinny_choice import float32_product
    from workers.engine.layers.skinny_kernel import skinny_matmul
    from workers.engine.layers.tiles import Tiles

    gen = torch.Generator().manual_seed(rows)
    n, k = 40, 600  # neither divides the tiles
    x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
    w = (torch.randn((2 * n if gated else n, k), generator=gen) * 0.05).to(torch.bfloat16)
    want = float32_product(x, w, gated)
    for tiles in (None, Tiles(8, 128, 1, 4), Tiles(4, 256, 3, 4)):
        got = skinny_matmul(x, w, gated=gated, tiles=tiles)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max())


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_skinny_norm_matmul(gated, with_residual):
    from workers.engine.layers.skinny_choice import float32_product, normed
    from workers.engine.layers.skinny_kernel import skinny_norm_matmul
    from workers.engine.layers.tiles import Tiles

    gen = torch.Generator().manual_seed(7)
    n, k, rows = 40, 600, 2
    x = (torch.randn((rows, k), generator=gen) * 3).to(torch.bfloat16)
    residual = torch.randn((rows, k), generator=gen).to(torch.bfloat16) if with_residual else None
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
    w = (torch.randn((2 * n if gated else n, k), generator=gen) * 0.05).to(torch.bfloat16)
    h, want_residual = normed(x, residual, norm_w, 1e-6)
    want = float32_product(h, w, gated)
    before = (x.clone(), None if residual is None else residual.clone())
    for tiles in (Tiles(4, 256, 1, 4), Tiles(8, 128, 3, 2)):  # K in 3 loads; split K
        got, new_residual = skinny_norm_matmul(
            x, residual, norm_w, 1e-6, w, gated=gated, tiles=tiles
        )
        torch.testing.assert_close(got.float(), want, rtol=2**-6, atol=2**-6 * want.abs().max())
        # the interpreter truncates to bf16 where the GPU rounds: one unit in the last place
        torch.testing.assert_close(new_residual, want_residual, rtol=2**-7, atol=0)
        assert torch.equal(x, before[0]) and (residual is None or torch.equal(residual, before[1]))


@pytest.mark.parametrize("block", [None, 4], ids=["a-token-a-program", "blocks-of-4"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_norm_rope_write_kv(qk_norm, block):
    from workers.engine.attention.base import kv_write_rows, write_kv
    from workers.engine.layers.ops import apply_rope, rms_norm
    from workers.engine.layers.qkv_kernel import qk_norm_rope_write_kv
    from workers.engine.layers.rotary import cos_sin_cache

    heads, kv_heads, dim, page, pages, tokens = 4, 2, 16, 4, 8, 5
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * dim), generator=gen) * 3
    q_weight = torch.rand(dim, generator=gen) + 0.5 if qk_norm else None
    k_weight = torch.rand(dim, generator=gen) + 0.5 if qk_norm else None
    positions = torch.randint(0, 200, (tokens,), generator=gen)
    table = cos_sin_cache(dim, 10000.0, None, 256)
    cache = torch.randn((pages, 2, page, kv_heads, dim), generator=gen)
    slots = torch.randperm(pages * page, generator=gen)[:tokens]
    rows = kv_write_rows(slots.int(), page)

    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)
    if qk_norm:
        q, k = rms_norm(q, q_weight, 1e-6, fused=False), rms_norm(k, k_weight, 1e-6, False)
    want_q, want_k = apply_rope(q, k, positions, table, fused=False)
    want_cache = cache.clone()
    write_kv(want_cache, want_k, v.reshape(tokens, kv_heads, dim), rows)

    got_cache = cache.clone()
    got_q = qk_norm_rope_write_kv(
        qkv,
        heads,
        kv_heads,
        positions,
        table,
        got_cache,
        rows,
        q_weight,
        k_weight,
        1e-6,
        block_tokens=block,  # 5 tokens in blocks of 4: the last block is part empty
    )
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)  # nothing else


def test_placement_rows():
    from workers.engine.approximate.placement import _place_stacked
    from workers.engine.layers.placement_kernel import place_rows
    from workers.engine.layers.rotary import cos_sin_cache

    layers, pages, page, heads, dim, n = 2, 16, 4, 2, 16, 20
    gen = torch.Generator().manual_seed(2)
    stack = torch.randn((layers, pages, 2, page, heads, dim), generator=gen)
    table = cos_sin_cache(dim, 10000.0, None, 512)
    slots = torch.randperm(pages * page, generator=gen)
    src, dst = slots[:n], slots[n : 2 * n]  # disjoint, unaligned, scattered
    delta = torch.randint(-100, 300, (n,), generator=gen)
    want = stack.clone()
    _place_stacked(want, src, dst, delta, table, page)
    got = stack.clone()
    place_rows(got, src, dst, delta, table)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("span", [1024, 4096])
def test_gumbel_argmax(span):
    from workers.engine.layers.sample_kernel import gumbel_argmax

    vocab = 2 * span + 300  # three spans, the last partial
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn((4, vocab), generator=gen) * 4
    logits[1, 10] = logits[1, span + 5] = 1e4  # a tie across spans: the first wins
    logits[2, 20] = logits[2, 21] = 1e4  # a tie inside a block
    greedy = gumbel_argmax(logits, torch.zeros(4), seed=1, span=span)
    assert greedy.tolist() == logits.argmax(dim=-1).tolist()
    assert greedy[1].item() == 10 and greedy[2].item() == 20
    support = torch.full((2, vocab), float("-inf"))
    support[:, [3, span + 7]] = torch.tensor([0.0, 0.5])
    draws = [gumbel_argmax(support, torch.ones(2), seed=s, span=span)[0].item() for s in range(40)]
    assert set(draws) == {3, span + 7}  # both drawn, nothing outside the support
    # the noise is keyed by the token's index: the span does not change a draw
    assert draws == [gumbel_argmax(support, torch.ones(2), seed=s)[0].item() for s in range(40)]


def test_a_one_row_step_through_every_skinny_path_matches_the_plain_path(tiny_qwen3):
    """The last prompt token alone (a one-row step over the cached prefix) with every
    projection through the kernel, the norms fused into QKV and gate-up, against the
    plain path: the logits agree (float32 weights: to float32 rounding)."""
    import random

    from tests.workers.reference import prefill_hidden
    from workers import LLM
    from workers.engine.layers.skinny_choice import KINDS
    from workers.engine.layers.tiles import Tiles

    llm = LLM(tiny_qwen3)
    model = llm.engine.runner.model
    prompt = random.Random(3).choices(range(10, 200), k=40)

    def last_logits() -> torch.Tensor:
        hidden = prefill_hidden(llm, prompt, [len(prompt) - 1, 1])
        with torch.inference_mode():
            return model.compute_logits(hidden[-1:])[0]

    plain = last_logits()
    model.use_skinny(dict.fromkeys(KINDS, Tiles(4, 32, 1, 4)))  # K in several loads
    try:
        skinny = last_logits()
    finally:
        model.use_skinny({})
    torch.testing.assert_close(skinny, plain, rtol=1e-4, atol=1e-4 * plain.abs().max().item())
    assert not torch.equal(skinny, plain)  # a different float32 sum order: it ran


# 12 heads: padded in merging; 3 heads a KV head and a 48-dim head: padded tiles
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (12, 6, 32), (6, 2, 48)])
def test_scattered_attention_matches_attention_by_position(heads, kv_heads, head_dim):
    """Queries at scattered positions (a partial last block, a walk over many key
    blocks, GQA, a shuffled page table) against the torch path the CPU runs. In
    float32: the interpreter's ``tl.dot`` of bfloat16 operands returns garbage
    (tests/gpu/test_scattered_attention.py checks bfloat16 on the GPU)."""
    dtype = torch.float32
    from workers.engine.attention.base import AttentionShape
    from workers.engine.attention.scattered import ScatteredAttention, attend_by_position
    from workers.engine.layers.scattered_kernel import scattered_attention

    gen = torch.Generator().manual_seed(5)
    page_size, kv_len = 4, 45
    shape = AttentionShape(heads, kv_heads, head_dim, page_size, dtype, torch.device("cpu"))
    num_pages = 20
    cache = torch.randn((num_pages, 2, page_size, kv_heads, head_dim), generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: -(-kv_len // page_size)].to(torch.int32)
    positions = torch.tensor([0, 3, 4, 9, 17, 18, 30, 41, 42, 43, 44])
    q = torch.randn((len(positions), heads, head_dim), generator=gen).to(dtype)
    attention = ScatteredAttention(shape, use_kernel=False)
    slots = torch.zeros(len(positions), dtype=torch.int64)  # unused by attend
    want = attend_by_position(q, cache, attention.metadata(positions, slots, table, kv_len), shape)
    # one split and several (each a key block, or two; some past a block's queries)
    for block_m, block_n, split in ((4, 8, 8), (8, 16, 32), (16, 16, 64)):
        knobs = dict(block_m=block_m, block_n=block_n, split=split)
        got = scattered_attention(q, cache, positions, table, shape.scale, kv_len, **knobs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the defaults (tile rows by the group, splits by the KV and the workspace)
    got = scattered_attention(q, cache, positions, table, shape.scale, kv_len)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_scattered_attention_over_several_sequences_in_one_launch():
    """Three sequences' queries (one shorter than a block, one spanning blocks, one
    alone in its block) with tables of their own, joined: one launch gives each query
    what it gets attending over its own sequence alone."""
    from workers.engine.layers.scattered_kernel import SequenceBlocks, scattered_attention

    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, head_dim, page_size, num_pages = 4, 2, 32, 4, 40
    cache = torch.randn((num_pages, 2, page_size, kv_heads, head_dim), generator=gen)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    sequences = [  # (KV length, query positions)
        (13, [2, 7, 12]),
        (45, [0, 3, 4, 9, 17, 18, 30, 41, 42, 43, 44]),
        (30, [29]),
    ]
    tables, positions, segments, used, row = [], [], [], 0, 0
    for kv_len, at in sequences:
        pages = -(-kv_len // page_size)
        tables.append(order[used : used + pages])
        segments.append((row, row + len(at), sum(len(t) for t in tables[:-1])))
        positions += at
        used, row = used + pages, row + len(at)
    q = torch.randn((row, heads, head_dim), generator=gen)
    positions = torch.tensor(positions)
    scale = head_dim**-0.5
    want = torch.cat([
        scattered_attention(q[a:b], cache, positions[a:b], table, scale, kv_len)
        for (a, b, _), table, (kv_len, _) in zip(segments, tables, sequences, strict=True)
    ])  # fmt: skip
    for block_m in (2, 4, 16):
        blocks = SequenceBlocks.build(segments, block_m, torch.device("cpu"))
        got = scattered_attention(
            q, cache, positions, torch.cat(tables), scale, 45, block_n=8, sequences=blocks
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # through ScatteredAttention's batch metadata: the kernel's one launch and plain
    # torch's sequence at a time agree
    from workers.engine.attention.base import AttentionShape
    from workers.engine.attention.scattered import ScatteredAttention

    shape = AttentionShape(heads, kv_heads, head_dim, page_size, q.dtype, torch.device("cpu"))
    slots = torch.arange(row, dtype=torch.int64)  # unused by attend
    ends = [(a, b, t, t + len(table), kv_len) for (a, b, t), table, (kv_len, _) in zip(
        segments, tables, sequences, strict=True)]  # fmt: skip
    joined = torch.cat(tables)
    outs = []
    for use_kernel in (True, False):
        attention = ScatteredAttention(shape, use_kernel=use_kernel)
        metadata = attention.batch_metadata(positions, slots, joined, ends)
        outs.append(attention.attend(q, cache, metadata))
    torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], want, rtol=1e-5, atol=1e-5)
