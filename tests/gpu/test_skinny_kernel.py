"""The skinny-matmul kernel equals a float32 matmul rounded once, with and without the
fused gate, split K or not, for every row count it takes and shapes that do not
divide its tiles; with the norm fused, it equals FlashInfer's norm then the product
to bf16 rounding;
wider inputs are refused; the engine's choice and a one-row step through it."""

from __future__ import annotations

import pytest
import torch

from workers.engine.layers.skinny_choice import float32_product as reference


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (1000, 1000)])
def test_skinny_matmul_equals_float32_product(gated, rows, n, k):
    from workers.engine.layers.skinny_kernel import default_tiles, skinny_matmul
    from workers.engine.layers.tiles import Tiles

    gen = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = torch.randn((rows, k), generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn((2 * n if gated else n, k), generator=gen, device="cuda") * 0.05).to(
        torch.bfloat16
    )
    ref = reference(x, w, gated)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for tiles in (None, Tiles(4, 256, 1, 4), Tiles(8, 512, 4, 8), default_tiles(n, k, 4, sms)):
        out = skinny_matmul(x, w, gated=gated, tiles=tiles)
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        # float32 sums in another order, one rounding to bf16 (relative 2^-8)
        torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max())


@pytest.mark.parametrize("gated", [False, True], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["first-layer", "add"])
def test_the_fused_norm_equals_flashinfers(gated, with_residual):
    """norm(x + residual) fused into the kernel: the residual FlashInfer's
    fused_add_rmsnorm writes, bit for bit, and the product of its normed rows (to
    bf16 rounding: FlashInfer normalizes the unrounded sum)."""
    from workers.engine.layers.ops import add_rms_norm, rms_norm
    from workers.engine.layers.skinny_kernel import skinny_norm_matmul

    gen = torch.Generator(device="cuda").manual_seed(5)
    k, n = 1024, 3072 if gated else 4096
    x = (torch.randn((1, k), generator=gen, device="cuda") * 4).to(torch.bfloat16)
    residual = torch.randn((1, k), generator=gen, device="cuda").to(torch.bfloat16)
    norm_w = (torch.rand(k, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
    w = (torch.randn((2 * n if gated else n, k), generator=gen, device="cuda") * 0.05).to(
        torch.bfloat16
    )
    if with_residual:
        h, want_residual = add_rms_norm(x.clone(), residual.clone(), norm_w, 1e-6, fused=True)
    else:
        h, want_residual = rms_norm(x, norm_w, 1e-6, fused=True), x
    ref = reference(h, w, gated)
    out, new_residual = skinny_norm_matmul(
        x, residual if with_residual else None, norm_w, 1e-6, w, gated=gated
    )
    if with_residual:
        assert torch.equal(new_residual, want_residual)
    else:
        assert new_residual is x  # the first layer's residual is its input itself
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max())


def test_strided_rows_and_refusals():
    from workers.engine.layers.skinny_kernel import skinny_matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    wide = torch.randn((3, 2048), generator=gen, device="cuda").to(torch.bfloat16)
    x = wide[:, :1024]  # rows 2048 apart, as a view of a wider activation
    w = torch.randn((512, 1024), generator=gen, device="cuda").to(torch.bfloat16)
    ref = reference(x, w, False)
    torch.testing.assert_close(
        skinny_matmul(x, w).float(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max()
    )
    with pytest.raises(ValueError, match="1 to 4 rows"):
        skinny_matmul(torch.zeros((5, 1024), device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_matmul(x, w.T.contiguous().T)


def test_the_engine_measures_every_projection_and_keeps_what_it_chose(qwen3_06b):
    from workers import LLM
    from workers.engine.layers.skinny_choice import KINDS, MIN_GAIN

    llm = LLM(qwen3_06b, page_size=16, num_pages=512)
    choice = llm.engine.runner.skinny
    assert choice.error == "" and [t.kind for t in choice.timings] == list(KINDS)
    for t in choice.timings:
        assert t.skinny_us is not None, t.note  # the kernel builds and matches cuBLAS
        assert t.tiles is not None
        assert (t.kind in choice.chosen) == (t.cublas_us >= MIN_GAIN * t.skinny_us)
        if t.kind in choice.chosen:
            assert choice.chosen[t.kind] == t.tiles
    model = llm.engine.runner.model
    flags = [dict(m.skinny) for m in model.modules() if hasattr(m, "skinny")]
    assert flags and all(f == choice.chosen for f in flags)
    off = LLM(qwen3_06b, page_size=16, num_pages=512, skinny_matmul=False)
    assert off.engine.runner.skinny.error == "off in the engine config"


def test_one_row_steps_through_the_kernel_match_cublas(qwen3_06b):
    """The last prompt token alone (a one-row step over the cached prefix), every
    projection through the kernel against none: logits within bf16 noise."""
    import random

    from tests.workers.reference import prefill_hidden
    from workers import LLM
    from workers.engine.layers.skinny_choice import KINDS
    from workers.engine.layers.tiles import Tiles

    llm = LLM(qwen3_06b, page_size=16, num_pages=512, skinny_matmul=False)
    model = llm.engine.runner.model
    prompt = random.Random(3).choices(range(10, 1000), k=300)

    def last_logits() -> torch.Tensor:
        hidden = prefill_hidden(llm, prompt, [len(prompt) - 1, 1])
        with torch.inference_mode():
            return model.compute_logits(hidden[-1:])[0].float()

    plain = last_logits()
    tiles = Tiles(block_n=4, block_k=1024, split_k=1, num_warps=4)
    model.use_skinny(dict.fromkeys(KINDS, tiles))
    try:
        skinny = last_logits()
    finally:
        model.use_skinny({})
    assert ((skinny - plain).norm() / plain.norm()).item() < 0.02
    assert not torch.equal(skinny, plain)  # other float32 sums: the kernel ran
