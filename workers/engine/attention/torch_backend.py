"""Reference attention backend in plain torch; runs on any device.

Correctness reference for the FlashInfer backend and the CPU path: it gathers each
sequence's pages and runs softmax attention per sequence, masked by position (a new
token sees the KV positions up to its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.attention.base import (
    AttentionShape,
    BatchLayout,
    kv_write_rows,
    position_mask,
    write_kv,
)


@dataclass(frozen=True)
class TorchSequencePlan:
    q_start: int
    q_end: int
    kv_pages: torch.Tensor  # [kv_len] page of each KV position, on the cache's device
    kv_offsets: torch.Tensor  # [kv_len] offset within the page
    mask: torch.Tensor  # [q_len, kv_len] bool, True where attention is allowed


@dataclass(frozen=True)
class TorchMetadata:
    kv_rows: torch.Tensor
    sequences: tuple[TorchSequencePlan, ...]


class TorchAttentionBackend:
    name = "torch"
    fused_ops = False  # the reference: plain torch throughout
    graph_hooks = False  # the reference runs every step eagerly
    last_plan_kind = "torch"  # one kind of step: every sequence's attention in torch

    def __init__(self, shape: AttentionShape) -> None:
        self.shape = shape

    def wants_cascade(self, layout: BatchLayout) -> bool:
        return False

    def plan(self, layout: BatchLayout) -> TorchMetadata:
        device = self.shape.device
        page_size = layout.page_size
        offsets = torch.arange(page_size, dtype=torch.int64)
        plans = []
        for i in range(layout.batch_size):
            q_start, q_end = int(layout.qo_indptr[i]), int(layout.qo_indptr[i + 1])
            kv_len = int(layout.kv_lens[i])
            pages = layout.kv_page_indices[
                int(layout.kv_page_indptr[i]) : int(layout.kv_page_indptr[i + 1])
            ].long()
            kv_pages = pages.repeat_interleave(page_size)[:kv_len]
            kv_offsets = offsets.repeat(pages.numel())[:kv_len]
            mask = position_mask(layout, i)
            plans.append(
                TorchSequencePlan(
                    q_start, q_end, kv_pages.to(device), kv_offsets.to(device), mask.to(device)
                )
            )
        rows = kv_write_rows(layout.slot_mapping, layout.page_size).to(device)
        return TorchMetadata(rows, tuple(plans))

    def plan_aside(self, layout: BatchLayout) -> TorchMetadata:
        """Plans here share nothing: a forward queued aside takes a plain plan."""
        return self.plan(layout)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchMetadata,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, metadata.kv_rows)
        return self.attend(q, kv_cache, metadata)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchMetadata):
        out = torch.empty_like(q)
        for seq in metadata.sequences:
            out[seq.q_start : seq.q_end] = attend_masked(
                q[seq.q_start : seq.q_end],
                kv_cache,
                seq.kv_pages,
                seq.kv_offsets,
                seq.mask,
                self.shape,
            )
        return out


def attend_masked(
    q: torch.Tensor,  # [n, H, D]
    kv_cache: torch.Tensor,
    kv_pages: torch.Tensor,  # [L] page of each KV position
    kv_offsets: torch.Tensor,  # [L] offset within the page
    mask: torch.Tensor,  # [n, L] bool, True where attention is allowed
    shape: AttentionShape,
) -> torch.Tensor:
    """Softmax attention of ``q`` over one sequence's KV positions (float32), masked:
    [n, H, D] in ``q``'s dtype."""
    group = shape.num_heads // shape.num_kv_heads
    ks = kv_cache[kv_pages, 0, kv_offsets].transpose(0, 1).repeat_interleave(group, dim=0)
    vs = kv_cache[kv_pages, 1, kv_offsets].transpose(0, 1).repeat_interleave(group, dim=0)
    scores = (q.transpose(0, 1).float() @ ks.float().transpose(1, 2)) * shape.scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ vs.float()).to(q.dtype).transpose(0, 1)
