"""Streamed text deltas add up to the same text as decoding the output once."""

from __future__ import annotations

import random

from workers import LLM, SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine


def test_streamed_text_equals_final_decode(tiny_qwen3):
    rng = random.Random(3)
    llm = LLM(tiny_qwen3)
    streaming = Engine(EngineConfig(model_dir=str(tiny_qwen3)), stream_text=True)
    prompts = [rng.choices(range(10, 1000), k=rng.randint(3, 30)) for _ in range(30)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 24), temperature=1.5, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    expected = [o.text for o in llm.generate_tokens(prompts, params)]
    texts = {f"s{i}": "" for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        streaming.add_request(f"s{i}", prompt, p)
    while streaming.has_unfinished():
        for out in streaming.step():
            texts[out.request_id] += out.new_text
    mismatched = [i for i in range(len(prompts)) if texts[f"s{i}"] != expected[i]]
    assert not mismatched, [(texts[f"s{i}"], expected[i]) for i in mismatched[:3]]
