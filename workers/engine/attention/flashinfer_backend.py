"""FlashInfer attention on CUDA: paged prefill (cached prefix + new tokens), paged
decode, and cascade decode for requests that share leading pages. Scattered
positions need nothing special: the layout gives each run its own causal row.
Prefill steps of a few short rows over a long KV take FA2, which splits the KV over
CTAs (``base.prefers_split_kv``), and so do steps of many rows of a token or a few
(``base.prefers_small_query_tiles``: FA2's small query tiles); others FlashInfer's
default (FA3 on Hopper).

Plans are built once per step (``plan``) and reused by every layer (``forward``).
"""

from __future__ import annotations

from dataclasses import dataclass

import flashinfer
import torch

from workers.engine import device_properties
from workers.engine.attention.base import (
    AttentionShape,
    BatchLayout,
    kv_write_rows,
    prefers_small_query_tiles,
    prefers_split_kv,
    write_kv,
)
from workers.engine.attention.cascade_plan import (
    MIN_SAVED_BYTES_PER_LAYER,
    MIN_SAVED_BYTES_PER_LAYER_EAGER,
    CascadePlan,
    plan_cascade,
)

WORKSPACE_BYTES = 256 * 2**20
# a prefill step's kernel (``FlashInferBackend.prefill_kernel``) and its last_plan_kind;
# both FA2 kinds plan eagerly on one wrapper, which picks its query tile from the rows
PLAN_KINDS = {
    "default": "prefill",
    "split-kv": "prefill-split",
    "small-tiles": "prefill-small-tiles",
}
ASIDE_PLANS = 2  # plan_aside's ring: forwards queued at once before one waits


class _PrefillWrappers:
    """A paged prefill wrapper of each kernel: FlashInfer's default (FA3 on Hopper),
    and FA2, which splits a row's KV over several CTAs and picks its query tile from
    the rows (``FlashInferBackend.prefill_kernel`` says when). ``planned``: in
    ``plan_aside``'s ring, an event recorded after the last plan's copy to the device
    was queued."""

    def __init__(self, workspace: torch.Tensor) -> None:
        self.default = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.fa2 = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        self.planned: torch.cuda.Event | None = None

    def pick(self, fa2: bool):
        return self.fa2 if fa2 else self.default


@dataclass(frozen=True)
class FlashInferMetadata:
    kv_rows: torch.Tensor  # [2T] int64 on the device, see kv_write_rows
    wrapper: object  # the planned prefill or decode wrapper (flat rows)
    cascade: tuple | None = None  # planned prefill wrappers, one per cascade level
    cascade_rows: torch.Tensor | None = None
    flat_rows: torch.Tensor | None = None


class FlashInferBackend:
    name = "flashinfer"
    fused_ops = True  # models run FlashInfer's fused norms, RoPE and gate (layers/ops)
    graph_hooks = True  # ``workers.engine.graphs`` captures its steps (the plan hooks)

    def __init__(
        self,
        shape: AttentionShape,
        enable_cascade: bool = True,
        min_saved_tokens: int | None = None,
    ) -> None:
        self.shape = shape
        self.enable_cascade = enable_cascade
        # tokens of KV whose reads cascade must save a layer (None: from the cost model
        # of the path cascade steps take: eager until cascade graphs are captured)
        self._cost_model_threshold = min_saved_tokens is None
        self.min_saved_tokens = (
            self._saved_tokens_worth(MIN_SAVED_BYTES_PER_LAYER_EAGER)
            if min_saved_tokens is None
            else min_saved_tokens
        )
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=shape.device)
        self.prefill = _PrefillWrappers(self.workspace)  # the steps'
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self._level_wrappers: list[flashinfer.BatchPrefillWithPagedKVCacheWrapper] = []
        self.num_sms = device_properties.sm_count(shape.device)
        # the last step's attention, planned here or by a graph (for tests, benchmarks):
        # a PLAN_KINDS value | "decode" | "cascade"
        self.last_plan_kind = ""
        self._memo: tuple[BatchLayout, CascadePlan | None] | None = None
        self._aside: list[_PrefillWrappers] = []  # plan_aside's ring
        self._aside_next = 0

    def _saved_tokens_worth(self, saved_bytes_per_layer: float) -> int:
        s = self.shape
        return int(saved_bytes_per_layer / (2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize))

    @property
    def use_tensor_cores(self) -> bool:
        return self.shape.num_heads // self.shape.num_kv_heads >= 4

    def prefers_split_kv(self, layout: BatchLayout) -> bool:
        return prefers_split_kv(layout, self.shape.num_heads, self.num_sms)

    def prefill_kernel(self, layout: BatchLayout) -> str:
        """The prefill kernel a step's attention takes (a ``PLAN_KINDS`` key): FA2 with
        its smallest query tile for rows of a token or a few
        (``base.prefers_small_query_tiles``), FA2 splitting the KV for a few short rows
        over a long KV (``base.prefers_split_kv``), else the default."""
        s = self.shape
        if prefers_small_query_tiles(layout, s.num_heads, s.num_kv_heads):
            return "small-tiles"
        return "split-kv" if self.prefers_split_kv(layout) else "default"

    def wants_cascade(self, layout: BatchLayout) -> bool:
        return self.cascade_plan(layout) is not None

    def cascade_plan(self, layout: BatchLayout) -> CascadePlan | None:
        """Planned once per step: ``wants_cascade`` and ``plan`` see the same layout."""
        if not self.enable_cascade:
            return None
        if self._memo is None or self._memo[0] is not layout:
            self._memo = (layout, plan_cascade(layout, min_saved_tokens=self.min_saved_tokens))
        return self._memo[1]

    def plan(self, layout: BatchLayout) -> FlashInferMetadata:
        if not layout.is_decode:
            kernel = self.prefill_kernel(layout)
            self.last_plan_kind = PLAN_KINDS[kernel]
            return self._plan_prefill(layout, self.prefill.pick(kernel != "default"))
        slots = kv_write_rows(layout.slot_mapping, layout.page_size).to(
            self.shape.device, non_blocking=True
        )
        cascade = self.cascade_plan(layout)
        if cascade is None:
            self._plan_decode(layout)
            self.last_plan_kind = "decode"
            return FlashInferMetadata(slots, self.decode)
        self.last_plan_kind = "cascade"
        return self._plan_cascade(layout, cascade, slots)

    def plan_aside(self, layout: BatchLayout) -> FlashInferMetadata:
        """A prefill plan for a forward queued outside the steps (an approximate
        request's selection forward, at admission): wrappers of its own, in a ring.
        FlashInfer copies a plan to the device from a pinned host buffer, queued on
        the stream; planning the same wrapper again before that copy ran rewrites the
        buffer under it, and the earlier forward runs on the later plan (an illegal
        memory access, seen with two admissions queued back to back). So a step's plan
        never shares these wrappers, and a wrapper is planned again only after the
        copy of its previous plan ran (an event recorded after it)."""
        if not self._aside:
            self._aside = [_PrefillWrappers(self.workspace) for _ in range(ASIDE_PLANS)]
        aside = self._aside[self._aside_next]
        self._aside_next = (self._aside_next + 1) % ASIDE_PLANS
        if aside.planned is not None:
            aside.planned.synchronize()
        metadata = self._plan_prefill(layout, aside.pick(self.prefers_split_kv(layout)))
        aside.planned = torch.cuda.Event()
        aside.planned.record()
        return metadata

    def _plan_prefill(self, layout: BatchLayout, wrapper) -> FlashInferMetadata:
        slots = kv_write_rows(layout.slot_mapping, layout.page_size).to(
            self.shape.device, non_blocking=True
        )
        plan_prefill(wrapper, layout, self.shape)
        return FlashInferMetadata(slots, wrapper)

    def cascade_captured(self) -> None:
        """Hook: the runner captured cascade decode graphs (``graphs.step``), so cascade
        steps take their cheaper path: the threshold follows (unless it was given)."""
        if self._cost_model_threshold:
            self.min_saved_tokens = self._saved_tokens_worth(MIN_SAVED_BYTES_PER_LAYER)

    def forward(self, q, k, v, kv_cache, metadata: FlashInferMetadata) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.kv_rows)
        return self.attend(q, kv_cache, metadata)

    def attend(self, q, kv_cache, metadata: FlashInferMetadata) -> torch.Tensor:
        if metadata.cascade is None:
            return metadata.wrapper.run(q, kv_cache)
        out = torch.empty_like(q)
        out[metadata.cascade_rows] = _run_levels(
            metadata.cascade, q[metadata.cascade_rows], kv_cache
        )
        if metadata.flat_rows.numel():
            out[metadata.flat_rows] = metadata.wrapper.run(q[metadata.flat_rows], kv_cache)
        return out

    # -- planning --------------------------------------------------------------
    def _plan_decode(self, layout: BatchLayout) -> None:
        plan_decode(self.decode, layout, self.shape)

    def _plan_cascade(
        self, layout: BatchLayout, cascade: CascadePlan, slots: torch.Tensor
    ) -> FlashInferMetadata:
        """One prefill wrapper per level, merged by log-sum-exp: what FlashInfer's
        MultiLevelCascadeAttentionWrapper does, plus a kv split for shared levels.
        A shared level has few query tiles (one group) over a long prefix, so
        without splitting the prefix it would occupy a fraction of the SMs."""
        while len(self._level_wrappers) < len(cascade.levels):
            self._level_wrappers.append(
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            )
        wrappers = self._level_wrappers[: len(cascade.levels)]
        self.plan_levels(wrappers, cascade.levels)
        flat_rows = cascade.flat_rows
        if flat_rows.numel():
            self._plan_decode(_select_rows(layout, flat_rows.tolist()))
        device = self.shape.device
        return FlashInferMetadata(
            slots,
            self.decode,
            cascade=tuple(wrappers),
            cascade_rows=cascade.rows.to(device).long(),
            flat_rows=flat_rows.to(device).long(),
        )

    def plan_levels(self, wrappers, levels) -> None:
        """Plan one prefill wrapper per cascade level (eager, or a cascade graph's):
        shared levels attend to their whole prefix, split over CTAs; the last level,
        each row's own pages, causally."""
        last = len(levels) - 1
        for i, (wrapper, level) in enumerate(zip(wrappers, levels, strict=True)):
            plan_prefill(
                wrapper,
                level,
                self.shape,
                causal=i == last,
                fixed_split_size=None if i == last else self._split_pages(level),
            )

    def _split_pages(self, level) -> int:
        """Pages per kv chunk so a shared level launches about two waves of CTAs."""
        s = self.shape
        rows = level.qo_indptr[1:] - level.qo_indptr[:-1]
        group = s.num_heads // s.num_kv_heads
        q_tiles = int(((rows * group + 127) // 128).sum()) * s.num_kv_heads
        pages = int(level.kv_page_indptr[-1])
        chunks = max(1, -(-2 * self.num_sms // max(q_tiles, 1)))
        return max(16, -(-pages // chunks))


def _select_rows(layout: BatchLayout, rows: list[int]) -> BatchLayout:
    """The decode layout of a subset of the batch's requests."""
    indptr = layout.kv_page_indptr.tolist()
    indices = layout.kv_page_indices
    new_indices = [indices[indptr[r] : indptr[r + 1]] for r in rows]
    counts = [indptr[r + 1] - indptr[r] for r in rows]
    new_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
    new_indptr[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    index = torch.tensor(rows, dtype=torch.long)
    return BatchLayout(
        qo_indptr=torch.arange(len(rows) + 1, dtype=torch.int32),
        kv_page_indptr=new_indptr,
        kv_page_indices=torch.cat(new_indices),
        kv_last_page_len=layout.kv_last_page_len[index],
        kv_lens=layout.kv_lens[index],
        slot_mapping=layout.slot_mapping[index],
        page_size=layout.page_size,
    )


def _run_levels(wrappers, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    out, lse = wrappers[-1].run(q, kv_cache, return_lse=True)
    for wrapper in wrappers[:-1]:
        partial, partial_lse = wrapper.run(q, kv_cache, return_lse=True)
        flashinfer.merge_state_in_place(out, lse, partial, partial_lse)
    return out


def plan_prefill(
    wrapper,
    layout,
    shape: AttentionShape,
    causal: bool = True,
    fixed_split_size=None,
) -> None:
    """Plan a paged prefill wrapper (also cascade levels and graph-mode wrappers);
    ``layout`` has ``qo_indptr``, ``kv_page_indptr``, ``kv_page_indices``,
    ``kv_last_page_len``."""
    wrapper.plan(
        layout.qo_indptr,
        layout.kv_page_indptr,
        layout.kv_page_indices.to(shape.device, non_blocking=True),
        layout.kv_last_page_len,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.page_size,
        causal=causal,
        fixed_split_size=fixed_split_size,
        q_data_type=shape.dtype,
        kv_data_type=shape.dtype,
    )


# What ``one_row_planner`` reads of a planned wrapper (FlashInfer 0.6.6's
# BatchPrefillWithPagedKVCacheWrapper, read in its source).
_PLANNER_STATE = (
    "_cached_module",
    "_backend",
    "_float_workspace_buffer",
    "_int_workspace_buffer",
    "_pin_memory_int_workspace_buffer",
    "_max_total_num_rows",
    "_plan_info",
)


def one_row_planner(wrapper, shape: AttentionShape):
    """For a CUDA-graph prefill wrapper planned once (``plan_prefill``) whose device
    index buffers the caller fills itself: a function ``plan(qo_indptr,
    kv_page_indptr, kv_len)`` (pinned int32 host tensors of one causal row) that
    re-plans it with the compiled planner alone, or None when this FlashInfer's
    wrapper does not look as read (then plan through ``plan_prefill``).

    Why: an approximate admission waits for this plan before its selection graph
    starts, and ``wrapper.plan`` adds about 0.1 ms of host time around the compiled
    call (its own Python, a pageable copy of the KV lengths to the device; 0.5-0.6 ms
    in all on an H200's host, the compiled call 0.47 ms of it there, 0.17 ms in a
    small process). What it skips is what a graph-mode replay does not read:
    the copies into the wrapper's index buffers (the caller's), and host fields that
    only the cuDNN and TensorRT-LLM backends use."""
    if not all(hasattr(wrapper, name) for name in _PLANNER_STATE):
        return None
    if wrapper._backend not in ("fa2", "fa3") or wrapper._plan_info is None:
        return None
    module = wrapper._cached_module
    fixed = (
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
    )
    # the compiled plan's arguments after the index arrays, in its order: rows, batch
    # size, heads, KV heads, page size, CUDA-graph mode, head dims (QK, VO), causal,
    # window (-1: none); FA2 also takes its split size (-1: its own), disable_split_kv
    # (False) and colocated CTAs (0)
    after = (
        wrapper._max_total_num_rows,
        1,
        shape.num_heads,
        shape.num_kv_heads,
        shape.page_size,
        True,
        shape.head_dim,
        shape.head_dim,
        True,
        -1,
    ) + ((-1, False, 0) if wrapper._backend == "fa2" else ())

    def plan(qo_indptr: torch.Tensor, kv_page_indptr: torch.Tensor, kv_len: torch.Tensor) -> None:
        wrapper._plan_info = module.plan(*fixed, qo_indptr, kv_page_indptr, kv_len, *after)

    return plan


def plan_decode(wrapper, layout: BatchLayout, shape: AttentionShape) -> None:
    """Plan a paged decode wrapper (eager or graph-mode)."""
    wrapper.plan(
        layout.kv_page_indptr,
        layout.kv_page_indices.to(shape.device, non_blocking=True),
        layout.kv_last_page_len,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.page_size,
        q_data_type=shape.dtype,
        kv_data_type=shape.dtype,
    )
