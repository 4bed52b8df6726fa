"""CUDA graphs for prefill steps of up to ``TOKEN_BUCKETS[-1]`` new tokens in up to
``ROW_BUCKETS[-1]`` layout rows, where an eager forward is bound by kernel launches,
not by the GPU: a cache hit's uncached tail, a short prompt, a few short prompts
batched, and an approximate request's first-token repair (``first_tokens`` without a
deviation ratio: one row per placed chunk's first tokens). Repairs chosen by deviation
run at admission instead (``graphs.kept``).

One graph per (token bucket, row bucket, kernel), the kernel the step's eager plan
would take (``FlashInferBackend.prefill_kernel``): steps that ``prefers_split_kv`` (a
few short rows over a long KV, at most ``max_split_kv_tokens`` new tokens) replay
graphs whose attention is FlashInfer's FA2 with the KV split over CTAs; steps of many
rows of a token or a few (``prefers_small_query_tiles``: decoding requests beside a
cache hit's tail, scattered repair runs) FA2 graphs with as many rows as tokens
(``SMALL_TILE_TOKENS``, those whose split scratch fits the shared workspace); the
others graphs of the default kernel (FA3 on Hopper), as does a step whose kernel has no
graph that fits it (``base.choose_graph``). In CUDA-graph mode FA2 fixes its query tile
when the graph is captured, from the longest row the captured shape allows (tokens -
rows + 1): 1 in the small-tile graphs, so their tile is FA2's smallest. The step's real
tokens fill the front of
the token bucket; padding tokens compute on token 0 at position 0, write their KV only
to the scratch page, and are never attended to. Padding rows have no query tokens and
one scratch page of KV, so the attention kernels do no work for them. Before each
replay the graph's FlashInfer prefill wrapper is re-planned into its fixed buffers, so
cached prefixes may be as long as a sequence can be. The wrappers share one page-index
buffer (only one graph runs at a time, planned right before its replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import flashinfer
import numpy as np
import torch

from workers.engine.attention.base import (
    QUERY_TILE,
    BatchLayout,
    choose_graph,
    kv_write_rows,
    max_split_kv_tokens,
    small_tile_scratch_bytes,
)
from workers.engine.attention.flashinfer_backend import (
    PLAN_KINDS,
    WORKSPACE_BYTES,
    FlashInferBackend,
    FlashInferMetadata,
    plan_prefill,
)
from workers.engine.graphs.capture import capture
from workers.engine.graphs.inputs import capture_layout, load_step
from workers.engine.models.decoder import DecoderModel

# 384, 640 and 768: steps of a few hundred tokens (a cache hit's tail; before session
# 29, an approximate request's repair step of 288 + 227 tokens) padded to 512 or 1,024
# ran their matmuls on up to twice their rows.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 1024)
ROW_BUCKETS = (1, 32, 1024)
# small-tile graphs (as many rows as tokens), those whose FA2 split scratch takes at most
# half the shared workspace (``small_tile_scratch_bytes``: all of these for qwen3-0.6b,
# up to 256 for 32 query heads); a step of more than 512 tokens averaging at most a few
# a row is rare
SMALL_TILE_TOKENS = (32, 64, 128, 256, 512)


@dataclass
class _PrefillGraph:
    tokens: int
    rows: int
    kernel: str  # a PLAN_KINDS key (FlashInferBackend.prefill_kernel)
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
        device = backend.shape.device
        # every row may see a whole sequence; a step's rows share one sequence's pages
        # (scattered runs) or split the batch's, so this bounds any layout we accept
        self.max_page_indices = ROW_BUCKETS[-1] * max_pages_per_seq
        padding = ROW_BUCKETS[-1]  # a scratch page per padding row
        self.page_indices = torch.zeros(
            self.max_page_indices + padding, dtype=torch.int32, device=device
        )
        # a layout that needs row bucket r has more rows, so more tokens, than the bucket
        # below r: no graph for token buckets that cannot reach it
        keys = [
            (t, r, "default")
            for t in TOKEN_BUCKETS
            for below, r in zip((0, *ROW_BUCKETS), ROW_BUCKETS, strict=False)
            if below < t
        ]
        # a split-KV step has at most one row per query tile
        split_tokens = max_split_kv_tokens(backend.shape.num_heads, backend.num_sms)
        split_rows = split_tokens // QUERY_TILE
        keys += [
            (t, r, "split-kv")
            for t, r, _ in keys
            if t <= split_tokens
            and (r == ROW_BUCKETS[0] or ROW_BUCKETS[ROW_BUCKETS.index(r) - 1] < split_rows)
        ]
        shape = backend.shape
        keys += [
            (t, t, "small-tiles")
            for t in SMALL_TILE_TOKENS
            if small_tile_scratch_bytes(t, shape.num_heads, shape.num_kv_heads, shape.head_dim)
            <= WORKSPACE_BYTES // 2
        ]
        self.graphs = {key: self._capture(*key) for key in sorted(keys, reverse=True)}
        self.buckets = sorted(self.graphs)
        self._memo: tuple[BatchLayout, tuple[int, int, str] | None] | None = None

    def _bucket(self, layout: BatchLayout) -> tuple[int, int, str] | None:
        """The graph for ``layout`` (asked by ``can_run``, then ``run``: worked out once):
        the smallest of the step's kernel that fits it, else of the default kernel."""
        if self._memo is not None and self._memo[0] is layout:
            return self._memo[1]
        kernel = self.backend.prefill_kernel(layout)
        key = choose_graph(self.buckets, layout.num_tokens, layout.batch_size, kernel)
        self._memo = (layout, key)
        return key

    def can_run(self, layout: BatchLayout) -> bool:
        return (
            layout.num_tokens > layout.batch_size  # decode steps have graphs of their own
            and layout.kv_page_indices.numel() <= self.max_page_indices
            and self._bucket(layout) is not None
        )

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout):
        """Final hidden states [n, hidden] of the step's n new tokens."""
        n = layout.num_tokens
        g = self.graphs[self._bucket(layout)]
        load_step(g, input_ids, positions, layout.slot_mapping, self.scratch_page, self.page_size)
        plan_prefill(g.wrapper, self._padded(layout, g.rows), self.backend.shape)
        g.graph.replay()
        self.backend.last_plan_kind = PLAN_KINDS[g.kernel]
        return g.hidden[:n]

    def _padded(self, layout: BatchLayout, rows: int) -> BatchLayout:
        """``layout`` with empty rows appended up to ``rows``: no query tokens, one
        scratch page of KV (host arrays: this runs before every replay)."""
        pad = rows - layout.batch_size
        if pad == 0:
            return layout
        ones = np.ones(pad, dtype=np.int32)

        def extend(t: torch.Tensor, tail: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.concatenate((t.numpy(), tail)))

        qo, kv_indptr = layout.qo_indptr.numpy(), layout.kv_page_indptr.numpy()
        return BatchLayout(
            qo_indptr=extend(layout.qo_indptr, np.full(pad, qo[-1], dtype=np.int32)),
            kv_page_indptr=extend(
                layout.kv_page_indptr, kv_indptr[-1] + ones.cumsum(dtype=np.int32)
            ),
            kv_page_indices=extend(
                layout.kv_page_indices, np.full(pad, self.scratch_page, dtype=np.int32)
            ),
            kv_last_page_len=extend(layout.kv_last_page_len, ones),
            kv_lens=extend(layout.kv_lens, ones),
            slot_mapping=layout.slot_mapping,
            page_size=layout.page_size,
        )

    @torch.inference_mode()
    def _capture(self, tokens: int, rows: int, kernel: str) -> _PrefillGraph:
        device = self.backend.shape.device
        i32 = dict(dtype=torch.int32, device=device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.backend.workspace,
            "NHD",
            backend="auto" if kernel == "default" else "fa2",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(rows + 1, **i32),
            paged_kv_indptr_buf=torch.zeros(rows + 1, **i32),
            paged_kv_indices_buf=self.page_indices,
            paged_kv_last_page_len_buf=torch.zeros(rows, **i32),
        )
        layout = capture_layout(tokens, rows, self.scratch_page, self.page_size)
        plan_prefill(wrapper, layout, self.backend.shape)
        input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        positions = torch.zeros(tokens, dtype=torch.long, device=device)
        kv_rows = kv_write_rows(layout.slot_mapping, self.page_size).to(device)
        metadata = FlashInferMetadata(kv_rows, wrapper)

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_caches, self.backend, metadata)

        graph, hidden = capture(forward, self.pool)
        return _PrefillGraph(
            tokens, rows, kernel, graph, wrapper, input_ids, positions, kv_rows, hidden
        )
