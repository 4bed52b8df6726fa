"""What structured output's token mask costs a decode step: ``--batch`` requests
decode with and without a JSON schema (``{"answer": string}``), in turns in one
process. The mask is filled on the host by xgrammar and applied on the device inside
the sampling step; its grammar is compiled once (cached) before the timed rounds.

    python bench/structured_overhead.py [--model DIR] [--batch 64] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_model, device_line, print_table  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402
from workers.engine.structured import ResponseFormat  # noqa: E402

SCHEMA = json.dumps(
    {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """Seconds, output tokens, and the longest output (the decode steps taken)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate_tokens(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    lengths = [len(o.token_ids) for o in outs]
    return time.perf_counter() - start, sum(lengths), max(lengths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if torch.cuda.is_available():
        print(device_line())
    llm = LLM(bench_model(args.model))
    rng = random.Random(0)
    variants = {
        "plain": SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True),
        "json schema": SamplingParams(
            max_tokens=args.tokens,
            temperature=0,
            response_format=ResponseFormat("json_schema", SCHEMA),
        ),
    }
    for params in variants.values():  # warm: kernels, graphs, the compiled grammar
        run(llm, [rng.choices(range(10, 1000), k=64) for _ in range(args.batch)], params)
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, params in variants.items():
            prompts = [rng.choices(range(10, 1000), k=64) for _ in range(args.batch)]
            elapsed, count, steps = run(llm, prompts, params)
            per_step[name].append(elapsed / steps)
            tokens[name].append(count)
    plain = statistics.median(per_step["plain"])
    rows = [
        [
            name,
            f"{statistics.median(values) * 1e3:.2f} "
            f"({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})",
            f"{statistics.median(values) / plain:.3f}",
            f"{(statistics.median(values) - plain) / args.batch * 1e6:.1f}",
            statistics.median(tokens[name]),
        ]
        for name, values in per_step.items()
    ]
    print_table(
        f"decode, batch {args.batch}, up to {args.tokens} tokens ({args.rounds} rounds)",
        ["variant", "ms a step (min-max)", "x plain", "us a token over plain", "tokens"],
        rows,
    )


if __name__ == "__main__":
    main()
