"""CUDA graphs of an approximate request's kept rows (``DecoderModel.forward_kept``:
the selection layer's attention and every layer after it, over the rows chosen on
the device), so their ~25 layers of small kernels launch as one graph instead of
several hundred eager launches the host cannot issue as fast as the GPU runs them.

A graph per (row bucket, KV bucket), captured on first use (a request pays its
capture once, about 0.1 s; engines that never serve approximate reuse capture none).
Rows pad to the bucket: a padding row sits at position 0 (it attends to key 0 of the
sequence, which it never writes; its inputs are whatever the buffers held) and writes
its KV to the scratch page. The KV bucket bounds the scattered kernel's key splits
(its grid is fixed at capture). All graphs draw on one memory pool, so together they
hold about what the largest one needs: by its buffers' sizes under 100 MiB for
qwen3-0.6b (1,024 rows over 32K keys). That pool is not counted when the engine sizes
the KV pool; it comes from the headroom left beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.attention.base import kv_write_rows
from workers.engine.attention.scattered import ScatteredAttention, ScatteredMetadata
from workers.engine.graphs.capture import capture
from workers.engine.models.decoder import DecoderModel

ROW_BUCKETS = (64, 128, 256, 512, 1024)
KV_BUCKETS = (4096, 8192, 16384, 32768)


@dataclass
class _Inputs:
    """Fixed buffers of one row bucket (every KV bucket's graph reads them)."""

    qkv: torch.Tensor  # [rows, q + 2 kv]
    residual: torch.Tensor  # [rows, hidden]
    positions: torch.Tensor  # [rows] int64
    slots: torch.Tensor  # [rows] int64, each row's KV slot


class KeptRowsGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        attention: ScatteredAttention,
        layer: int,
        scratch_page: int,
        max_pages_per_seq: int,
    ) -> None:
        self.model = model
        self.layer = layer  # the selection layer: the first one the graphs run
        self.kv_caches = kv_caches
        self.attention = attention
        self.page_size = attention.shape.page_size
        self.scratch_slot = scratch_page * self.page_size
        device = attention.shape.device
        self.page_table = torch.zeros(max_pages_per_seq, dtype=torch.int32, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.inputs: dict[int, _Inputs] = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @staticmethod
    def buckets(rows: int, kv_len: int) -> tuple[int, int] | None:
        """The graph that serves ``rows`` kept rows over ``kv_len`` keys, if any."""
        row_bucket = next((b for b in ROW_BUCKETS if b >= rows), None)
        kv_bucket = next((b for b in KV_BUCKETS if b >= kv_len), None)
        return None if row_bucket is None or kv_bucket is None else (row_bucket, kv_bucket)

    @torch.inference_mode()
    def run(
        self,
        qkv: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor | None:
        """``forward_kept`` of these rows through a graph: final hidden states [N,
        hidden], or None when no bucket fits (the caller runs it eagerly)."""
        key = self.buckets(qkv.shape[0], kv_len)
        if key is None or page_table.shape[0] > self.page_table.shape[0]:
            return None
        n = qkv.shape[0]
        inputs = self.inputs.get(key[0]) or self._inputs(key[0], qkv, residual)
        inputs.qkv[:n].copy_(qkv)
        inputs.residual[:n].copy_(residual)
        inputs.positions[:n].copy_(positions)
        inputs.positions[n:].zero_()
        inputs.slots[:n].copy_(slots)
        inputs.slots[n:].fill_(self.scratch_slot)
        self.page_table[: page_table.shape[0]].copy_(page_table)
        graph, hidden = self.graphs.get(key) or self._capture(key)
        graph.replay()
        return hidden[:n]

    def _inputs(self, rows: int, qkv: torch.Tensor, residual: torch.Tensor) -> _Inputs:
        device = qkv.device
        inputs = _Inputs(
            torch.zeros((rows, qkv.shape[1]), dtype=qkv.dtype, device=device),
            torch.zeros((rows, residual.shape[1]), dtype=residual.dtype, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device),
        )
        self.inputs[rows] = inputs
        return inputs

    def _capture(self, key: tuple[int, int]):
        inputs, kv_bucket = self.inputs[key[0]], key[1]

        def forward() -> torch.Tensor:
            rows = kv_write_rows(inputs.slots, self.page_size)
            metadata = ScatteredMetadata(rows, inputs.positions, self.page_table, kv_bucket)
            return self.model.forward_kept(
                inputs.qkv,
                inputs.residual.clone(),  # forward_kept overwrites it: replays must not
                inputs.positions,
                self.kv_caches,
                self.layer,
                self.attention,
                metadata,
            )

        # capture runs forward three times: on the current inputs, which are real
        # rows and padding only; it writes what the replay writes next anyway
        self.graphs[key] = capture(forward, self.pool)
        return self.graphs[key]
