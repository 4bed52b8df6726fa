"""Elementwise ops fused into single kernels on CUDA (FlashInfer), with the same math
in plain torch elsewhere (the CPU reference path, compared against transformers).

Decode is launch-bound for small models: a layer of unfused torch ops issues ~35
kernels, these bring it to ~13.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

_HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _HAS_FLASHINFER


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> normalized in float32, scaled by ``weight``, in x's dtype."""
    if _fused(x):
        import flashinfer

        return flashinfer.norm.rmsnorm(x.contiguous(), weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x). On CUDA both inputs are overwritten."""
    if _fused(x):
        import flashinfer

        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]"""
    if _fused(x):
        import flashinfer

        return flashinfer.activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim] float32: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary embedding (rotate halves)."""
    if _fused(q):
        import flashinfer

        q, k = q.contiguous(), k.contiguous()
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
            positions,
            q.view(q.shape[0], -1),
            k.view(k.shape[0], -1),
            q.shape[-1],
            cos_sin_cache,
            is_neox=True,
        )
        return q, k
    half = q.shape[-1] // 2
    table = cos_sin_cache[positions]
    cos = torch.cat((table[:, :half], table[:, :half]), dim=-1).to(q.dtype)[:, None, :]
    sin = torch.cat((table[:, half:], table[:, half:]), dim=-1).to(q.dtype)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)
