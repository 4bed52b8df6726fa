"""Where a step's time goes: torch profiler tables (CPU and CUDA) for a warm RAG
request's time to first token and for a batch-8 decode step.

    python bench/profile_step.py [--model DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_model  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402


def show(title: str, fn) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n===== {title}: by CUDA time")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
    )
    print(f"===== {title}: by CPU time")
    print(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60)
    )
    pr = cProfile.Profile()
    pr.enable()
    fn()
    torch.cuda.synchronize()
    pr.disable()
    print(f"===== {title}: Python cumulative")
    pstats.Stats(pr).sort_stats("cumulative").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    args = ap.parse_args()
    rng = random.Random(0)
    llm = LLM(bench_model(args.model), num_pages=16384, max_num_seqs=64)
    context = rng.choices(range(10, 1000), k=5120)
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate_tokens([context + [5] * 64], one)
    show(
        "warm RAG TTFT",
        lambda: llm.generate_tokens([context + rng.choices(range(10, 1000), k=64)], one),
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"d{i}", rng.choices(range(10, 1000), k=300), params)
    for _ in range(5):
        engine.step()
    show("decode step, batch 8", engine.step)


if __name__ == "__main__":
    main()
