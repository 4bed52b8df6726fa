"""The scattered-query attention kernel on the GPU against the torch path, at
qwen3-0.6b's heads: an approximate request's rows after its selection layer."""

from __future__ import annotations

import pytest
import torch

from workers.engine.attention.base import AttentionShape
from workers.engine.attention.scattered import ScatteredAttention, attend_by_position
from workers.engine.layers.scattered_kernel import scattered_attention


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_queries", [1, 515])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(16, 8, 128), (32, 8, 128), (40, 8, 128), (24, 8, 64), (16, 4, 256)],
)
def test_scattered_attention_equals_the_torch_path(dtype, num_queries, heads, kv_heads, head_dim):
    """qwen3-0.6b's heads; groups of 4 and 5 (padded tiles, Qwen3-14B's shape);
    64- and 256-dim heads."""
    gen = torch.Generator(device="cuda").manual_seed(num_queries)
    page_size, kv_len = 16, 4383
    device = torch.device("cuda")
    shape = AttentionShape(heads, kv_heads, head_dim, page_size, dtype, device)
    num_pages = 400
    cache = torch.randn(
        (num_pages, 2, page_size, kv_heads, head_dim), generator=gen, device=device
    ).to(dtype)
    table = torch.randperm(num_pages, generator=gen, device=device)[: -(-kv_len // page_size)]
    table = table.to(torch.int32)
    # a system prompt's run first, repairs scattered after it, a question's run last
    head = torch.arange(min(num_queries - 1, 256), device=device)  # one query: the last
    tail = torch.arange(kv_len - min(num_queries - len(head), 32), kv_len, device=device)
    middle = torch.randperm(kv_len - 288, generator=gen, device=device) + 256
    spread = middle[: num_queries - len(head) - len(tail)]
    positions = torch.cat((head, spread, tail)).sort().values
    q = torch.randn((num_queries, heads, head_dim), generator=gen, device=device).to(dtype)
    metadata = ScatteredAttention(shape, use_kernel=False).metadata(
        positions, positions, table, kv_len
    )
    want = attend_by_position(q, cache, metadata, shape).float()
    got = scattered_attention(q, cache, positions, table, shape.scale, kv_len).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # the engine's route: the kernel through ScatteredAttention, with its defaults
    routed = ScatteredAttention(shape, use_kernel=True).attend(q, cache, metadata)
    assert torch.equal(routed.float(), got)
