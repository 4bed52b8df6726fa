"""Chunk reuse, RAG shape: system 1024 + 4 documents x 1024 (from a pool of 20) +
query 64 tokens. Time to first token cold (nothing cached) vs warm (system and the
same documents cached, new query), and warm against its floor: one forward pass of
just the uncached tokens over the cached context.

    python bench/chunk_reuse.py [--model DIR] [--trials 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    bench_model,
    device_line,
    kv_bytes_per_token,
    measure_bandwidth,
    measure_matmul_rate,
    print_table,
    weight_bytes,
)
from workers import LLM, SamplingParams  # noqa: E402

SYSTEM, DOC, DOCS, POOL, QUERY = 1024, 1024, 4, 20, 64


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    out = llm.generate_tokens([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    sync()
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    system = rng.choices(range(10, 1000), k=SYSTEM)
    pool = [rng.choices(range(10, 1000), k=DOC) for _ in range(POOL)]
    llm = LLM(bench_model(args.model), num_pages=16384)
    bandwidth, flops = measure_bandwidth(), measure_matmul_rate()
    ttft(llm, rng.choices(range(10, 1000), k=SYSTEM))  # warm up kernels
    cold, warm, cached = [], [], []
    for _ in range(args.trials):
        docs = [t for d in rng.sample(pool, DOCS) for t in d]
        llm.engine.pool.clear()
        cold.append(ttft(llm, system + docs + rng.choices(range(10, 1000), k=QUERY))[0])
        seconds, hit = ttft(llm, system + docs + rng.choices(range(10, 1000), k=QUERY))
        warm.append(seconds)
        cached.append(hit)
    total = SYSTEM + DOCS * DOC + QUERY
    uncached = total - statistics.median(cached)
    weights = weight_bytes(llm.engine.runner.model)
    kv = kv_bytes_per_token(llm.engine.model_config)
    floor = max((weights + total * kv) / bandwidth, weights * uncached / flops)
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    print(f"device: {device_line()}")
    print_table(
        f"RAG time to first token ({total} prompt tokens, median of {args.trials})",
        ["case", "TTFT ms", "cached tokens", "vs warm floor"],
        [
            ["cold", 1000 * cold_s, 0, cold_s / floor],
            ["warm", 1000 * warm_s, int(statistics.median(cached)), warm_s / floor],
            ["warm floor (uncached tokens over cached context)", 1000 * floor, "-", 1.0],
        ],
    )
    print(f"\ncold / warm TTFT = {cold_s / warm_s:.1f}x")


if __name__ == "__main__":
    main()
