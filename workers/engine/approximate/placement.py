"""Placement primitives for position-free chunk entries (docs/design.md, "Approximate
reuse", items 1-2): move a chunk's cached K/V to another position by re-rotating
its keys.

Keys are cached *after* RoPE (NeoX half-split layout, ``layers/ops.apply_rope``):
the key of a token at position ``x`` is ``R(x) k`` where ``R(x)`` rotates each
pair ``(k[i], k[i + d/2])`` by the angle ``x * inv_freq[i]``. Rotations of a pair
compose, ``R(a + b) = R(b) R(a)``, so a key cached at ``x`` becomes the key at
``x + delta`` by applying ``R(delta)``, computed from row ``delta`` of the very
``cos_sin_cache`` that ``apply_rope`` reads (same frequencies, Llama 3 scaling
included). Values carry no position and are copied unchanged.

Why a chunk computed alone may be moved at all: a chunk that attends only to
itself sees RoPE only through query-key *relative* positions, so its hidden
states, and with them its values and un-rotated keys at every layer, do not
depend on where it starts. Only the stored key rotation does, and that is what
``rotate_keys`` fixes. This holds only when RoPE is a pure per-position rotation
of every head; ``rope_supports_placement`` says whether a model's is.

Exactness: up to float32 rounding. The reference (computing the chunk at
``p`` directly) evaluates ``cos((p + x) * f)`` whereas placement evaluates the
product of ``cos(p * f)`` and ``cos(x * f)`` rotations; both round the angle
products in float32, so they differ by a few ulps of the angle, which grows with
the position (about ``(p + x) * 2**-24`` radians).

Plain torch on CPU and CUDA, with no per-token Python loops; on CUDA, placing
entries into a request's pages takes one fused Triton kernel (``layers/placement_kernel``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from workers.engine.attention.base import kv_write_rows
from workers.engine.layers.rotary import RopeScaling


def _rows_of(table: torch.Tensor, delta: int | torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """cos and sin ``[n or 1, 1, head_dim]`` float32 of the rotation by ``delta``,
    in the full-width NeoX layout (each half-frequency repeated for both halves).
    A negative delta uses ``R(-a) = (cos a, -sin a)``."""
    half = table.shape[-1] // 2
    if isinstance(delta, torch.Tensor):
        delta = delta.to(device=table.device, dtype=torch.int64)
        if delta.dim() != 1 or delta.numel() != n:
            raise ValueError(f"delta tensor must have shape [{n}], got {list(delta.shape)}")
        rows = table.index_select(0, delta.abs())
        sign = torch.where(delta < 0, -1.0, 1.0).to(torch.float32)[:, None]
    else:
        delta = int(delta)
        if abs(delta) >= table.shape[0]:
            raise ValueError(
                f"rotation by {delta} needs cos_sin_cache row {abs(delta)}, "
                f"but the cache has {table.shape[0]} rows"
            )
        rows = table[abs(delta)][None, :]
        sign = -1.0 if delta < 0 else 1.0
    rows = rows.to(torch.float32)
    cos = rows[:, :half]
    sin = rows[:, half:] * sign
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]


def rotate_keys(
    keys: torch.Tensor,  # [n, kv_heads, head_dim], rotated at positions x
    delta: int | torch.Tensor,  # int, or [n] int64 (one shift per row)
    cos_sin_cache: torch.Tensor,  # [max_pos, head_dim] float32, from layers.rotary
) -> torch.Tensor:
    """Keys rotated at positions ``x`` -> the same keys rotated at ``x + delta``.

    Returns a new tensor of ``keys``' dtype and shape; the math runs in float32 and
    is cast back once. ``delta`` may be negative (rotates back), and must satisfy
    ``|delta| < cos_sin_cache.shape[0]`` (checked for an int; for a tensor it is the
    caller's precondition, since checking would synchronize a CUDA stream).
    ``cos_sin_cache`` must be the table the keys were rotated with (the model's
    ``rope_cache``), on the keys' device.
    """
    if keys.dim() != 3:
        raise ValueError(f"keys must be [n, kv_heads, head_dim], got {list(keys.shape)}")
    if keys.shape[-1] != cos_sin_cache.shape[-1]:
        raise ValueError(
            f"head_dim {keys.shape[-1]} does not match cos_sin_cache width "
            f"{cos_sin_cache.shape[-1]}"
        )
    cos, sin = _rows_of(cos_sin_cache, delta, keys.shape[0])
    half = keys.shape[-1] // 2
    k = keys.float()
    rotated = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
    return rotated.to(keys.dtype)


def place_chunk(
    kv_caches: Sequence[torch.Tensor] | torch.Tensor,
    src: torch.Tensor | Sequence[torch.Tensor],
    dst_slots: torch.Tensor,  # [n] int
    delta: int | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    page_size: int,
    disjoint: bool = False,
) -> None:
    """Copy a chunk's K/V into ``dst_slots`` of every layer, keys rotated by ``delta``.

    ``kv_caches``: one ``[pages, 2, page_size, kv_heads, head_dim]`` tensor per layer,
    or all layers stacked in one ``[layers, pages, 2, page_size, kv_heads, head_dim]``
    tensor (the model runner's ``kv_stack``): then, with ``src`` as slots, every layer
    is gathered, rotated and scattered at once (a few kernels in all).

    ``src`` is either a ``[n]`` int tensor of slots in ``kv_caches`` themselves (an
    entry held in the pool's pages), or one ``[n, 2, kv_heads, head_dim]`` tensor per
    layer (rows held elsewhere, e.g. host memory; index 0 keys, 1 values). Row ``i``
    of the chunk goes to ``dst_slots[i]``.

    Invariants:
    - Destination slots need no alignment: the chunk may start mid-page and span
      any pages (a slot is ``page * page_size + offset``; consecutive positions of a
      sequence need not be consecutive slots). ``dst_slots`` must be distinct.
    - Only the ``2 * n`` destination rows of each layer are written (keys rotated,
      values bit-identical to the source); every other slot is untouched.
    - Source rows are gathered before anything is written, so sources and
      destinations may overlap (e.g. shifting a chunk within its own pages). A
      caller that knows they are ``disjoint`` lets a stacked CUDA cache take the
      fused kernel (``layers/placement_kernel.py``): one read and one write per row.
    - The keys at the source are taken to be rotated at positions ``x``; at the
      destination they are rotated at ``x + delta`` (see ``rotate_keys``). Placing
      an entry computed at position 0 at offset ``p`` is ``delta = p``.
    - One gather and one scatter per layer; no per-token Python work, no host sync.
    """
    if isinstance(kv_caches, torch.Tensor) and kv_caches.dim() == 6:
        if not isinstance(src, torch.Tensor):
            raise ValueError("a stacked cache takes source slots, not rows")
        if disjoint and _fused_placement(kv_caches):
            from workers.engine.layers.placement_kernel import place_rows

            n = dst_slots.numel()
            deltas = delta if isinstance(delta, torch.Tensor) else torch.full((n,), int(delta))
            place_rows(kv_caches, src, dst_slots, deltas, cos_sin_cache)
            return
        _place_stacked(kv_caches, src, dst_slots, delta, cos_sin_cache, page_size)
        return
    if not kv_caches:
        return
    device = kv_caches[0].device
    dst_rows = kv_write_rows(dst_slots.to(device), page_size)  # keys, then values
    n = dst_slots.numel()
    from_slots = isinstance(src, torch.Tensor)
    if from_slots:
        if src.numel() != n:
            raise ValueError(f"{src.numel()} source slots for {n} destination slots")
        src_rows = kv_write_rows(src.to(device), page_size)
    elif len(src) != len(kv_caches):
        raise ValueError(f"{len(src)} source layers for {len(kv_caches)} cache layers")
    for layer, kv_cache in enumerate(kv_caches):
        kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        flat = kv_cache.view(-1, kv_heads * head_dim)
        if from_slots:
            rows = flat.index_select(0, src_rows)  # a copy: overlap-safe
            keys, values = rows[:n], rows[n:]
        else:
            chunk = src[layer]
            if chunk.shape != (n, 2, kv_heads, head_dim):
                raise ValueError(
                    f"layer {layer}: source rows {list(chunk.shape)}, "
                    f"expected {[n, 2, kv_heads, head_dim]}"
                )
            chunk = chunk.to(device=device, dtype=kv_cache.dtype)
            keys, values = chunk[:, 0].reshape(n, -1), chunk[:, 1].reshape(n, -1)
        keys = rotate_keys(keys.reshape(n, kv_heads, head_dim), delta, cos_sin_cache)
        flat.index_copy_(0, dst_rows, torch.cat((keys.reshape(n, -1), values)))


def sequence_slots(page_table: Sequence[int], start: int, end: int, page_size: int) -> torch.Tensor:
    """``[end - start]`` int64 cache slots of positions ``[start, end)`` of a sequence
    whose pages are ``page_table`` (slot = page * page_size + offset)."""
    table = torch.as_tensor(np.asarray(page_table, dtype=np.int64))
    positions = torch.arange(start, end)
    return table[positions // page_size] * page_size + positions % page_size


def place_spans(
    kv_stack: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    page_table: Sequence[int],
    spans: Sequence[tuple[int, int, Sequence[int]]],
    page_size: int,
    first_layer: int = 0,
    end_layer: int | None = None,
) -> None:
    """Place several entries into one sequence at once: for each ``(start, end,
    entry_pages)``, the entry's tokens ``[0, end - start)`` (held in ``entry_pages``)
    go to positions ``[start, end)`` of the sequence whose pages are ``page_table``,
    keys rotated by ``start``, in the layers from ``first_layer`` up to ``end_layer``
    (default: the last; the layers below ``first_layer`` are left as they are: a
    caller that computes them there anyway need not place them). One ``place_chunk``
    call over those layers of the stacked cache; entry pages are never the sequence's
    own, so sources and destinations are disjoint. This runs on every approximate
    admission, before its first step."""
    if not spans:
        return
    entry_slots, in_sequence, starts = _span_slots(page_table, spans, page_size)
    layers = kv_stack[first_layer:end_layer]  # contiguous: a slice of the outermost dimension
    _move_rows(layers, cos_sin_cache, entry_slots, in_sequence, starts, page_size)


def take_spans(
    kv_stack: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    page_table: Sequence[int],
    spans: Sequence[tuple[int, int, Sequence[int]]],
    page_size: int,
) -> None:
    """The inverse of ``place_spans``: for each ``(start, end, entry_pages)``, positions
    ``[start, end)`` of the sequence whose pages are ``page_table`` go to tokens
    ``[0, end - start)`` of the fresh ``entry_pages``, keys rotated back by ``start``,
    in every layer: a chunk computed in context becomes a position-free entry without
    being computed again. The entry pages are never the sequence's own (disjoint)."""
    if not spans:
        return
    entry_slots, in_sequence, starts = _span_slots(page_table, spans, page_size)
    _move_rows(kv_stack, cos_sin_cache, in_sequence, entry_slots, -starts, page_size)


def _span_slots(
    page_table: Sequence[int],
    spans: Sequence[tuple[int, int, Sequence[int]]],
    page_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(entry slots, sequence slots, span start) of every token of ``spans``, int64:
    token ``i`` of the entry in ``entry_pages`` is position ``start + i`` of the
    sequence. Computed in a few array operations (no loop over tokens)."""
    starts = np.fromiter((s for s, _, _ in spans), dtype=np.int64, count=len(spans))
    lengths = np.fromiter((e - s for s, e, _ in spans), dtype=np.int64, count=len(spans))
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    offset = np.arange(int(lengths.sum()), dtype=np.int64) - first  # within its entry
    table = np.asarray(page_table, dtype=np.int64)
    start = np.repeat(starts, lengths)
    position = start + offset
    in_sequence = table[position // page_size] * page_size + position % page_size
    entry_pages = [
        np.asarray(pages[: -(-n // page_size)], dtype=np.int64)
        for (_, _, pages), n in zip(spans, lengths.tolist(), strict=True)
    ]
    page_base = np.cumsum([0] + [len(p) for p in entry_pages[:-1]])
    entry_page = np.concatenate(entry_pages)[np.repeat(page_base, lengths) + offset // page_size]
    return entry_page * page_size + offset % page_size, in_sequence, start


def _move_rows(
    layers: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    src: np.ndarray,
    dst: np.ndarray,
    delta: np.ndarray,
    page_size: int,
) -> None:
    """Disjoint slots ``src`` -> ``dst`` in ``layers`` (of a stacked cache), keys
    rotated by ``delta``. The three index arrays reach the device in one copy, from
    pinned memory on CUDA (torch's caching host allocator keeps the block until the
    copy ran; a pageable copy of these ~100 KB took a few hundred microseconds of host
    time)."""
    moves = torch.empty((3, len(src)), dtype=torch.int64, pin_memory=layers.is_cuda)
    np.stack((src, dst, delta), out=moves.numpy())
    moves = moves.to(layers.device, non_blocking=True)
    place_chunk(layers, moves[0], moves[1], moves[2], cos_sin_cache, page_size, disjoint=True)


def _fused_placement(kv_stack: torch.Tensor) -> bool:
    """Whether the fused CUDA kernel can place rows in this stacked cache (Triton
    present, power-of-two kv_heads and head_dim, as ``tl.arange`` needs)."""
    if kv_stack.device.type != "cuda" or not kv_stack.is_contiguous():
        return False
    heads, head_dim = kv_stack.shape[-2], kv_stack.shape[-1]
    if heads & (heads - 1) or head_dim & (head_dim - 1):
        return False
    return _has_triton()


@functools.cache
def _has_triton() -> bool:
    """Looked up once: placement runs on every approximate admission."""
    return importlib.util.find_spec("triton") is not None


def _place_stacked(
    kv_stack: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    delta: int | torch.Tensor,
    cos_sin_cache: torch.Tensor,
    page_size: int,
) -> None:
    """``place_chunk`` over all layers at once: one gather, the rotation, one scatter."""
    layers, kv_heads, head_dim = kv_stack.shape[0], kv_stack.shape[-2], kv_stack.shape[-1]
    device = kv_stack.device
    n = dst_slots.numel()
    if src_slots.numel() != n:
        raise ValueError(f"{src_slots.numel()} source slots for {n} destination slots")
    flat = kv_stack.view(layers, -1, kv_heads * head_dim)
    rows = flat.index_select(1, kv_write_rows(src_slots.to(device), page_size))  # a copy
    keys = rows[:, :n].reshape(layers * n, kv_heads, head_dim)
    if isinstance(delta, torch.Tensor):
        delta = delta.to(device).repeat(layers)
    rotated = rotate_keys(keys, delta, cos_sin_cache).reshape(layers, n, -1)
    flat.index_copy_(
        1, kv_write_rows(dst_slots.to(device), page_size), torch.cat((rotated, rows[:, n:]), 1)
    )


# Why each refused RoPE variant is not a pure per-position rotation of every head.
_NOT_PURE_ROTATION = {
    "yarn": "YaRN scales cos/sin by an attention factor, so rotations do not compose",
    "dynamic": "dynamic NTK frequencies depend on the sequence length",
    "longrope": "LongRoPE switches frequencies with the sequence length and rescales cos/sin",
    "linear": "linear position interpolation is not implemented by our layers",
}


def rope_supports_placement(model_config: Any) -> str | None:
    """None when a model's RoPE lets cached keys be moved by ``rotate_keys``, else a
    message naming the config field that prevents it.

    Accepts our ``ModelConfig`` or a raw Hugging Face ``config.json`` dict (so a
    model can be judged without loading it). Accepted: no scaling (``default``) and
    ``llama3`` scaling, which only rescales frequencies: still one pure rotation per
    position and head. Refused: other ``rope_scaling`` / ``rope_parameters`` types
    (``ModelConfig.from_dict`` refuses those too), ``partial_rotary_factor`` < 1
    (only part of each head rotated; our layers rotate whole heads) and an odd
    ``head_dim`` (no half-split pairs).
    """
    if isinstance(model_config, Mapping):
        return _raw_config_problem(model_config)
    scaling = model_config.rope_scaling
    if scaling is not None and not isinstance(scaling, RopeScaling):
        return f"rope_scaling {scaling!r} is not llama3 scaling: not a pure rotation"
    partial = getattr(model_config, "partial_rotary_factor", 1.0)
    if partial is not None and float(partial) < 1.0:
        return f"partial_rotary_factor {partial} < 1: only part of each head is rotated"
    if model_config.head_dim % 2:
        return f"head_dim {model_config.head_dim} is odd: NeoX RoPE rotates pairs"
    return None


def _raw_config_problem(raw: Mapping) -> str | None:
    for field in ("rope_scaling", "rope_parameters"):
        params = raw.get(field) or {}
        kind = params.get("rope_type") or params.get("type")
        if kind in (None, "default", "llama3"):
            continue
        reason = _NOT_PURE_ROTATION.get(kind, "not known to be a pure per-position rotation")
        return f"{field}.rope_type {kind!r}: {reason}"
    for where, params in (("", raw), ("rope_parameters.", raw.get("rope_parameters") or {})):
        partial = params.get("partial_rotary_factor")
        if partial is not None and float(partial) < 1.0:
            return (
                f"{where}partial_rotary_factor {partial} < 1: only part of each head is "
                "rotated (not supported by our layers)"
            )
    heads = int(raw.get("num_attention_heads") or 1)
    head_dim = int(raw.get("head_dim") or int(raw.get("hidden_size") or 0) // heads)
    if head_dim % 2:
        return f"head_dim {head_dim} is odd: NeoX RoPE rotates pairs"
    return None
