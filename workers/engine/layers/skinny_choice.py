"""Which projections take the skinny kernel (``layers/skinny_kernel``) for one-row
inputs, decided by measuring on the engine's GPU at start, before any CUDA graph is
captured: per projection kind, a graph of one call per layer over the model's own
weights (a decode step's walk, weights from HBM) with cuBLAS, then with the kernel
under each of a few tilings (``skinny_kernel.tile_candidates``). A kind takes the
kernel, with its fastest tiling, only where its output matches a float32 product and
it was faster than cuBLAS by ``MIN_GAIN``; anything that fails (a build, a launch)
leaves cuBLAS in place. The QKV and gate-up kinds take the (add +) RMSNorm before them
into the kernel (``NORMED``), so they are timed against that norm's kernel + cuBLAS.

Invariant: the choice is made once, before graphs are captured, and never changes
(graphs bake the path in).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.layers.ops import add_rms_norm, silu_and_mul
from workers.engine.layers.tiles import Tiles

logger = logging.getLogger(__name__)

KINDS = ("qkv", "o", "gate_up", "down")  # the gate_up kind fuses silu_and_mul
# kinds whose kernel also runs the (add +) RMSNorm before them (``DecoderLayer``):
# measured against FlashInfer's fused_add_rmsnorm + cuBLAS, which they replace
NORMED = {"qkv": "input_layernorm", "gate_up": "post_attention_layernorm"}
MIN_GAIN = 1.05  # cuBLAS time / kernel time needed to switch (timing noise is ~1-2%)
REPLAYS = 10


@dataclass(frozen=True)
class KindTiming:
    kind: str
    cublas_us: float  # per layer call
    skinny_us: float | None  # the fastest tiling's; None: the kernel failed or differed
    note: str = ""
    tiles: Tiles | None = None  # the tiling that gave skinny_us

    @property
    def chosen(self) -> bool:
        return (
            self.skinny_us is not None
            and self.tiles is not None
            and self.cublas_us >= MIN_GAIN * self.skinny_us
        )


@dataclass(frozen=True)
class SkinnyChoice:
    timings: tuple[KindTiming, ...] = ()
    error: str = ""  # why nothing was measured (the model or device does not qualify)
    # kind -> its tiling (read-only)
    chosen: Mapping[str, Tiles] = field(default_factory=lambda: MappingProxyType({}))

    def summary(self) -> str:
        if self.error:
            return f"skinny matmuls off: {self.error}"
        parts = [
            f"{t.kind} {t.cublas_us:.1f}->{t.skinny_us:.1f} us{_tiling(t.tiles)}"
            if t.skinny_us is not None
            else f"{t.kind} cuBLAS ({t.note})"
            for t in self.timings
        ]
        return f"skinny matmuls for one-row steps: {sorted(self.chosen) or 'none'} ({', '.join(parts)})"


def _tiling(tiles: Tiles | None) -> str:
    if tiles is None:
        return ""
    split = f" split {tiles.split_k}" if tiles.split_k > 1 else ""
    return f" ({tiles.block_n}x{tiles.block_k}{split} w{tiles.num_warps})"


def decide(timings: list[KindTiming]) -> SkinnyChoice:
    chosen = MappingProxyType({t.kind: t.tiles for t in timings if t.chosen})
    return SkinnyChoice(tuple(timings), chosen=chosen)


# kind -> (submodule of a decoder layer, its nn.Linear)
_PROJECTIONS = {
    "qkv": ("self_attn", "qkv_proj"),
    "o": ("self_attn", "o_proj"),
    "gate_up": ("mlp", "gate_up_proj"),
    "down": ("mlp", "down_proj"),
}


def projections(model: nn.Module, kind: str) -> list[nn.Linear]:
    """Projection ``kind`` of every decoder layer."""
    block, name = _PROJECTIONS[kind]
    return [getattr(getattr(layer, block), name) for layer in model.layers]


def eligible(model: nn.Module) -> str:
    """Why the model cannot use the kernel ("" when it can)."""
    for kind in KINDS:
        for linear in projections(model, kind):
            w = linear.weight
            if linear.bias is not None:
                return "projections with a bias"
            if not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16):
                return f"weights in {w.dtype} on {w.device.type} (needs bf16/fp16 on CUDA)"
            if not w.is_contiguous():
                return "non-contiguous weights"
    return ""


@torch.inference_mode()
def choose(model: nn.Module) -> SkinnyChoice:
    """Measure every kind and decide; never raises (a failure keeps cuBLAS)."""
    why = eligible(model)
    if why:
        return SkinnyChoice(error=why)
    try:
        timings = [_measure(model, kind) for kind in KINDS]
    except Exception as error:  # noqa: BLE001 - the fallback is cuBLAS, said in the log
        logger.warning("skinny matmul measurement failed, cuBLAS kept: %r", error)
        return SkinnyChoice(error=f"measurement failed: {error!r}")
    choice = decide(timings)
    logger.info(choice.summary())
    return choice


def cublas_product(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    """What the model runs without the kernel: cuBLAS, then (``gated``) the fused
    ``silu_and_mul`` of FlashInfer (CUDA)."""
    y = F.linear(x, w)
    return silu_and_mul(y, fused=True) if gated else y


def float32_product(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    """The reference: the same math in float32, in torch."""
    y = F.linear(x.float(), w.float())
    return silu_and_mul(y, fused=False) if gated else y


def normed(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) as the kernel's fused norm computes them, in
    torch: the sum rounded to x's dtype, normalized in float32, times the weight, rounded
    once (``skinny_kernel``'s docstring says how this differs from FlashInfer's)."""
    total = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h = total.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * norm_weight.float()
    return h.to(x.dtype), total


def _measure(model: nn.Module, kind: str) -> KindTiming:
    from workers.engine import device_properties
    from workers.engine.layers.skinny_kernel import (
        skinny_matmul,
        skinny_norm_matmul,
        tile_candidates,
    )

    weights = [linear.weight for linear in projections(model, kind)]
    gated = kind == "gate_up"
    norms = [getattr(layer, NORMED[kind]) for layer in model.layers] if kind in NORMED else []
    w0 = weights[0]
    gen = torch.Generator(device=w0.device).manual_seed(0)
    x, residual = torch.randn((2, 1, w0.shape[1]), generator=gen, device=w0.device, dtype=w0.dtype)
    first_layer = None  # the QKV kernel of layer 0 has no residual to add: checked too
    if norms:
        # fused_add_rmsnorm writes both inputs: the cuBLAS graph gets copies of its own
        xc, rc = x.clone(), residual.clone()
        cublas_us = graph_us(
            [
                lambda w=w, g=g: cublas_product(
                    add_rms_norm(xc, rc, g.weight, g.eps, fused=True)[0], w, gated
                )
                for w, g in zip(weights, norms, strict=True)
            ]
        )
        h, _ = normed(x, residual, norms[0].weight, norms[0].eps)
        want = float32_product(h, w0, gated)
        if kind == "qkv":
            h, _ = normed(x, None, norms[0].weight, norms[0].eps)
            first_layer = float32_product(h, w0, gated)
    else:
        cublas_us = graph_us([lambda w=w: cublas_product(x, w, gated) for w in weights])
        want = float32_product(x, w0, gated)

    def kernel(w, g, tiles, with_residual=True):
        if g is None:
            return skinny_matmul(x, w, gated=gated, tiles=tiles)
        res = residual if with_residual else None
        return skinny_norm_matmul(x, res, g.weight, g.eps, w, gated=gated, tiles=tiles)[0]

    def off_by(got: torch.Tensor, reference: torch.Tensor) -> float:
        """Largest error over the reference's largest magnitude (NaN if any is NaN)."""
        scale = max(reference.abs().max().item(), 1e-30)
        return (got.float() - reference).abs().max().item() / scale

    layer_norms = norms or [None] * len(weights)
    n = w0.shape[0] // 2 if gated else w0.shape[0]
    best: tuple[float, Tiles] | None = None
    note = ""
    for tiles in tile_candidates(n, w0.shape[1], 1, device_properties.sm_count(x.device)):
        try:  # the first call builds it, outside a graph
            errors = [off_by(kernel(w0, layer_norms[0], tiles), want)]
            if first_layer is not None:
                errors.append(off_by(kernel(w0, norms[0], tiles, False), first_layer))
            # bf16 rounding is 2^-8 of the largest output; NaN fails too
            bad = [e for e in errors if not e <= 2**-6]
            if bad:
                note = f"output off by {bad[0]:.3g} of its scale ({tiles})"
                continue
            us = graph_us(
                [
                    lambda w=w, g=g, t=tiles: kernel(w, g, t)
                    for w, g in zip(weights, layer_norms, strict=True)
                ]
            )
        except Exception as error:  # noqa: BLE001 - this tiling is dropped, noted
            note = f"kernel failed: {error!r:.200}"
            continue
        if best is None or us < best[0]:
            best = (us, tiles)
    if best is None:
        return KindTiming(kind, cublas_us, None, note)
    return KindTiming(kind, cublas_us, best[0], tiles=best[1])


def graph_us(calls, replays: int = REPLAYS) -> float:
    """Microseconds a call: ``calls`` captured once in a CUDA graph, replayed."""
    from workers.engine.graphs.capture import capture  # imports FlashInfer: CUDA hosts

    graph, _ = capture(lambda: [call() for call in calls], pool=None)
    graph.replay()  # the first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * len(calls))
