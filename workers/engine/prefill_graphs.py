"""CUDA graphs for single-request prefill steps of up to ``PREFILL_BUCKETS[-1]`` new
tokens — a cache hit's uncached tail, a short prompt — where an eager forward is bound
by kernel launches, not by the GPU.

One graph per token bucket. The request's real tokens fill the front of the bucket;
padding rows compute on token 0 at position 0, write their KV only to the scratch page,
and are never attended to (the attention plan covers the real tokens only). Before each
replay the graph's FlashInfer prefill wrapper is re-planned into its fixed buffers, so
the cached prefix may be as long as a sequence can be.
"""

from __future__ import annotations

from dataclasses import dataclass

import flashinfer
import torch

from workers.engine.attention.base import BatchLayout, kv_write_rows
from workers.engine.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferMetadata,
    plan_prefill,
)
from workers.engine.cuda_graphs import capture
from workers.engine.models.decoder import DecoderModel

PREFILL_BUCKETS = (16, 32, 64, 128, 256)


@dataclass
class _PrefillGraph:
    tokens: int
    graph: torch.cuda.CUDAGraph
    wrapper: flashinfer.BatchPrefillWithPagedKVCacheWrapper
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_rows: torch.Tensor  # [2 * tokens]
    hidden: torch.Tensor  # [tokens, hidden]


class PrefillGraphs:
    def __init__(
        self,
        model: DecoderModel,
        backend: FlashInferBackend,
        kv_caches: list[torch.Tensor],
        scratch_page: int,
        max_pages_per_seq: int,
        pool,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.scratch_page = scratch_page
        self.page_size = backend.shape.page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.pool = pool
        self.graphs = {t: self._capture(t) for t in sorted(PREFILL_BUCKETS, reverse=True)}
        self.buckets = sorted(self.graphs)

    def can_run(self, layout: BatchLayout) -> bool:
        return (
            layout.batch_size == 1
            and 1 < layout.num_tokens <= self.buckets[-1]
            and layout.kv_page_indices.numel() <= self.max_pages_per_seq
        )

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout):
        """Final hidden states [n, hidden] of the request's n new tokens."""
        n = layout.num_tokens
        g = self.graphs[next(t for t in self.buckets if t >= n)]
        g.input_ids[:n].copy_(input_ids, non_blocking=True)
        g.positions[:n].copy_(positions, non_blocking=True)
        g.input_ids[n:].zero_()
        g.positions[n:].zero_()
        slots = torch.cat(
            (
                layout.slot_mapping,
                torch.full((g.tokens - n,), self.scratch_page * self.page_size, dtype=torch.int32),
            )
        )
        g.kv_rows.copy_(kv_write_rows(slots, self.page_size), non_blocking=True)
        plan_prefill(g.wrapper, layout, self.backend.shape)
        g.graph.replay()
        return g.hidden[:n]

    def _capture_layout(self, tokens: int) -> BatchLayout:
        """``tokens`` new tokens of one request laid on the scratch page."""
        pages = -(-tokens // self.page_size)
        i32 = torch.int32
        return BatchLayout(
            qo_indptr=torch.tensor([0, tokens], dtype=i32),
            kv_page_indptr=torch.tensor([0, pages], dtype=i32),
            kv_page_indices=torch.full((pages,), self.scratch_page, dtype=i32),
            kv_last_page_len=torch.tensor([tokens - (pages - 1) * self.page_size], dtype=i32),
            kv_lens=torch.tensor([tokens], dtype=i32),
            slot_mapping=torch.full((tokens,), self.scratch_page * self.page_size, dtype=i32),
            page_size=self.page_size,
        )

    @torch.inference_mode()
    def _capture(self, tokens: int) -> _PrefillGraph:
        device = self.backend.shape.device
        i32 = dict(dtype=torch.int32, device=device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.backend.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indices_buf=torch.zeros(self.max_pages_per_seq, **i32),
            paged_kv_last_page_len_buf=torch.zeros(1, **i32),
        )
        layout = self._capture_layout(tokens)
        input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        positions = torch.zeros(tokens, dtype=torch.long, device=device)
        kv_rows = kv_write_rows(layout.slot_mapping, self.page_size).to(device)
        plan_prefill(wrapper, layout, self.backend.shape)
        metadata = FlashInferMetadata(kv_rows, wrapper)

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_caches, self.backend, metadata)

        graph, hidden = capture(forward, self.pool)
        return _PrefillGraph(tokens, graph, wrapper, input_ids, positions, kv_rows, hidden)
