"""The host-memory KV tier on one engine: what a host hit saves, what an idle tier
costs, and whether loads stall the requests stepping beside them. Each comparison runs
in this process, its variants in turns.

- **TTFT**: a prompt of a 512-token system prompt, 4 documents x 512 and a fresh
  40-token question (2,600 tokens): a miss (nothing cached), a device hit (the prefix
  in device pages) and a host hit (the prefix pushed out to host memory first, so the
  admission loads it back).
- **An idle tier's cost**: unique prompts through a pool that evicts as it goes, with
  the tier off and on. On, every evicted page is copied out and none is ever hit.
- **Inter-token latency during loads**: ``--decoders`` requests decode; while they
  do, prompts whose prefixes sit in host memory arrive, one every few steps. The
  decoders' inter-token p99 is compared with the same arrivals hitting device memory.

    python bench/host_tier.py [--model DIR] [--trials 7] [--host-kv-gib 8] [--parts ttft]
        [--load-format dummy]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_model, device_line, print_table  # noqa: E402
from workers import LLM, SamplingParams  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.llm import reuse_request  # noqa: E402

SYSTEM, DOC, DOCS, QUESTION = 512, 512, 4, 40
VOCAB = range(10, 1000)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return rng.choices(VOCAB, k=n)


def push_out(engine: Engine) -> None:
    """Evict every cached page the pool holds into the host tier, a staging bound's
    worth at a time, each written before the next (so none is skipped)."""
    pool, taken = engine.pool, []
    while pool.num_available:
        taken += pool.allocate(min(pool.host.copier.staging_pages, pool.num_available))
        _sync()
    pool.release(taken)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    _sync()
    start = time.perf_counter()
    out = llm.generate_tokens([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    _sync()
    return time.perf_counter() - start, out.num_cached_tokens


def measure_ttft(llm: LLM, trials: int, rng: random.Random) -> list[list[object]]:
    ttft(llm, _tokens(rng, SYSTEM + DOCS * DOC))  # kernels warm
    times: dict[str, list[float]] = {"miss": [], "device hit": [], "host hit": []}
    cached: dict[str, int] = {}
    loaded_pages = 0
    for _ in range(trials):
        prefix = _tokens(rng, SYSTEM + DOCS * DOC)
        llm.engine.pool.clear()
        times["miss"].append(ttft(llm, prefix + _tokens(rng, QUESTION))[0])
        elapsed, cached["device hit"] = ttft(llm, prefix + _tokens(rng, QUESTION))
        times["device hit"].append(elapsed)
        push_out(llm.engine)
        before = llm.engine.pool.host.stats().pages_loaded
        elapsed, cached["host hit"] = ttft(llm, prefix + _tokens(rng, QUESTION))
        times["host hit"].append(elapsed)
        loaded_pages = llm.engine.pool.host.stats().pages_loaded - before
    miss = statistics.median(times["miss"])
    rows = []
    for kind, values in times.items():
        median = statistics.median(values)
        rows.append(
            [
                kind,
                f"{median * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})",
                f"{median / miss:.3f}",
                cached.get(kind, 0),
            ]
        )
    rows[-1][3] = f"{cached['host hit']} ({loaded_pages} pages loaded)"
    return rows


def profile_ttft(llm: LLM, rng: random.Random) -> None:
    """One device hit and one host hit of a fresh prefix, profiled."""
    prefix = _tokens(rng, SYSTEM + DOCS * DOC)
    llm.engine.pool.clear()
    ttft(llm, prefix + _tokens(rng, QUESTION))
    print_profile("device hit", lambda: ttft(llm, prefix + _tokens(rng, QUESTION)))
    push_out(llm.engine)
    print_profile("host hit", lambda: ttft(llm, prefix + _tokens(rng, QUESTION)))


def throughput(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    outs = llm.generate_tokens(prompts, params)
    _sync()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def print_profile(title: str, run) -> None:
    """``run()`` under cProfile and torch's profiler: the host functions and the device
    kernels that took the most time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    host = cProfile.Profile()
    with profile(activities=activities) as prof:
        host.enable()
        run()
        host.disable()
    print(f"\n### {title}: host functions (cProfile, by own time)\n")
    pstats.Stats(host).sort_stats("tottime").print_stats(25)
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(f"### {title}: operators by device time\n")
    print(prof.key_averages().table(sort_by=key, row_limit=25))


def measure_idle_tier(
    model: Path,
    pages: int,
    host_gib: float,
    requests: int,
    rounds: int,
    rng: random.Random,
    profile: bool = False,
    writes: tuple[str, ...] = ("all",),
    load_format: str = "safetensors",
) -> tuple[list[list[object]], float]:
    """Output tok/s with the tier off and on (once per write policy in ``writes``:
    ``engine.host_kv_write``), rounds alternating between them; the rows and the
    first policy's ratio to off."""
    llms = {"off": LLM(model, num_pages=pages, load_format=load_format)}
    for write in writes:
        name = "on" if len(writes) == 1 else f"on, {write} writes"
        llms[name] = LLM(
            model, num_pages=pages, host_kv_gib=host_gib, host_kv_write=write,
            load_format=load_format,
        )  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in llms}
    for llm in llms.values():
        throughput(llm, [_tokens(rng, 1024) for _ in range(32)], 16)  # warm
    for _ in range(rounds):
        for name, llm in llms.items():
            prompts = [_tokens(rng, 1024) for _ in range(requests)]  # never seen: no hit
            rates[name].append(throughput(llm, prompts, 64))
    if profile:
        for name, llm in llms.items():
            prompts = [_tokens(rng, 1024) for _ in range(requests)]
            print_profile(f"idle tier {name}", lambda: throughput(llm, prompts, 64))  # noqa: B023
    rows = [
        [name, " / ".join(f"{r:,.0f}" for r in values), f"{statistics.median(values):,.0f}"]
        for name, values in rates.items()
    ]
    ratios = []
    for name, llm in llms.items():
        if name == "off":
            continue
        stats = llm.engine.pool.host.stats()
        ratios.append(statistics.median(rates[name]) / statistics.median(rates["off"]))
        rows.append([f"{name} / off", "", f"{ratios[-1]:.3f} ({stats.pages_written:,} pages "
                     f"written, {stats.pages_skipped:,} skipped, {stats.hits} hits)"])  # fmt: skip
    ratio = ratios[0]
    llms.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, ratio


def decode_gaps(
    llm: LLM, decoders: int, arrivals: list[list[int]], every: int, from_host: bool
) -> tuple[list[float], int]:
    """Inter-token gaps of ``decoders`` requests while ``arrivals`` come one every
    ``every`` steps; their prefixes are pushed out to host memory first if
    ``from_host``, else left cached in device memory."""
    engine = llm.engine
    engine.pool.clear()
    question = random.Random(9)
    llm.generate_tokens([a[:-QUESTION] for a in arrivals], SamplingParams(max_tokens=1))
    if from_host:
        push_out(engine)
    reuse = reuse_request(None)
    long = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(decoders)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, _tokens(random.Random(i), 128), long, reuse=reuse)
    last: dict[str, float] = {}
    gaps: list[float] = []
    pending = list(arrivals)
    loads_before = engine.pool.host.stats().pages_loaded
    step = 0
    measuring = False
    tail = 2 * every  # steps measured after the last arrival: its load lands in them
    while pending or tail:
        tail -= not pending
        outs = engine.step()
        now = time.perf_counter()
        step += 1
        stepped = {o.request_id for o in outs if o.new_token_ids}
        if not measuring and all(rid in last for rid in ids):
            measuring = True  # every decoder has its first token: steady decoding
        for rid in stepped & set(ids):
            if measuring and rid in last:
                gaps.append(now - last[rid])
            last[rid] = now
        if measuring and step % every == 0 and pending:
            tokens = pending.pop()[:-QUESTION] + _tokens(question, QUESTION)
            engine.add_request(
                f"arrival-{len(pending)}", tokens, SamplingParams(max_tokens=1), reuse=reuse
            )
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return gaps, engine.pool.host.stats().pages_loaded - loads_before


def measure_itl(
    llm: LLM, decoders: int, loads: int, every: int, rounds: int, rng: random.Random
) -> list[list[object]]:
    arrivals = [_tokens(rng, SYSTEM + DOCS * DOC + QUESTION) for _ in range(loads)]
    gaps: dict[bool, list[float]] = {False: [], True: []}
    loaded = 0
    for _ in range(rounds):
        for from_host in (False, True):
            run, pages = decode_gaps(llm, decoders, arrivals, every, from_host)
            gaps[from_host] += run
            loaded += pages if from_host else 0
    base = statistics.quantiles(gaps[False], n=100)
    rows = []
    for from_host, values in gaps.items():
        q = statistics.quantiles(values, n=100)
        rows.append(
            [
                "host hits (loads)" if from_host else "device hits",
                f"{statistics.median(values) * 1e3:.2f}",
                f"{q[98] * 1e3:.2f}",
                f"{q[98] / base[98]:.3f}",
                loaded if from_host else 0,
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--host-kv-gib", type=float, default=8.0)
    ap.add_argument(
        "--load-format",
        default="safetensors",
        choices=("safetensors", "dummy"),
        help="dummy: random weights made in place (a checkpoint of config files only, "
        "`make-model --no-weights`)",
    )
    ap.add_argument("--pages", type=int, default=4096, help="device pool, idle-tier run")
    ap.add_argument("--requests", type=int, default=512, help="idle-tier run, a round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decoders", type=int, default=100)
    ap.add_argument("--loads", type=int, default=16)
    ap.add_argument("--every", type=int, default=8, help="steps between arrivals")
    ap.add_argument("--parts", nargs="+", choices=("ttft", "itl", "idle"), default=None)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="TTFT: a device hit and a host hit, profiled; idle tier: one more round of "
        "each, profiled",
    )
    ap.add_argument(
        "--host-kv-write",
        nargs="+",
        default=["all"],
        choices=("all", "reused"),
        help="idle tier: the write policies to run (engine.host_kv_write), each against off",
    )
    args = ap.parse_args()
    parts = set(args.parts or ("ttft", "itl", "idle"))
    if torch.cuda.is_available():
        print(device_line())
    rng = random.Random(0)
    model = bench_model(args.model)
    llm = LLM(model, num_pages=16384, host_kv_gib=args.host_kv_gib, load_format=args.load_format)
    if "ttft" in parts:
        print_table(
            f"TTFT, {SYSTEM} + {DOCS} x {DOC} + {QUESTION} tokens ({args.trials} trials)",
            ["kind", "ms median (min-max)", "x miss", "cached tokens"],
            measure_ttft(llm, args.trials, rng),
        )
        if args.profile:
            profile_ttft(llm, rng)
    if "itl" in parts:
        print_table(
            f"{args.decoders} decoders, {args.loads} arrivals one every {args.every} steps "
            f"({args.rounds} rounds)",
            ["arrivals", "ITL p50 ms", "ITL p99 ms", "p99 x device hits", "pages loaded"],
            measure_itl(llm, args.decoders, args.loads, args.every, args.rounds, rng),
        )
    del llm
    gc.collect()
    if "idle" not in parts:
        return
    rows, _ = measure_idle_tier(
        model, args.pages, args.host_kv_gib, args.requests, args.rounds, rng, args.profile,
        tuple(args.host_kv_write), args.load_format,
    )  # fmt: skip
    print_table(
        f"idle tier: {args.requests} unique 1,024-token prompts, 64 out, {args.pages}-page pool",
        ["tier", "output tok/s a round", "median"],
        rows,
    )


if __name__ == "__main__":
    main()
