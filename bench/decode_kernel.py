"""FlashInfer paged decode attention alone, qwen3-0.6b head shapes (16 query heads,
8 KV heads, dim 128, page 16): CUDA-core vs tensor-core kernels, against the KV-read
floor. Chooses the backend's ``use_tensor_cores`` rule by measurement.

    python bench/decode_kernel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_line, measure_bandwidth, median_time, print_table  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16


def main() -> None:
    import flashinfer

    bandwidth = measure_bandwidth()
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for batch, context in ((1, 512), (64, 512), (256, 512), (256, 4096)):
        pages_per = -(-context // PAGE)
        cache = torch.randn(
            batch * pages_per, 2, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda"
        )
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per
        indices = torch.randperm(batch * pages_per, dtype=torch.int32).cuda()
        last = torch.full((batch,), context - (pages_per - 1) * PAGE, dtype=torch.int32)
        q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        kv_bytes = batch * context * 2 * KV_HEADS * DIM * 2
        times = []
        for tensor_cores in (False, True):
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores
            )
            wrapper.plan(
                indptr,
                indices,
                last,
                HEADS,
                KV_HEADS,
                DIM,
                PAGE,
                q_data_type=torch.bfloat16,
                kv_data_type=torch.bfloat16,
            )
            times.append(median_time(lambda w=wrapper, q=q, c=cache: w.run(q, c), 50) * 1e6)
        floor = kv_bytes / bandwidth * 1e6
        rows.append([batch, context, times[0], times[1], floor, min(times) / floor])
    print(f"device: {device_line()}")
    print_table(
        "Decode attention per layer (us)",
        ["batch", "context", "cuda cores", "tensor cores", "KV-read floor", "best x floor"],
        rows,
    )


if __name__ == "__main__":
    main()
