"""Tensor parallelism: decode at batch 1 and at a large batch on 1 and N ranks of one
host, each size's engine built in turn in this process, ratios against one rank.
Weights are random, made in place (``engine.load_format dummy``), so shapes too large
to write serve: ``chunkserve make-model DIR --preset qwen3-8b --no-weights``.

    python bench/tensor_parallel.py --model DIR [--sizes 1 2] [--batch 256]

A size whose weights do not fit one rank's GPU is reported as refused (the engine's
own check, with its message), not skipped silently."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_line, print_table  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def decode_step_ms(engine: Engine, batch: int, context: int, steps: int) -> float:
    """Wall time per step once ``batch`` requests of ``context`` prompt tokens all
    decode: ``steps`` consecutive steps, synchronized only before and after."""
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", rng.choices(range(10, 1000), k=context), params)
    while engine.scheduler.waiting or any(
        s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # the first decode step
    _sync(engine)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine)
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return 1000 * elapsed / steps


def measure(args: argparse.Namespace, world: int) -> dict:
    config = EngineConfig(
        str(args.model),
        device=args.device,
        load_format=args.load_format,
        tensor_parallel_size=world,
        max_num_seqs=max(args.batch, 1),
        max_model_len=args.context + args.steps + 16,
        num_pages=args.pages,
    )
    began = time.perf_counter()
    print(f"{world} rank(s): starting the engine", flush=True)
    try:
        engine = Engine(config)
    except ValueError as refused:
        return {"ranks": world, "refused": str(refused)}
    print(f"{world} rank(s): started in {time.perf_counter() - began:.0f} s", flush=True)
    try:
        decode_step_ms(engine, 1, args.context, 4)  # warm up (graphs, kernels)
        print(f"{world} rank(s): warmed up", flush=True)
        one = decode_step_ms(engine, 1, args.context, args.steps)
        print(f"{world} rank(s): batch-1 step {one:.3f} ms", flush=True)
        many = decode_step_ms(engine, args.batch, args.context, args.steps)
    except BaseException:
        traceback.print_exc()  # now: closing a broken group can take ABORT_WAIT_S
        raise
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"ranks": world, "batch1_ms": one, "batch_ms": many, "tok_s": args.batch / many * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint or config directory")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="ranks to compare")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens a request")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed")
    ap.add_argument("--load-format", default="dummy", choices=("dummy", "safetensors"))
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    ap.add_argument("--pages", type=int, default=None, help="KV pages a rank (default: auto)")
    args = ap.parse_args()
    faulthandler.enable()  # a fatal signal prints where it struck
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where it is
    print(device_line() if torch.cuda.is_available() else "cpu", flush=True)
    results = []
    for world in args.sizes:
        result = measure(args, world)
        results.append(result)
        print(result, flush=True)
    base = next((r for r in results if "refused" not in r), None)
    rows = []
    for r in results:
        if "refused" in r:
            rows.append([r["ranks"], "refused", "", "", "", r["refused"]])
            continue
        rows.append([
            r["ranks"], f"{r['batch1_ms']:.3f}", f"{r['batch1_ms'] / base['batch1_ms']:.3f}x",
            f"{r['tok_s']:.0f}", f"{r['tok_s'] / base['tok_s']:.3f}x", "",
        ])  # fmt: skip
    print_table(
        f"decode, context {args.context}, {args.model.name} ({args.load_format} weights)",
        ["ranks", "batch-1 step ms", "x first", f"batch {args.batch} tok/s", "x first", "note"],
        rows,
    )


if __name__ == "__main__":
    main()
