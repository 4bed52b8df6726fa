"""Pre-norm decoder-only transformer covering Qwen3 and Llama 3."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.engine.attention.base import AttentionBackend, AttentionMetadata, kv_deviation
from workers.engine.layers.attention import SelfAttention
from workers.engine.layers.mlp import GatedMLP
from workers.engine.layers.norm import RMSNorm
from workers.engine.layers.ops import add_rms_norm
from workers.engine.layers.rotary import cos_sin_cache
from workers.engine.models.config import ModelConfig
from workers.engine.tp.shard import SINGLE, Shard

if TYPE_CHECKING:
    from workers.engine.layers.tiles import Tiles


class DecoderLayer(nn.Module):
    fused_ops = False  # set by DecoderModel.use_fused_ops
    # projection kind -> its tiling, for one-row inputs; set by DecoderModel.use_skinny.
    # Here "qkv" and "gate_up" take the norm before them into the kernel.
    skinny: Mapping[str, Tiles] = MappingProxyType({})

    def __init__(self, config: ModelConfig, shard: Shard = SINGLE) -> None:
        """``config``: this rank's shape (``Shard.local_config``)."""
        super().__init__()
        self.self_attn = SelfAttention(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            hidden_size=config.hidden_size,
            attention_bias=config.attention_bias,
            qk_norm=config.qk_norm,
            rms_norm_eps=config.rms_norm_eps,
            shard=shard,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden, residual, positions, rope_cache, kv_cache, backend, metadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual carried separately: returns this layer's
        MLP output and the residual stream before it is added (the next norm adds it,
        fused). One-row steps with skinny projections chosen (CUDA) run each norm
        inside the projection after it."""
        qkv, residual = self.attention_input(hidden, residual)
        hidden = self.self_attn(qkv, positions, rope_cache, kv_cache, backend, metadata)
        return self.feed_forward(hidden, residual)

    def attention_input(self, hidden, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm (adding the residual) and the QKV projection: ``qkv_proj``'s
        output and the residual stream."""
        attn, norm = self.self_attn, self.input_layernorm
        tiles = self.skinny.get("qkv") if hidden.shape[0] == 1 else None
        if tiles is not None:
            from workers.engine.layers.skinny_kernel import skinny_norm_matmul  # Triton

            return skinny_norm_matmul(
                hidden, residual, norm.weight, norm.eps, attn.qkv_proj.weight, tiles=tiles
            )
        if residual is None:
            residual, hidden = hidden, norm(hidden)
        else:
            hidden, residual = add_rms_norm(hidden, residual, norm.weight, norm.eps, self.fused_ops)
        return attn.qkv_proj(hidden), residual

    def feed_forward(self, hidden, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm (adding the residual) and the MLP."""
        mlp, norm = self.mlp, self.post_attention_layernorm
        tiles = self.skinny.get("gate_up") if hidden.shape[0] == 1 else None
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

    def __init__(self, config: ModelConfig, shard: Shard = SINGLE) -> None:
        """``config``: the whole model's shape; ``shard``: the part of it this rank
        holds (``tp.shard``; the whole model by default). ``self.config`` is this
        rank's shape: its heads, KV heads and MLP columns, the full vocabulary."""
        super().__init__()
        config.validate()
        self.shard = shard
        self.config = shard.local_config(config)
        vocab_rows = shard.vocab_per_rank(config.vocab_size)
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(self.config, shard) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("rope_cache", self.build_rope_cache(), persistent=False)
        self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)
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
        hidden, residual = self._layers(
            0, self.embed(input_ids), None, positions, kv_caches, backend, metadata
        )
        return self._final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] embeddings. Sharded, each rank looks up the ids in its rows
        (zeros for the others') and the ranks' lookups are summed: exact, since every
        id has one nonzero term."""
        if not self.shard.parallel:
            return self.embed_tokens(input_ids)
        first, _ = self.shard.vocab_rows(self.config.vocab_size)
        local = input_ids - first
        rows = self.embed_tokens.num_embeddings
        mine = (local >= 0) & (local < rows)
        hidden = self.embed_tokens(local.clamp(0, rows - 1)) * mine.unsqueeze(1)
        return self.shard.all_reduce(hidden)

    def _layers(
        self, first: int, hidden, residual, positions, kv_caches, backend, metadata, end=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ``first`` to ``end`` (default: the last) over ``hidden``: each writes
        its KV; returns the last one's output and the residual stream before it."""
        for block, kv_cache in zip(self.layers[first:end], kv_caches[first:end], strict=True):
            hidden, residual = block(
                hidden, residual, positions, self.rope_cache, kv_cache, backend, metadata
            )
        return hidden, residual

    def _final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        hidden, _ = add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps, self.fused_ops)
        return hidden

    def early_layers(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        metadata: AttentionMetadata,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first part of a forward whose token set shrinks at ``layer`` (>= 1): the
        layers before it over every new token, writing their KV (and reading no other
        layer's). Returns the last one's output and the residual stream, what
        ``selection_deviation`` takes. No host sync: it runs in a CUDA graph
        (``graphs.selection``)."""
        return self._layers(
            0, self.embed(input_ids), None, positions, kv_caches, backend, metadata, layer
        )

    def selection_deviation(
        self,
        hidden: torch.Tensor,  # [T, hidden]: ``early_layers``' outputs
        residual: torch.Tensor,  # [T, hidden]; may be overwritten (fused ops add in place)
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # layer ``layer``'s
        kv_rows: torch.Tensor,  # [2T] int64: where each token's K/V sit (kv_write_rows)
        layer: int,
        candidate: torch.Tensor,  # [T] bool: the tokens whose deviation counts
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The second part: ``layer``'s input norm and QKV projection. Returns
        ``qkv_proj``'s output and the residual stream (what ``forward_kept`` takes, for
        the rows that go on), and each token's deviation at ``layer`` (``kv_deviation``:
        how far the K/V it computes there is from what ``kv_cache`` holds at its rows),
        +inf where not a ``candidate`` (those always go on: a top-k of their number plus
        the candidates to keep takes them all). Nothing is written at ``layer``; its K/V
        are computed on a copy, so ``qkv`` stays unrotated. No host sync. Sharded, each
        rank's deviation over its KV heads is summed over the ranks, so that every rank
        selects the same tokens."""
        block = self.layers[layer]
        qkv, residual = block.attention_input(hidden, residual)
        _, k, v = block.self_attn.split_qkv(qkv.clone(), positions, self.rope_cache)
        deviation = self.shard.all_reduce(kv_deviation(k, v, kv_cache, kv_rows))
        return qkv, residual, deviation.masked_fill(~candidate, float("inf"))

    def forward_kept(
        self,
        qkv: torch.Tensor,  # [N, q + 2 kv]: layer ``layer``'s projection of the kept rows
        residual: torch.Tensor,  # [N, hidden]; overwritten (fused ops add in place)
        positions: torch.Tensor,  # [N]
        kv_caches: list[torch.Tensor],
        layer: int,
        backend,  # ``forward`` / ``attend`` over the kept rows (attention/scattered)
        metadata,
    ) -> torch.Tensor:
        """The second half: the kept rows through ``layer``'s attention and every layer
        after it (writing their KV there; other positions' KV is left as the cache holds
        it). Final hidden states [N, hidden]."""
        block = self.layers[layer]
        hidden = block.self_attn(
            qkv, positions, self.rope_cache, kv_caches[layer], backend, metadata
        )
        hidden, residual = block.feed_forward(hidden, residual)
        hidden, residual = self._layers(
            layer + 1, hidden, residual, positions, kv_caches, backend, metadata
        )
        return self._final_norm(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits. On CUDA the bf16 matmul writes float32 directly, so logits
        keep float32 resolution (bf16 logits tie every 0.125 around |x|~16, which makes
        greedy choices flip on noise) at the cost of a bf16 matmul. Sharded, each rank
        scores its vocabulary rows and the scores are gathered on every rank."""
        if hidden.is_cuda and hidden.dtype != torch.float32:
            logits = torch.mm(hidden, self.lm_head.weight.t(), out_dtype=torch.float32)
        else:
            logits = self.lm_head(hidden).float()
        return self.shard.gather_vocab(logits, self.config.vocab_size)
