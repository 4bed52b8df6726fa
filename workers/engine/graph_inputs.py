"""Loading a step into a CUDA graph's fixed input buffers (every graph kind does it
the same way; no CUDA or FlashInfer needed, so it is tested on the CPU)."""

from __future__ import annotations

import numpy as np
import torch

from workers.engine.attention.base import kv_write_rows_host


def load_step(
    graph,  # has input_ids, positions [size] and kv_rows [2 * size] device buffers
    input_ids: torch.Tensor,  # [n]
    positions: torch.Tensor,  # [n]
    slot_mapping: torch.Tensor,  # [n] int32, CPU
    scratch_page: int,
    page_size: int,
) -> None:
    """Copy a step's n tokens into a graph's fixed input buffers. The padding tokens
    after them compute token 0 at position 0 and write their KV to the scratch page
    (never read by a real row)."""
    n, size = input_ids.shape[0], graph.input_ids.shape[0]
    graph.input_ids[:n].copy_(input_ids, non_blocking=True)
    graph.positions[:n].copy_(positions, non_blocking=True)
    if size > n:
        graph.input_ids[n:].zero_()
        graph.positions[n:].zero_()
    slots = np.full(size, scratch_page * page_size, dtype=np.int64)
    slots[:n] = slot_mapping.numpy()
    rows = torch.from_numpy(kv_write_rows_host(slots, page_size))
    graph.kv_rows.copy_(rows, non_blocking=True)
