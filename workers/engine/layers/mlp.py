"""SiLU-gated MLP with the gate and up projections fused into one matmul (and, for
one-row inputs where the engine chose it, the gate fused into that matmul)."""

from __future__ import annotations

import torch
from torch import nn

from workers.engine.layers.ops import project, silu_and_mul


class GatedMLP(nn.Module):
    fused_ops = False  # set by DecoderModel.use_fused_ops
    skinny: frozenset[str] = frozenset()  # set by DecoderModel.use_skinny

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "gate_up" in self.skinny and x.shape[0] == 1:  # chosen at start: CUDA only
            from workers.engine.layers.skinny_kernel import skinny_matmul  # Triton

            hidden = skinny_matmul(x, self.gate_up_proj.weight, gated=True)
        else:
            hidden = silu_and_mul(self.gate_up_proj(x), self.fused_ops)
        return project(hidden, self.down_proj, "down" in self.skinny)
