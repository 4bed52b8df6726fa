"""SiLU-gated MLP with the gate and up projections fused into one matmul (for one-row
inputs where the engine chose it, ``DecoderLayer`` fuses the norm and the gate into
that matmul too)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.engine.layers.ops import project, silu_and_mul
from workers.engine.tp.shard import SINGLE, Shard

if TYPE_CHECKING:
    from workers.engine.layers.tiles import Tiles


class GatedMLP(nn.Module):
    fused_ops = False  # set by DecoderModel.use_fused_ops
    # projection kind -> its tiling, for one-row inputs; set by DecoderModel.use_skinny
    # (this module reads its output projection's; DecoderLayer the input one's, fused
    # with the norm before it)
    skinny: Mapping[str, Tiles] = MappingProxyType({})

    def __init__(self, hidden_size: int, intermediate_size: int, shard: Shard = SINGLE) -> None:
        """``intermediate_size``: this rank's columns; ``down_proj`` is row parallel
        (its output summed over the ranks)."""
        super().__init__()
        self.shard = shard
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_and_mul(self.gate_up_proj(x), self.fused_ops))

    def down(self, gated: torch.Tensor) -> torch.Tensor:
        """The down projection of ``silu(gate) * up`` (one-row steps compute that with
        the norm and gate fused in: ``DecoderLayer``)."""
        return self.shard.all_reduce(project(gated, self.down_proj, self.skinny.get("down")))
