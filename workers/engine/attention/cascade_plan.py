"""Cascade grouping for a decode batch, and the cost model that decides whether it pays.

Requests that share leading pages (a system prompt, then shared documents) read those
pages once per group instead of once per request. Levels: the group's shared prefix
→ (optionally) a subgroup's further shared pages → each request's own pages. The
merge of levels by log-sum-exp is exact.

Vectorized over a padded [batch, pages] table on the CPU (planning runs every decode
step, so it must cost far less than the step), and tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.attention.base import BatchLayout

# Cascade pays when the KV reads it saves outweigh its fixed cost (planning, and per
# layer a gather, a kernel per level, merges and a scatter), which depends on whether
# the step replays a CUDA graph (graphs.cascade) or runs eagerly (graphs off).
# Graphs: on an H200 (bench/cascade.py, synchronized steps) a cascade step at batch 8
# over 256 shared tokens cost 2.4 ms more than a plain decode step, about 0.4 GB of KV
# reads per layer at 4.8 TB/s, and 64 x 4K shared (1.06 GB saved a layer) ran 8.6 ms
# against 9.9 flat; the threshold keeps a 2.5x margin. Eager: about 0.6 ms more per
# layer (batch 64 x 4K declined correctly, 64 x 16K and 256 x 4K pay), ~2.5 GB of KV
# reads per layer at ~4.2 TB/s.
MIN_SAVED_BYTES_PER_LAYER = 1.0e9
MIN_SAVED_BYTES_PER_LAYER_EAGER = 2.5e9
# In tokens, for a backend that does not know its KV size (tests):
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


@dataclass(frozen=True)
class _Grouping:
    """Rows (sorted so each group is contiguous), their group id, and the number of
    leading pages each group shares (identical for all members)."""

    rows: torch.Tensor
    group: torch.Tensor  # per row, 0..G-1, non-decreasing
    start: torch.Tensor  # per row: page index where this level's sharing begins
    shared: torch.Tensor  # per row: pages shared with its group, from ``start``


def plan_cascade(
    layout: BatchLayout, max_levels: int = 3, min_saved_tokens: int = DEFAULT_MIN_SAVED_TOKENS
) -> CascadePlan | None:
    """A cascade plan for a decode batch, or None where the cost model declines."""
    if not layout.is_decode or layout.batch_size < 2:
        return None
    indptr = layout.kv_page_indptr.long()
    counts = indptr[1:] - indptr[:-1]
    # a shared page must come before the page being written: only pages[:-1] qualify
    shareable = counts - 1
    bound = int(shareable.sum() - shareable.max()) * layout.page_size
    if bound < min_saved_tokens:  # even perfect sharing would not pay
        return None
    table = _page_table(layout, counts)
    candidates = torch.nonzero(shareable >= 1).flatten()
    start = torch.zeros(len(candidates), dtype=torch.long)
    level0 = _group(table, shareable, candidates, table[candidates, 0], start)
    if level0 is None:
        return None
    page_size = layout.page_size
    saved = _saved(level0) * page_size
    level1 = None
    if max_levels >= 3:
        start = level0.shared
        nxt = table[level0.rows, start.clamp(max=table.shape[1] - 1)]
        # rows with nothing left to share get a key of their own
        alone = start >= shareable[level0.rows]
        key = torch.where(alone, -1 - level0.rows, nxt)
        level1 = _subgroup(table, shareable, level0, key)
        extra = _saved(level1) * page_size
        level1 = level1 if extra > 0 else None
        saved += extra
    if saved < min_saved_tokens:
        return None
    last = level1 or level0
    order = last.rows
    levels = [_shared_level(table, level0, page_size)]
    if level1 is not None:
        levels.append(_shared_level(table, level1, page_size))
    skip = last.start + last.shared
    levels.append(_own_level(table, counts, layout.kv_last_page_len, order, skip))
    in_cascade = torch.zeros(layout.batch_size, dtype=torch.bool)
    in_cascade[order] = True
    flat = torch.nonzero(~in_cascade).flatten()
    return CascadePlan(order.int(), flat.int(), tuple(levels), int(saved))


def _page_table(layout: BatchLayout, counts: torch.Tensor) -> torch.Tensor:
    """[B, max pages] page ids padded with -1."""
    width = max(int(counts.max()), 1)
    counts = counts.numpy()
    table = np.full((len(counts), width), -1, dtype=np.int32)
    # row-major order of the filled cells is the order of kv_page_indices (numpy: this
    # masked assignment is several times faster than torch's on the CPU)
    table[np.arange(width)[None, :] < counts[:, None]] = layout.kv_page_indices.numpy()
    return torch.from_numpy(table)


def _group(table, shareable, rows, key, start) -> _Grouping | None:
    """Groups of >= 2 rows with equal ``key``; each group's common prefix length
    (pages from ``start``) within its members' shareable pages."""
    _, inverse, sizes = torch.unique(key, return_inverse=True, return_counts=True)
    keep = sizes[inverse] >= 2
    if not bool(keep.any()):
        return None
    rows, inverse, start = rows[keep], inverse[keep], start[keep]
    _, group = torch.unique(inverse, return_inverse=True)
    order = torch.argsort(group, stable=True)
    rows, group, start = rows[order], group[order], start[order]
    return _Grouping(rows, group, start, _common_prefix(table, shareable, rows, group, start))


def _subgroup(table, shareable, parent: _Grouping, key) -> _Grouping:
    """Split each parent group by ``key``; every row lands in exactly one subgroup
    (singletons share nothing more), and subgroups keep their parent's order."""
    # unique rows of (parent group, key) sort lexicographically: parents stay in order
    _, sub = torch.unique(torch.stack((parent.group, key), dim=1), dim=0, return_inverse=True)
    order = torch.argsort(sub, stable=True)
    rows, sub, start = parent.rows[order], sub[order], parent.shared[order]
    _, sub = torch.unique(sub, return_inverse=True)
    shared = _common_prefix(table, shareable, rows, sub, start)
    return _Grouping(rows, sub, start, shared)


def _common_prefix(table, shareable, rows, group, start) -> torch.Tensor:
    """Per row: pages its whole group shares, counted from ``start`` (per row, equal
    within a group), capped at each member's shareable pages."""
    num_groups = int(group.max()) + 1
    first = torch.full((num_groups,), len(rows), dtype=torch.long)
    first.scatter_reduce_(0, group, torch.arange(len(rows)), reduce="amin")
    reference = table[rows[first[group]]]
    cols = torch.arange(table.shape[1])[None, :]
    equal = (table[rows] == reference) | (cols < start[:, None])
    equal &= cols < shareable[rows][:, None]
    differ = ~equal
    # leading equal columns: the first that differs, or all of them
    ends = torch.where(differ.any(dim=1), differ.byte().argmax(dim=1), table.shape[1])
    run = (ends - start).clamp(min=0)
    per_group = torch.full((num_groups,), table.shape[1], dtype=torch.long)
    per_group.scatter_reduce_(0, group, run, reduce="amin")
    return per_group[group]


def _saved(grouping: _Grouping) -> int:
    """KV-token reads saved per page of sharing: (members - 1) x shared pages."""
    num_groups = int(grouping.group.max()) + 1
    sizes = torch.bincount(grouping.group, minlength=num_groups)
    shared = torch.zeros(num_groups, dtype=torch.long)
    shared[grouping.group] = grouping.shared
    return int(((sizes - 1) * shared).sum())


def _shared_level(table, grouping: _Grouping, page_size: int) -> CascadeLevel:
    """One entry per group: all of its rows attend to its shared pages (full pages;
    a group without shared pages at this level gets an empty entry)."""
    num_groups = int(grouping.group.max()) + 1
    sizes = torch.bincount(grouping.group, minlength=num_groups)
    first = torch.zeros(num_groups, dtype=torch.long)
    first.scatter_reduce_(
        0, grouping.group, torch.arange(len(grouping.rows)), reduce="amin", include_self=False
    )
    ref_rows = grouping.rows[first]
    lengths = grouping.shared[first]
    begin = grouping.start[first]
    cols = torch.arange(table.shape[1])[None, :]
    mask = (cols >= begin[:, None]) & (cols < (begin + lengths)[:, None])
    indices = table[ref_rows][mask]
    return CascadeLevel(
        _indptr(sizes),
        _indptr(lengths),
        indices.int(),
        torch.where(lengths > 0, page_size, 0).int(),
    )


def _own_level(table, counts, last_page_len, order, skip) -> CascadeLevel:
    """Each row's remaining pages (always at least its last one)."""
    cols = torch.arange(table.shape[1])[None, :]
    mask = (cols >= skip[:, None]) & (cols < counts[order][:, None])
    own = counts[order] - skip
    return CascadeLevel(
        torch.arange(len(order) + 1, dtype=torch.int32),
        _indptr(own),
        table[order][mask].int(),
        last_page_len[order].int(),
    )


def _indptr(sizes: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    out[1:] = sizes.cumsum(0)
    return out


@dataclass(frozen=True)
class PaddedCascade:
    """A cascade plan laid out for a CUDA graph of ``size`` rows: every level has
    exactly ``size`` entries and covers all ``size`` query rows in ``order``, so the
    graph's gathers, kernels and merges keep their shapes from step to step.

    ``order`` [size] int64 is a permutation of the padded batch: the cascaded rows (in
    level order), then the plan's flat rows, then padding rows ``batch..size-1``. In a
    shared level, the flat and padding rows form one entry with no KV (log-sum-exp
    -inf: it adds nothing when merged); its unused entries have no query rows and one
    scratch page. The last level gives every row its own pages (a flat row all of
    them; a padding row one scratch-page token)."""

    order: torch.Tensor
    levels: tuple[CascadeLevel, ...]


def pad_cascade(
    plan: CascadePlan, layout: BatchLayout, size: int, scratch_page: int
) -> PaddedCascade:
    batch = layout.batch_size
    if size < batch:
        raise ValueError(f"a padded cascade of {size} rows cannot hold a batch of {batch}")
    cascaded = len(plan.rows)
    rest = size - cascaded  # flat and padding rows
    order = torch.cat(
        (plan.rows.long(), plan.flat_rows.long(), torch.arange(batch, size, dtype=torch.long))
    )
    i32 = torch.int32
    levels = []
    for level in plan.levels[:-1]:
        entries = len(level.qo_indptr) - 1
        qo = [level.qo_indptr]
        pages = [level.kv_page_indptr]
        last = [level.kv_last_page_len]
        unused = size - entries
        if rest:  # the flat and padding rows: one entry, no KV
            qo.append(torch.tensor([cascaded + rest], dtype=i32))
            pages.append(level.kv_page_indptr[-1:].clone())
            last.append(torch.zeros(1, dtype=i32))
            unused -= 1
        top = int(pages[-1][-1])
        qo.append(torch.full((unused,), size, dtype=i32))
        pages.append(torch.arange(top + 1, top + unused + 1, dtype=i32))
        last.append(torch.ones(unused, dtype=i32))
        indices = torch.cat((level.kv_page_indices, torch.full((unused,), scratch_page, dtype=i32)))
        levels.append(CascadeLevel(torch.cat(qo), torch.cat(pages), indices, torch.cat(last)))
    own = plan.levels[-1]
    indptr = layout.kv_page_indptr.long()
    flat = plan.flat_rows.long()
    counts = indptr[flat + 1] - indptr[flat]
    starts = torch.repeat_interleave(indptr[flat], counts)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    padding = size - batch
    top = own.kv_page_indptr[-1]
    levels.append(
        CascadeLevel(
            torch.arange(size + 1, dtype=i32),
            torch.cat(
                (
                    own.kv_page_indptr,
                    top + torch.cumsum(counts, 0).to(i32),
                    top + int(counts.sum()) + torch.arange(1, padding + 1, dtype=i32),
                )
            ),
            torch.cat(
                (
                    own.kv_page_indices,
                    layout.kv_page_indices[starts + offsets],
                    torch.full((padding,), scratch_page, dtype=i32),
                )
            ),
            torch.cat(
                (
                    own.kv_last_page_len,
                    layout.kv_last_page_len[flat],
                    torch.ones(padding, dtype=i32),
                )
            ),
        )
    )
    return PaddedCascade(order, tuple(levels))
