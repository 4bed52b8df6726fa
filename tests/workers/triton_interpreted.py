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
    from workers.engine.layers import skinny_kernel

    monkeypatch.setattr(skinny_kernel, "sm_count", lambda device: 132)  # an H200's


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_skinny_matmul(gated, rows):
    from workers.engine.layers.skinny_choice import Tiles, float32_product
    from workers.engine.layers.skinny_kernel import skinny_matmul

    gen = torch.Generator().manual_seed(rows)
    n, k = 40, 600  # neither divides the tiles
    x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
    w = (torch.randn((2 * n if gated else n, k), generator=gen) * 0.05).to(torch.bfloat16)
    want = float32_product(x, w, gated)
    for tiles in (None, Tiles(8, 128, 1, 4), Tiles(4, 256, 3, 4)):
        got = skinny_matmul(x, w, gated=gated, tiles=tiles)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=2**-7 * want.abs().max())


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_norm_rope_write_kv(qk_norm):
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
        qkv, heads, kv_heads, positions, table, got_cache, rows, q_weight, k_weight, 1e-6
    )
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)  # nothing else


def test_placement_rows():
    from workers.engine.layers.placement_kernel import place_rows
    from workers.engine.layers.rotary import cos_sin_cache
    from workers.engine.placement import _place_stacked

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


def test_gumbel_argmax():
    from workers.engine.layers.sample_kernel import SPAN, gumbel_argmax

    vocab = SPAN + 300  # two spans, the second partial
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn((4, vocab), generator=gen) * 4
    logits[1, 10] = logits[1, SPAN + 5] = 1e4  # a tie across spans: the first wins
    logits[2, 20] = logits[2, 21] = 1e4  # a tie inside a block
    greedy = gumbel_argmax(logits, torch.zeros(4), seed=1)
    assert greedy.tolist() == logits.argmax(dim=-1).tolist()
    assert greedy[1].item() == 10 and greedy[2].item() == 20
    support = torch.full((2, vocab), float("-inf"))
    support[:, [3, SPAN + 7]] = torch.tensor([0.0, 0.5])
    draws = {gumbel_argmax(support, torch.ones(2), seed=s)[0].item() for s in range(40)}
    assert draws == {3, SPAN + 7}  # both drawn, nothing outside the support
