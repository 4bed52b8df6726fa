"""Where an approximate request's time to first token goes (torch profiler): the
TTFT scenario of bench/approx_speed.py (system + 8 documents x 512 tokens held
position-free, unseen order and system prompt), one request profiled after warm-up.

    python bench/approx_profile.py [--model DIR] [--trace FILE]

``--trace`` writes the Chrome trace (host ops with Python stacks, GPU kernels) for
a timeline; the tables also name the Python callers of every host-device sync, and
``bench/idle_gaps`` charges the time the GPU sat idle to what the host was doing then.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.approx_speed import FIRST_TOKEN, QUESTION, SYSTEM, held_documents, layout, sync  # noqa: E402
from bench.host_phases import ADMISSION_TIMELINE, ENGINE_STEP, HostPhases, Timeline  # noqa: E402
from bench.idle_gaps import idle_report  # noqa: E402
from workers.engine.reuse_info import ReuseRequest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--trace", help="write the profiler's Chrome trace here")
    ap.add_argument("--first-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--deviation-ratio", type=float, default=None)
    args = ap.parse_args()
    runner, docs, draw = held_documents(args.model)
    rng = random.Random(2)  # the documents' order
    defaults = ReuseRequest("approximate")
    reuse = ReuseRequest(
        "approximate",
        first_tokens=defaults.first_tokens if args.first_tokens is None else args.first_tokens,
        deviation_ratio=(
            defaults.deviation_ratio if args.deviation_ratio is None else args.deviation_ratio
        ),
    )
    print(f"repair: first_tokens={reuse.first_tokens} deviation_ratio={reuse.deviation_ratio}")

    def first_token() -> float:
        order = docs[:]
        rng.shuffle(order)
        prompt, spans = layout(draw(SYSTEM), order, draw(QUESTION))
        rid = runner.submit(prompt, spans, reuse, FIRST_TOKEN)
        sync()
        start = time.perf_counter()
        while not any(o.request_id == rid for o in runner.engine.step()):
            pass
        sync()
        return time.perf_counter() - start

    graphs = runner.engine.runner.graphs and runner.engine.runner.graphs.prefill
    if graphs is not None:  # which kernels each prefill graph bucket took
        kernels = {
            f"{t}x{r} {kernel}": g.wrapper._backend for (t, r, kernel), g in graphs.graphs.items()
        }
        print("prefill graph kernels (tokens x rows):", kernels)

    def planners(timeline: Timeline) -> None:  # the selection graphs' compiled planner
        selection = runner.engine.runner.selection_graphs
        for g in (selection.graphs if selection is not None else {}).values():
            timeline.wrap(g, "plan", "workers.engine.graphs.selection:planner")

    profile_first_token(first_token, args.trace, planners)


def profile_first_token(
    first_token: Callable[[], float],
    trace: str | None = None,
    instrument: Callable[[Timeline], None] | None = None,
) -> None:
    """Profile one call of ``first_token`` (it returns its own wall seconds) after
    warm-up: host phases, the host and device times at each admission edge
    (``instrument`` may add edges to the ``Timeline``; on CUDA), the device's idle gaps
    charged to host events, kernels and host ops by time, the callers of every
    host-device sync, then host functions under cProfile. ``trace``: also write the
    Chrome trace there."""
    for _ in range(3):
        first_token()
    with HostPhases(ENGINE_STEP) as phases:
        for _ in range(5):
            first_token()
    print("host phases, mean of 5 requests (bench/host_phases.py):")
    print(phases.report(calls=5))
    if torch.cuda.is_available():
        with Timeline(ADMISSION_TIMELINE) as timeline:
            if instrument is not None:
                instrument(timeline)
            for _ in range(3):
                timeline.edges.clear()
                seconds = first_token()
                print(f"\nhost and device at each edge, one request ({seconds * 1e3:.2f} ms):")
                print(timeline.report())
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    plain = min(first_token() for _ in range(5))
    with profile(activities=activities, with_stack=True) as prof:
        seconds = first_token()
    print(f"TTFT {plain * 1e3:.2f} ms (best of 5); under the profiler: {seconds * 1e3:.2f} ms")
    print(idle_report(prof))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    syncs = [
        e
        for e in prof.key_averages(group_by_stack_n=8)
        if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")
    ]
    for event in syncs:
        print(f"{event.key} x{event.count}, {event.cpu_time_total / 1e3:.2f} ms, from:")
        print("    " + "\n    ".join(event.stack))
    if trace:
        prof.export_chrome_trace(trace)
    # Host time by Python function (no CUDA profiler): where the host spends the TTFT,
    # waits for the device included (they show as the syncing calls' own time).
    host = cProfile.Profile()
    host.enable()
    seconds = first_token()
    host.disable()
    print(f"\n===== host functions, one request ({seconds * 1e3:.2f} ms under cProfile)")
    pstats.Stats(host).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
