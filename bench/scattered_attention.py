"""Attention for queries at scattered positions, the repair step of approximate reuse
(issue 12): each query attends causally by its position over the request's KV. Three
layouts on qwen3-0.6b attention shapes (16 query heads, 8 KV heads, head dim 128, bf16,
16-token pages), each checked against a float32 reference:

- ``runs``: one causal row per run of consecutive positions, the KV up to the run's end
  (what the engine does now; FlashInfer's default kernel, FA3 on Hopper);
- ``masked``: every query in one row over the whole KV, a custom mask (FA2);
- ``grouped G``: the queries, in position order, split into G rows of equal size, each
  over the KV up to its last query, a custom mask each (FA2);
- ``Triton kernel``: ``layers/scattered_kernel`` (every query masked by its position,
  no plan: what the engine runs after an approximate request's selection layer), in
  the configurations ``--triton`` names.

The layout question for issue 12: a layout whose plan does not depend on which
positions were selected (masked, grouped) lets the selection stay on the device.

    python bench/scattered_attention.py [--kv 4384] [--placed 4096] [--repair 227]
        [--system 256] [--tail 32] [--groups 4 8] [--reps 20] [--triton 32x64k512w4s2 ...]

Prints per layout: rows, the attention's device time per call (profiler kernel sum),
the host time of its plan, and the largest error against the reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402

QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16


def query_positions(args, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions: the first ``system`` positions (a system prompt computed, not
    matched), ``repair`` of the placed tokens after it and the last ``tail`` positions
    of the prompt."""
    system = args.kv - args.placed - args.tail
    repaired = rng.choice(args.placed, size=args.repair, replace=False) + system
    tail = np.arange(args.kv - args.tail, args.kv)
    return np.sort(np.concatenate((np.arange(args.system), repaired, tail)))


def runs_of(positions: np.ndarray) -> list[tuple[int, int]]:
    """[first, last] of each run of consecutive positions."""
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [len(positions) - 1]))
    return [(int(positions[s]), int(positions[e])) for s, e in zip(starts, ends, strict=True)]


def rows_layout(kv_lens: list[int], q_lens: list[int]) -> dict:
    """Host tensors of a layout whose rows all read the one sequence's pages from page 0."""
    i32 = torch.int32
    pages = [-(-n // PAGE) for n in kv_lens]
    return {
        "qo_indptr": torch.tensor(np.concatenate(([0], np.cumsum(q_lens))), dtype=i32),
        "kv_indptr": torch.tensor(np.concatenate(([0], np.cumsum(pages))), dtype=i32),
        "kv_indices": torch.tensor(np.concatenate([np.arange(p) for p in pages]), dtype=i32),
        "last_page_len": torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, pages, strict=True)], dtype=i32),
    }  # fmt: skip


def position_mask(positions: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
    """Flattened custom mask: for each row (first query, query count, KV length), query
    i may see KV j when j <= its position."""
    parts = []
    for first, count, kv_len in rows:
        pos = positions[first : first + count]
        parts.append((torch.arange(kv_len, device=pos.device)[None, :] <= pos[:, None]).reshape(-1))
    return torch.cat(parts)


def plan(wrapper, layout: dict, mask: torch.Tensor | None) -> float:
    """Plans ``wrapper``; returns the plan's host seconds."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    # with a custom mask FlashInfer packs it on the device, by device indptrs
    where = "cuda" if mask is not None else "cpu"
    wrapper.plan(
        layout["qo_indptr"].to(where),
        layout["kv_indptr"].to(where),
        layout["kv_indices"].cuda(),
        layout["last_page_len"].to(where),
        QO_HEADS,
        KV_HEADS,
        HEAD_DIM,
        PAGE,
        custom_mask=mask,
        causal=mask is None,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - started


def device_us(fn, reps: int) -> float:
    """Kernel time per call (us): the profiler's sum over ``reps`` calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / reps


def reference(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Float32 attention of each query over the KV up to its position."""
    n = int(positions.max()) + 1
    keys = kv[:, 0].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float()
    values = kv[:, 1].reshape(-1, KV_HEADS, HEAD_DIM)[:n].float()
    group = QO_HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) / HEAD_DIM**0.5
    visible = torch.arange(n, device=q.device)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", type=int, default=4384, help="prompt tokens (the KV)")
    ap.add_argument("--placed", type=int, default=4096, help="placed tokens among them")
    ap.add_argument("--repair", type=int, default=227, help="placed tokens recomputed")
    ap.add_argument("--tail", type=int, default=32, help="prompt tail computed")
    ap.add_argument(
        "--system",
        type=int,
        default=256,
        help="computed positions at the start (<= kv - placed - tail)",
    )
    ap.add_argument("--groups", type=int, nargs="*", default=[4, 8])
    ap.add_argument(
        "--runs-only",
        action="store_true",
        help="of FlashInfer's layouts only runs (the masked ones compile on first use)",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--triton",
        nargs="*",
        default=["32x64k512w4s2"],
        help="configs of the Triton kernel (layers/scattered_kernel): "
        "<queries a program>x<keys a step>k<keys a split>w<warps>s<stages>",
    )
    args = ap.parse_args()
    if args.placed + args.tail + args.system > args.kv:
        ap.error("--system + --placed + --tail must be at most --kv")
    import flashinfer

    torch.manual_seed(0)
    positions_np = query_positions(args, np.random.default_rng(0))
    positions = torch.from_numpy(positions_np).cuda()
    m = len(positions_np)
    pages = -(-args.kv // PAGE)
    kv = torch.randn(pages, 2, PAGE, KV_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    q = torch.randn(m, QO_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    expected = reference(q, kv, positions)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    layouts = []
    runs = runs_of(positions_np)
    layouts.append(("runs (causal, default kernel)", "auto", rows_layout([e + 1 for _, e in runs], [e - s + 1 for s, e in runs]), None))  # fmt: skip
    whole = [(0, m, args.kv)]
    if not args.runs_only:
        layouts.append(("masked, one row (FA2)", "fa2", rows_layout([args.kv], [m]), whole))
    for g in [] if args.runs_only else args.groups:
        bounds = np.linspace(0, m, g + 1).astype(int)
        rows = [(int(a), int(b - a), int(positions_np[b - 1]) + 1) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]  # fmt: skip
        layout = rows_layout([r[2] for r in rows], [r[1] for r in rows])
        layouts.append((f"grouped {len(rows)} rows (FA2)", "fa2", layout, rows))

    table = []
    for name, backend, layout, mask_rows in layouts:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        mask = None if mask_rows is None else position_mask(positions, mask_rows)
        plan_s = min(plan(wrapper, layout, mask) for _ in range(3))
        out = wrapper.run(q, kv)
        error = (out.float() - expected).abs().max().item()
        us = device_us(lambda w=wrapper: w.run(q, kv), args.reps)
        table.append([name, len(layout["qo_indptr"]) - 1, us, 1e6 * plan_s, f"{error:.2e}"])
        print(f"{name}: {us:.1f} us, plan {1e6 * plan_s:.0f} us, max error {error:.2e}", flush=True)
    from workers.engine.layers.scattered_kernel import scattered_attention

    table_ids = torch.arange(pages, dtype=torch.int32, device="cuda")
    for config in args.triton:
        block_m, rest = config.split("x")
        block_n, rest = rest.split("k")
        split, rest = rest.split("w")
        warps, stages = rest.split("s")
        knobs = dict(block_m=int(block_m), block_n=int(block_n), split=int(split))
        knobs.update(num_warps=int(warps), num_stages=int(stages))

        def run(knobs=knobs):
            scale = HEAD_DIM**-0.5
            return scattered_attention(q, kv, positions, table_ids, scale, args.kv, **knobs)

        error = (run().float() - expected).abs().max().item()
        us = device_us(run, args.reps)
        name = f"Triton kernel {config} (queries by position)"
        table.append([name, 1, us, 0.0, f"{error:.2e}"])
        print(f"{name}: {us:.1f} us, max error {error:.2e}", flush=True)
    print_table(
        f"Scattered-query attention, one layer: {m} queries ({args.system} at the start, "
        f"{args.repair} of {args.placed} placed tokens, a {args.tail}-token tail) over "
        f"{args.kv} tokens of KV; "
        f"{torch.cuda.get_device_name()}",
        ["layout", "rows", "device us", "plan us (host)", "max error vs float32"],
        table,
    )


if __name__ == "__main__":
    main()
