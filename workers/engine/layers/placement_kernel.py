"""Fused placement on CUDA (Triton): copy K/V rows between cache slots of every
layer, keys rotated by a per-row delta, in one kernel.

The torch path (``placement._place_stacked``) gathers every row, rotates in float32
through several full-size temporaries, concatenates and scatters: about five passes
over the moved bytes plus index tensors as large as the data. This kernel reads each
source row once and writes each destination row once.

Same math as ``placement.rotate_keys``: float32, NeoX half-split pairs
``(k[i], k[i + d/2])`` rotated by the angle in row ``|delta|`` of the model's
``cos_sin_cache`` (``R(-a) = (cos a, -sin a)``), cast back to the cache dtype once.
Values are copied bit for bit.

Precondition (the caller's): source and destination slots are disjoint. Programs
run in any order, so a destination written before another program reads it as a
source would be corrupted; ``placement.place_chunk`` keeps the gather-first torch
path for overlapping moves (a fill shifting a chunk within its own pages).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _place_kernel(
    kv_ptr,  # [layers, pages, 2, page_size, heads * head_dim], contiguous
    src_ptr,  # [n] int64 slots
    dst_ptr,  # [n] int64 slots
    delta_ptr,  # [n] int64
    table_ptr,  # [max_pos, head_dim] float32: cos of each frequency, then sin
    layer_stride,  # elements per layer
    PAGE_SIZE: tl.constexpr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    row = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    width: tl.constexpr = HEADS * 2 * HALF
    src = tl.load(src_ptr + row)
    dst = tl.load(dst_ptr + row)
    delta = tl.load(delta_ptr + row)
    # key row of slot s: page s // P, K/V index 0, offset s % P
    src_k = layer * layer_stride + ((src // PAGE_SIZE) * 2 * PAGE_SIZE + src % PAGE_SIZE) * width
    dst_k = layer * layer_stride + ((dst // PAGE_SIZE) * 2 * PAGE_SIZE + dst % PAGE_SIZE) * width
    to_values = PAGE_SIZE * width

    heads = tl.arange(0, HEADS)[:, None]
    pairs = tl.arange(0, HALF)[None, :]
    lo = heads * (2 * HALF) + pairs  # [HEADS, HALF] first element of each pair
    hi = lo + HALF

    angle_row = tl.abs(delta) * (2 * HALF)
    cos = tl.load(table_ptr + angle_row + pairs)
    sin = tl.load(table_ptr + angle_row + HALF + pairs)
    sin = tl.where(delta < 0, -sin, sin)

    k_lo = tl.load(kv_ptr + src_k + lo).to(tl.float32)
    k_hi = tl.load(kv_ptr + src_k + hi).to(tl.float32)
    out_lo = k_lo * cos - k_hi * sin
    out_hi = k_hi * cos + k_lo * sin
    out_ty = kv_ptr.dtype.element_ty
    tl.store(kv_ptr + dst_k + lo, out_lo.to(out_ty))
    tl.store(kv_ptr + dst_k + hi, out_hi.to(out_ty))

    values = tl.arange(0, HEADS * 2 * HALF)
    tl.store(kv_ptr + dst_k + to_values + values, tl.load(kv_ptr + src_k + to_values + values))


def place_rows(
    kv_stack: torch.Tensor,  # [layers, pages, 2, page_size, kv_heads, head_dim] on CUDA
    src_slots: torch.Tensor,  # [n] int
    dst_slots: torch.Tensor,  # [n] int, disjoint from src_slots
    delta: torch.Tensor,  # [n] int
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim] float32 on the cache's device
) -> None:
    layers, _, _, page_size, heads, head_dim = kv_stack.shape
    n = dst_slots.numel()
    if n == 0:
        return
    if not kv_stack.is_contiguous():
        raise ValueError("the stacked KV cache must be contiguous")
    if heads & (heads - 1) or head_dim & (head_dim - 1):
        raise ValueError(
            f"the fused placement kernel needs power-of-two kv_heads and head_dim, "
            f"got {heads} and {head_dim} (placement.place_chunk falls back to torch)"
        )
    device = kv_stack.device

    def slots(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()

    _place_kernel[(n, layers)](
        kv_stack,
        slots(src_slots),
        slots(dst_slots),
        slots(delta),
        cos_sin_cache.contiguous(),
        kv_stack.stride(0),
        PAGE_SIZE=page_size,
        HEADS=heads,
        HALF=head_dim // 2,
    )
