"""Matmuls of a few rows against a large weight (CUDA, Triton): ``x [M, K] @ W.T`` for
``M <= MAX_ROWS``, optionally with the MLP's gate fused in (``silu(x @ Wg.T) * (x @ Wu.T)``
where ``W = [Wg; Wu]``) and the layer's (add +) RMSNorm fused before it: ``norm(x +
residual) @ W.T``, the sum written out as the new residual. That is the whole of a
decoder layer's input or post-attention norm, so a one-row step runs no norm kernels.

At batch 1 a decode step is a walk through the weights: every projection reads its
whole matrix once for one row. cuBLAS picks GEMM tiles for these shapes that take
5-12 us where the bytes need 1-3 us at HBM bandwidth (H200, bench/skinny_gemm.py --rows 1).
Here each program owns ``BLOCK_N`` output columns of every row, streams their weight
rows along K (contiguous in ``nn.Linear``'s ``[N, K]`` layout) and reduces in float32;
``SPLIT_K > 1`` splits K over programs as well, each writing a float32 partial that a
second pass sums (and gates) — for the narrow projections (N = hidden size), which
otherwise give too few programs to keep every SM reading.

Invariant: the output equals ``x.float() @ W.float().T`` summed in float32, rounded
once to ``x``'s dtype (the order of the float32 sum differs from cuBLAS', so results
agree to float32 rounding before the final cast, not bit for bit). With the norm, ``x``
is first the sum rounded to ``x``'s dtype (the new residual, bit for bit what FlashInfer's
``fused_add_rmsnorm`` stores), normalized in float32, times the norm weight, rounded.
FlashInfer normalizes the float32 sum before rounding it, so the normed rows differ from
its by one unit in the last place in some elements (the torch path, ``ops.add_rms_norm``,
also normalizes the rounded sum).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from workers.engine import device_properties
from workers.engine.layers.tiles import Tiles

MAX_ROWS = 4  # rows this path takes; wider inputs go to cuBLAS


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K], rows x_stride apart, unit inner stride
    x_stride,
    w_ptr,  # [N_total, K] contiguous
    out_ptr,  # [M, N] (SPLIT_K == 1) or float32 partials [SPLIT_K, M, N]
    M,
    N,  # output columns (for GATED: the gate's, the up rows start at N)
    K,
    K_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_K
    ROWS: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GATED: tl.constexpr,
    res_ptr,  # NORM and RESIDUAL: [M, K] added to x first, rows res_stride apart
    res_stride,
    res_out_ptr,  # NORM and RESIDUAL: [M, K] contiguous out, x + residual
    norm_w_ptr,  # NORM: [K]
    eps,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    k_start = pid_k * K_PER_SPLIT
    if NORM:  # every program finds the rows' RMS over all of K (from L2: K is small)
        squares = tl.zeros((ROWS,), dtype=tl.float32)
        first = (pid_n == 0) & (pid_k == 0)  # the one program that writes the residual
        for k0 in tl.range(0, K, BLOCK_K):
            k = k0 + ks
            mask = row_ok[:, None] & (k < K)[None, :]
            h = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=mask, other=0.0)
            if RESIDUAL:
                r = tl.load(res_ptr + rows[:, None] * res_stride + k[None, :], mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)  # stored as rounded
                if first:
                    tl.store(res_out_ptr + rows[:, None] * K + k[None, :], h, mask=mask)
            h = h.to(tl.float32)
            squares += tl.sum(h * h, axis=1)
        inv_rms = 1.0 / tl.sqrt(squares / K + eps)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if GATED:
        up_rows = w_ptr + (cols.to(tl.int64) + N)[:, None] * K
        acc_up = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K):  # masked past K
        k = k_start + k0 + ks
        k_ok = k < K
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if NORM:
            if RESIDUAL:
                r = tl.load(
                    res_ptr + rows[:, None] * res_stride + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            g = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * inv_rms[:, None] * g[None, :]).to(x.dtype)
        x = x.to(tl.float32)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
        if GATED:
            u = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32)
            acc_up += x[:, None, :] * u[None, :, :]
    out = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    store_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        if GATED:
            up = tl.sum(acc_up, axis=2)
            out = out / (1.0 + tl.exp(-out)) * up
        dst = out_ptr + rows[:, None] * N + cols[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        width = 2 * N if GATED else N
        dst = out_ptr + (pid_k * M + rows[:, None]) * width + cols[None, :]
        tl.store(dst, out, mask=store_mask)
        if GATED:
            tl.store(dst + N, tl.sum(acc_up, axis=2), mask=store_mask)


@triton.jit
def _reduce_kernel(
    part_ptr,  # float32 [SPLIT_K, M, width]
    out_ptr,  # [M, N]
    M,
    N,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    width = 2 * N if GATED else N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        src = part_ptr + (s * M + row) * width + cols
        total += tl.load(src, mask=ok, other=0.0)
        if GATED:
            up += tl.load(src + N, mask=ok, other=0.0)
    if GATED:
        total = total / (1.0 + tl.exp(-total)) * up
    tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def default_tiles(n: int, k: int, rows: int, sms: int) -> Tiles:
    """Tiles for ``n`` output columns over ``k``: four columns a program, K in wide
    loads, split along K only when the columns alone give fewer programs than SMs
    (the best of the sweep for Qwen3-0.6B's shapes on an H200,
    bench/skinny_gemm.py --rows 1 4)."""
    block_k = max(256, 1024 // rows)
    block_n = 4
    split_k = 1
    while triton.cdiv(n, block_n) * split_k < sms and split_k < 8 and k >= 2048 * split_k:
        split_k *= 2
    return Tiles(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4)


def tile_candidates(n: int, k: int, rows: int, sms: int) -> list[Tiles]:
    """What the engine times at start for one shape (layers/skinny_choice): the
    default, then the same with fewer and more warps (the sweep's best tiles for one row
    were among these for three projection kinds of four, and within 0.7% for the fourth)."""
    first = default_tiles(n, k, rows, sms)
    return [first] + [replace(first, num_warps=w) for w in (2, 8) if w != first.num_warps]


def skinny_matmul(
    x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False, tiles: Tiles | None = None
) -> torch.Tensor:
    """``x [M, K] @ weight.T`` (``weight [N, K]``) for ``M <= MAX_ROWS``; ``gated``:
    ``weight`` is ``[gate; up]`` (``[2I, K]``) and the result ``silu(gate) * up``
    ``[M, I]``, as ``silu_and_mul`` of the full product."""
    return _launch(x, weight, gated, tiles, None, None, 0.0)


def skinny_norm_matmul(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    *,
    gated: bool = False,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``skinny_matmul(rms_norm(x + residual) * norm_weight, weight)`` and the new
    residual ``x + residual`` (a new tensor; ``residual`` None: no sum, the residual is
    ``x`` itself). Neither input is written."""
    if norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous():
        raise ValueError(
            f"norm weight of shape {tuple(norm_weight.shape)} for K = {x.shape[1]}, "
            "or not contiguous"
        )
    if residual is not None and (
        residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype
    ):
        raise ValueError("the residual must be [M, K] like x, in its dtype, unit inner stride")
    if any(t.device != x.device for t in (weight, norm_weight, residual) if t is not None):
        raise ValueError("x, the residual and both weights must be on one device")
    new_residual = (
        x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    out = _launch(x, weight, gated, tiles, residual, (norm_weight, new_residual), eps)
    return out, new_residual


def _launch(x, weight, gated, tiles, residual, norm, eps) -> torch.Tensor:
    m, k = x.shape
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1 to {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"need x [M, K] (unit inner stride), weight [N, {k}] contiguous")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    rows = triton.next_power_of_2(m)
    if tiles is None:
        tiles = default_tiles(n, k, rows, device_properties.sm_count(x.device))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split = tiles.split_k
    target = out
    if split > 1:
        width = 2 * n if gated else n
        target = torch.empty((split, m, width), dtype=torch.float32, device=x.device)
    norm_weight, res_out = norm if norm is not None else (x, x)  # unread without NORM
    res_in = residual if residual is not None else x
    grid = (triton.cdiv(n, tiles.block_n), split)
    _skinny_kernel[grid](
        x,
        x.stride(0),
        weight,
        target,
        m,
        n,
        k,
        K_PER_SPLIT=triton.cdiv(triton.cdiv(k, split), tiles.block_k) * tiles.block_k,
        ROWS=rows,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        SPLIT_K=split,
        GATED=gated,
        res_ptr=res_in,
        res_stride=res_in.stride(0),
        res_out_ptr=res_out,
        norm_w_ptr=norm_weight,
        eps=eps,
        NORM=norm is not None,
        RESIDUAL=residual is not None,
        num_warps=tiles.num_warps,
    )
    if split > 1:
        block = 1024
        _reduce_kernel[(m, triton.cdiv(n, block))](
            target, out, m, n, SPLIT_K=split, BLOCK=block, GATED=gated
        )
    return out
