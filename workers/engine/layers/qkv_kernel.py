"""The attention layer's step between the QKV projection and attention, fused on CUDA
(Triton): per-head QK RMSNorm (Qwen3; skipped without it), NeoX RoPE of queries and
keys, and the write of keys and values into the paged KV cache, in one kernel.

Unfused, with FlashInfer's kernels, the same step is seven launches a layer (two
copies out of the projection's output, two norms, RoPE, the K/V concatenation and
its scatter); a batch-1 decode step on a small model is bound by such launches
(bench/profile_step.py).

Same math as the unfused path (``layers/ops``): the norm in float32, rounded to the
activation dtype (as the norm kernel's output is), then the rotation in float32 with
the angle row ``position`` of the model's ``cos_sin_cache``, rounded once. Values
are copied bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# num_tokens changes every prefill step: not specialized, so no step compiles a variant
@triton.jit(do_not_specialize=["num_tokens"])
def _qkv_kernel(
    qkv_ptr,  # [T, (H + 2 * KH) * D], rows ``qkv_stride`` apart
    qkv_stride,
    q_ptr,  # [T, H, D] out: normed, rotated queries
    kv_ptr,  # one layer's cache, as rows of KH * D elements
    kv_rows_ptr,  # [2T] int64: each token's key row, then its value row
    num_tokens,
    positions_ptr,  # [T] int
    table_ptr,  # [max_pos, D] float32: cos of each frequency, then sin
    q_weight_ptr,  # [D] (QK_NORM only)
    k_weight_ptr,  # [D] (QK_NORM only)
    eps,
    H: tl.constexpr,
    KH: tl.constexpr,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tokens < num_tokens
    head = tl.program_id(1)  # 0..H-1: a query head; H..H+KH-1: a key head and its values
    is_query = head < H
    dim: tl.constexpr = 2 * HALF
    pairs = tl.arange(0, HALF)[None, :]
    mask = live[:, None]
    row = qkv_ptr + tokens[:, None] * qkv_stride
    src = row + head * dim  # query heads, then key heads: contiguous in the projection
    lo = tl.load(src + pairs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF + pairs, mask=mask, other=0.0).to(tl.float32)
    out_ty = q_ptr.dtype.element_ty
    if QK_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / dim + eps)[:, None]
        if is_query:
            w_lo = tl.load(q_weight_ptr + pairs).to(tl.float32)
            w_hi = tl.load(q_weight_ptr + HALF + pairs).to(tl.float32)
        else:
            w_lo = tl.load(k_weight_ptr + pairs).to(tl.float32)
            w_hi = tl.load(k_weight_ptr + HALF + pairs).to(tl.float32)
        lo = (lo * inv * w_lo).to(out_ty).to(tl.float32)
        hi = (hi * inv * w_hi).to(out_ty).to(tl.float32)
    position = tl.load(positions_ptr + tokens, mask=live, other=0).to(tl.int64)[:, None]
    cos = tl.load(table_ptr + position * dim + pairs, mask=mask, other=0.0)
    sin = tl.load(table_ptr + position * dim + HALF + pairs, mask=mask, other=0.0)
    out_lo = (lo * cos - hi * sin).to(out_ty)
    out_hi = (hi * cos + lo * sin).to(out_ty)
    if is_query:
        dst = q_ptr + (tokens[:, None] * H + head) * dim
        tl.store(dst + pairs, out_lo, mask=mask)
        tl.store(dst + HALF + pairs, out_hi, mask=mask)
    else:
        kv_head = head - H
        key_row = tl.load(kv_rows_ptr + tokens, mask=live, other=0)[:, None]
        key = kv_ptr + key_row * (KH * dim) + kv_head * dim
        tl.store(key + pairs, out_lo, mask=mask)
        tl.store(key + HALF + pairs, out_hi, mask=mask)
        elements = tl.arange(0, dim)[None, :]
        value = tl.load(row + (H + KH + kv_head) * dim + elements, mask=mask)
        value_row = tl.load(kv_rows_ptr + num_tokens + tokens, mask=live, other=0)[:, None]
        dst = kv_ptr + value_row * (KH * dim) + kv_head * dim
        tl.store(dst + elements, value, mask=mask)


# A program per (token, head) for decode-sized steps; from BLOCKED_MIN_TOKENS tokens a
# program per (BLOCK_TOKENS tokens, head): one per token and head made a 4,384-token
# prefill's kernel 85 us a layer on an H200, where it moves about 90 MB (bench/profile_step.py).
BLOCKED_MIN_TOKENS = 128
BLOCK_TOKENS = 16


def qk_norm_rope_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * KH) * D], the QKV projection's output
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
    kv_cache: torch.Tensor,  # [pages, 2, page_size, KH, D], contiguous
    kv_rows: torch.Tensor,  # [2T] int64, attention.base.kv_write_rows
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    block_tokens: int | None = None,  # tokens per program; None: by the step's size
) -> torch.Tensor:
    """Queries [T, H, D], normed (when weights are given) and rotated; the keys, so
    treated, and the values are written to ``kv_cache`` at ``kv_rows``."""
    tokens = qkv.shape[0]
    head_dim = kv_cache.shape[-1]
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be [T, (H + 2 KH) D] with unit inner stride, got {qkv.shape}")
    if not kv_cache.is_contiguous():
        raise ValueError("the KV cache must be contiguous")
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    norm = q_weight is not None
    if block_tokens is None:
        block_tokens = BLOCK_TOKENS if tokens >= BLOCKED_MIN_TOKENS else 1
    elif block_tokens < 1 or block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
    grid = (triton.cdiv(tokens, block_tokens), num_heads + num_kv_heads)
    _qkv_kernel[grid](
        qkv,
        qkv.stride(0),
        q,
        kv_cache,
        kv_rows,
        tokens,
        positions,
        cos_sin_cache,
        q_weight if norm else qkv,
        k_weight if norm else qkv,
        eps,
        H=num_heads,
        KH=num_kv_heads,
        HALF=head_dim // 2,
        QK_NORM=norm,
        BLOCK_T=block_tokens,
    )
    return q
