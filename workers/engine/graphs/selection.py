"""CUDA graphs of an approximate request's selection pass: the first half of
``ModelRunner.repair_selecting``'s forward, in two graphs per token bucket: the
early layers (``DecoderModel.early_layers``: the layers before the selection layer
over every position the forward computes) and the deviation step
(``DecoderModel.selection_deviation``: that layer's projection and each candidate's
deviation there). Eagerly those are about 60 launches, which kept the host ~3 ms
behind the device at every approximate admission; through graphs they are two
replays (and a plan where a bucket's row starts elsewhere than last time, below).
Between the two the caller places the entries' KV from the selection layer on
(``repair_selecting``'s ``place``): the early layers overwrite the layers below it at
every placed position and read no other layer, so placement is needed only by the
deviation step, and its host work runs while the device runs the early layers.

Graphs come per token bucket (multiples of ``TOKEN_STEP`` up to ``MAX_TOKENS``: a
padding token costs its matmuls in every selection layer, so buckets are
fine-grained), captured on first use (about 0.1 s each; an engine that never serves
approximate reuse captures none). The forward is one layout row (consecutive
positions). Padding tokens compute token 0 at position 0, write their KV to the
scratch page and are never attended to by a real token
(``graphs.inputs.stage_selection``); outputs past the real tokens are never read.
Outputs land in buffers shared by every bucket, sized for the largest, so a graph
keeps no output memory of its own; intermediates draw on one memory pool.

A replay's inputs reach the device in two copies from pinned host buffers: the token
ids, positions, KV slots and candidate flags (int64), and the plan's inputs (int32:
the row's FlashInfer index arrays, which are the device buffers every bucket's
wrapper reads, then the sequence's page indices). The planned row is the whole
bucket, padding tokens last (``stage_selection``), so a bucket's plan depends only on
where the row starts (the exactly matched prefix before it): a graph is planned again
only when that differs from its last replay's, so admissions after the same system
prompt, or after none, start their early layers with no plan at all (the plan was the
largest host cost before the first replay: 0.47 ms on an H200's host). A re-plan calls
FlashInfer's compiled planner directly (``flashinfer_backend.one_row_planner``), about
0.1 ms less host time than ``wrapper.plan``. The kept
rows' positions, slots and page table are read from the same device buffers
(``Selection``), so nothing else is copied between the selection pass and the kept
rows. Where FlashInfer's wrapper does not look as that planner expects, no graph is
captured and the selection pass runs eagerly.
FlashInfer copies a plan to the device from a pinned host buffer of the wrapper,
and these copies read the pinned buffers after the host moves on, so nothing pinned
is written again until the last replay's copies ran (an event recorded after them):
two admissions back to back keep the host at most one selection pass ahead of the
device (the second waits until the device reaches the first's copies).

Memory, none of it counted when the engine sizes the KV pool (it comes from the
headroom left beside it): the shared buffers, about 130 MiB for qwen3-0.6b (qkv, the
hidden states and the residual stream of 8,192 tokens) and the inputs' 0.25 MiB on
the device and in pinned host memory, allocated with the first graph; per bucket
captured, its FlashInfer wrapper's 8 MiB device workspace and 8 MiB of pinned host
memory; the graphs' pool, about what the largest bucket's early layers need at once.

Kernel: every bucket runs FlashInfer's default prefill kernel (FA3 on Hopper), also
where an eager step would take the split-KV kernel (``prefers_split_kv``: a few hundred
new tokens over a long prefix), which is slower there; the launches it saves weigh more
(not measured apart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import flashinfer
import numpy as np
import torch

from workers.engine.attention.base import kv_write_rows
from workers.engine.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferMetadata,
    one_row_planner,
    plan_prefill,
)
from workers.engine.graphs.capture import capture
from workers.engine.graphs.inputs import (
    PLAN_FIELDS,
    PLAN_PAGES,
    capture_layout,
    input_layout,
    padded_row_pages,
    stage_selection,
)
from workers.engine.models.decoder import DecoderModel

log = logging.getLogger(__name__)

TOKEN_STEP = 512
MAX_TOKENS = 8192  # longer forwards run eagerly: their launches are a small share


class Selection(NamedTuple):
    """A selection pass's outputs for its n tokens, views of shared device buffers
    valid until the next run: ``selection_deviation``'s three, then the tokens'
    positions and KV slots (int64) and the sequence's page table (int32)."""

    qkv: torch.Tensor
    residual: torch.Tensor
    deviation: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    page_table: torch.Tensor


@dataclass
class _Graph:
    early: torch.cuda.CUDAGraph
    deviation: torch.cuda.CUDAGraph
    plan: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # one_row_planner's
    planned_start: int  # the row's start its wrapper holds a plan for (stage_selection)
    # views of the shared device input buffer, sized to the bucket (input_layout)
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    candidate: torch.Tensor  # int64 flags


class Started(NamedTuple):
    """An early-layers replay queued by ``SelectionGraphs.start`` (``finish`` takes it)."""

    graph: _Graph
    tokens: int  # real tokens (the bucket's graph runs padding beyond them)
    plan_end: int  # the plan inputs' length: PLAN_PAGES + the sequence's pages


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
        self.plannable = True  # False: FlashInfer's wrapper is not as one_row_planner reads it
        self.copied: torch.cuda.Event | None = None  # after the last replay's copies

    def _allocate(self) -> None:
        """The buffers every bucket shares, sized for the largest."""
        device = self.backend.shape.device
        attention = self.model.layers[self.layer].self_attn
        width = attention.q_size + 2 * attention.kv_size
        dtype = self.kv_caches[0].dtype
        n = MAX_TOKENS
        self.inputs = torch.zeros(4 * n, dtype=torch.long, device=device)
        self.staged = torch.zeros(4 * n, dtype=torch.long, pin_memory=True)
        self.staged_np = self.staged.numpy()
        # a planned row's pages: a sequence's and a bucket's padding after them
        pages = PLAN_PAGES + self.max_pages_per_seq + -(-n // self.page_size)
        self.plan_inputs = torch.zeros(pages, dtype=torch.int32, device=device)
        self.plan_staged = torch.zeros(pages, dtype=torch.int32, pin_memory=True)
        self.plan_np = self.plan_staged.numpy()
        self.qkv = torch.zeros((n, width), dtype=dtype, device=device)
        hidden = self.model.config.hidden_size
        self.hidden = torch.zeros((n, hidden), dtype=dtype, device=device)
        self.residual = torch.zeros((n, hidden), dtype=dtype, device=device)
        self.deviation = torch.zeros(n, dtype=torch.float32, device=device)
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def bucket(tokens: int) -> int | None:
        """The token bucket of a forward over ``tokens`` positions (None: eager)."""
        if not 0 < tokens <= MAX_TOKENS:
            return None
        return -(-tokens // TOKEN_STEP) * TOKEN_STEP

    @torch.inference_mode()
    def start(
        self,
        input_ids: np.ndarray,  # [n]: the ids at positions start..start + n - 1
        start: int,
        page_table: np.ndarray,  # int32: the sequence's pages
        candidate: np.ndarray,  # [n] bool
    ) -> Started | None:
        """Queue the early layers over one row of n consecutive positions from
        ``start``, or None when no graph serves them (run the selection pass
        eagerly)."""
        n = len(input_ids)
        tokens = self.bucket(n)
        pages = -(-(start + n) // self.page_size)
        if tokens is None or not self.plannable or pages > self.max_pages_per_seq:
            return None
        if self.pool is None:
            self._allocate()
        g = self.graphs.get(tokens) or self._capture(tokens)
        if g is None:
            return None
        if self.copied is not None:  # the last replay's copies read the pinned buffers
            self.copied.synchronize()
        stage_selection(
            self.staged_np,
            self.plan_np,
            tokens,
            input_ids,
            start,
            page_table,
            candidate,
            self.scratch_page,
            self.page_size,
        )
        self.inputs[: 4 * tokens].copy_(self.staged[: 4 * tokens], non_blocking=True)
        row_end = PLAN_PAGES + padded_row_pages(start, tokens, self.page_size)
        self.plan_inputs[:row_end].copy_(self.plan_staged[:row_end], non_blocking=True)
        if g.planned_start != start:
            host = self.plan_staged
            g.plan(
                host[PLAN_FIELDS["qo_indptr"]],
                host[PLAN_FIELDS["kv_page_indptr"]],
                host[PLAN_FIELDS["kv_len"]],
            )
            g.planned_start = start
        self.copied = torch.cuda.Event()
        self.copied.record()
        g.early.replay()
        return Started(g, n, PLAN_PAGES + pages)

    @torch.inference_mode()
    def finish(self, started: Started) -> Selection:
        """Queue the deviation step after ``start``'s early layers (and whatever the
        caller queued in between); its outputs."""
        g, n = started.graph, started.tokens
        g.deviation.replay()
        return Selection(
            self.qkv[:n],
            self.residual[:n],
            self.deviation[:n],
            g.positions[:n],
            g.slots[:n],
            self.plan_inputs[PLAN_PAGES : started.plan_end],
        )

    def _capture(self, tokens: int) -> _Graph | None:
        device = self.backend.shape.device
        views = {name: self.plan_inputs[at] for name, at in PLAN_FIELDS.items()}
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.backend.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=views["qo_indptr"],
            paged_kv_indptr_buf=views["kv_page_indptr"],
            paged_kv_indices_buf=self.plan_inputs[PLAN_PAGES:],
            paged_kv_last_page_len_buf=views["kv_last_page_len"],
        )
        # captured over the scratch page: one row of ``tokens`` tokens, none a candidate
        layout = capture_layout(tokens, 1, self.scratch_page, self.page_size)
        plan_prefill(wrapper, layout, self.backend.shape)
        plan = one_row_planner(wrapper, self.backend.shape)
        if plan is None:
            log.warning(
                "FlashInfer %s's prefill wrapper is not as chunkserve's one-row planner "
                "reads it: an approximate admission's selection pass runs eagerly",
                flashinfer.__version__,
            )
            self.plannable = False
            return None
        at = input_layout(tokens)
        g = _Graph(
            None,
            None,
            plan,
            0,  # the capture layout's row is the bucket's row from position 0
            self.inputs[at["input_ids"]],
            self.inputs[at["positions"]],
            self.inputs[at["slots"]],
            self.inputs[at["candidate"]],
        )
        g.input_ids.zero_()
        g.positions.zero_()
        g.slots.copy_(layout.slot_mapping.to(device))
        g.candidate.zero_()

        def early() -> None:
            metadata = FlashInferMetadata(kv_write_rows(g.slots, self.page_size), wrapper)
            hidden, residual = self.model.early_layers(
                g.input_ids, g.positions, self.kv_caches, self.backend, metadata, self.layer
            )
            self.hidden[:tokens].copy_(hidden)
            self.residual[:tokens].copy_(residual)

        def deviation() -> None:
            qkv, residual, deviation = self.model.selection_deviation(
                self.hidden[:tokens],
                self.residual[:tokens],  # overwritten in place with fused ops
                g.positions,
                self.kv_caches[self.layer],
                kv_write_rows(g.slots, self.page_size),
                self.layer,
                g.candidate.bool(),
            )
            self.qkv[:tokens].copy_(qkv)
            self.residual[:tokens].copy_(residual)  # a no-op where it is the same
            self.deviation[:tokens].copy_(deviation)

        g.early, _ = capture(early, self.pool)
        g.deviation, _ = capture(deviation, self.pool)
        self.graphs[tokens] = g
        return g
