"""Pre-norm decoder-only transformer covering Qwen3 and Llama 3."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.engine.attention.base import AttentionBackend, AttentionMetadata
from workers.engine.layers.attention import SelfAttention
from workers.engine.layers.mlp import GatedMLP
from workers.engine.layers.norm import RMSNorm
from workers.engine.layers.ops import add_rms_norm
from workers.engine.layers.rotary import cos_sin_cache
from workers.engine.models.config import ModelConfig

if TYPE_CHECKING:
    from workers.engine.layers.skinny_choice import Tiles


class DecoderLayer(nn.Module):
    fused_ops = False  # set by DecoderModel.use_fused_ops
    # projection kind -> its tiling, for one-row inputs; set by DecoderModel.use_skinny.
    # Here "qkv" and "gate_up" take the norm before them into the kernel.
    skinny: Mapping[str, Tiles] = MappingProxyType({})

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            hidden_size=config.hidden_size,
            attention_bias=config.attention_bias,
            qk_norm=config.qk_norm,
            rms_norm_eps=config.rms_norm_eps,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden, residual, positions, rope_cache, kv_cache, backend, metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual carried separately: returns this layer's
        MLP output and the residual stream before it is added (the next norm adds it,
        fused). One-row steps with skinny projections chosen (CUDA) run each norm
        inside the projection after it."""
        attn, mlp = self.self_attn, self.mlp
        one_row = hidden.shape[0] == 1
        norm = self.input_layernorm
        tiles = self.skinny.get("qkv") if one_row else None
        if tiles is not None:
            from workers.engine.layers.skinny_kernel import skinny_norm_matmul  # Triton

            qkv, residual = skinny_norm_matmul(
                hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight, tiles=tiles
            )
        else:
            if residual is None:
                residual, hidden = hidden, norm(hidden)
            else:
                hidden, residual = add_rms_norm(
                    hidden, residual, norm.weight, norm.eps, self.fused_ops
                )
            qkv = attn.qkv_proj(hidden)
        hidden = attn(qkv, positions, rope_cache, kv_cache, backend, metadata)
        norm = self.post_attention_layernorm
        tiles = self.skinny.get("gate_up") if one_row else None
        if tiles is not None:
            from workers.engine.layers.skinny_kernel import skinny_norm_matmul

            gated, residual = skinny_norm_matmul(
                hidden,
                residual,
                norm.weight,
                norm.eps,
                mlp.gate_up_proj.weight,
                gated=True,
                tiles=tiles,
            )
            return mlp.down(gated), residual
        hidden, residual = add_rms_norm(hidden, residual, norm.weight, norm.eps, self.fused_ops)
        return mlp(hidden), residual


class DecoderModel(nn.Module):
    fused_ops = False  # set by use_fused_ops

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("rope_cache", self.build_rope_cache(), persistent=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def build_rope_cache(self) -> torch.Tensor:
        c = self.config
        return cos_sin_cache(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)

    def use_fused_ops(self, fused: bool) -> None:
        """Run the elementwise ops (norms, RoPE, the MLP's gate) as fused FlashInfer
        kernels or as plain torch (``layers/ops``), in every layer: what the attention
        backend says (``AttentionBackend.fused_ops``). Plain torch until called."""
        for module in self.modules():
            if hasattr(module, "fused_ops"):
                module.fused_ops = fused

    def use_skinny(self, chosen: Mapping[str, Tiles]) -> None:
        """Projections (``layers/skinny_choice.KINDS``) whose one-row inputs take the
        skinny kernel, each with its tiling: what the engine measured at start, before
        capturing graphs."""
        shared = MappingProxyType(dict(chosen))  # one read-only map for every module
        for module in self.modules():
            if hasattr(module, "skinny"):
                module.skinny = shared

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (moving the
        model between devices unties parameters, so call this again after)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer
        backend: AttentionBackend,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the new tokens; writes their KV."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(
                hidden, residual, positions, self.rope_cache, kv_cache, backend, metadata
            )
        hidden, _ = add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps, self.fused_ops)
        return hidden

    def kv_at_layer(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        metadata: AttentionMetadata,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values that layer ``layer`` computes for the new tokens, running
        (and writing the KV of) only the layers before it: the cheap probe of how far
        cached KV is from what this context gives."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for block, kv_cache in zip(self.layers[:layer], kv_caches, strict=False):
            hidden, residual = block(
                hidden, residual, positions, self.rope_cache, kv_cache, backend, metadata
            )
        target = self.layers[layer]
        norm = target.input_layernorm
        if residual is None:
            hidden = norm(hidden)
        else:
            hidden, _ = add_rms_norm(hidden, residual, norm.weight, norm.eps, self.fused_ops)
        qkv = target.self_attn.qkv_proj(hidden)
        _, k, v = target.self_attn.split_qkv(qkv, positions, self.rope_cache)
        return k, v

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits. On CUDA the bf16 matmul writes float32 directly, so logits
        keep float32 resolution (bf16 logits tie every 0.125 around |x|~16, which makes
        greedy choices flip on noise) at the cost of a bf16 matmul."""
        if hidden.is_cuda and hidden.dtype != torch.float32:
            return torch.mm(hidden, self.lm_head.weight.t(), out_dtype=torch.float32)
        return self.lm_head(hidden).float()
