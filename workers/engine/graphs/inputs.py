"""Loading a step into a CUDA graph's fixed input buffers (the step graphs by
``load_step``, the selection graphs by ``stage_selection``, which packs them for two
copies), and the layout graphs are captured over (``capture_layout``); no CUDA or
FlashInfer needed, so all are tested on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from workers.engine.attention.base import BatchLayout, kv_write_rows_host


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
    input buffers (host and device alike)."""
    return {
        "input_ids": slice(0, tokens),
        "positions": slice(tokens, 2 * tokens),
        "slots": slice(2 * tokens, 3 * tokens),  # each token's KV slot
        "candidate": slice(3 * tokens, 4 * tokens),  # 1: a candidate, 0: not
    }


# A selection graph's plan inputs, one int32 buffer (host and device alike): its one
# row's FlashInfer index arrays and KV length, then the sequence's page indices.
PLAN_FIELDS = {
    "qo_indptr": slice(0, 2),
    "kv_page_indptr": slice(2, 4),
    "kv_last_page_len": slice(4, 5),
    "kv_len": slice(5, 6),
}
PLAN_PAGES = 8  # where the page indices start (32-byte aligned)


def stage_selection(
    staged: np.ndarray,  # int64, at least 4 * tokens
    plan: np.ndarray,  # int32, at least PLAN_PAGES + padded_row_pages(start, tokens)
    tokens: int,
    input_ids: np.ndarray,  # [n]: the ids at positions start..start + n - 1
    start: int,
    page_table: np.ndarray,  # int32: the sequence's pages
    candidate: np.ndarray,  # [n] bool
    scratch_page: int,
    page_size: int,
) -> int:
    """Write a selection graph's inputs for one row of n <= ``tokens`` consecutive
    positions from ``start`` where ``input_layout`` puts them, and its plan inputs
    where ``PLAN_FIELDS`` and ``PLAN_PAGES`` put them; returns the number of the
    sequence's pages the real tokens' KV spans (0 to start + n - 1). The inputs are
    what ``build_inputs`` would give for that row, in a few array operations. Padding
    tokens compute token 0 at position 0, write their KV to the scratch page and are
    never candidates.

    The planned row is the whole bucket: ``tokens`` queries over start + ``tokens``
    keys, the padding tokens its last queries, their keys on the sequence's last page
    and then the scratch page (never read by a real token: attention is causal within
    the row). So the plan depends on (tokens, start) alone, and a graph planned for
    them once needs no plan again (``SelectionGraphs.start``)."""
    n, at = len(input_ids), input_layout(tokens)
    end = start + n
    pages = -(-end // page_size)
    assert len(page_table) >= pages, "the sequence's pages must cover the row's KV"
    positions = staged[at["positions"]]
    positions[:n] = np.arange(start, end)
    slots = staged[at["slots"]]
    slots[:n] = page_table[positions[:n] // page_size]
    slots[:n] *= page_size
    slots[:n] += positions[:n] % page_size
    positions[n:] = 0
    slots[n:] = scratch_page * page_size
    for name, values in (("input_ids", input_ids), ("candidate", candidate)):
        part = staged[at[name]]
        part[:n] = values
        part[n:] = 0
    row_end = start + tokens
    row_pages = padded_row_pages(start, tokens, page_size)
    last = row_end - (row_pages - 1) * page_size
    plan[:PLAN_PAGES] = (0, tokens, 0, row_pages, last, row_end, 0, 0)
    plan[PLAN_PAGES : PLAN_PAGES + pages] = page_table[:pages]
    plan[PLAN_PAGES + pages : PLAN_PAGES + row_pages] = scratch_page
    return pages


def padded_row_pages(start: int, tokens: int, page_size: int) -> int:
    """The pages of a selection graph's planned row (``stage_selection``)."""
    return -(-(start + tokens) // page_size)


def capture_layout(tokens: int, rows: int, scratch_page: int, page_size: int) -> BatchLayout:
    """``tokens`` new tokens in ``rows`` rows: one token each and the rest in the last
    row, or, with more rows than tokens, empty rows after the first ``tokens``; every
    row's KV on the scratch page (what a graph is captured over)."""
    i32 = torch.int32
    counts = torch.ones(rows, dtype=i32)
    if rows > tokens:
        counts[tokens:] = 0
    else:
        counts[-1] = tokens - rows + 1
    kv_lens = counts.clamp_min(1)
    pages = (kv_lens + page_size - 1) // page_size
    zero = torch.zeros(1, dtype=i32)
    return BatchLayout(
        qo_indptr=torch.cat((zero, counts.cumsum(0, dtype=i32))),
        kv_page_indptr=torch.cat((zero, pages.cumsum(0, dtype=i32))),
        kv_page_indices=torch.full((int(pages.sum()),), scratch_page, dtype=i32),
        kv_last_page_len=kv_lens - (pages - 1) * page_size,
        kv_lens=kv_lens,
        slot_mapping=torch.full((tokens,), scratch_page * page_size, dtype=i32),
        page_size=page_size,
    )
