"""Cascade decode: full decode-step time (model runner: inputs, plan, forward) with a
shared prefix, cascade vs flat, plus a small shape where the cost model should decline
cascade and cost nothing. Steps are timed back to back (the host prepares the next
while the device runs one, as in the engine's overlapped steps) and, beside, one at a
time with the device synchronized after each.

    python bench/cascade.py [--model DIR]
    python bench/cascade.py --profile 256,16384   # kernel table of one shape's steps
"""

from __future__ import annotations

import argparse
import random
import sys
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    bench_model,
    device_line,
    median_time,
    print_table,
    profiled_calls,
)
from chunkstore.hashing import Namespace  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402
from workers.engine.request import Sequence  # noqa: E402
from workers.engine.scheduler import ScheduledSeq  # noqa: E402

PAGE = 16
SHAPES = [(64, 4096), (64, 16384), (256, 4096), (256, 16384)]
DECLINED = (8, 256)
CONSECUTIVE = 8


def decode_batch(batch: int, prefix: int, rng: random.Random) -> list[ScheduledSeq]:
    """``batch`` requests sharing ``prefix`` tokens of pages, each with 128-512 own
    tokens; page ids laid out directly (KV contents are random: timing only)."""
    prefix_pages = list(range(prefix // PAGE))
    next_page = len(prefix_pages)
    items = []
    for i in range(batch):
        own = rng.randint(128, 512)
        own_pages = list(range(next_page, next_page + -(-own // PAGE)))
        next_page += len(own_pages)
        kv_len = prefix + own
        seq = Sequence(f"c{i}", i, [1] * kv_len, SamplingParams(), Namespace("bench"))
        seq.page_ids = array("i", prefix_pages + own_pages)  # as the engine keeps them
        seq.num_computed = kv_len - 1
        items.append(ScheduledSeq(seq, kv_len - 1, 1))
    return items


def profile_steps(step, title: str, steps: int = 5) -> None:
    """Print the CUDA kernels of ``steps`` calls of ``step`` (after a warm-up), with
    the host's wall time per step beside the device's."""
    prof, wall, device = profiled_calls(step, steps)
    print(f"\n### {title}: wall {1000 * wall:.2f} ms a step (profiled), kernels {device:.2f} ms")
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--profile",
        metavar="BATCH,PREFIX",
        help="instead of the table: the profiler's kernel table for 5 steps of this shape, "
        "flat and cascade",
    )
    args = ap.parse_args()
    llm = LLM(bench_model(args.model), num_pages=10240, max_num_seqs=256)
    runner = llm.engine.runner
    backend = runner.backend
    for cache in runner.kv_caches:
        cache.normal_()
    rng = random.Random(0)
    rows = []

    def consecutive_ms(items) -> float:
        """Median over ``iters`` samples of CONSECUTIVE back-to-back steps, the device
        synchronized only before and after: the host plans step i + 1 while the
        device runs step i, as the engine's overlapped steps do."""

        def steps() -> None:
            for _ in range(CONSECUTIVE):
                runner.run(items)

        return 1000 * median_time(steps, max(3, args.iters // 4)) / CONSECUTIVE

    def step_ms(items, cascade: bool, forced: bool = False) -> tuple[float, float, str]:
        """(consecutive, synchronized) step times; ``forced``: cascade whenever
        anything is shared (the cost model's threshold off), to see where it pays."""
        backend.enable_cascade = cascade
        threshold = backend.min_saved_tokens
        backend.min_saved_tokens = 0 if forced else threshold
        try:
            overlapped = consecutive_ms(items)
            synchronized = 1000 * median_time(lambda: runner.run(items), args.iters)
        finally:
            backend.min_saved_tokens = threshold
        graphs = runner.graphs
        graph = graphs is not None and graphs.graph_for(_layout(items)) is not None
        return overlapped, synchronized, f"{backend.last_plan_kind}{' graph' if graph else ''}"

    def _layout(items):
        from workers.engine.model_runner import build_inputs

        return build_inputs(items, PAGE).layout

    if args.profile:
        batch, prefix = map(int, args.profile.split(","))
        items = decode_batch(batch, prefix, rng)
        for cascade in (False, True):
            backend.enable_cascade = cascade
            profile_steps(lambda: runner.run(items), f"cascade={cascade}")
        return
    for batch, prefix in SHAPES + [DECLINED]:
        items = decode_batch(batch, prefix, rng)
        flat, flat_sync, _ = step_ms(items, cascade=False)
        auto, auto_sync, kind = step_ms(items, cascade=True)
        forced, _, forced_kind = step_ms(items, cascade=True, forced=True)
        rows.append(
            [
                batch,
                prefix,
                flat,
                auto,
                kind,
                flat / auto,
                f"{flat_sync:.3g} / {auto_sync:.3g} ({flat_sync / auto_sync:.2f}x)",
                forced,
                forced_kind,
            ]
        )
    print(f"device: {device_line()}")
    print_table(
        "Decode step with a shared prefix (own tokens 128-512): flat vs cascade, ms a step "
        f"over {CONSECUTIVE} consecutive steps (synchronized single steps beside)",
        [
            "batch",
            "shared prefix",
            "flat",
            "cascade-enabled",
            "path taken",
            "speed-up",
            "synchronized: flat / cascade",
            "cascade forced",
            "forced path",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
