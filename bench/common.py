"""Shared helpers for the GPU benchmarks: device roofline measurements, timing,
tables, and the benchmark model."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch

from workers.engine.reuse_info import ReuseRequest


def measure_bandwidth(size_bytes: int = 2 * 2**30, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large device-to-device copy (each
    copy reads and writes ``size_bytes``)."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(cuda_time(lambda: dst.copy_(src)) for _ in range(iters))
    return 2 * size_bytes / best


def measure_matmul_rate(n: int = 8192, iters: int = 10) -> float:
    """bf16 dense matmul FLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    a @ b
    best = min(cuda_time(lambda: a @ b) for _ in range(iters))
    return 2 * n**3 / best


def cuda_time(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(cuda_time(fn) for _ in range(iters))


def weight_bytes(model: torch.nn.Module) -> int:
    seen = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    from workers.engine.model_runner import ModelRunner

    return ModelRunner.bytes_per_page(config, 1, dtype)


def bench_model(path: str | None) -> Path:
    """The checkpoint to benchmark: ``path`` or a qwen3-0.6b-shaped random one."""
    if path:
        return Path(path)
    from modeltools.make_model import make_model

    out = Path("/tmp/chunkserve-bench/qwen3-0.6b")
    if not (out / "config.json").exists():
        make_model(out, preset="qwen3-0.6b", family="qwen3", seed=0, overwrite=True)
    return out


def print_table(title: str, headers: list[str], rows: list[list[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(f"\n### {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def device_line() -> str:
    props = torch.cuda.get_device_properties(0)
    import flashinfer

    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, flashinfer {flashinfer.__version__}"
    )


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def load_transformers_model(path: Path | str, dtype: torch.dtype = torch.bfloat16):
    """The transformers reference on the GPU (4.x calls the dtype argument torch_dtype)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    return model.cuda().eval()


def profiled_calls(fn: Callable[[], object], calls: int, with_stack: bool = False):
    """Run ``fn`` once to warm up, then ``calls`` times under the torch profiler (CPU and
    CUDA; ``with_stack``: with Python stacks, which ``bench/idle_gaps`` labels host
    events by). Returns the profile, the wall seconds per call (profiler overhead
    included) and the device kernels' milliseconds per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=with_stack) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / calls
    kernels_ms = sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1000
    return prof, wall, kernels_ms


def parse_repair(text: str) -> ReuseRequest:
    """``k=4`` or ``k=2,r=0.1`` -> an approximate ReuseRequest."""
    values = {"k": "0", "r": "0"}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in values or not value:
            raise ValueError(f"repair settings look like k=4 or k=2,r=0.1; got {text!r}")
        values[name.strip()] = value
    return ReuseRequest("approximate", int(values["k"]), float(values["r"]))


@dataclass(frozen=True)
class Shape:
    """A RAG workload's requests (``cluster_rag``, ``http_rag``, ``routing_model``): one
    of ``systems`` system prompts + ``docs_per_request`` of ``docs`` documents (Zipf
    ``zipf``, in the order retrieval ranked them) + a question."""

    docs: int
    zipf: float
    system_tokens: int
    doc_tokens: int
    question_tokens: int
    max_tokens: int
    docs_per_request: int = 1
    systems: int = 3


def document_sequence(shape: Shape, requests: int, seed: int) -> list[tuple[int, int]]:
    """(system index, document index) per request: the same for every run (one
    document a request)."""
    rng = random.Random(seed)
    weights = list(accumulate(1 / (k + 1) ** shape.zipf for k in range(shape.docs)))
    docs = rng.choices(range(shape.docs), cum_weights=weights, k=requests)
    return [(rng.randrange(shape.systems), d) for d in docs]


def retrieval_sequence(shape: Shape, requests: int, seed: int) -> list[tuple[int, tuple[int, ...]]]:
    """(system index, document indices in relevance order) per request, the same for
    every run: ``docs_per_request`` distinct documents, each drawn by Zipf popularity
    (the first drawn ranks first, so popular documents tend to rank high and each query
    orders its own). One document a request: ``document_sequence``'s draws."""
    if shape.docs_per_request == 1:
        return [(s, (d,)) for s, d in document_sequence(shape, requests, seed)]
    if shape.docs_per_request > shape.docs:
        raise ValueError(f"{shape.docs_per_request} documents a request, of {shape.docs}")
    rng = random.Random(seed)
    weights = list(accumulate(1 / (k + 1) ** shape.zipf for k in range(shape.docs)))
    sequence = []
    for _ in range(requests):
        ranked: dict[int, None] = {}
        while len(ranked) < shape.docs_per_request:
            ranked[rng.choices(range(shape.docs), cum_weights=weights)[0]] = None
        sequence.append((rng.randrange(shape.systems), tuple(ranked)))
    return sequence
