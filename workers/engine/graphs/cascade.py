"""CUDA graphs for cascade decode steps with the FlashInfer backend.

An eager cascade step launches, per layer, a gather of the queries, one prefill kernel
per level, a merge per shared level and a scatter back, each through FlashInfer's
Python wrappers: on an H200 at batch 256 over a 16K shared prefix it spent 78 ms (under
the profiler) on 15.9 ms of kernels. Here such a step replays a graph instead.

One graph per (batch size in ``CAPTURE_SIZES``, number of levels: 2 or 3). A step
takes the smallest size that holds its batch; ``cascade_plan.pad_cascade`` lays its
plan out so every level has exactly that many entries covering every row (flat rows
and padding rows attend to no shared KV), which keeps the captured shapes fixed. Before
each replay every level's wrapper is re-planned into its fixed buffers, as prefill
graphs are. The level wrappers of all graphs share one page-index buffer per level
(only one graph runs at a time, planned right before its replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import flashinfer
import torch

from workers.engine.attention.base import BatchLayout, kv_write_rows
from workers.engine.attention.cascade_plan import CascadeLevel, pad_cascade
from workers.engine.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferMetadata,
)
from workers.engine.graphs.capture import capture
from workers.engine.graphs.inputs import load_step
from workers.engine.models.decoder import DecoderModel

# Cascade pays only for large batches (attention/cascade_plan's cost model), so fewer
# sizes than plain decode: padding rows cost a scratch-page read each.
CAPTURE_SIZES = (16, 32, 64, 128, 192, 256, 384, 512)
LEVELS = (2, 3)


@dataclass
class _CascadeGraph:
    batch_size: int
    graph: torch.cuda.CUDAGraph
    wrappers: tuple  # one prefill wrapper per level, shared levels first
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_rows: torch.Tensor  # [2 * batch_size]
    order: torch.Tensor  # [batch_size] int64: the padded plan's row order
    hidden: torch.Tensor  # [batch_size, hidden]: logits are computed outside the graph


class CascadeGraphs:
    def __init__(
        self,
        model: DecoderModel,
        backend: FlashInferBackend,
        kv_caches: list[torch.Tensor],
        scratch_page: int,
        max_batch_size: int,
        max_pages_per_seq: int,
        pool,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.scratch_page = scratch_page
        self.page_size = backend.shape.page_size
        device = backend.shape.device
        sizes = [s for s in CAPTURE_SIZES if s < max_batch_size] + [max_batch_size]
        # a level lists each row's pages at most once, plus a scratch page per unused entry
        self.max_page_indices = max_batch_size * max_pages_per_seq
        self.page_indices = [
            torch.zeros(self.max_page_indices + max_batch_size, dtype=torch.int32, device=device)
            for _ in range(max(LEVELS))
        ]
        self.pool = pool
        self.graphs: dict[tuple[int, int], _CascadeGraph] = {}
        for size in sorted(sizes, reverse=True):  # largest first: later ones reuse its pool
            for levels in LEVELS:
                self.graphs[size, levels] = self._capture(size, levels)
        self.sizes = sorted(sizes)

    def fits(self, layout: BatchLayout) -> bool:
        """A decode step the backend runs as a cascade, with a graph of its shape."""
        if not layout.is_decode or layout.batch_size > self.sizes[-1]:
            return False
        plan = self.backend.cascade_plan(layout)
        return (
            plan is not None
            and len(plan.levels) in LEVELS
            and layout.kv_page_indices.numel() <= self.max_page_indices
        )

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout):
        """Final hidden states [n, hidden] of a decode step of n rows that ``fits``
        (the graph stops before the LM head: a [size, vocab] output per graph would
        hold hundreds of MB)."""
        plan = self.backend.cascade_plan(layout)
        n = layout.batch_size
        size = next(s for s in self.sizes if s >= n)
        g = self.graphs[size, len(plan.levels)]
        padded = pad_cascade(plan, layout, size, self.scratch_page)
        load_step(g, input_ids, positions, layout.slot_mapping, self.scratch_page, self.page_size)
        g.order.copy_(padded.order, non_blocking=True)
        self.backend.plan_levels(g.wrappers, padded.levels)
        g.graph.replay()
        self.backend.last_plan_kind = "cascade"
        return g.hidden[:n]

    def _capture_levels(self, size: int, levels: int) -> tuple[CascadeLevel, ...]:
        """Every level: ``size`` one-row entries on one scratch-page token."""
        i32 = torch.int32
        entry = CascadeLevel(
            torch.arange(size + 1, dtype=i32),
            torch.arange(size + 1, dtype=i32),
            torch.full((size,), self.scratch_page, dtype=i32),
            torch.ones(size, dtype=i32),
        )
        return (entry,) * levels

    @torch.inference_mode()
    def _capture(self, size: int, levels: int) -> _CascadeGraph:
        device = self.backend.shape.device
        i32 = dict(dtype=torch.int32, device=device)
        wrappers = tuple(
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.backend.workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=torch.zeros(size + 1, **i32),
                paged_kv_indptr_buf=torch.zeros(size + 1, **i32),
                paged_kv_indices_buf=self.page_indices[i],
                paged_kv_last_page_len_buf=torch.zeros(size, **i32),
            )
            for i in range(levels)
        )
        self.backend.plan_levels(wrappers, self._capture_levels(size, levels))
        input_ids = torch.zeros(size, dtype=torch.long, device=device)
        positions = torch.zeros(size, dtype=torch.long, device=device)
        slots = torch.full((size,), self.scratch_page * self.page_size, dtype=torch.int32)
        kv_rows = kv_write_rows(slots, self.page_size).to(device)
        order = torch.arange(size, dtype=torch.long, device=device)
        metadata = FlashInferMetadata(
            kv_rows,
            wrapper=None,
            cascade=wrappers,
            cascade_rows=order,
            flat_rows=torch.zeros(0, dtype=torch.long, device=device),
        )

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_caches, self.backend, metadata)

        graph, hidden = capture(forward, self.pool)
        return _CascadeGraph(size, graph, wrappers, input_ids, positions, kv_rows, order, hidden)
