"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from workers.engine.sampling_params import SamplingParams


def sample_on_device(
    logits: torch.Tensor,  # [S, vocab], float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """One token per row (int64, on the logits' device; nothing waits for it). Greedy
    rows take the argmax; others sample from the temperature-scaled distribution
    restricted by top-k and top-p. A row with a generator draws only from it, so a
    seeded request is reproducible whatever it is batched with.

    A batch of greedy rows only is one argmax. Otherwise, on CUDA, greedy rows and
    rows that only scale by a temperature take one fused pass
    (``layers/sample_kernel``: Gumbel-max, the same distribution); rows that filter or
    carry a generator take the unfused path below."""
    if all(p.greedy for p in params):  # one reduction; the first maximum, as below
        return logits.argmax(dim=-1)
    if logits.is_cuda:
        from workers.engine.layers.sample_kernel import gumbel_argmax

        inv_temp = _inverse_temperatures(
            tuple(0.0 if p.greedy else 1.0 / p.temperature for p in params), logits.device
        )
        seed = int(torch.randint(0, 2**31 - 1, ()))
        tokens = gumbel_argmax(logits, inv_temp, seed)
        unfused = [
            i
            for i, p in enumerate(params)
            if not p.greedy and (p.top_k > 0 or p.top_p < 1 or generators[i] is not None)
        ]
    else:
        tokens = logits.argmax(dim=-1)
        unfused = [i for i, p in enumerate(params) if not p.greedy]
    if unfused:
        rows = _on_device(unfused, torch.long, logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in unfused])
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws a token with
        # probability p, for all rows at once on the logits' device.
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(unfused):
            if generators[i] is not None:
                noise[j].exponential_(generator=generators[i])
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Every decision here is made from ``params`` on the host: nothing waits for the
    device (overlapped steps queue the next step meanwhile)."""
    temps = _on_device([p.temperature for p in params], torch.float32, logits.device)
    logits = logits / temps[:, None]
    top_ks = [p.top_k for p in params]
    if any(top_ks):
        vocab = logits.shape[-1]
        ks = _on_device([k if 0 < k < vocab else vocab for k in top_ks], torch.long, logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):
        top_ps = _on_device([p.top_p for p in params], torch.float32, logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # keep a token while the mass before it is below top_p (the top token always)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_ps[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


@functools.lru_cache(maxsize=64)
def _inverse_temperatures(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The fused pass's per-row inverse temperatures on the device, kept for the next
    step with the same ones (most steps repeat the last one: staging a list through
    pinned memory costs more host time than the kernel). Read-only: never written."""
    return _on_device(list(values), torch.float32, device)


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device's queued work
    (``torch.tensor(..., device="cuda")`` synchronizes the stream): staged through
    pinned memory, copied asynchronously."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def top_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[tuple[tuple[int, float], ...] | None]:
    """Per row: the chosen token's log-probability followed by the ``params.logprobs``
    most likely (token, log-probability) pairs, from the unscaled distribution; None
    for rows that asked for none."""
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    out: list[tuple[tuple[int, float], ...] | None] = [None] * len(params)
    if not wanted:
        return out
    rows = torch.tensor(wanted, device=logits.device)
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(params[i].logprobs for i in wanted)
    top_values, top_ids = logp.topk(k, dim=-1)
    chosen = logp.gather(
        1, torch.tensor([tokens[i] for i in wanted], device=logits.device)[:, None]
    )
    top_values, top_ids, chosen = top_values.tolist(), top_ids.tolist(), chosen[:, 0].tolist()
    for j, i in enumerate(wanted):
        n = params[i].logprobs
        pairs = tuple(zip(top_ids[j][:n], top_values[j][:n], strict=True))
        out[i] = ((tokens[i], chosen[j]), *pairs)
    return out
