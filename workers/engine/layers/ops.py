"""Elementwise ops, each either one fused FlashInfer kernel (``fused=True``: CUDA
tensors, flashinfer installed) or the same math in plain torch (the reference path,
compared against transformers). Which one a model runs follows its attention backend
(``AttentionBackend.fused_ops``, set by ``DecoderModel.use_fused_ops``), not whether
flashinfer happens to be importable.

Decode is launch-bound for small models: a layer of unfused torch ops issues ~35
kernels, these bring it to ~13.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from workers.engine.layers.tiles import Tiles


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    """x [..., dim] -> normalized in float32, scaled by ``weight``, in x's dtype."""
    if fused:
        import flashinfer

        return flashinfer.norm.rmsnorm(x.contiguous(), weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x). Fused, both inputs are overwritten."""
    if fused:
        import flashinfer

        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return rms_norm(residual, weight, eps, fused=False), residual


def silu_and_mul(x: torch.Tensor, fused: bool) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]"""
    if fused:
        import flashinfer

        return flashinfer.activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim] float32: cos half, then sin half
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary embedding (rotate halves)."""
    if fused:
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


def project(x: torch.Tensor, linear: nn.Linear, tiles: Tiles | None) -> torch.Tensor:
    """``linear(x)``; a one-row input of a projection chosen for it at start takes
    the skinny kernel with the ``tiles`` measured best (``layers/skinny_choice``;
    None: not chosen; CUDA only)."""
    if tiles is not None and x.shape[0] == 1:
        from workers.engine.layers.skinny_kernel import skinny_matmul  # Triton: CUDA only

        return skinny_matmul(x, linear.weight, tiles=tiles)
    return linear(x)
