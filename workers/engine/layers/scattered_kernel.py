"""Attention of queries at scattered positions of one sequence over its paged KV, on
CUDA (Triton): the layers after an approximate request's selection, whose query rows
(the deviating tokens, the gaps, the question) were chosen on the device, so no host
plan exists for them (``attention/scattered.py``).

A query at position p attends to the sequence's KV positions 0..p (masked by
position, so the queries need not be consecutive). One program per (block of
``BLOCK_M`` queries, KV head, split of ``SPLIT`` keys), over the query heads that
share that KV head: it walks its split's keys up to the largest position in its
block, ``BLOCK_N`` at a time through the page table, with the online softmax in
float32, and writes its partial result; a second kernel merges the splits. Splitting
the keys matters: one program per query block walking 4K keys took 115-140 us a
layer on an H200 (qwen3-0.6b heads, 515 queries), bound by the walk's latency, not
by the GPU's throughput. Queries sorted by position keep each block's walk short.

Several sequences' queries go in one launch (``SequenceBlocks``: the kept rows of a
step's approximate admissions, selected in one forward): each program's block of
queries is then one sequence's, and it walks that sequence's page table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Keys per split: at least MIN_SPLIT_KEYS, at most MAX_SPLITS splits, and the partial
# results (splits x queries x heads x head_dim floats) within WORKSPACE_BYTES. On an
# H200 (qwen3-0.6b heads, 4,384 keys, 493 queries as an approximate request leaves them)
# one split took 103 us, 256 keys 94, 512 keys 73, 1,024 keys 68
# (bench/scattered_attention.py).
MIN_SPLIT_KEYS = 1024
MAX_SPLITS = 8
WORKSPACE_BYTES = 256 * 2**20
TILE_ROWS = 64  # query rows of a program's tile: queries x (query heads of a KV head)


def default_block_m(heads: int, kv_heads: int) -> int:
    """Queries a program takes by default: ``TILE_ROWS`` tile rows."""
    return max(1, TILE_ROWS // triton.next_power_of_2(heads // kv_heads))


@dataclass(frozen=True)
class SequenceBlocks:
    """Query blocks of several sequences for one launch (device int tensors, one entry
    a block): its first query row, the end of its sequence's rows, and where its
    sequence's page table starts in the launch's page table."""

    first_rows: torch.Tensor  # int32
    row_ends: torch.Tensor  # int32
    table_starts: torch.Tensor  # int32
    block_m: int

    @classmethod
    def build(
        cls,
        segments: Sequence[tuple[int, int, int]],  # (first row, end row, table start)
        block_m: int,
        device: torch.device,
    ) -> SequenceBlocks:
        firsts, ends, tables = [], [], []
        for first, end, table in segments:
            for row in range(first, end, block_m):
                firsts.append(row)
                ends.append(end)
                tables.append(table)
        packed = torch.tensor([firsts, ends, tables], dtype=torch.int32)
        if device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(device, non_blocking=True)
        return cls(packed[0], packed[1], packed[2], block_m)


def key_split(kv_len: int, queries: int, heads: int, head_dim: int, block_n: int = 64) -> int:
    """Keys per split for ``queries`` over ``kv_len`` keys: a multiple of ``block_n``."""
    per_split = max(1, queries * heads * head_dim * 4)
    splits = max(1, min(MAX_SPLITS, WORKSPACE_BYTES // per_split))
    split = max(MIN_SPLIT_KEYS, triton.cdiv(kv_len, splits))
    return triton.cdiv(split, block_n) * block_n


@triton.jit(do_not_specialize=["num_queries", "split_keys"])
def _scattered_kernel(
    q_ptr,  # [N, heads, D]
    acc_ptr,  # [splits, N, heads, D] float32: unnormalized outputs of each key split
    stat_ptr,  # [splits, N, heads, 2] float32: running max (log2 units), then sum
    pos_ptr,  # [N] int64, positions of the queries
    table_ptr,  # [pages] int32, the sequence's page table (SEQUENCES: every sequence's)
    first_row_ptr,  # SEQUENCES: [blocks] int32, a block's first query row
    row_end_ptr,  # SEQUENCES: [blocks] int32, the end of its sequence's rows
    table_start_ptr,  # SEQUENCES: [blocks] int32, its sequence's table in table_ptr
    kv_ptr,  # [num_pages, 2, PAGE, kv_heads, D], contiguous
    num_queries,
    scale_log2,  # softmax scale times log2(e)
    q_stride_t,
    q_stride_h,
    split_keys,  # keys per split (a multiple of BLOCK_N)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P2: tl.constexpr,  # a power of two >= GROUP (tile rows of padding heads)
    KV_HEADS: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,  # a power of two >= HEAD_DIM
    BLOCK_M: tl.constexpr,  # queries per program; the tile has BLOCK_M * GROUP_P2 rows
    BLOCK_N: tl.constexpr,
    SEQUENCES: tl.constexpr,  # blocks of several sequences (SequenceBlocks)
):
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # tile row r: the block's first query + r // GROUP_P2, query head kv_head * GROUP +
    # r % GROUP_P2 (the heads that share this KV head read each key tile once)
    tile = tl.arange(0, BLOCK_M * GROUP_P2)
    if SEQUENCES:
        rows = tl.load(first_row_ptr + block) + tile // GROUP_P2
        row_end = tl.load(row_end_ptr + block)
        table_ptr += tl.load(table_start_ptr + block)
    else:
        rows = block * BLOCK_M + tile // GROUP_P2
        row_end = num_queries
    in_group = tile % GROUP_P2
    heads = kv_head * GROUP + in_group
    row_ok = (rows < row_end) & (in_group < GROUP)
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
    last = tl.max(pos, axis=0)
    first_key = split * split_keys
    end_key = tl.minimum(first_key + split_keys, last + 1)  # empty when the split is past all
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (rows.to(tl.int64) * q_stride_t + heads * q_stride_h)[:, None] + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    row_width: tl.constexpr = KV_HEADS * HEAD_DIM
    values_offset: tl.constexpr = PAGE * row_width  # K then V within a page
    m_i = tl.full([BLOCK_M * GROUP_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, DIM_P2], dtype=tl.float32)
    for start in range(first_key, end_key, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < end_key
        page = tl.load(table_ptr + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
        base = (page * 2 * PAGE + keys % PAGE) * row_width + kv_head * HEAD_DIM
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(kv_ptr + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        scores = tl.where(keys[None, :] <= pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # a row that sees no key yet keeps max -inf: subtract 0 there, not -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_ptr + values_offset + base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # only rows that see a key of this split (the merge reads no other)
    stored = row_ok & (pos >= first_key)
    # (split, row, head), in int64: splits x N x heads x D may pass 2^31
    at = (split.to(tl.int64) * num_queries + rows) * (GROUP * KV_HEADS) + heads
    tl.store(
        acc_ptr + at[:, None] * HEAD_DIM + dims[None, :],
        acc,
        mask=stored[:, None] & dim_ok[None, :],
    )
    tl.store(stat_ptr + at * 2, m_i, mask=stored)
    tl.store(stat_ptr + at * 2 + 1, l_i, mask=stored)


@triton.jit(do_not_specialize=["num_queries", "split_keys"])
def _merge_kernel(
    acc_ptr,  # [splits, N, heads, D] float32
    stat_ptr,  # [splits, N, heads, 2] float32
    pos_ptr,  # [N] int64
    out_ptr,  # [N, heads, D], contiguous
    num_queries,
    split_keys,
    HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,  # a power of two >= HEADS
    HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr,  # a power of two >= HEAD_DIM
    SPLITS: tl.constexpr,  # a power of two >= the splits
):
    """One query, all heads at once (one round of loads: a loop over heads waited on
    each in turn, 26 us a layer): the partial softmaxes of the splits holding keys up
    to its position combined (split 0 holds key 0, so each head's max is finite)."""
    row = tl.program_id(0).to(tl.int64)
    used = tl.load(pos_ptr + row) // split_keys + 1
    heads = tl.arange(0, HEADS_P2)[:, None]  # [H, 1]
    parts = tl.arange(0, SPLITS)[None, :]  # [1, S]
    ok = (parts < used) & (heads < HEADS)
    at = (parts * num_queries + row) * HEADS + heads  # [H, S]
    m = tl.load(stat_ptr + at * 2, mask=ok, other=float("-inf"))
    l_sum = tl.load(stat_ptr + at * 2 + 1, mask=ok, other=0.0)
    m_max = tl.max(m, axis=1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # padding heads
    weight = tl.math.exp2(m - m_max[:, None])  # 0 for the splits not read
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    acc = tl.load(
        acc_ptr + at[:, :, None] * HEAD_DIM + dims[None, None, :],
        mask=ok[:, :, None] & dim_ok[None, None, :],
        other=0.0,
    )
    total = tl.sum(l_sum * weight, axis=1)
    total = tl.where(total == 0.0, 1.0, total)  # padding heads
    out = tl.sum(acc * weight[:, :, None], axis=1) / total[:, None]  # [H, D]
    head_rows = tl.arange(0, HEADS_P2)[:, None]
    tl.store(
        out_ptr + (row * HEADS + head_rows) * HEAD_DIM + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(head_rows < HEADS) & dim_ok[None, :],
    )


def scattered_attention(
    q: torch.Tensor,  # [N, heads, D]
    kv_cache: torch.Tensor,  # [num_pages, 2, page_size, kv_heads, D], contiguous
    positions: torch.Tensor,  # [N] int64, ascending (any order is correct, slower)
    page_table: torch.Tensor,  # [pages] int32, covering every position in ``positions``
    scale: float,
    kv_len: int,  # above every position: bounds the key splits
    block_m: int | None = None,
    block_n: int | None = None,
    split: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    sequences: SequenceBlocks | None = None,
) -> torch.Tensor:
    """Attention outputs [N, heads, D]: each query over KV positions up to its own.
    ``block_m``: queries a program (default: ``TILE_ROWS`` tile rows); ``block_n``: keys
    a step (64; 32 for heads over 128); ``split``: keys a split (a multiple of
    ``block_n``; by default ``key_split``). ``sequences``: the queries are several
    sequences' (positions ascending within each), ``page_table`` holds their tables,
    ``kv_len`` is above every position of any; its ``block_m`` is the one used."""
    tokens, heads, head_dim = q.shape
    _, _, page_size, kv_heads, _ = kv_cache.shape
    assert kv_cache.is_contiguous() and heads % kv_heads == 0 and q.stride(2) == 1
    group = heads // kv_heads
    group_p2, dim_p2 = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    if sequences is not None:
        block_m = sequences.block_m
    block_m = block_m or default_block_m(heads, kv_heads)
    block_n = block_n or (64 if dim_p2 <= 128 else 32)
    split = split or key_split(kv_len, tokens, heads, head_dim, block_n)
    assert split % block_n == 0, "a split is whole key blocks"
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    splits = triton.cdiv(kv_len, split)
    acc = torch.empty((splits, tokens, heads, head_dim), dtype=torch.float32, device=q.device)
    stats = torch.empty((splits, tokens, heads, 2), dtype=torch.float32, device=q.device)
    blocks = triton.cdiv(tokens, block_m) if sequences is None else len(sequences.first_rows)
    extra = (page_table,) * 3 if sequences is None else (
        sequences.first_rows, sequences.row_ends, sequences.table_starts
    )  # fmt: skip
    _scattered_kernel[(blocks, kv_heads, splits)](
        q,
        acc,
        stats,
        positions,
        page_table,
        *extra,
        kv_cache,
        tokens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        split,
        GROUP=group,
        GROUP_P2=group_p2,
        KV_HEADS=kv_heads,
        PAGE=page_size,
        HEAD_DIM=head_dim,
        DIM_P2=dim_p2,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SEQUENCES=sequences is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _merge_kernel[(tokens,)](
        acc,
        stats,
        positions,
        out,
        tokens,
        split,
        HEADS=heads,
        HEADS_P2=triton.next_power_of_2(heads),
        HEAD_DIM=head_dim,
        DIM_P2=dim_p2,
        SPLITS=triton.next_power_of_2(splits),
        num_warps=8,
    )
    return out
