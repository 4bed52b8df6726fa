"""The skinny-matmul choice (layers/skinny_choice): a projection takes the kernel only
where it measured faster by the margin and matched cuBLAS; models and engines that
cannot use it say why; the flags it sets leave wider inputs on the plain path. (The
kernel itself and the measurement need CUDA: tests/gpu/test_skinny_kernel.py.)"""

from __future__ import annotations

import torch

from workers import LLM
from workers.engine.layers.skinny_choice import (
    KINDS,
    MIN_GAIN,
    KindTiming,
    SkinnyChoice,
    choose,
    decide,
    eligible,
)
from workers.engine.layers.tiles import Tiles

ONE_ROW = Tiles(block_n=4, block_k=1024, split_k=1, num_warps=4)


def skinny_flags(model) -> list[dict]:
    return [dict(m.skinny) for m in model.modules() if hasattr(m, "skinny")]


def test_a_kind_is_chosen_only_where_the_kernel_won_by_the_margin():
    timings = [
        KindTiming("qkv", cublas_us=9.0, skinny_us=3.0, tiles=ONE_ROW),  # 3x faster
        KindTiming("o", cublas_us=4.0, skinny_us=4.0 / MIN_GAIN * 1.001),  # inside the noise
        KindTiming("gate_up", cublas_us=10.0, skinny_us=None, note="kernel failed: boom"),
        KindTiming("down", cublas_us=5.0, skinny_us=6.0),  # slower
    ]
    choice = decide(timings)
    assert choice.chosen == {"qkv": ONE_ROW}  # with the tiling that won
    summary = choice.summary()
    assert "['qkv']" in summary and "qkv 9.0->3.0 us (4x1024 w4)" in summary
    assert "gate_up cuBLAS (kernel failed: boom)" in summary
    assert not KindTiming("o", cublas_us=9.0, skinny_us=3.0).chosen  # no tiling: not chosen
    assert (
        decide([KindTiming("o", 2.0, 3.0)])
        .summary()
        .startswith("skinny matmuls for one-row steps: none")
    )


def test_models_and_engines_that_cannot_use_it_say_why(tiny_qwen3):
    llm = LLM(tiny_qwen3)  # the CPU: the torch backend, float32 weights
    runner = llm.engine.runner
    assert runner.skinny.error == "no fused ops (the torch backend)" and not runner.skinny.chosen
    assert "float32 on cpu" in eligible(runner.model)
    assert choose(runner.model) == SkinnyChoice(error=eligible(runner.model))
    assert LLM(tiny_qwen3, skinny_matmul=False).engine.runner.skinny.error == (
        "off in the engine config"
    )
    flags = skinny_flags(runner.model)
    assert flags and all(f == {} for f in flags)


def test_the_flags_leave_inputs_of_several_rows_on_the_plain_path(tiny_qwen3):
    """With every kind flagged, a prefill of several tokens gives the same hidden states
    bit for bit (on the CPU the kernel would need CUDA: taking it would raise)."""
    import random

    from tests.workers.reference import prefill_hidden
    from workers.engine.layers.ops import project

    llm = LLM(tiny_qwen3)
    model = llm.engine.runner.model
    prompt = random.Random(5).choices(range(10, 200), k=24)
    plain = prefill_hidden(llm, prompt, [20, 4])
    attn_out = torch.randn(3, model.layers[0].self_attn.q_size)
    plain_o = model.layers[0].self_attn.o_proj(attn_out)
    model.use_skinny(dict.fromkeys(KINDS, ONE_ROW))
    try:
        assert all(f == dict.fromkeys(KINDS, ONE_ROW) for f in skinny_flags(model))
        assert torch.equal(prefill_hidden(llm, prompt, [20, 4]), plain)
        assert torch.equal(project(attn_out, model.layers[0].self_attn.o_proj, ONE_ROW), plain_o)
    finally:
        model.use_skinny({})
