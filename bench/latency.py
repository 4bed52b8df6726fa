"""Latency: decode time per step at batch 1, 64 and 256 (context 512) against the
roofline floor, and prefill tokens/s for 1K and 8K prompts. ``--skinny-ab N``: batch-1
decode with the skinny projections the engine chose (layers/skinny_choice) against
cuBLAS only, engines built alternately N times each in this process.

    python bench/latency.py [--model DIR] [--skinny-ab N]
"""

from __future__ import annotations

import argparse
import random
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

CONTEXT = 512
DECODE_STEPS = 64


def decode_step_ms(llm: LLM, batch: int) -> float:
    """Wall time per engine step once ``batch`` requests all decode: DECODE_STEPS
    consecutive steps, the device synchronized only before and after (a synchronize
    per step would stop overlapped steps from overlapping; without overlap the two
    ways agree)."""
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=DECODE_STEPS + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"lat-{batch}-{i}", rng.choices(range(10, 1000), k=CONTEXT), params)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    engine.step()  # the first decode step
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return 1000 * elapsed / DECODE_STEPS


def prefill_tokens_per_s(llm: LLM, length: int) -> float:
    rng = random.Random(length)
    prompt = rng.choices(range(10, 1000), k=length)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate_tokens([rng.choices(range(10, 1000), k=length)], params)  # warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate_tokens([prompt], params)
    torch.cuda.synchronize()
    return length / (time.perf_counter() - start)


def skinny_ab(model_dir, rounds: int) -> None:
    """Batch-1 decode ms with the engine's skinny choice against none, alternately."""
    import gc

    rows = []
    for i in range(rounds):
        for skinny in (True, False):
            llm = LLM(model_dir, enable_reuse=False, max_num_seqs=8, skinny_matmul=skinny)
            choice = llm.engine.runner.skinny
            if skinny:
                print(f"round {i + 1}: {choice.summary()}")
            rows.append([i + 1, sorted(choice.chosen) or "none", decode_step_ms(llm, 1)])
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print_table(
        "Batch-1 decode, skinny projections against cuBLAS (context 512)",
        ["round", "skinny kinds", "ms/step"],
        rows,
    )
    on = [r[2] for r in rows[0::2]]
    off = [r[2] for r in rows[1::2]]
    print(f"cuBLAS / skinny: {sum(off) / sum(on):.3f}x (mean of {rounds} rounds)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--skinny-ab", type=int, default=0, metavar="N", help="see the docstring")
    args = ap.parse_args()
    model_dir = bench_model(args.model)
    if args.skinny_ab:
        skinny_ab(model_dir, args.skinny_ab)
        return
    bandwidth, flops = measure_bandwidth(), measure_matmul_rate()
    llm = LLM(model_dir, enable_reuse=False, max_num_seqs=256, max_num_batched_tokens=16384)
    print(llm.engine.runner.skinny.summary())
    weights = weight_bytes(llm.engine.runner.model)
    kv = kv_bytes_per_token(llm.engine.model_config)
    rows = []
    for batch in (1, 64, 256):
        measured = decode_step_ms(llm, batch)
        floor = 1000 * max(
            (weights + batch * (CONTEXT + DECODE_STEPS // 2) * kv) / bandwidth,
            weights * batch / flops,
        )
        rows.append([batch, measured, floor, measured / floor, batch * 1000 / measured])
    print(f"device: {device_line()}")
    print(
        f"measured: bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s"
    )
    print_table(
        f"Decode step (context {CONTEXT}, CUDA graphs, wall clock incl. scheduling)",
        ["batch", "ms/step", "floor ms", "x floor", "tok/s"],
        rows,
    )
    prefill_rows = []
    for length in (1024, 8192):
        tps = prefill_tokens_per_s(llm, length)
        floor_tps = flops / weights  # 2 * params FLOPs per token
        prefill_rows.append([length, tps, floor_tps, tps / floor_tps])
    print_table(
        "Prefill (one prompt, time to first token)",
        ["prompt tokens", "tokens/s", "floor tokens/s (matmul)", "share of floor"],
        prefill_rows,
    )


if __name__ == "__main__":
    main()
