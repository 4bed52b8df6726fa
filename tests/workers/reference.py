"""The oracle: greedy generation and logits from ``transformers`` on the same files."""

from __future__ import annotations

import torch

from chunkstore.hashing import Namespace
from workers.engine.model_runner import build_inputs
from workers.engine.request import Sequence
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def prefill_hidden(llm, tokens: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    """Our final hidden states at every position [T, hidden], prefilled in chunks of
    the given sizes through the engine's model runner (later chunks read the earlier
    ones' KV from the paged cache: the path a cache hit takes)."""
    engine = llm.engine
    runner = engine.runner
    page_size = engine.pool.page_size
    seq = Sequence("probe", 0, tokens, SamplingParams(), Namespace("probe"))
    seq.page_ids = engine.pool.allocate(-(-len(tokens) // page_size))
    rows = []
    start = 0
    try:
        with torch.inference_mode():
            for size in chunk_sizes:
                inputs = build_inputs([ScheduledSeq(seq, start, size)], page_size)
                metadata = runner.backend.plan(inputs.layout)
                rows.append(
                    runner.model(
                        inputs.input_ids.to(runner.device),
                        inputs.positions.to(runner.device),
                        runner.kv_caches,
                        runner.backend,
                        metadata,
                    )
                )
                start += size
    finally:
        engine.pool.release(seq.page_ids)
    return torch.cat(rows)
