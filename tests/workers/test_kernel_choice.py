"""Which prefill kernel a step takes (pure Python; tests/gpu checks the kernels agree)."""

from __future__ import annotations

import torch

from workers.engine.attention.base import (
    BatchLayout,
    choose_graph,
    max_split_kv_tokens,
    prefers_small_query_tiles,
    prefers_split_kv,
    small_tile_scratch_bytes,
)

PAGE = 16
HEADS, KV_HEADS, SMS = 16, 8, 132  # qwen3-0.6b's heads, an H100 / H200


def _layout(rows: list[tuple[int, int]]) -> BatchLayout:
    """Rows of (new tokens, KV length), each on pages of its own."""
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    qo, indptr, last = [0], [0], []
    for new, kv in rows:
        pages = -(-kv // PAGE)
        qo.append(qo[-1] + new)
        indptr.append(indptr[-1] + pages)
        last.append(kv - (pages - 1) * PAGE)
    kv_lens = [kv for _, kv in rows]
    return BatchLayout(
        i32(qo), i32(indptr), i32(list(range(indptr[-1]))), i32(last), i32(kv_lens),
        i32([0] * qo[-1]), PAGE,
    )  # fmt: skip


def test_a_few_short_rows_over_a_long_kv_split_it():
    assert prefers_split_kv(_layout([(32, 4384)]), HEADS, SMS)  # a question after documents
    assert prefers_split_kv(_layout([(256, 256), (32, 4384)]), HEADS, SMS)
    assert prefers_split_kv(_layout([(64, 5184)]), HEADS, SMS)  # a cache hit's tail


def test_short_kv_or_many_tiles_keep_the_default_kernel():
    assert not prefers_split_kv(_layout([(256, 256)]), HEADS, SMS)  # nothing long to split
    assert not prefers_split_kv(_layout([(1024, 1024)]), HEADS, SMS)  # a prompt fills the GPU
    assert not prefers_split_kv(_layout([(40, 3040)] * 8), HEADS, SMS)  # 8 tiles: one wave
    repair = [(256, 256), (216, 2000), (99, 3000), (95, 4000), (32, 4384)]
    assert not prefers_split_kv(_layout(repair), HEADS, SMS)


def test_the_split_token_bound_covers_every_split_step():
    bound = max_split_kv_tokens(HEADS, SMS)
    assert bound == 512
    assert prefers_split_kv(_layout([(bound, 4096)]), HEADS, SMS)
    assert not prefers_split_kv(_layout([(bound + 1, 4096)]), HEADS, SMS)
    # more query heads: fewer tiles fit in half the SMs
    assert max_split_kv_tokens(32, SMS) == 256
    assert not prefers_split_kv(_layout([(32, 4384)]), 96, SMS)


def test_rows_of_a_token_or_a_few_take_small_query_tiles():
    hit_and_decodes = [(48, 2608)] + [(1, 2600)] * 20  # a loaded worker's mixed step
    assert prefers_small_query_tiles(_layout(hit_and_decodes), HEADS, KV_HEADS)
    assert prefers_small_query_tiles(_layout([(1, 300)] * 4 + [(4, 300)]), HEADS, KV_HEADS)
    # at most 16 packed queries a row on average: 8 tokens at two query heads a KV head
    assert prefers_small_query_tiles(_layout([(8, 900)] * 3), HEADS, KV_HEADS)
    assert not prefers_small_query_tiles(_layout([(9, 900)] * 3), HEADS, KV_HEADS)
    # four query heads a KV head pack twice the queries: 4 tokens a row at most
    assert prefers_small_query_tiles(_layout([(4, 900)] * 3), 32, 8)
    assert not prefers_small_query_tiles(_layout([(5, 900)] * 3), 32, 8)


def test_one_row_or_long_rows_keep_their_kernel():
    assert not prefers_small_query_tiles(_layout([(4, 4384)]), HEADS, KV_HEADS)  # one row
    assert not prefers_small_query_tiles(_layout([(40, 3040)] * 8), HEADS, KV_HEADS)
    two_hits = [(48, 2608)] * 2 + [(1, 2600)] * 4  # 100 tokens in 6 rows
    assert not prefers_small_query_tiles(_layout(two_hits), HEADS, KV_HEADS)


def test_small_tile_scratch_grows_with_the_query_heads():
    # qwen3-0.6b (16 / 8 heads, dim 128), 512 tokens in 512 rows: 64 + 511 tile slots
    assert small_tile_scratch_bytes(512, 16, 8, 128) == 575 * 16 * 16 * 129 * 4  # 76 MB
    # four query heads a KV head: twice the packed queries, and twice the heads
    assert small_tile_scratch_bytes(512, 32, 8, 128) == 639 * 32 * 16 * 129 * 4  # 169 MB
    assert small_tile_scratch_bytes(32, 16, 8, 128) < small_tile_scratch_bytes(64, 16, 8, 128)


def test_a_step_replays_the_smallest_graph_of_its_kernel_else_the_default_kernels():
    buckets = sorted(
        [(t, r, "default") for t in (64, 128, 1024) for r in (1, 32, 1024) if r <= t]
        + [(64, 32, "split-kv"), (64, 1, "split-kv")]
        + [(t, t, "small-tiles") for t in (32, 64, 128)]
    )
    assert choose_graph(buckets, 68, 21, "small-tiles") == (128, 128, "small-tiles")
    assert choose_graph(buckets, 30, 30, "small-tiles") == (32, 32, "small-tiles")
    assert choose_graph(buckets, 40, 2, "split-kv") == (64, 32, "split-kv")
    assert choose_graph(buckets, 40, 1, "split-kv") == (64, 1, "split-kv")
    # no graph of its kernel holds it: the default kernel's
    assert choose_graph(buckets, 700, 600, "small-tiles") == (1024, 1024, "default")
    assert choose_graph(buckets, 100, 2, "split-kv") == (128, 32, "default")
    assert choose_graph(buckets, 100, 40, "default") == (1024, 1024, "default")
    assert choose_graph(buckets, 2000, 1, "default") is None  # eager
