"""Approximate reuse speed, through the engine (random weights: shapes matter here).

1. TTFT: system prompt + 8 documents x 512 tokens + question, where every document
   is held as a position-free entry but this order and this system prompt were
   never seen. Approximate (default repair) vs exact (misses: nothing before the
   documents matches) vs cold (reuse off). Ratios are against exact and cold
   measured in the same process.
2. RAG workload: requests draw 8 of 64 documents (Zipf popularity, random order)
   after one of 8 system prompts, arriving all at once; requests/s and TTFT
   p50/p90, approximate vs exact (each on a fresh engine with the same stream),
   measured after a warm-up stream of the same kind (steady state: popular
   documents held, as a serving worker would).

    python bench/approx_speed.py [--model DIR] [--trials 5] [--requests 256]
        [--rag-pages 6144]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_model, parse_repair, print_table  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.reuse_info import ReuseRequest  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.engine.workload_tally import StepTally  # noqa: E402

SYSTEM, DOC, DOCS, QUESTION = 256, 512, 8, 32
PAGES = 6144  # per engine (several share the GPU): 98K tokens of KV
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def layout(system, docs, question):
    prompt, spans = list(system), []
    for doc in docs:
        spans.append((len(prompt), len(prompt) + len(doc)))
        prompt += doc
    return prompt + list(question), tuple(spans)


class StepProfile:
    """Where a loaded engine's time goes: each resolved step's device time by kind
    (a ``StepTally``, as a worker's loop keeps one) and, after every step, the running
    requests and the pool's cached pages, entries and entry pages (``KVPool.occupancy``)."""

    def __init__(self) -> None:
        self.tally = StepTally()
        self.samples: list[tuple[int, int, int, int]] = []

    def observe(self, engine: Engine, step_s: float) -> None:
        self.tally.add(step_s, engine.last_resolved_steps)
        self.samples.append((len(engine.scheduler.running), *engine.pool.occupancy()))

    def summary(self) -> dict:
        columns = np.array(self.samples or [(0, 0, 0, 0)], dtype=float)
        names = ("running", "cached_pages", "entries", "entry_pages")
        by_kind = sorted(self.tally.steps_by_kind.items())
        return {
            "device_s_by_kind": {kind: seconds for kind, (_, seconds) in by_kind},
            "steps_by_kind": {kind: steps for kind, (steps, _) in by_kind},
            "busy_s": self.tally.busy_s,
            "occupancy_mean": dict(zip(names, columns.mean(axis=0).round(1).tolist(), strict=True)),
            "occupancy_max": dict(
                zip(names, columns.max(axis=0).astype(int).tolist(), strict=True)
            ),
        }


class Runner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ids = 0

    def submit(self, prompt, spans, reuse, params) -> str:
        self.ids += 1
        rid = f"b{self.ids}"
        self.engine.add_request(rid, prompt, params, placeable=spans, reuse=reuse)
        return rid

    def drain(self, profile: StepProfile | None = None) -> dict[str, float]:
        """Step until idle; seconds from now to each request's first token. With
        ``profile``: every step's device time by kind and the occupancy after it."""
        first: dict[str, float] = {}
        start = time.perf_counter()
        while self.engine.has_unfinished():
            began = time.perf_counter()
            outs = self.engine.step()
            sync()
            now = time.perf_counter() - start
            for out in outs:
                first.setdefault(out.request_id, now)
            if profile is not None:
                profile.observe(self.engine, time.perf_counter() - began)
        return first

    def fill(self, docs) -> None:
        for doc in docs:
            self.engine.fill_entry(doc)
        self.drain()


def held_documents(model_dir: str | None, seed: int = 1):
    """The TTFT scenario's approximate engine (``bench_model``'s checkpoint unless
    ``model_dir``) with its ``DOCS`` documents held position-free: the runner, the
    documents and ``draw(n)``, n random token ids from the same generator."""
    model = bench_model(model_dir)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return rng.choices(range(10, vocab - 1), k=n)

    docs = [draw(DOC) for _ in range(DOCS)]
    runner = Runner(Engine(EngineConfig(str(model), num_pages=PAGES)))
    runner.fill(docs)
    return runner, docs, draw


def ttft_scenario(model, trials, rng, vocab, repairs, deviation_layer=None):
    """TTFT of a never-seen prompt over held documents: a row per repair setting
    (``repairs``: {label: ReuseRequest}, rows "approximate <label>", one approximate
    engine), then exact and cold. Every request of every row has a system prompt and
    question of its own, so no row reuses another's exact prefix."""
    draw = lambda n: rng.choices(range(10, vocab - 1), k=n)  # noqa: E731
    docs = [draw(DOC) for _ in range(DOCS)]
    engines = {
        "approximate": Engine(
            EngineConfig(str(model), num_pages=PAGES, deviation_layer=deviation_layer)
        ),
        "exact": Engine(EngineConfig(str(model), num_pages=PAGES)),
        "cold": Engine(EngineConfig(str(model), num_pages=PAGES, enable_reuse=False)),
    }
    runners = {name: Runner(e) for name, e in engines.items()}
    runners["approximate"].fill(docs)
    rows = [(f"approximate {label}", "approximate", reuse) for label, reuse in repairs.items()]
    rows += [("exact", "exact", None), ("cold", "cold", None)]
    # warm up kernels (and the exact engine's view of these documents in one order)
    for _, engine, reuse in rows:
        prompt, spans = layout(draw(SYSTEM), docs, draw(QUESTION))
        runners[engine].submit(prompt, spans, reuse, FIRST_TOKEN)
        runners[engine].drain()
    times = {name: [] for name, _, _ in rows}
    reused = {name: [] for name, _, _ in rows}
    steps = {name: [] for name, _, _ in rows}
    shapes = {name: [] for name, _, _ in rows}  # (new tokens, rows) of each graph replay
    current = [rows[0][0]]  # the row being timed
    for runner in runners.values():
        model_runner = runner.engine.runner
        if model_runner.graphs is not None:  # each replay once (not can_run's question too)
            graphs = model_runner.graphs.prefill
            graphs.run = lambda ids, positions, lay, run=graphs.run: (
                shapes[current[0]].append((lay.num_tokens, lay.batch_size))
                or run(ids, positions, lay)
            )
    for _ in range(trials):
        order = docs[:]
        rng.shuffle(order)
        for name, engine, reuse in rows:
            current[0] = name
            runner = runners[engine]
            prompt, spans = layout(draw(SYSTEM), order, draw(QUESTION))  # never seen
            rid = runner.submit(prompt, spans, reuse, FIRST_TOKEN)
            sync()
            start = time.perf_counter()
            info, count = None, 0
            while info is None:
                count += 1
                for out in runner.engine.step():
                    if out.request_id == rid:
                        info = out.reuse
            sync()
            times[name].append(time.perf_counter() - start)
            steps[name].append(count)
            reused[name].append((info.reused_tokens, info.recomputed_tokens))
            runner.drain()
    del engines, runners
    release_memory()
    return {
        name: {
            "ttft_ms": 1e3 * statistics.median(t),
            "ttft_ms_trials": [round(1e3 * x, 2) for x in t],
            "steps_to_first_token": steps[name],
            "graph_steps_tokens_rows": shapes[name],  # (new tokens, rows) of each replay
            "reused_tokens": reused[name][-1][0],
            "recomputed_tokens": reused[name][-1][1],
        }
        for name, t in times.items()
    } | {"prompt_tokens": len(prompt)}


def rag_workload(
    model,
    requests,
    warm,
    rng,
    vocab,
    repair,
    pool_docs=64,
    systems=8,
    zipf=1.0,
    deviation_layer=None,
    pages=PAGES,
    variants=(),
):
    """``variants``: names from ``VARIANTS``, each one more approximate run with those
    engine settings (the levers of issue 36 switched off), beside the default one."""
    draw = lambda n: rng.choices(range(10, vocab - 1), k=n)  # noqa: E731
    docs = [draw(DOC) for _ in range(pool_docs)]
    system_prompts = [draw(SYSTEM) for _ in range(systems)]
    weights = np.array([1 / (i + 1) ** zipf for i in range(pool_docs)])
    weights /= weights.sum()
    np_rng = np.random.default_rng(rng.randrange(1 << 30))
    stream = []
    for _ in range(warm + requests):
        chosen = np_rng.choice(pool_docs, size=DOCS, replace=False, p=weights)
        np_rng.shuffle(chosen)
        stream.append(
            layout(
                system_prompts[rng.randrange(systems)], [docs[i] for i in chosen], draw(QUESTION)
            )
        )
    out = {}
    runs = [("approximate", repair, {}), ("exact", None, {})]  # repair: the first setting
    runs += [(f"approximate, {name}", repair, VARIANTS[name]) for name in variants]
    for name, reuse, settings in runs:
        layer = deviation_layer if reuse is not None else None
        config = EngineConfig(str(model), num_pages=pages, deviation_layer=layer, **settings)
        runner = Runner(Engine(config))
        for prompt, spans in stream[:warm]:  # kernels, graphs, and a warm cache
            runner.submit(prompt, spans, reuse, ANSWER)
        runner.drain()
        start = time.perf_counter()
        tally, profile = runner.engine.tally.copy(), StepProfile()
        ids = [runner.submit(prompt, spans, reuse, ANSWER) for prompt, spans in stream[warm:]]
        first = runner.drain(profile)
        elapsed = time.perf_counter() - start
        ttfts = sorted(first[rid] for rid in ids)
        out[name] = {
            "requests_per_s": len(ids) / elapsed,
            "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
            "ttft_p90_ms": 1e3 * ttfts[int(len(ttfts) * 0.9)],
            "prompt_tokens_per_request": sum(len(p) for p, _ in stream[warm:]) / len(ids),
            "tally": dataclasses.asdict(runner.engine.tally.since(tally)),
            **profile.summary(),
        }
        del runner
        release_memory()
    return out


# Approximate reuse with levers switched off, to measure each in one process
VARIANTS = {
    "fills, no reserve": {"entries_from_context": False, "entry_reserve": 0.0},
    "no reserve": {"entry_reserve": 0.0},
    "one forward each": {"batch_admissions": False},
}


def print_workload_profile(rag: dict, requests: int) -> None:
    """Where each mode's time and work went over the measured stream (issue 36's
    table): device time by step kind, occupancy, entry traffic, positions computed."""
    kinds = sorted({k for r in rag.values() for k in r["device_s_by_kind"]})
    print_table(
        "RAG workload: device seconds by step kind (steps)",
        ["step kind", *rag],
        [
            [kind]
            + [
                f"{r['device_s_by_kind'].get(kind, 0.0):.3f} ({r['steps_by_kind'].get(kind, 0)})"
                for r in rag.values()
            ]
            for kind in kinds
        ],
    )
    rows = [
        ("running requests, mean / max", lambda r: _mean_max(r, "running")),
        ("cached pages, mean / max", lambda r: _mean_max(r, "cached_pages")),
        ("entries, mean / max", lambda r: _mean_max(r, "entries")),
        ("entry pages, mean / max", lambda r: _mean_max(r, "entry_pages")),
        ("entry hits / misses", lambda r: f"{r['tally']['entry_hits']} / {r['tally']['entry_misses']}"),
        ("entries taken in context", lambda r: r["tally"]["entries_taken"]),
        ("entry fills queued / stored", lambda r: f"{r['tally']['fills_queued']} / {r['tally']['fills_stored']}"),
        ("entry evictions", lambda r: r["tally"]["entry_evictions"]),
        ("positions through every layer, per request", lambda r: f"{r['tally']['prompt_positions'] / requests:.0f}"),
        ("... as a share of the prompt", lambda r: f"{r['tally']['prompt_positions'] / requests / r['prompt_tokens_per_request']:.3f}"),
        ("positions through the selection layers only, per request", lambda r: f"{r['tally']['selection_only_positions'] / requests:.0f}"),
        ("admission forwards per step that had any", lambda r: f"{r['tally']['admission_forwards'] / max(1, r['tally']['steps_with_admissions']):.2f}"),
        ("steps", lambda r: r["tally"]["steps"]),
    ]  # fmt: skip
    print_table(
        "RAG workload: occupancy and work over the measured stream",
        ["", *rag],
        [[label, *(value(r) for r in rag.values())] for label, value in rows],
    )


def _mean_max(run: dict, name: str) -> str:
    return f"{run['occupancy_mean'][name]:.0f} / {run['occupancy_max'][name]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--requests", type=int, default=256, help="0: TTFT only")
    ap.add_argument("--warm-requests", type=int, default=128, help="unmeasured, first")
    ap.add_argument("--first-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--deviation-ratio", type=float, default=None)
    ap.add_argument(
        "--repairs",
        nargs="+",
        help="TTFT rows of several repair settings (k=0,r=0.05 k=1 ...) in one run; the "
        "RAG workload takes the first (instead of --first-tokens / --deviation-ratio). A "
        "setting leaving out k or r takes 0 for it, not the engine's default",
    )
    ap.add_argument(
        "--deviation-layer", type=int, default=None, help="default: the engine's (layer 3)"
    )
    ap.add_argument(
        "--rag-pages",
        type=int,
        default=PAGES,
        help="KV pages of the RAG workload's engine (one at a time): with the default, "
        "about 20 of its 4.4K-token requests fit at once",
    )
    ap.add_argument(
        "--variants",
        nargs="*",
        default=[],
        choices=list(VARIANTS),
        help="RAG workload: more approximate runs with levers switched off, in this process",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.repairs and (args.first_tokens is not None or args.deviation_ratio is not None):
        ap.error("--repairs replaces --first-tokens and --deviation-ratio")
    if args.repairs and len(set(args.repairs)) < len(args.repairs):
        ap.error(f"--repairs lists a setting twice: {' '.join(args.repairs)}")
    try:
        repairs = {text: parse_repair(text) for text in args.repairs or ()}
    except ValueError as error:
        ap.error(str(error))
    if not repairs:
        defaults = ReuseRequest("approximate")
        k = defaults.first_tokens if args.first_tokens is None else args.first_tokens
        r = defaults.deviation_ratio if args.deviation_ratio is None else args.deviation_ratio
        repairs = {f"k={k},r={r}": ReuseRequest("approximate", k, r)}
    repair = next(iter(repairs.values()))
    model = bench_model(args.model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    ttft = ttft_scenario(model, args.trials, rng, vocab, repairs, args.deviation_layer)
    exact, cold = ttft["exact"]["ttft_ms"], ttft["cold"]["ttft_ms"]
    first = f"approximate {next(iter(repairs))}"
    print_table(
        f"TTFT, {ttft['prompt_tokens']} prompt tokens, documents held position-free "
        f"(repair k first tokens, r deviation ratio; deviating tokens selected at layer "
        f"{args.deviation_layer or 'default'})",
        [
            "mode",
            "TTFT ms",
            "min",
            "max",
            "x faster than exact",
            "x faster than cold",
            "reused",
            "recomputed",
        ],
        [
            [
                name,
                r["ttft_ms"],
                min(r["ttft_ms_trials"]),
                max(r["ttft_ms_trials"]),
                exact / r["ttft_ms"],
                cold / r["ttft_ms"],
                r["reused_tokens"],
                r["recomputed_tokens"],
            ]
            for name, r in ttft.items()
            if name != "prompt_tokens"
        ],
    )
    if not args.requests:
        if args.json:
            Path(args.json).write_text(json.dumps({"ttft": ttft}, indent=2) + "\n")
        return
    rag = rag_workload(
        model,
        args.requests,
        args.warm_requests,
        rng,
        vocab,
        repair,
        deviation_layer=args.deviation_layer,
        pages=args.rag_pages,
        variants=args.variants,
    )
    print_table(
        f"RAG workload: {args.requests} requests after {args.warm_requests} warm-up ones, "
        f"8 of 64 documents (Zipf 1), 8 system prompts, {args.rag_pages} KV pages",
        ["mode", "requests/s", "TTFT p50 ms", "TTFT p90 ms"],
        [
            [name, r["requests_per_s"], r["ttft_p50_ms"], r["ttft_p90_ms"]]
            for name, r in rag.items()
        ],
    )
    print_workload_profile(rag, args.requests)
    ratio = rag["approximate"]["requests_per_s"] / rag["exact"]["requests_per_s"]
    print(f"\n{first} / exact: {exact / ttft[first]['ttft_ms']:.2f}x TTFT, {ratio:.2f}x requests/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"ttft": ttft, "rag": rag}, indent=2) + "\n")


if __name__ == "__main__":
    main()
