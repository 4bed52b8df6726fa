"""Sampling in one pass over the logits (CUDA, Triton): each row's token is
``argmax(logits * (1 / temperature) + gumbel)`` for rows that sample and
``argmax(logits)`` for greedy rows (temperature 0: no noise), first index on ties.

Gumbel-max draws token ``j`` with probability ``softmax(logits / temperature)[j]``,
the distribution the unfused sampler's exponential race draws from, but it reads
the float32 logits once instead of the seven passes of gather, scale, softmax,
noise, divide and two argmaxes (at batch 256 over a 151,936-token vocabulary, about
2 GB of memory traffic a step by count of bytes; the measured gain was 0.16 ms a step,
bench/RESULTS.md). Rows split into spans of tokens, one program each, the spans
short enough that the programs fill every SM (a batch-1 step's one row in 10
programs of 16K tokens took 81 us on an H200); the best of each span is reduced
after. Greedy rows skip the noise.

Noise comes from Philox (``tl.rand``) keyed by a per-call seed and the element's
offset, so rows draw independently. Rows that filter (top-k, top-p) or carry their
own generator (a seeded request) are not for this kernel (``sampler`` sends them
through the unfused path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine import device_properties

MIN_SPAN, MAX_SPAN = 1024, 16384  # tokens a program scans (powers of two)
BLOCK = 1024  # tokens a program loads at once (MIN_SPAN: every span a multiple)


# Triton compiles a variant per value class of an int argument (divisible by 16, equal
# to 1): a per-call seed or a per-batch span length would compile variants inside steps
# (each ~0.5 s: an H200 throughput run lost 8 s to them). One variant serves every call.
@triton.jit(do_not_specialize=["seed", "blocks", "spans"])
def _gumbel_argmax_kernel(
    logits_ptr,  # [rows, vocab] float32, rows ``stride`` apart
    stride,
    vocab,
    inv_temp_ptr,  # [rows] float32: 1 / temperature; 0 for a greedy row
    seed,
    best_val_ptr,  # [rows, spans] float32 out: the span's best score
    best_idx_ptr,  # [rows, spans] int32 out: its token
    spans,
    blocks,  # blocks of BLOCK tokens a program scans (passed as blocks, not tokens, so
    # that the compiler knows each program's start is a multiple of BLOCK: vector loads)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    inv_temp = tl.load(inv_temp_ptr + row)
    sampled = inv_temp > 0
    base = logits_ptr + row.to(tl.int64) * stride
    best_val = float("-inf")
    start = part * blocks * BLOCK
    best_idx = start
    for b in tl.range(0, blocks):
        i = b * BLOCK
        cols = start + i + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if sampled:  # greedy rows: no noise, and no time spent drawing it
            u = tl.rand(seed, row * vocab + cols)
            x = x * inv_temp - tl.log(-tl.log(u))
        x = tl.where(inside, x, float("-inf"))
        top = tl.max(x, 0)
        at = tl.argmax(x, 0)  # the first maximum
        better = top > best_val  # strict: an earlier block keeps a tie
        best_idx = tl.where(better, start + i + at, best_idx)
        best_val = tl.where(better, top, best_val)
    tl.store(best_val_ptr + row * spans + part, best_val)
    tl.store(best_idx_ptr + row * spans + part, best_idx)


def span_for(rows: int, vocab: int, sms: int) -> int:
    """The longest span that still gives two programs per SM (MIN_SPAN..MAX_SPAN)."""
    span = MAX_SPAN
    while span > MIN_SPAN and rows * triton.cdiv(vocab, span) < 2 * sms:
        span //= 2
    return span


def gumbel_argmax(
    logits: torch.Tensor, inv_temp: torch.Tensor, seed: int, span: int | None = None
) -> torch.Tensor:
    """One token per row (int64, on the logits' device), as the module docstring
    says. ``inv_temp``: [rows] float32 on the same device, 0 for greedy rows.
    ``span``: tokens a program scans (a multiple of BLOCK); by default ``span_for``.
    The draws do not depend on it: the noise is keyed by the element's index."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    if span is None:  # off CUDA (Triton's interpreter, for tests) count one SM
        span = span_for(
            rows, vocab, device_properties.sm_count(logits.device) if logits.is_cuda else 1
        )
    if span <= 0 or span % BLOCK:
        raise ValueError(f"span {span} is not a positive multiple of {BLOCK}")
    spans = triton.cdiv(vocab, span)
    best_val = torch.empty(rows, spans, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, spans, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, spans)](
        logits,
        logits.stride(0),
        vocab,
        inv_temp,
        seed,
        best_val,
        best_idx,
        spans,
        span // BLOCK,
        BLOCK=BLOCK,
    )
    best_span = best_val.argmax(dim=1, keepdim=True)  # the first span on a tie
    return best_idx.gather(1, best_span)[:, 0].long()
