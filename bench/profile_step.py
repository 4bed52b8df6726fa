"""Where a step's time goes: torch profiler tables (CPU and CUDA) for a warm RAG
request's time to first token, a cold 4,384-token prefill, a cache hit joining 20
decoding requests (against their decode step), and decode steps at batch 1 and 256 (8
consecutive steps, so overlapped steps overlap as they do in service), with the wall
time per call beside the device's kernel time.

    python bench/profile_step.py [--model DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_model, profiled_calls  # noqa: E402
from bench.idle_gaps import idle_report  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402

HIT_BATCH = 20  # requests a loaded worker decodes (4 H200s, bench/cluster_rag.py)


def show(title: str, fn, calls: int = 1) -> None:
    prof, wall, kernels = profiled_calls(fn, calls, with_stack=True)
    print(
        f"\n===== {title}: {1000 * wall:.2f} ms a call under the profiler, "
        f"device kernels {kernels:.2f} ms a call"
    )
    print(f"===== {title}: device idle")
    print(idle_report(prof))
    print(f"===== {title}: by CUDA time")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)
    )
    print(f"===== {title}: by CPU time")
    print(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60)
    )
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
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
    llm = LLM(bench_model(args.model), num_pages=16384, max_num_seqs=256)
    context = rng.choices(range(10, 1000), k=5120)
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate_tokens([context + [5] * 64], one)
    show(
        "warm RAG TTFT",
        lambda: llm.generate_tokens([context + rng.choices(range(10, 1000), k=64)], one),
    )
    show(
        "cold prefill, 4,384 tokens",
        lambda: llm.generate_tokens([rng.choices(range(10, 1000), k=4384)], one),
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    # The serving case of a chunk-aware worker (bench/cluster_rag.py): a cache hit's
    # short tail joining a batch of decoding requests, against a decode step of that batch.
    docs = [rng.choices(range(10, 1000), k=2560) for _ in range(HIT_BATCH)]
    for i, doc in enumerate(docs):
        engine.add_request(f"h{i}", doc, params)
    for _ in range(5):
        engine.step()
    hits = itertools.count()

    def hit_step() -> None:
        rid = f"hit{next(hits)}"
        engine.add_request(rid, docs[0] + rng.choices(range(10, 1000), k=48), one)
        while not any(o.request_id == rid for o in engine.step()):
            pass

    hit_step()
    show(f"cache hit (2,560 cached + 48) joining {HIT_BATCH} decoding", hit_step)
    show(f"decode steps, batch {HIT_BATCH}, context 2.6K", engine.step, calls=8)
    for i in range(HIT_BATCH):
        engine.abort(f"h{i}")
    while engine.has_unfinished():
        engine.step()
    for batch in (1, 256):
        for i in range(batch):
            engine.add_request(f"d{batch}-{i}", rng.choices(range(10, 1000), k=512), params)
        for _ in range(5):
            engine.step()
        show(f"decode steps, batch {batch}", engine.step, calls=8)
        for i in range(batch):
            engine.abort(f"d{batch}-{i}")
        while engine.has_unfinished():
            engine.step()


if __name__ == "__main__":
    main()
