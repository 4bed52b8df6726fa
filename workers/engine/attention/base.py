"""The attention backend interface.

KV cache layout (one tensor per layer, FlashInfer's paged NHD layout with K and V
interleaved per page): ``[num_pages, 2, page_size, num_kv_heads, head_dim]``.
Index 0 of dim 1 holds keys, 1 holds values. A token at position ``p`` of a
sequence lives in page ``page_table[p // page_size]`` at offset ``p % page_size``.

A forward step covers a flattened batch of sequences; each contributes its new
tokens (a prefill chunk, one decode token, or tokens at scattered positions over KV
that is already filled, e.g. repairs of placed chunks) and attends causally *by
position*: a new token at position p sees every KV position <= p of its sequence
(including the other new tokens' KV, written before attention). ``BatchLayout``
describes that once per step, as rows that are each a causal tail of their KV;
``AttentionBackend.plan`` turns it into backend metadata that every layer reuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class BatchLayout:
    """One step's batch shape. All tensors are int32 on the CPU.

    A row is a run of consecutive new tokens of one sequence, seeing that sequence's
    KV up to the run's end (a sequence computing scattered positions gives one row
    per run, sharing its page table).

    Invariants: ``qo_indptr[-1]`` is the number of new tokens T; row i's new tokens
    are the last ones of its KV, at positions ``kv_lens[i] - n .. kv_lens[i] - 1``
    (so a plain causal kernel attends exactly by position); every earlier position
    holds KV or is computed by another row of the same step; ``kv_page_indptr``
    indexes ``kv_page_indices`` with exactly ``ceil(kv_lens[i] / page_size)`` pages
    per row. ``positions`` repeats the new tokens' positions (None only in layouts
    built inside a backend: decode subsets, graph padding).
    """

    qo_indptr: torch.Tensor  # [B + 1]
    kv_page_indptr: torch.Tensor  # [B + 1]
    kv_page_indices: torch.Tensor  # [total pages]
    kv_last_page_len: torch.Tensor  # [B], in 1..page_size
    kv_lens: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [T], page * page_size + offset of each new token
    page_size: int
    positions: torch.Tensor | None = None  # [T], position of each new token

    @property
    def batch_size(self) -> int:
        return self.kv_lens.numel()

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        """Every row is exactly one new token."""
        return self.num_tokens == self.batch_size

    def query_positions(self, i: int) -> torch.Tensor:
        """Positions of sequence i's new tokens (int64)."""
        start, end = int(self.qo_indptr[i]), int(self.qo_indptr[i + 1])
        if self.positions is not None:
            return self.positions[start:end].long()
        kv_len = int(self.kv_lens[i])
        return torch.arange(kv_len - (end - start), kv_len)


def position_mask(layout: BatchLayout, i: int) -> torch.Tensor:
    """[q_len, kv_len] bool for sequence i: True where a new token may attend (KV
    position <= its own position)."""
    kv_len = int(layout.kv_lens[i])
    return torch.arange(kv_len)[None, :] <= layout.query_positions(i)[:, None]


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class AttentionMetadata(Protocol):
    """Backend-specific, built once per step by ``plan``; read-only afterwards."""

    kv_rows: torch.Tensor  # [2T] int64 on the cache's device, see kv_write_rows


class StepGraphs(Protocol):
    """CUDA graphs of a model's steps (``workers.engine.graphs``), captured by the model
    runner over a backend with ``graph_hooks``."""

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
        rows: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits [S, vocab] of the new tokens at ``rows`` if a graph fits this step;
        None: the step runs eagerly (``plan``, then the model)."""
        ...


class AttentionBackend(Protocol):
    """Paged attention over a flattened batch.

    ``plan`` is called once per step; ``forward`` once per layer with the same
    metadata. ``forward`` first writes the new tokens' K/V into ``kv_cache`` at
    ``slot_mapping`` (the only mutation), then returns attention outputs of the new
    tokens' queries over each sequence's full KV, causally. ``attend`` is the second
    half alone, for a layer that wrote the K/V itself (at ``metadata.kv_rows``, fused
    with producing them: ``layers/qkv_kernel``).
    """

    name: str
    fused_ops: bool  # whether models run fused elementwise kernels (layers/ops)
    # whether ``workers.engine.graphs`` captures this backend's steps in CUDA graphs (it
    # drives the backend's plan hooks); False: every step runs eagerly
    graph_hooks: bool
    # the attention kind the last step ran ("decode", "prefill", "cascade", ...; set by
    # ``plan`` or a graph's replay): what step tallies call it
    last_plan_kind: str

    def wants_cascade(self, layout: BatchLayout) -> bool:
        """Whether ``plan`` would run this decode batch as cascade attention."""
        ...

    def plan(self, layout: BatchLayout) -> AttentionMetadata: ...

    def plan_aside(self, layout: BatchLayout) -> AttentionMetadata:
        """A plan for a forward queued outside the engine's steps (at admission, while
        a step may still be in flight): it must not disturb the plans of steps, nor
        those of other forwards queued aside before it."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]

    def attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]; the new K/V already written


def kv_write_rows(slot_mapping: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of ``kv_cache.view(-1, kv_heads * head_dim)`` that the new tokens' keys,
    then values, go to: ``[2T]`` int64, on the slots' device (a step's are computed
    on the CPU, once)."""
    if slot_mapping.device.type == "cpu":
        return torch.from_numpy(kv_write_rows_host(slot_mapping.numpy(), page_size))
    slots = slot_mapping.long()
    key_rows = (slots // page_size) * (2 * page_size) + slots % page_size
    return torch.cat((key_rows, key_rows + page_size))


def kv_write_rows_host(slots: np.ndarray, page_size: int) -> np.ndarray:
    """``kv_write_rows`` on host arrays: numpy takes a few microseconds where torch's
    CPU ops take dozens (it runs before every step and graph replay)."""
    slots = slots.astype(np.int64, copy=False)
    key_rows = (slots // page_size) * (2 * page_size) + slots % page_size
    return np.concatenate((key_rows, key_rows + page_size))


def kv_deviation(
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    kv_cache: torch.Tensor,
    rows: torch.Tensor,  # [2T] int64, see kv_write_rows
) -> torch.Tensor:
    """[T] float32: the squared distance of each token's K and V from what the cache
    holds where ``write_kv`` would write them (two gathers; no host sync)."""
    tokens = k.shape[0]
    flat = kv_cache.view(-1, kv_cache.shape[-2] * kv_cache.shape[-1])
    held = flat.index_select(0, rows).float()
    deviation = (k.reshape(tokens, -1).float() - held[:tokens]).square().sum(1)
    return deviation + (v.reshape(tokens, -1).float() - held[tokens:]).square().sum(1)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """Scatter new K/V into the paged cache at ``kv_write_rows`` (one kernel)."""
    tokens = k.shape[0]
    flat = kv_cache.view(-1, kv_cache.shape[-2] * kv_cache.shape[-1])
    new = torch.cat((k.reshape(tokens, -1), v.reshape(tokens, -1))).to(kv_cache.dtype)
    flat.index_copy_(0, rows, new)


# A prefill kernel without KV splitting (FlashInfer's FA3, its default on Hopper) gives
# each (128-query tile, query head) one CTA that walks its row's whole KV: a step of a
# few short rows over a long KV (a cache hit's tail, an approximate request's question)
# keeps a few dozen of the SMs busy for as long as the longest walk. Measured on an
# H200, qwen3-0.6b heads, one layer (bench/prefill_kernel.py): 32 queries over 4,384
# keys 63 us with FA3, 18 us with FA2 splitting the KV; 256 + 32 queries over 256 and
# 4,384 keys 64 against 30 us; but 8 rows of 40 over 3,000 keys (8 tiles) 51 against
# 62 us, and a 1,024-token prompt 22 against 74 us.
QUERY_TILE = 128
SPLIT_KV_MIN_KV_LEN = 1024


def prefers_split_kv(layout: BatchLayout, num_heads: int, num_sms: int) -> bool:
    """Whether a prefill step's attention should take the split-KV kernel: its query
    tiles (``QUERY_TILE`` new tokens of one row, per query head) fill at most half the
    SMs, and some row sees at least ``SPLIT_KV_MIN_KV_LEN`` tokens of KV."""
    rows = np.diff(layout.qo_indptr.numpy())  # host arrays: this runs on every step
    tiles = int(((rows + QUERY_TILE - 1) // QUERY_TILE).sum()) * num_heads
    return tiles <= num_sms // 2 and int(layout.kv_lens.numpy().max()) >= SPLIT_KV_MIN_KV_LEN


def max_split_kv_tokens(num_heads: int, num_sms: int) -> int:
    """The most new tokens a step that ``prefers_split_kv`` can have."""
    return (num_sms // 2 // num_heads) * QUERY_TILE


# The other case FA3's 128-query tile serves badly: many rows of a token or a few, each
# tile almost empty and walking its row's whole KV. That is a loaded worker's mixed step,
# the one-token rows of decoding requests beside a cache hit's tail: 48 + 20 x 1 queries
# over 2,600 keys 125 us a layer with FA3, 61 with FA2 (H200, bench/prefill_kernel.py
# --variants fa2 --shapes decodes), which takes its smallest query tile,
# ``SMALL_QUERY_TILE`` packed queries (new tokens x query heads per KV head), where a
# step's rows average at most that.
SMALL_QUERY_TILE = 16


def prefers_small_query_tiles(layout: BatchLayout, num_heads: int, num_kv_heads: int) -> bool:
    """Whether a prefill step of several rows averages at most ``SMALL_QUERY_TILE``
    packed queries a row (mostly one-token rows), so that FA2 with its smallest query
    tile should take it."""
    rows, group = layout.batch_size, num_heads // num_kv_heads
    return rows > 1 and layout.num_tokens * group <= SMALL_QUERY_TILE * rows


def small_tile_scratch_bytes(tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """The float workspace FA2 reserves when planned for a CUDA graph of ``tokens``
    tokens in as many rows (its query tile then ``SMALL_QUERY_TILE``): in graph mode it
    always splits the KV, keeping a float32 partial output and log-sum-exp per query
    head and tile row for each of ceil(tokens x group / tile) + tokens - 1 tile slots
    (FlashInfer 0.6.6's ``PrefillSplitQOKVIndptr`` and ``PrefillPlan``). It grows with
    the query heads: 76 MB for qwen3-0.6b at 512 tokens, 169 MB for 32 heads."""
    group = num_heads // num_kv_heads
    slots = -(-tokens * group // SMALL_QUERY_TILE) + tokens - 1
    return slots * num_heads * SMALL_QUERY_TILE * (head_dim + 1) * 4


def choose_graph(
    buckets: list[tuple[int, int, str]], tokens: int, rows: int, kernel: str
) -> tuple[int, int, str] | None:
    """The prefill graph for a step of ``tokens`` new tokens in ``rows`` rows whose
    attention takes ``kernel``: the first of ``buckets`` (sorted (tokens, rows, kernel)
    keys) of that kernel holding them, else the first of the default kernel, else None
    (the step runs eagerly)."""
    fitting = [key for key in buckets if key[0] >= tokens and key[1] >= rows]
    for wanted in (kernel, "default"):
        key = next((key for key in fitting if key[2] == wanted), None)
        if key is not None:
            return key
    return None
