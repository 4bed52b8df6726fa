"""Loading a step into a CUDA graph's fixed input buffers (the step graphs by
``load_step``, the selection graphs by ``stage_selection``, which packs them for one
copy; no CUDA or FlashInfer needed, so both are tested on the CPU)."""

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
    rows = padded_kv_rows(slot_mapping, size, scratch_page * page_size, page_size)
    graph.kv_rows.copy_(torch.from_numpy(rows), non_blocking=True)


def padded_kv_rows(
    slot_mapping: torch.Tensor, size: int, scratch_slot: int, page_size: int
) -> np.ndarray:
    """int64 [2 * size]: the K/V rows of a step's n tokens (``kv_write_rows``), then
    those of ``size`` - n padding tokens, all on the scratch slot."""
    slots = np.full(size, scratch_slot, dtype=np.int64)
    slots[: len(slot_mapping)] = slot_mapping.numpy()
    return kv_write_rows_host(slots, page_size)


def input_layout(tokens: int) -> dict[str, slice]:
    """Where a selection graph of ``tokens`` keeps each input in the shared int64
    input buffers (host and device alike); the page indices follow, as many as the
    sequence has."""
    return {
        "input_ids": slice(0, tokens),
        "positions": slice(tokens, 2 * tokens),
        "kv_rows": slice(2 * tokens, 4 * tokens),
        "candidate": slice(4 * tokens, 5 * tokens),  # 1: a candidate, 0: not
        "pages": slice(5 * tokens, None),
    }


def stage_selection(
    staged: np.ndarray,  # int64, at least 5 * tokens + the sequence's pages
    indptrs: np.ndarray,  # int32 [5]: qo_indptr, kv_page_indptr, last page's length
    tokens: int,
    input_ids: torch.Tensor,  # [n], CPU
    positions: torch.Tensor,  # [n], CPU
    layout,  # one row: n consecutive positions (a BatchLayout)
    candidate: np.ndarray,  # [n] bool
    scratch_slot: int,
) -> int:
    """Write a selection graph's inputs for n <= ``tokens`` tokens where
    ``input_layout`` puts them, and the plan's index arrays; returns the number of
    pages. Padding tokens compute token 0 at position 0, write their KV to the scratch
    page (never read by a real row) and are never candidates."""
    n, at = layout.num_tokens, input_layout(tokens)
    for name, values in (
        ("input_ids", input_ids.numpy()),
        ("positions", positions.numpy()),
        ("candidate", candidate),
    ):
        part = staged[at[name]]
        part[:n] = values
        part[n:] = 0
    staged[at["kv_rows"]] = padded_kv_rows(
        layout.slot_mapping, tokens, scratch_slot, layout.page_size
    )
    page_indices = layout.kv_page_indices.numpy()
    pages = len(page_indices)
    staged[at["pages"]][:pages] = page_indices
    indptrs[:] = (0, n, 0, pages, int(layout.kv_last_page_len[0]))
    return pages
