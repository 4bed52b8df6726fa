"""The CUDA graphs a FlashInfer backend captures (``FlashInferBackend.capture_graphs``):
decode graphs (``cuda_graphs.DecodeGraphs``) and prefill graphs
(``prefill_graphs.PrefillGraphs``) behind one ``replay``, so the model runner asks
whether a graph fits a step without knowing which backend it has."""

from __future__ import annotations

import torch

from workers.engine.attention.base import BatchLayout
from workers.engine.cuda_graphs import DecodeGraphs
from workers.engine.prefill_graphs import PrefillGraphs


class FlashInferGraphs:
    def __init__(self, model, backend, decode: DecodeGraphs, prefill: PrefillGraphs) -> None:
        self.model = model
        self.backend = backend
        self.decode = decode
        self.prefill = prefill

    def decode_fits(self, layout: BatchLayout) -> bool:
        """A plain decode step (cascade steps run eagerly) of at most the largest
        captured batch."""
        return (
            layout.is_decode
            and layout.batch_size <= self.decode.max_batch_size()
            and not self.backend.wants_cascade(layout)
        )

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
        rows: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits [S, vocab] of the new tokens at ``rows`` if a graph fits this step;
        None: the step runs eagerly."""
        if self.decode_fits(layout):
            return self.decode.run(input_ids, positions, layout)[rows]
        if self.prefill.can_run(layout):
            hidden = self.prefill.run(input_ids, positions, layout)
            return self.model.compute_logits(hidden[rows])
        return None
