"""FlashInfer paged prefill attention alone, qwen3-0.6b head shapes (16 query heads,
8 KV heads, dim 128, page 16), for the shapes short prefills take: rows of a few
queries over a long KV (a cache hit's tail, an approximate request's question and
repair runs). The default kernel on Hopper (FA3) gives each (128-query tile, head)
one CTA walking the row's whole KV, so such rows leave most SMs idle. Variants:

- ``fa3``: the default, causal, one row per run (the engine today);
- ``fa2``: FA2 with its own split-KV planning;
- ``fa2/N``: FA2 with a fixed split of N pages;
- ``fa3 split C``: each row's KV before its chunk-aligned own part cut into chunks
  of C tokens, every chunk a non-causal row of that row's queries (queries copied),
  the own part one causal row, partial outputs merged by their log-sum-exp;
- ``ragged``, ``ragged/fa2`` (only with ``--variants``; shapes without a cached prefix):
  a cold prompt's rows through the ragged kernel, K and V contiguous (no pages), the
  default kernel or FA2;
- ``decode + fa3`` (only with ``--variants``; shapes with one-query rows): one-query rows
  (decoding requests) through the decode kernel, the others through ``fa3``;
- ``batch attn``: FlashInfer's persistent ``BatchAttention`` (causal).

Outputs are compared with ``fa3``'s (relative L2 difference).

    python bench/prefill_kernel.py [--variants fa2 fa2/32] [--shapes decodes]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_line, print_table  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16
# (name, [(new tokens, KV length) per row])
SHAPES = [
    ("question: 32 over 4,384", [(32, 4384)]),
    ("approx r=0 step: 256 + 32 over 4,384", [(256, 256), (32, 4384)]),
    ("cache-hit tail: 64 over 5,184", [(64, 5184)]),
    ("cache-hit tails: 8 x 40 over 3,000", [(40, 3040)] * 8),
    ("prompt: 1,024", [(1024, 1024)]),
    ("prompt: 4,384", [(4384, 4384)]),
    (
        "repair: 700 in 5 runs over 4,400",
        [(256, 256), (216, 2000), (99, 3000), (95, 4000), (32, 4384)],
    ),
    ("repair: 700 in 30 runs over 4,400", [(23, 256 + 140 * i) for i in range(30)]),
    # first-token repair (k=1) of 8 placed documents: the system prompt, each document's
    # first token, the question (bench/approx_speed.py: 1.1 ms slower than no repair)
    (
        "approx k=1 step: 256 + 8 x 1 + 32 over 4,384",
        [(256, 256)] + [(1, 257 + 512 * i) for i in range(8)] + [(32, 4384)],
    ),
    # a cache hit joining decoding requests: the mixed step of a loaded chunk-aware
    # worker (bench/cluster_rag.py: system 512 + document 2,048 + question)
    ("hit joining 20 decodes: 48 + 20 x 1 over 2,600", [(48, 2608)] + [(1, 2600)] * 20),
    ("2 hits joining 20 decodes", [(48, 2608)] * 2 + [(1, 2600)] * 20),
    ("hit joining 60 decodes", [(48, 2608)] + [(1, 2600)] * 60),
]


def timed(fn, iters: int = 50) -> tuple[float, float]:
    """Seconds per call: wall (CUDA events around back-to-back calls; for small shapes
    this is the host's launch cost) and GPU (the profiler's sum of kernel times, what
    a CUDA graph replay costs)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    wall = start.elapsed_time(end) / 1e3 / iters
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages())
    return wall, kernels / 1e6 / iters


class Rows:
    """A paged layout: rows of (queries, KV length), every row's pages its own."""

    def __init__(self, spec, device="cuda") -> None:
        self.spec = spec
        self.pages = [-(-kv // PAGE) for _, kv in spec]
        self.total_pages = sum(self.pages)
        self.indices = torch.randperm(self.total_pages, dtype=torch.int32).to(device)
        starts = [0]
        for p in self.pages:
            starts.append(starts[-1] + p)
        self.page_start = starts

    def layout(self, rows):
        """Tensors for ``rows``: (row, queries, first KV token (page-aligned), KV end)."""
        qo, kv_ptr, idx, last = [0], [0], [], []
        for r, q, a, e in rows:
            first, end = a // PAGE, -(-e // PAGE)
            base = self.page_start[r]
            idx.append(self.indices[base + first : base + end])
            qo.append(qo[-1] + q)
            kv_ptr.append(kv_ptr[-1] + end - first)
            last.append(e - (end - 1) * PAGE)
        i32 = torch.int32
        return (
            torch.tensor(qo, dtype=i32),
            torch.tensor(kv_ptr, dtype=i32),
            torch.cat(idx),
            torch.tensor(last, dtype=i32),
        )


def plan(wrapper, tensors, causal, **kw) -> None:
    qo, kv_ptr, idx, last = tensors
    wrapper.plan(
        qo, kv_ptr, idx, last, HEADS, KV_HEADS, DIM, PAGE,
        causal=causal, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **kw,
    )  # fmt: skip


def split_rows(spec, chunk: int):
    """Causal own parts and non-causal prefix chunks; ``source[i]``: the query row of
    each copied query, ``slot[i]``: where its partial output goes (query * states +
    state), ``states``: 1 + the most chunks of a row."""
    own, chunks, source, slot, q0 = [], [], [], [], 0
    states = 1 + max(((kv - q) // chunk) for q, kv in spec)
    for r, (q, kv) in enumerate(spec):
        a = ((kv - q) // chunk) * chunk
        own.append((r, q, a, kv))
        for j, c in enumerate(range(0, a, chunk)):
            chunks.append((r, q, c, c + chunk))
            source.extend(range(q0, q0 + q))
            slot.extend(i * states + 1 + j for i in range(q0, q0 + q))
        q0 += q
    cuda = dict(dtype=torch.long, device="cuda")
    return own, chunks, torch.tensor(source, **cuda), torch.tensor(slot, **cuda), states


def merge(out, lse, parts, part_lse, slot, states):
    """Merge partial attention outputs by log-sum-exp: ``parts[i]`` is state
    ``slot[i] % states`` of query ``slot[i] // states``; missing states have lse -inf."""
    import flashinfer

    n = out.shape[0]
    v = torch.zeros(n, states, *out.shape[1:], dtype=out.dtype, device=out.device)
    s = torch.full((n, states, lse.shape[1]), -math.inf, device=out.device)
    v[:, 0], s[:, 0] = out, lse
    v.view(n * states, *out.shape[1:])[slot] = parts
    s.view(n * states, -1)[slot] = part_lse
    return flashinfer.merge_states(v, s)[0]


def build(variant, spec, layout, full, q, cache, workspaces):
    """The call that computes one variant's attention output."""
    import flashinfer

    if variant.startswith("fa3 split"):
        own, chunks, source, slot, states = split_rows(spec, int(variant.split()[-1]))
        w_own = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspaces[0], "NHD")
        plan(w_own, layout.layout(own), causal=True)
        if chunks:
            w_chunk = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspaces[1], "NHD")
            plan(w_chunk, layout.layout(chunks), causal=False)

        def fn():
            out, lse = w_own.run(q, cache, return_lse=True)
            if not chunks:
                return out
            parts, part_lse = w_chunk.run(q[source], cache, return_lse=True)
            return merge(out, lse, parts, part_lse, slot, states)
    elif variant == "decode + fa3":  # one-query rows through the decode kernel
        one = [r for r, (n, _) in enumerate(spec) if n == 1]
        many = [r for r, (n, _) in enumerate(spec) if n > 1]
        if not one or not many:
            raise ValueError("needs both one-query and longer rows")
        starts = full[0].tolist()
        one_q = torch.tensor([starts[r] for r in one], device="cuda")
        many_q = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in many]).cuda()
        w_many = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspaces[0], "NHD")
        plan(w_many, layout.layout([(r, spec[r][0], 0, spec[r][1]) for r in many]), causal=True)
        _, kv_ptr, idx, last = layout.layout([(r, 1, 0, spec[r][1]) for r in one])
        w_one = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspaces[1], "NHD")
        w_one.plan(
            kv_ptr.cuda(), idx, last.cuda(), HEADS, KV_HEADS, DIM, PAGE,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip

        def fn():
            out = torch.empty_like(q)
            out[many_q] = w_many.run(q[many_q], cache)
            out[one_q] = w_one.run(q[one_q], cache)
            return out
    elif variant.startswith("ragged"):  # new tokens only: K and V contiguous, no pages
        if any(n != kv for n, kv in spec):
            raise ValueError("ragged: only rows without a cached prefix")
        slots = torch.cat(
            [
                layout.indices[layout.page_start[r] : layout.page_start[r + 1]].long()
                for r in range(len(spec))
            ]
        )
        rows_of = lambda part: torch.cat(  # noqa: E731
            [cache[slots[layout.page_start[r] : layout.page_start[r + 1]], part]
             .reshape(-1, KV_HEADS, DIM)[: spec[r][1]] for r in range(len(spec))]
        )  # fmt: skip
        k, v = rows_of(0).contiguous(), rows_of(1).contiguous()
        backend = variant.partition("/")[2] or "auto"
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspaces[0], "NHD", backend=backend)
        qo = full[0]
        w.plan(
            qo, qo, HEADS, KV_HEADS, DIM, causal=True,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip

        def fn():
            return w.run(q, k, v)
    elif variant == "batch attn":
        w = flashinfer.BatchAttention("NHD")
        qo, kv_ptr, idx, last = full
        kv_len = torch.tensor([kv for _, kv in spec], dtype=torch.int32)
        w.plan(
            qo.cuda(), kv_ptr.cuda(), idx, kv_len.cuda(), HEADS, KV_HEADS, DIM, DIM,
            PAGE, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip

        def fn():
            return w.run(q, cache)[0]
    else:
        backend, _, split = variant.partition("/")
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspaces[0], "NHD", backend="auto" if backend == "fa3" else backend
        )
        plan(w, full, causal=True, fixed_split_size=int(split) if split else None)

        def fn():
            return w.run(q, cache)

    return fn


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--variants",
        nargs="+",
        help="default: all but ragged, ragged/fa2 and decode + fa3 (for some shapes "
        "only); fa3 always runs (the base)",
    )
    ap.add_argument("--shapes", help="only the shapes whose name contains this")
    args = ap.parse_args()
    workspaces = [torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    variants = [
        "fa3",
        "fa2",
        "fa2/32",
        "fa3 split 256",
        "fa3 split 512",
        "fa3 split 1024",
        "batch attn",
    ]
    if args.variants:
        variants = ["fa3"] + [v for v in args.variants if v != "fa3"]
    rows = []
    for name, spec in SHAPES:
        if args.shapes and args.shapes not in name:
            continue
        layout = Rows(spec)
        cache = torch.randn(
            layout.total_pages, 2, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda"
        )
        full = layout.layout([(r, q, 0, kv) for r, (q, kv) in enumerate(spec)])
        q = torch.randn(int(full[0][-1]), HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        times, outs = {}, {}
        for variant in variants:
            try:
                fn = build(variant, spec, layout, full, q, cache, workspaces)
                outs[variant] = fn().float()
                times[variant] = timed(fn)
            except Exception as e:  # a variant this FlashInfer does not take
                print(f"{name} / {variant}: {type(e).__name__}: {str(e)[:200]}")
        base = outs["fa3"]
        row = [name]
        for variant in variants:
            if variant not in times:
                row.append("-")
                continue
            diff = ((outs[variant] - base).norm() / base.norm()).item()
            wall, gpu = times[variant]
            row.append(f"{1e6 * gpu:.1f} / {1e6 * wall:.0f} ({diff:.0e})")
        rows.append(row)
    print(device_line())
    print_table(
        "Paged prefill attention, one layer: GPU us / wall us (relative difference to fa3)",
        ["shape", *variants],
        rows,
    )


if __name__ == "__main__":
    main()
