"""Attention for the rows an approximate request keeps after its selection layer
(``DecoderModel.forward_kept``, from ``ModelRunner.repair_selecting``): queries at
scattered positions of one sequence (or of several, ``ScatteredBatch``, one
sequence's rows at a time), chosen on the device, each attending causally by
position over its sequence's paged KV. No host plan exists for rows the host never
sees, so this is not an ``AttentionBackend``'s ``plan``; it offers the two calls
``SelfAttention`` makes (``forward``, ``attend``) over ``ScatteredMetadata`` built
from device tensors.

On CUDA with fused ops the Triton kernel (``layers/scattered_kernel``) attends; else
plain torch, ``TorchAttentionBackend``'s own math (``attend_masked``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.engine.attention.base import AttentionShape, kv_write_rows, write_kv
from workers.engine.attention.torch_backend import attend_masked

if TYPE_CHECKING:  # the kernel's module imports Triton, which CPU hosts may lack
    from workers.engine.layers.scattered_kernel import SequenceBlocks


@dataclass(frozen=True)
class ScatteredMetadata:
    """Invariants: ``positions`` are ascending, each below ``kv_len``; ``page_table``
    covers ``kv_len`` positions; every position up to the last one holds KV or is
    among ``positions`` (written before attending)."""

    kv_rows: torch.Tensor  # [2N] int64, device: kv_write_rows of the rows' slots
    positions: torch.Tensor  # [N] int64, device
    page_table: torch.Tensor  # [ceil(kv_len / page_size)] int32, device
    kv_len: int


@dataclass(frozen=True)
class ScatteredBatch:
    """Kept rows of several sequences in one forward
    (``ModelRunner.repair_selecting_batch``). ``kv_rows`` covers every row, in order.
    With the kernel, one launch attends for all of them (``blocks``, over ``positions``
    and the sequences' tables joined in ``page_table``); in plain torch, rows
    ``[first, last)`` of each of ``segments`` attend by that sequence's own metadata."""

    kv_rows: torch.Tensor  # [2N] int64
    positions: torch.Tensor  # [N] int64: every row's
    page_table: torch.Tensor  # int32: the sequences' tables, one after another
    kv_len: int  # above every row's position
    blocks: SequenceBlocks | None = None  # with the kernel
    segments: tuple[tuple[int, int, ScatteredMetadata], ...] = ()  # without it


class ScatteredAttention:
    name = "scattered"

    def __init__(self, shape: AttentionShape, use_kernel: bool) -> None:
        self.shape = shape
        self.use_kernel = use_kernel  # the Triton kernel (CUDA only)

    def metadata(
        self, positions: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor, kv_len: int
    ) -> ScatteredMetadata:
        """For rows at ``positions`` (device, ascending) whose K/V go to ``slots``."""
        rows = kv_write_rows(slots, self.shape.page_size)
        return ScatteredMetadata(rows, positions, page_table, kv_len)

    def batch_metadata(
        self,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        segments: list[tuple[int, int, int, int, int]],
    ) -> ScatteredBatch:
        """For rows of several sequences: ``segments`` gives each one's rows
        ``[first, last)`` (positions ascending within), its page table
        ``tables[table_start:table_end]`` and its KV length."""
        kv_rows = kv_write_rows(slots, self.shape.page_size)
        kv_len = max(kv_len for *_, kv_len in segments)
        if self.use_kernel:
            from workers.engine.layers.scattered_kernel import SequenceBlocks, default_block_m

            block_m = default_block_m(self.shape.num_heads, self.shape.num_kv_heads)
            starts = [(first, last, a) for first, last, a, _, _ in segments]
            blocks = SequenceBlocks.build(starts, block_m, positions.device)
            return ScatteredBatch(kv_rows, positions, tables, kv_len, blocks)
        per_sequence = tuple(
            (first, last, self.metadata(positions[first:last], slots[first:last], tables[a:b], n))
            for first, last, a, b, n in segments
        )
        return ScatteredBatch(kv_rows, positions, tables, kv_len, segments=per_sequence)

    def forward(self, q, k, v, kv_cache, metadata: ScatteredMetadata | ScatteredBatch):
        write_kv(kv_cache, k, v, metadata.kv_rows)
        return self.attend(q, kv_cache, metadata)

    def attend(self, q, kv_cache, metadata: ScatteredMetadata | ScatteredBatch) -> torch.Tensor:
        if isinstance(metadata, ScatteredBatch) and not self.use_kernel:  # a sequence at a time
            return torch.cat(
                [self.attend(q[first:last], kv_cache, m) for first, last, m in metadata.segments]
            )
        if self.use_kernel:
            from workers.engine.layers.scattered_kernel import scattered_attention  # Triton

            return scattered_attention(
                q,
                kv_cache,
                metadata.positions,
                metadata.page_table,
                self.shape.scale,
                metadata.kv_len,
                sequences=metadata.blocks if isinstance(metadata, ScatteredBatch) else None,
            )
        return attend_by_position(q, kv_cache, metadata, self.shape)


def attend_by_position(
    q: torch.Tensor, kv_cache: torch.Tensor, metadata: ScatteredMetadata, shape: AttentionShape
) -> torch.Tensor:
    """Plain torch: every query over the sequence's first ``kv_len`` positions, masked
    to those up to its own, softmax in float32."""
    position = torch.arange(metadata.kv_len, device=q.device)
    pages = metadata.page_table.long()[position // shape.page_size]
    allowed = position[None, :] <= metadata.positions[:, None]
    out = attend_masked(q, kv_cache, pages, position % shape.page_size, allowed, shape)
    return out.contiguous()
