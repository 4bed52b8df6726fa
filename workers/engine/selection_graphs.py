"""CUDA graphs of an approximate request's selection pass: the first half of
``ModelRunner.repair_selecting``'s forward (``DecoderModel.selection_input``: the
layers before the selection layer over every position the forward computes, that
layer's projection, and each candidate's deviation there). Eagerly those are about
60 launches, which kept the host ~3 ms behind the device at every approximate
admission; through a graph they are one plan and one replay.

A graph per token bucket (multiples of ``TOKEN_STEP`` up to ``MAX_TOKENS``: a padding
token costs its matmuls in every selection layer, so buckets are fine-grained),
captured on first use (about 0.1 s each; an engine that never serves approximate
reuse captures none). The forward is one layout row (consecutive positions).
Padding tokens compute token 0 at position 0, write their KV to the scratch page and
are never attended to (``graph_inputs.stage_selection``); they are never candidates, so
their deviation is -inf. Outputs land in buffers shared by every bucket, sized for
the largest, so a graph keeps no output memory of its own; intermediates draw on one
memory pool.

A replay's inputs reach the device in one copy: the token ids, positions, K/V rows,
candidate flags and the sequence's page indices are written into one pinned host
buffer and copied at once into one device buffer (each bucket's graph reads its
views of it), and the FlashInfer plan's index arrays come from small pinned host
tensors. Pageable copies cost tens of microseconds of host time each: four of them
and two fills took about 0.26 ms before every replay on an H200's host, beside a
0.73 ms plan.
FlashInfer copies a plan to the device from a pinned host buffer of the wrapper,
and these copies read the pinned buffers after the host moves on, so nothing pinned
is written again until the last replay's copies ran (an event recorded after them):
two admissions back to back keep the host at most one selection pass ahead of the
device (the second waits until the device reaches the first's copies).

Memory, none of it counted when the engine sizes the KV pool (it comes from the
headroom left beside it): the shared buffers, about 80 MiB for qwen3-0.6b (qkv and the
residual stream of 8,192 tokens) and the inputs' 0.3 MiB on the device and in pinned
host memory, allocated with the first graph; per bucket captured, its FlashInfer
wrapper's 8 MiB device workspace and 8 MiB of pinned host memory; the graphs' pool,
about what the largest bucket's selection layers need at once.

Kernel: every bucket runs FlashInfer's default prefill kernel (FA3 on Hopper), also
where an eager step would take the split-KV kernel (``prefers_split_kv``: a few hundred
new tokens over a long prefix), which is slower there; the launches it saves weigh more
(not measured apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import flashinfer
import numpy as np
import torch

from workers.engine.attention.base import BatchLayout, kv_write_rows
from workers.engine.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferMetadata,
    plan_prefill,
)
from workers.engine.cuda_graphs import capture
from workers.engine.graph_inputs import input_layout, stage_selection
from workers.engine.models.decoder import DecoderModel
from workers.engine.prefill_graphs import capture_layout

TOKEN_STEP = 512
MAX_TOKENS = 8192  # longer forwards run eagerly: their launches are a small share


class _PlanIndices(NamedTuple):
    """What ``plan_prefill`` reads of a layout, from the pinned and device buffers."""

    qo_indptr: torch.Tensor
    kv_page_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    wrapper: flashinfer.BatchPrefillWithPagedKVCacheWrapper
    # views of the shared device input buffer, sized to the bucket (input_layout)
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_rows: torch.Tensor  # [2 * tokens]
    candidate: torch.Tensor  # [tokens] int64 flags


class SelectionGraphs:
    def __init__(
        self,
        model: DecoderModel,
        backend: FlashInferBackend,
        kv_caches: list[torch.Tensor],
        layer: int,
        scratch_page: int,
        max_pages_per_seq: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.layer = layer  # the selection layer
        self.scratch_page = scratch_page
        self.page_size = backend.shape.page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.pool = None  # the buffers and graphs come with the first run
        self.graphs: dict[int, _Graph] = {}
        self.copied: torch.cuda.Event | None = None  # after the last replay's copies

    def _allocate(self) -> None:
        """The buffers every bucket shares, sized for the largest."""
        device = self.backend.shape.device
        attention = self.model.layers[self.layer].self_attn
        width = attention.q_size + 2 * attention.kv_size
        dtype = self.kv_caches[0].dtype
        n = MAX_TOKENS
        # a sequence's pages, or a capture layout's (the largest bucket's scratch pages)
        pages = max(self.max_pages_per_seq, -(-n // self.page_size))
        self.inputs = torch.zeros(5 * n + pages, dtype=torch.long, device=device)
        self.staged = torch.zeros(5 * n + pages, dtype=torch.long, pin_memory=True)
        self.staged_np = self.staged.numpy()
        # the plan's index arrays of one row: qo_indptr, kv_page_indptr, last page's length
        self.indptrs = torch.zeros(5, dtype=torch.int32, pin_memory=True)
        self.indptrs_np = self.indptrs.numpy()
        self.qkv = torch.zeros((n, width), dtype=dtype, device=device)
        hidden = self.model.config.hidden_size
        self.residual = torch.zeros((n, hidden), dtype=dtype, device=device)
        self.deviation = torch.zeros(n, dtype=torch.float32, device=device)
        self.page_indices = torch.zeros(pages, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def bucket(tokens: int) -> int | None:
        """The token bucket of a forward over ``tokens`` positions (None: eager)."""
        if not 0 < tokens <= MAX_TOKENS:
            return None
        return -(-tokens // TOKEN_STEP) * TOKEN_STEP

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [n], CPU
        positions: torch.Tensor,  # [n], CPU
        layout: BatchLayout,  # one row: the forward's positions
        candidate: np.ndarray,  # [n] bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``selection_input``'s outputs for these n tokens (views of shared buffers,
        valid until the next run), or None when no graph serves them (run eagerly)."""
        n = layout.num_tokens
        tokens = self.bucket(n)
        if (
            tokens is None
            or layout.batch_size != 1
            or layout.kv_page_indices.numel() > self.max_pages_per_seq
        ):
            return None
        if self.pool is None:
            self._allocate()
        g = self.graphs.get(tokens) or self._capture(tokens)
        pages = self._stage(tokens, input_ids, positions, layout, candidate)
        at = input_layout(tokens)
        self.inputs[: at["pages"].start + pages].copy_(
            self.staged[: at["pages"].start + pages], non_blocking=True
        )
        indices = _PlanIndices(
            qo_indptr=self.indptrs[:2],
            kv_page_indptr=self.indptrs[2:4],
            kv_page_indices=self.inputs[at["pages"]][:pages],  # FlashInfer's copy narrows it
            kv_last_page_len=self.indptrs[4:],
        )
        plan_prefill(g.wrapper, indices, self.backend.shape)
        self.copied = torch.cuda.Event()
        self.copied.record()
        g.graph.replay()
        return self.qkv[:n], self.residual[:n], self.deviation[:n]

    def _stage(self, tokens, input_ids, positions, layout, candidate) -> int:
        """``stage_selection`` into the pinned buffers, once the last replay's copies
        from them ran; returns the number of pages."""
        if self.copied is not None:
            self.copied.synchronize()
        return stage_selection(
            self.staged_np,
            self.indptrs_np,
            tokens,
            input_ids,
            positions,
            layout,
            candidate,
            self.scratch_page * self.page_size,
        )

    def _capture(self, tokens: int) -> _Graph:
        device = self.backend.shape.device
        i32 = dict(dtype=torch.int32, device=device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.backend.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indices_buf=self.page_indices,
            paged_kv_last_page_len_buf=torch.zeros(1, **i32),
        )
        at = input_layout(tokens)
        g = _Graph(
            None,
            wrapper,
            self.inputs[at["input_ids"]],
            self.inputs[at["positions"]],
            self.inputs[at["kv_rows"]],
            self.inputs[at["candidate"]],
        )
        # captured over the scratch page: one row of ``tokens`` tokens, none a candidate
        layout = capture_layout(tokens, 1, self.scratch_page, self.page_size)
        g.input_ids.zero_()
        g.positions.zero_()
        g.kv_rows.copy_(kv_write_rows(layout.slot_mapping, self.page_size))
        g.candidate.zero_()
        plan_prefill(wrapper, layout, self.backend.shape)
        metadata = FlashInferMetadata(g.kv_rows, wrapper)

        def forward() -> None:
            qkv, residual, deviation = self.model.selection_input(
                g.input_ids,
                g.positions,
                self.kv_caches,
                self.backend,
                metadata,
                self.layer,
                g.candidate.bool(),
            )
            self.qkv[:tokens].copy_(qkv)
            self.residual[:tokens].copy_(residual)
            self.deviation[:tokens].copy_(deviation)

        g.graph, _ = capture(forward, self.pool)
        self.graphs[tokens] = g
        return g
