"""How the skinny matmul kernel tiles one projection (chosen in ``skinny_choice``,
carried by the layers, read by ``skinny_kernel``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    """How ``layers/skinny_kernel`` splits one matmul over programs."""

    block_n: int  # output columns a program owns
    block_k: int  # weight elements per row loaded at once
    split_k: int  # programs sharing one column block along K
    num_warps: int
