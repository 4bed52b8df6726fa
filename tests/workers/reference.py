"""The oracle: greedy generation and logits from ``transformers`` on the same files."""

from __future__ import annotations

import torch


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
