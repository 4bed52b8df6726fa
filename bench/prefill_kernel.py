"""FlashInfer paged prefill attention alone, qwen3-0.6b head shapes (16 query heads,
8 KV heads, dim 128, page 16): FA2 (split-KV) against the default kernels (FA3 on
Hopper), for the shapes short prefills take. Checks the backend's short-prefill rule
(``flashinfer_backend.is_short_prefill``) by measurement; outputs are compared too.

    python bench/prefill_kernel.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_line, print_table  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16
# (name, [(new tokens, KV length) per row])
SHAPES = [
    ("cache-hit tail: 40 over 3,000", [(40, 3040)]),
    ("cache-hit tails: 8 x 40 over 3,000", [(40, 3040)] * 8),
    ("short prompt: 256", [(256, 256)]),
    ("prompt: 1,024", [(1024, 1024)]),
    (
        "repair: 700 in 5 runs over 4,400",
        [(256, 256), (216, 2000), (99, 3000), (95, 4000), (32, 4384)],
    ),
    ("repair: 700 in 30 runs over 4,400", [(23, 256 + 140 * i) for i in range(30)]),
]


def kernel_time(wrapper, q, cache, iters: int = 50) -> float:
    """Seconds per run, from CUDA events around back-to-back runs (no host gaps)."""
    for _ in range(5):
        wrapper.run(q, cache)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        wrapper.run(q, cache)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    import flashinfer

    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for name, spec in SHAPES:
        pages = [-(-kv // PAGE) for _, kv in spec]
        cache = torch.randn(sum(pages), 2, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        qo_indptr = torch.tensor([0] + [q for q, _ in spec], dtype=torch.int32).cumsum(
            0, dtype=torch.int32
        )
        kv_indptr = torch.tensor([0, *pages], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        indices = torch.randperm(sum(pages), dtype=torch.int32).cuda()
        last = torch.tensor(
            [kv - (p - 1) * PAGE for (_, kv), p in zip(spec, pages, strict=True)], dtype=torch.int32
        )
        q = torch.randn(int(qo_indptr[-1]), HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        times, outs = [], []
        for backend in ("auto", "fa2"):
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", backend=backend
            )
            wrapper.plan(
                qo_indptr, kv_indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE,
                causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
            )  # fmt: skip
            outs.append(wrapper.run(q, cache).float())
            times.append(kernel_time(wrapper, q, cache))
        diff = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
        rows.append([name, 1e6 * times[0], 1e6 * times[1], times[0] / times[1], diff])
    print(device_line())
    print_table(
        "Paged prefill attention, one layer (us)",
        ["shape", "default (FA3 on Hopper)", "FA2", "FA2 speedup", "rel. diff"],
        rows,
    )


if __name__ == "__main__":
    main()
