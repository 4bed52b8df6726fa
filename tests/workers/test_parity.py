"""Our engine against transformers on the same checkpoint files (float32, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.workers.reference import prefill_hidden, reference_greedy, reference_logits
from workers import LLM, SamplingParams

VARIANTS = [("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family,tied", VARIANTS)
def test_logits_match_transformers(model_factory, hf_reference, family, tied):
    model_dir = model_factory(family, tied)
    ref = hf_reference(model_dir)
    llm = LLM(model_dir, page_size=16)
    tokens = random.Random(1).choices(range(10, llm.engine.model_config.vocab_size), k=300)
    expected = reference_logits(ref, tokens)
    for chunks in ([300], [37, 100, 163], [16, 16, 268]):
        with torch.inference_mode():
            got = llm.engine.runner.model.compute_logits(prefill_hidden(llm, tokens, chunks))
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel <= 1e-4, f"chunks {chunks}: relative error {rel:.2e}"


@pytest.mark.parametrize("family,tied", VARIANTS)
def test_greedy_matches_transformers_generate(model_factory, hf_reference, family, tied):
    model_dir = model_factory(family, tied)
    ref = hf_reference(model_dir)
    llm = LLM(model_dir, page_size=16)
    rng = random.Random(2)
    vocab = llm.engine.model_config.vocab_size
    prompts = [rng.choices(range(10, vocab), k=n) for n in (1, 15, 16, 17, 90, 300)]
    outputs = llm.generate(prompts, GREEDY)  # one batch: mixed lengths run together
    for prompt, out in zip(prompts, outputs, strict=True):
        assert list(out.token_ids) == reference_greedy(ref, prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length"


def test_text_prompt_and_chat_decode(tiny_qwen3, hf_reference):
    llm = LLM(tiny_qwen3)
    out = llm.generate("The weather today is", SamplingParams(max_tokens=8, temperature=0))[0]
    ref = reference_greedy(hf_reference(tiny_qwen3), list(out.prompt_token_ids), 8)
    assert list(out.token_ids)[: len(ref)] == ref[: len(out.token_ids)]
    assert out.text == llm.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_qwen3):
    from modeltools.make_model import make_model

    sharded = make_model(tmp_path / "sharded", preset="tiny", seed=0, shard_size_mb=0.05)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = list(range(20, 60))
    a = LLM(sharded).generate([prompt], GREEDY)[0]
    b = LLM(tiny_qwen3).generate([prompt], GREEDY)[0]
    assert a.token_ids == b.token_ids
