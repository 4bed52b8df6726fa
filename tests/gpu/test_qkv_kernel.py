"""The fused QK-norm + RoPE + KV-write kernel equals the unfused FlashInfer path."""

from __future__ import annotations

import pytest
import torch

from workers.engine.attention.base import kv_write_rows, write_kv
from workers.engine.layers.ops import apply_rope, rms_norm
from workers.engine.layers.rotary import cos_sin_cache

H, KH, D, PAGE, PAGES = 16, 8, 128, 16, 512


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("tokens", [1, 37, 1000])
def test_fused_qkv_step_equals_unfused(qk_norm, tokens):
    from workers.engine.layers.qkv_kernel import qk_norm_rope_write_kv  # Triton: CUDA hosts

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dev, dtype = "cuda", torch.bfloat16
    qkv = torch.randn((tokens, (H + 2 * KH) * D), generator=gen, device=dev).to(dtype) * 3
    q_weight = (torch.rand(D, generator=gen, device=dev) + 0.5).to(dtype) if qk_norm else None
    k_weight = (torch.rand(D, generator=gen, device=dev) + 0.5).to(dtype) if qk_norm else None
    positions = torch.randint(0, 4000, (tokens,), generator=gen, device=dev)
    table = cos_sin_cache(D, 1e6, None, 4096).to(dev)
    cache = torch.randn((PAGES, 2, PAGE, KH, D), generator=gen, device=dev).to(dtype)
    slots = torch.randperm(PAGES * PAGE, generator=gen, device=dev)[:tokens]
    rows = kv_write_rows(slots.cpu().int(), PAGE).to(dev)

    # the unfused path rotates in place, and for one token its views of the projection
    # are contiguous, so it would rotate ``qkv`` itself: give it a copy
    q, k, v = qkv.clone().split([H * D, KH * D, KH * D], dim=-1)
    q, k, v = q.view(tokens, H, D), k.view(tokens, KH, D), v.view(tokens, KH, D)
    if qk_norm:
        q, k = rms_norm(q, q_weight, 1e-6, fused=True), rms_norm(k, k_weight, 1e-6, fused=True)
    want_q, want_k = apply_rope(q, k, positions, table, fused=True)
    want_cache = cache.clone()
    write_kv(want_cache, want_k, v, rows)

    got_cache = cache.clone()
    got_q = qk_norm_rope_write_kv(
        qkv, H, KH, positions, table, got_cache, rows, q_weight, k_weight, 1e-6
    )
    torch.cuda.synchronize()
    flat = lambda c: c.view(-1, KH * D)  # noqa: E731
    written = torch.zeros(flat(cache).shape[0], dtype=torch.bool, device=dev)
    written[rows] = True
    assert torch.equal(flat(got_cache)[~written], flat(cache)[~written])  # nothing else
    value_rows = rows[tokens:]
    assert torch.equal(flat(got_cache)[value_rows], flat(want_cache)[value_rows])
    # queries and keys: the same float32 math in another order, so a normed value may
    # round to the neighbouring bf16 (one ulp of the inputs, magnitude up to ~4 here)
    # before the rotation; most elements are identical
    keys = (flat(got_cache)[rows[:tokens]], flat(want_cache)[rows[:tokens]])
    for got, want in ((got_q, want_q), keys):
        got, want = got.float().flatten(), want.float().flatten()
        ulp = torch.finfo(dtype).eps * want.abs().clamp_min(4.0)
        assert ((got - want).abs() <= 2 * ulp).all(), (got - want).abs().max()
        assert (got != want).float().mean() < 0.05
