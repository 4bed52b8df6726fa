"""SiLU-gated MLP with the gate and up projections fused into one matmul (and, for
one-row inputs where the engine chose it, the gate fused into that matmul)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.engine.layers.ops import project, silu_and_mul

if TYPE_CHECKING:
    from workers.engine.layers.skinny_choice import Tiles


class GatedMLP(nn.Module):
    fused_ops = False  # set by DecoderModel.use_fused_ops
    # projection kind -> its tiling, for one-row inputs; set by DecoderModel.use_skinny
    skinny: Mapping[str, Tiles] = MappingProxyType({})

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self.skinny.get("gate_up")
        if tiles is not None and x.shape[0] == 1:  # chosen at start: CUDA only
            from workers.engine.layers.skinny_kernel import skinny_matmul  # Triton

            hidden = skinny_matmul(x, self.gate_up_proj.weight, gated=True, tiles=tiles)
        else:
            hidden = silu_and_mul(self.gate_up_proj(x), self.fused_ops)
        return project(hidden, self.down_proj, self.skinny.get("down"))
