"""The fused placement kernel equals the torch placement path on the GPU."""

from __future__ import annotations

import pytest
import torch

from workers.engine.approximate.placement import _place_stacked, place_chunk
from workers.engine.layers.rotary import cos_sin_cache


@pytest.mark.parametrize(
    ("dtype", "heads", "head_dim", "page_size"),
    [(torch.bfloat16, 8, 128, 16), (torch.float32, 2, 16, 4), (torch.float16, 4, 64, 8)],
)
def test_fused_placement_equals_torch_path(dtype, heads, head_dim, page_size):
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, pages, n = 3, 128, 200
    stack = torch.randn(
        (layers, pages, 2, page_size, heads, head_dim), generator=gen, device="cuda"
    ).to(dtype)
    table = cos_sin_cache(head_dim, 10000.0, None, 4096).cuda()
    slots = torch.randperm(pages * page_size, generator=gen, device="cuda")
    src, dst = slots[:n], slots[n : 2 * n]  # disjoint, unaligned, scattered
    delta = torch.randint(-1000, 4000, (n,), generator=gen, device="cuda")
    expected = stack.clone()
    _place_stacked(expected, src, dst, delta, table, page_size)
    fused = stack.clone()
    place_chunk(fused, src, dst, delta, table, page_size, disjoint=True)
    torch.cuda.synchronize()
    untouched = torch.ones(pages * page_size, dtype=torch.bool, device="cuda")
    untouched[dst] = False
    flat = lambda t: t.transpose(2, 3).reshape(layers, pages * page_size, 2, -1)  # noqa: E731
    assert torch.equal(flat(fused)[:, untouched], flat(stack)[:, untouched])
    # values bit for bit; keys to one rounding of the cache dtype (FMA contraction)
    assert torch.equal(flat(fused)[:, dst, 1], flat(expected)[:, dst, 1])
    keys, want = flat(fused)[:, dst, 0].float(), flat(expected)[:, dst, 0].float()
    ulp = torch.finfo(dtype).eps * want.abs().clamp_min(1.0)
    assert ((keys - want).abs() <= ulp).all()
    if dtype != torch.float32:  # float32 keeps the last-bit differences of FMA
        assert (keys != want).float().mean() < 0.01
