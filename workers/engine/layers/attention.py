"""Self-attention layer: fused QKV projection, optional per-head QK norm, RoPE, paged
attention through the step's backend. With fused ops on CUDA, norm, RoPE and the KV
write are one kernel (``layers/qkv_kernel``) and the backend only attends."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.layers.norm import RMSNorm
from workers.engine.layers.ops import apply_rope, project
from workers.engine.tp.shard import SINGLE, Shard

if TYPE_CHECKING:
    from workers.engine.layers.tiles import Tiles


class SelfAttention(nn.Module):
    fused_ops = False  # set by DecoderModel.use_fused_ops
    # projection kind -> its tiling, for one-row inputs; set by DecoderModel.use_skinny
    # (this module reads its output projection's; DecoderLayer the input one's, fused
    # with the norm before it)
    skinny: Mapping[str, Tiles] = MappingProxyType({})

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        hidden_size: int,
        attention_bias: bool,
        qk_norm: bool,
        rms_norm_eps: float,
        shard: Shard = SINGLE,
    ) -> None:
        """Head counts are this rank's (``Shard.local_config``); ``o_proj`` is row
        parallel: its output is summed over the ranks (rank 0 alone holds a bias)."""
        super().__init__()
        self.shard = shard
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=attention_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=attention_bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None

    def forward(
        self,
        qkv: torch.Tensor,  # [T, q_size + 2 * kv_size]: qkv_proj's output
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention output (after ``o_proj``) from ``qkv_proj``'s output, which the
        caller computes (``DecoderLayer``: one-row steps fuse the norm before it in);
        writes the new tokens' K/V."""
        if self.fused_ops and _fused_qkv_supported(self.head_dim):  # fused ops: CUDA
            from workers.engine.layers import qkv_kernel  # Triton: CUDA only

            q = qkv_kernel.qk_norm_rope_write_kv(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                positions,
                cos_sin_cache,
                kv_cache,
                metadata.kv_rows,
                None if self.q_norm is None else self.q_norm.weight,
                None if self.k_norm is None else self.k_norm.weight,
                self.q_norm.eps if self.q_norm is not None else 0.0,
            )
            out = backend.attend(q, kv_cache, metadata)
        else:
            q, k, v = self.split_qkv(qkv, positions, cos_sin_cache)
            out = backend.forward(q, k, v, kv_cache, metadata)
        out = project(out.reshape(qkv.shape[0], self.q_size), self.o_proj, self.skinny.get("o"))
        return self.shard.all_reduce(out)

    def split_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``qkv_proj``'s output at ``positions`` (keys and
        queries normed and rotated: exactly what ``forward`` writes to the KV cache)."""
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = apply_rope(q, k, positions, cos_sin_cache, self.fused_ops)
        return q, k, v


def _fused_qkv_supported(head_dim: int) -> bool:
    """``tl.arange`` in the fused kernel needs a power-of-two half head."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half & (half - 1) == 0
