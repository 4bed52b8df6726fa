"""Cascade grouping for a decode batch, and the cost model that decides whether it pays.

Requests that share leading pages (a system prompt, then shared documents) read those
pages once per group instead of once per request. Levels: the group's shared prefix
→ (optionally) a subgroup's further shared pages → each request's own pages. The
merge of levels by log-sum-exp is exact.

Pure Python over CPU tensors, so it is tested without a GPU.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from workers.attention.base import BatchLayout

# Cascade pays when sharing saves at least this many KV-token reads per step
# (summed over requests); below it the extra kernels and merges cost more.
DEFAULT_MIN_SAVED_TOKENS = 16384


@dataclass(frozen=True)
class CascadeLevel:
    """One level's paged-KV description over the cascaded rows (FlashInfer layout).
    Shared levels list each group once: ``qo_indptr`` spans the group's rows."""

    qo_indptr: torch.Tensor
    kv_page_indptr: torch.Tensor
    kv_page_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass(frozen=True)
class CascadePlan:
    rows: torch.Tensor  # batch rows (requests) that go through the cascade, in level order
    flat_rows: torch.Tensor  # the other rows: plain decode
    levels: tuple[CascadeLevel, ...]
    saved_tokens: int


def plan_cascade(
    layout: BatchLayout, max_levels: int = 3, min_saved_tokens: int = DEFAULT_MIN_SAVED_TOKENS
) -> CascadePlan | None:
    """A cascade plan for a decode batch, or None where the cost model declines."""
    if not layout.is_decode or layout.batch_size < 2:
        return None
    pages = _page_lists(layout)
    last_len = layout.kv_last_page_len.tolist()
    by_first: dict[int, list[int]] = defaultdict(list)
    for row, p in enumerate(pages):
        if len(p) >= 2:  # a shared page must come before the page being written
            by_first[p[0]].append(row)
    groups = [rows for rows in by_first.values() if len(rows) >= 2]
    if not groups:
        return None
    page_size = layout.page_size
    rows_out: list[int] = []
    shared0: list[tuple[list[int], list[int]]] = []  # (rows, shared pages) per group
    for rows in groups:
        prefix = _common_prefix([pages[r][:-1] for r in rows])
        shared0.append((rows, prefix))
        rows_out += rows
    saved = sum((len(rows) - 1) * len(prefix) * page_size for rows, prefix in shared0)
    shared1: list[tuple[list[int], list[int]]] = []
    if max_levels >= 3:
        shared1, saved1 = _second_level(pages, shared0, page_size)
        if saved1 == 0:
            shared1 = []
        saved += saved1
    if saved < min_saved_tokens:
        return None
    # rows in level order: each group, and each subgroup within it, is contiguous
    order = [r for rows, _ in shared1 for r in rows] if shared1 else rows_out
    levels = _build_levels(pages, last_len, page_size, order, shared0, shared1)
    grouped = set(order)
    flat = [r for r in range(layout.batch_size) if r not in grouped]
    return CascadePlan(_i32(order), _i32(flat), levels, saved)


def _page_lists(layout: BatchLayout) -> list[list[int]]:
    indptr = layout.kv_page_indptr.tolist()
    indices = layout.kv_page_indices.tolist()
    return [indices[indptr[i] : indptr[i + 1]] for i in range(len(indptr) - 1)]


def _common_prefix(lists: list[list[int]]) -> list[int]:
    first = lists[0]
    n = min(len(x) for x in lists)
    for i in range(n):
        if any(x[i] != first[i] for x in lists):
            return first[:i]
    return first[:n]


def _second_level(
    pages: list[list[int]], shared0: list[tuple[list[int], list[int]]], page_size: int
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """Subgroups within each group sharing more pages after the group prefix. Every
    row of a group lands in exactly one subgroup (possibly a singleton with no
    further shared pages), and subgroups of one group stay contiguous."""
    out: list[tuple[list[int], list[int]]] = []
    saved = 0
    for rows, prefix in shared0:
        start = len(prefix)
        by_next: dict[int, list[int]] = defaultdict(list)
        for r in rows:
            own = pages[r][start:-1]
            by_next[own[0] if own else -1 - r].append(r)
        for sub in by_next.values():
            if len(sub) >= 2:
                extra = _common_prefix([pages[r][start:-1] for r in sub])
            else:
                extra = []
            out.append((sub, extra))
            saved += (len(sub) - 1) * len(extra) * page_size
    return out, saved


def _build_levels(
    pages: list[list[int]],
    last_len: list[int],
    page_size: int,
    order: list[int],
    shared0: list[tuple[list[int], list[int]]],
    shared1: list[tuple[list[int], list[int]]],
) -> tuple[CascadeLevel, ...]:
    position = {r: i for i, r in enumerate(order)}
    prefix_of = {r: prefix for rows, prefix in shared0 for r in rows}
    levels = [_shared_level(shared0, position, page_size)]
    extra_of: dict[int, list[int]] = {}
    if shared1:
        levels.append(_shared_level(shared1, position, page_size))
        extra_of = {r: extra for rows, extra in shared1 for r in rows}
    qo, indptr, indices, lens = [0], [0], [], []
    for r in order:
        skip = len(prefix_of[r]) + len(extra_of.get(r, []))
        own = pages[r][skip:]
        indices += own
        indptr.append(len(indices))
        lens.append(last_len[r])
        qo.append(qo[-1] + 1)
    levels.append(CascadeLevel(_i32(qo), _i32(indptr), _i32(indices), _i32(lens)))
    return tuple(levels)


def _shared_level(
    groups: list[tuple[list[int], list[int]]], position: dict[int, int], page_size: int
) -> CascadeLevel:
    """One entry per group: all of its rows attend to its shared pages (full pages;
    a group without shared pages at this level gets an empty entry)."""
    groups = sorted(groups, key=lambda g: position[g[0][0]])
    qo, indptr, indices, lens = [0], [0], [], []
    for rows, shared in groups:
        qo.append(qo[-1] + len(rows))
        indices += shared
        indptr.append(len(indices))
        lens.append(page_size if shared else 0)
    return CascadeLevel(_i32(qo), _i32(indptr), _i32(indices), _i32(lens))


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
