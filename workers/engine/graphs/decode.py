"""CUDA graphs for plain (non-cascade) decode steps with the FlashInfer backend.

One graph per batch size in ``CAPTURE_SIZES``; a step runs the smallest graph that
fits, padding the batch with rows that read and write only the scratch page (the
last page of the KV tensors, never handed out by the KV pool). Inputs are copied
into fixed buffers and the graph's FlashInfer wrapper is re-planned into its own
fixed buffers before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import flashinfer
import torch

from workers.engine.attention.base import BatchLayout, kv_write_rows
from workers.engine.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferMetadata,
    plan_decode,
)
from workers.engine.graphs.capture import capture
from workers.engine.graphs.inputs import load_step
from workers.engine.models.decoder import DecoderModel

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 512)


@dataclass
class _Graph:
    batch_size: int
    graph: torch.cuda.CUDAGraph
    wrapper: flashinfer.BatchDecodeWithPagedKVCacheWrapper
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_rows: torch.Tensor  # [2 * batch_size], see kv_write_rows
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        backend: FlashInferBackend,
        kv_caches: list[torch.Tensor],
        scratch_page: int,
        max_batch_size: int,
        max_pages_per_seq: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.scratch_page = scratch_page
        self.page_size = backend.shape.page_size
        sizes = [s for s in CAPTURE_SIZES if s <= max_batch_size]
        if not sizes or sizes[-1] < max_batch_size:
            sizes.append(max_batch_size)
        self.max_pages_per_seq = max_pages_per_seq
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Graph] = {}
        for size in sorted(sizes, reverse=True):  # largest first: later ones reuse its pool
            self.graphs[size] = self._capture(size)
        self.sizes = sorted(self.graphs)

    def max_batch_size(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout):
        n = layout.batch_size
        g = self.graphs[next(s for s in self.sizes if s >= n)]
        pad = g.batch_size - n
        load_step(g, input_ids, positions, layout.slot_mapping, self.scratch_page, self.page_size)
        padded = _padded(layout, pad, self.scratch_page)
        plan_decode(g.wrapper, padded, self.backend.shape)
        g.graph.replay()
        return g.logits[:n]

    @torch.inference_mode()
    def _capture(self, size: int) -> _Graph:
        device = self.backend.shape.device
        i32 = dict(dtype=torch.int32, device=device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.backend.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.backend.use_tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(size + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(size * self.max_pages_per_seq, **i32),
            paged_kv_last_page_len_buffer=torch.zeros(size, **i32),
        )
        input_ids = torch.zeros(size, dtype=torch.long, device=device)
        positions = torch.zeros(size, dtype=torch.long, device=device)
        empty = _padded(_empty_layout(self.page_size), size, self.scratch_page)
        kv_rows = kv_write_rows(empty.slot_mapping, self.page_size).to(device)
        plan_decode(wrapper, empty, self.backend.shape)
        metadata = FlashInferMetadata(kv_rows, wrapper)

        def forward() -> torch.Tensor:
            hidden = self.model(input_ids, positions, self.kv_caches, self.backend, metadata)
            return self.model.compute_logits(hidden)

        graph, logits = capture(forward, self.pool)
        return _Graph(size, graph, wrapper, input_ids, positions, kv_rows, logits)


def _empty_layout(page_size: int) -> BatchLayout:
    zero = torch.zeros(1, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int32)
    return BatchLayout(zero, zero, none, none, none, none, page_size)


def _padded(layout: BatchLayout, pad: int, scratch_page: int) -> BatchLayout:
    """``layout`` plus ``pad`` one-token rows on the scratch page."""
    if pad == 0:
        return layout
    last = int(layout.kv_page_indptr[-1])
    extra_indptr = torch.arange(last + 1, last + pad + 1, dtype=torch.int32)
    return BatchLayout(
        qo_indptr=torch.arange(layout.batch_size + pad + 1, dtype=torch.int32),
        kv_page_indptr=torch.cat([layout.kv_page_indptr, extra_indptr]),
        kv_page_indices=torch.cat(
            [layout.kv_page_indices, torch.full((pad,), scratch_page, dtype=torch.int32)]
        ),
        kv_last_page_len=torch.cat([layout.kv_last_page_len, torch.ones(pad, dtype=torch.int32)]),
        kv_lens=torch.cat([layout.kv_lens, torch.ones(pad, dtype=torch.int32)]),
        slot_mapping=torch.cat(
            [
                layout.slot_mapping,
                torch.full((pad,), scratch_page * layout.page_size, dtype=torch.int32),
            ]
        ),
        page_size=layout.page_size,
    )
