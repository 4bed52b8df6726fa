"""Offline throughput: 256 requests, input and output lengths uniform in 100-1024,
EOS ignored (the workload nano-vllm and vLLM publish). Prints our output tok/s, the
transformers ``generate`` peer on a subset of the same requests, and the roofline
floor of an ideal schedule on this device.

    python bench/throughput.py [--model DIR] [--requests 256] [--peer-requests 64]
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
    load_transformers_model,
    measure_bandwidth,
    measure_matmul_rate,
    print_table,
    weight_bytes,
)
from bench.step_profile import StepProfile  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        (rng.choices(range(10, 1000), k=rng.randint(100, 1024)), rng.randint(100, 1024))
        for _ in range(n)
    ]


def run_ours(model_dir: Path, requests) -> tuple[float, int, StepProfile, LLM]:
    llm = LLM(model_dir, max_num_seqs=256)
    llm.generate_tokens([[1, 2, 3]], SamplingParams(max_tokens=4))  # warm up
    profile = StepProfile(llm.engine)
    params = [SamplingParams(max_tokens=o, temperature=0.6, ignore_eos=True) for _, o in requests]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate_tokens([p for p, _ in requests], params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(o for _, o in requests)
    return elapsed, produced, profile, llm


def run_peer(model_dir: Path, requests, batch_size: int) -> tuple[float, int]:
    model = load_transformers_model(model_dir)
    ordered = sorted(requests, key=lambda r: len(r[0]))
    useful = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = ordered[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(o for _, o in batch)
        with torch.no_grad():
            model.generate(
                ids.cuda(),
                attention_mask=mask.cuda(),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=0.6,
                top_k=0,
                eos_token_id=None,
                pad_token_id=0,
            )
        useful += sum(o for _, o in batch)  # tokens past a request's own length are waste
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return elapsed, useful


def floor_seconds(llm: LLM, requests, bandwidth: float, flops: float) -> float:
    """Every request runs from the start (ideal batching): prefill is compute-bound
    at the matmul rate; each decode step reads the weights once plus every active
    request's KV, or is compute-bound, whichever is slower."""
    engine = llm.engine
    weights = weight_bytes(engine.runner.model)
    params = weights / 2
    kv = kv_bytes_per_token(engine.model_config)
    prefill = 2 * params * sum(len(p) for p, _ in requests) / flops
    decode = 0.0
    for step in range(1, max(o for _, o in requests) + 1):
        active = [(len(p), o) for p, o in requests if o >= step]
        read = weights + sum(i + step for i, _ in active) * kv
        decode += max(read / bandwidth, 2 * params * len(active) / flops)
    return prefill + decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--peer-requests", type=int, default=64, help="0: no transformers comparison")
    ap.add_argument("--peer-batch", type=int, default=64)
    args = ap.parse_args()
    model_dir = bench_model(args.model)
    requests = workload(args.requests)
    bandwidth, flops = measure_bandwidth(), measure_matmul_rate()
    ours_s, produced, profile, llm = run_ours(model_dir, requests)
    floor = floor_seconds(llm, requests, bandwidth, flops)
    profile.print()
    del llm, profile  # free the KV cache before the peer loads
    torch.cuda.empty_cache()
    ours_tps, floor_tps = produced / ours_s, produced / floor
    rows = [
        ["chunkserve", args.requests, produced, ours_s, ours_tps, 1.0],
        [
            "floor (ideal schedule, roofline)",
            args.requests,
            produced,
            floor,
            floor_tps,
            floor_tps / ours_tps,
        ],
    ]
    print(f"\nours / floor = {ours_tps / floor_tps:.1%}")  # before the peer's long run
    peer_requests = requests[: args.peer_requests]
    if peer_requests:
        peer_s, peer_tokens = run_peer(model_dir, peer_requests, args.peer_batch)
        peer_tps = peer_tokens / peer_s
        peer = f"transformers generate (batch {args.peer_batch})"
        rows.insert(
            1, [peer, len(peer_requests), peer_tokens, peer_s, peer_tps, peer_tps / ours_tps]
        )
    print(f"device: {device_line()}")
    print(
        f"measured: bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s"
    )
    print_table(
        f"Throughput, {args.requests} requests, in/out uniform 100-1024, EOS ignored",
        ["system", "requests", "output tokens", "seconds", "output tok/s", "vs ours"],
        rows,
    )
    if peer_requests:
        print(
            f"\nours / floor = {ours_tps / floor_tps:.1%}; "
            f"ours / transformers = {ours_tps / peer_tps:.1f}x"
        )


if __name__ == "__main__":
    main()
