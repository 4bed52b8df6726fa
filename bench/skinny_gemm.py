"""Skinny matmuls (1-4 rows against a layer's weight): the Triton kernel of
``workers/engine/layers/skinny_kernel.py`` over a sweep of tiles against cuBLAS
(``F.linear``, plus FlashInfer's ``silu_and_mul`` for the gated MLP projection, as the
model runs them), at Qwen3-0.6B's
four projection shapes.

Each timing replays a CUDA graph of one call per layer over NUM_LAYERS weight copies
(as a decode step walks them, so the weights come from HBM, not L2), and prints
microseconds a call, the weights' floor at the measured bandwidth, and the ratio
against cuBLAS timed the same way in the same process.

    python bench/skinny_gemm.py [--rows 1 2 4]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_line, measure_bandwidth  # noqa: E402
from workers.engine.device_properties import sm_count  # noqa: E402
from workers.engine.layers.skinny_choice import (  # noqa: E402
    cublas_product,
    float32_product,
    graph_us,
)
from workers.engine.layers.skinny_kernel import default_tiles, skinny_matmul  # noqa: E402
from workers.engine.layers.tiles import Tiles  # noqa: E402

NUM_LAYERS = 28
REPLAYS = 20
# (name, output columns N, input K, gated): Qwen3-0.6B's projections
SHAPES = [
    ("qkv", 4096, 1024, False),
    ("o", 1024, 2048, False),
    ("gate_up+silu", 3072, 1024, True),
    ("down", 1024, 3072, False),
]


def candidates(n: int, k: int, rows: int, sms: int) -> list[Tiles]:
    """Tiles worth timing (each is a Triton compile): four warps, K split only for
    the narrow projections; ``main`` retimes the best few with 2 and 8 warps."""
    narrow = triton.cdiv(n, 4) < 4 * sms  # under 4 programs an SM at the smallest block
    splits = (1, 2, 4) if narrow else (1,)
    out = []
    for block_n, block_k, split in itertools.product((4, 8, 16), (256, 512, 1024), splits):
        if rows * block_n * block_k > 8192:
            continue  # registers: the float32 accumulator
        if split > 1 and k // split < block_k:
            continue
        out.append(Tiles(block_n, block_k, split, 4))
    return out


def timed(x: torch.Tensor, weights: list[torch.Tensor], gated: bool, tiles: Tiles) -> float:
    """Microseconds a call with ``tiles``, after checking the result against float32."""
    ref = float32_product(x, weights[0], gated)
    out = skinny_matmul(x, weights[0], gated=gated, tiles=tiles)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    if err > 2e-2:
        raise AssertionError(f"{tiles}: relative error {err:.3g}")
    calls = [lambda w=w: skinny_matmul(x, w, gated=gated, tiles=tiles) for w in weights]
    return graph_us(calls, REPLAYS)


def sweep(x: torch.Tensor, weights: list[torch.Tensor], gated: bool, sms: int) -> list:
    """(us, tiles) best first: the candidates, then the best three with 2 and 8 warps,
    and the default tiles."""
    n = weights[0].shape[0] // 2 if gated else weights[0].shape[0]
    k, rows = x.shape[1], x.shape[0]
    results = sorted(
        ((timed(x, weights, gated, t), t) for t in candidates(n, k, rows, sms)), key=_first
    )
    for _, t in results[:3]:
        for warps in (2, 8):
            other = Tiles(t.block_n, t.block_k, t.split_k, warps)
            results.append((timed(x, weights, gated, other), other))
    default = default_tiles(n, k, triton.next_power_of_2(rows), sms)
    if default not in [t for _, t in results]:
        results.append((timed(x, weights, gated, default), default))
    return sorted(results, key=_first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    print(device_line())
    bandwidth = measure_bandwidth()
    sms = sm_count(torch.device("cuda"))
    print(f"bandwidth {bandwidth / 1e12:.2f} TB/s, {sms} SMs")
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = []
    for name, n, k, gated in SHAPES:
        width = 2 * n if gated else n
        weights = [
            torch.randn((width, k), generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            for _ in range(NUM_LAYERS)
        ]
        floor_us = 1e6 * width * k * 2 / bandwidth
        for rows in args.rows:
            x = torch.randn((rows, k), generator=gen, device="cuda", dtype=torch.bfloat16)
            base = graph_us(
                [lambda w=w, x=x, g=gated: cublas_product(x, w, g) for w in weights], REPLAYS
            )
            results = sweep(x, weights, gated, sms)
            for us, tiles in results[:5]:
                print(f"  {name} rows={rows} {tiles}: {us:.2f} us", flush=True)
            default = default_tiles(n, k, triton.next_power_of_2(rows), sms)
            default_us = next(us for us, t in results if t == default)
            table.append((name, rows, floor_us, base, *results[0], default_us, default))
    print()
    print(
        "| projection | rows | floor us | cuBLAS us | best Triton us | x cuBLAS | tiles "
        "| default us |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rows, floor_us, base, best_us, best, default_us, default in table:
        print(
            f"| {name} | {rows} | {floor_us:.2f} | {base:.2f} | {best_us:.2f} | "
            f"{base / best_us:.2f} | {best.block_n}x{best.block_k} split {best.split_k} "
            f"w{best.num_warps} | {default_us:.2f} ({default.block_n}x{default.block_k} "
            f"split {default.split_k} w{default.num_warps}) |"
        )


def _first(pair: tuple) -> float:
    return pair[0]


if __name__ == "__main__":
    main()
