"""Overlapped steps against plain ones, in one process (GPU): offline throughput on
bench/throughput.py's workload and decode step time at a few batch sizes, each
engine built with ``overlap_scheduling`` off and on, alternately, ``--rounds`` times.
Also checks that greedy outputs agree between the two.

    python bench/overlap.py [--model DIR] [--requests 256] [--rounds 2]

Decode step time is ``bench/latency.py``'s: consecutive ``step()`` calls once every
request decodes, the device synchronized only at both ends (a synchronize per step
would undo the overlap)."""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_model, device_line, print_table  # noqa: E402
from bench.latency import CONTEXT, decode_step_ms  # noqa: E402
from bench.throughput import workload  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402

BATCHES = (1, 64, 256)


def throughput(llm: LLM, requests) -> float:
    params = [SamplingParams(max_tokens=o, temperature=0.6, ignore_eos=True) for _, o in requests]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate_tokens([p for p, _ in requests], params)
    torch.cuda.synchronize()
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(o for _, o in requests)
    return produced / (time.perf_counter() - start)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    rng = random.Random(7)
    prompts = [rng.choices(range(10, 1000), k=rng.randint(50, 400)) for _ in range(32)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate_tokens(prompts, params)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model_dir = bench_model(args.model)
    requests = workload(args.requests)
    rows, outputs = [], {}
    for round_ in range(args.rounds):
        for overlap in (False, True):
            # half the memory each: the engine before may not be collected yet
            llm = LLM(
                model_dir,
                max_num_seqs=256,
                overlap_scheduling=overlap,
                gpu_memory_utilization=0.45,
            )
            assert llm.engine.overlap == overlap
            llm.generate_tokens([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm up
            outputs[overlap] = greedy_tokens(llm)
            tps = throughput(llm, requests)
            steps = [decode_step_ms(llm, b) for b in BATCHES]
            rows.append([round_ + 1, "on" if overlap else "off", tps, *steps])
            print(rows[-1], flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    agree = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
    print(f"device: {device_line()}")
    print(f"greedy outputs equal, overlap off vs on: {agree} of {len(outputs[False])} requests")
    print_table(
        f"Overlapped steps, {args.requests} requests (in/out uniform 100-1024); decode steps "
        f"at context {CONTEXT}",
        ["round", "overlap", "output tok/s", *(f"decode ms, batch {b}" for b in BATCHES)],
        rows,
    )
    for round_ in range(args.rounds):
        off, on = rows[2 * round_], rows[2 * round_ + 1]
        ratios = [f"{a / b:.3f}x" for a, b in zip(off[3:], on[3:], strict=True)]
        print(
            f"round {round_ + 1}: throughput {on[2] / off[2]:.3f}x with overlap; decode step "
            f"speedup {', '.join(ratios)} (batch {', '.join(map(str, BATCHES))})"
        )


if __name__ == "__main__":
    main()
