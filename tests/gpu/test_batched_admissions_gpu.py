"""Approximate admissions of one step, selected in one forward on the GPU (FlashInfer
for the layers below the selection layer, the scattered-attention kernel per sequence
after it), give each request the first-token logits it gets admitted alone (through
the single-request CUDA graphs), to bf16 noise."""

from __future__ import annotations

import random

import torch

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams

REPAIR = ReuseRequest("approximate", 0, 0.05)
ONE = SamplingParams(max_tokens=1, temperature=0)


def _layout(rng: random.Random, docs: list[list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    prompt, spans = rng.choices(range(10, 1000), k=rng.randint(40, 90)), []
    for doc in rng.sample(docs, len(docs)):
        spans.append((len(prompt), len(prompt) + len(doc)))
        prompt += doc
    return prompt + rng.choices(range(10, 1000), k=24), spans


def _first_logits(engine: Engine, requests) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Admit ``requests`` (id -> prompt, spans) in one step; the selection batches'
    sizes and each request's admission logits."""
    sizes, logits, batch = [], {}, engine.runner.repair_selecting_batch

    def spy(selections, layer):
        out = batch(selections, layer)
        sizes.append(len(selections))
        for one, ready in zip(selections, out, strict=True):
            logits[one.seq.request_id] = ready.float().clone()
        return out

    engine.runner.repair_selecting_batch = spy
    for rid, (prompt, spans) in requests.items():
        engine.add_request(rid, prompt, ONE, placeable=tuple(spans), reuse=REPAIR)
    while engine.has_unfinished():
        engine.step()
    engine.runner.repair_selecting_batch = batch
    return sizes, logits


def test_admissions_selected_in_one_forward_match_each_alone(qwen3_06b):
    rng = random.Random(3)
    docs = [rng.choices(range(10, 1000), k=rng.randint(300, 520)) for _ in range(6)]
    engine = Engine(EngineConfig(str(qwen3_06b), page_size=16, num_pages=4096))
    warm, warm_spans = _layout(rng, docs)
    engine.add_request("warm", warm, ONE, placeable=tuple(warm_spans), reuse=REPAIR)
    while engine.has_unfinished():  # the documents' entries, taken in context
        engine.step()
    requests = {f"q{i}": _layout(rng, docs) for i in range(6)}
    together_sizes, together = _first_logits(engine, requests)
    alone = {}
    for rid, request in requests.items():
        sizes, logits = _first_logits(engine, {f"{rid}-alone": request})
        assert sizes == [1]
        alone[rid] = logits[f"{rid}-alone"]
    assert together_sizes == [6]
    for rid, want in alone.items():
        got = together[rid]
        cosine = torch.nn.functional.cosine_similarity(got, want).item()
        assert cosine > 0.999, (rid, cosine)
    agree = sum(together[r].argmax().item() == alone[r].argmax().item() for r in alone)
    assert agree >= 5, agree
