"""SiLU-gated MLP with the gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.layers.ops import silu_and_mul


class GatedMLP(nn.Module):
    fused_ops = False  # set by DecoderModel.use_fused_ops

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused_ops))
