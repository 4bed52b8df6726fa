"""The CUDA graphs of a model's steps over a FlashInfer backend (``capture_step_graphs``,
which the model runner calls): decode graphs (``graphs.decode.DecodeGraphs``), cascade
decode graphs (``graphs.cascade.CascadeGraphs``) and prefill graphs
(``graphs.prefill.PrefillGraphs``) behind one ``replay``, so the runner asks whether a
graph fits a step without knowing which backend it has."""

from __future__ import annotations

import torch

from workers.engine.attention.base import BatchLayout
from workers.engine.graphs.cascade import CascadeGraphs
from workers.engine.graphs.decode import DecodeGraphs
from workers.engine.graphs.prefill import PrefillGraphs


def capture_step_graphs(
    model,
    backend,
    kv_caches: list[torch.Tensor],
    scratch_page: int,
    max_batch_size: int,
    max_pages_per_seq: int,
) -> FlashInferGraphs:
    """Decode graphs (plain decode steps of up to ``max_batch_size`` sequences), cascade
    decode graphs (the same sizes, when the backend's cascade is on) and prefill graphs
    (steps of up to 1,024 new tokens). ``scratch_page`` is a KV page the pool never
    hands out, for padding rows to read and write."""
    decode = DecodeGraphs(
        model, backend, kv_caches, scratch_page, max_batch_size, max_pages_per_seq
    )
    cascade = None
    if backend.enable_cascade:
        cascade = CascadeGraphs(
            model,
            backend,
            kv_caches,
            scratch_page,
            decode.max_batch_size(),
            max_pages_per_seq,
            decode.pool,
        )
        backend.cascade_captured()
    prefill = PrefillGraphs(model, backend, kv_caches, scratch_page, max_pages_per_seq, decode.pool)
    return FlashInferGraphs(model, backend, decode, prefill, cascade)


class FlashInferGraphs:
    def __init__(
        self,
        model,
        backend,
        decode: DecodeGraphs,
        prefill: PrefillGraphs,
        cascade: CascadeGraphs | None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.decode = decode
        self.prefill = prefill
        self.cascade = cascade

    def graph_for(self, layout: BatchLayout) -> str | None:
        """Which graph a step replays: "decode", "cascade" or "prefill"; None: the step
        runs eagerly (a cascade step larger than the captured sizes, a prefill step
        beyond the prefill buckets)."""
        if layout.is_decode:
            if self.backend.wants_cascade(layout):
                return "cascade" if self.cascade is not None and self.cascade.fits(layout) else None
            return "decode" if layout.batch_size <= self.decode.max_batch_size() else None
        return "prefill" if self.prefill.can_run(layout) else None

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
        rows: torch.Tensor,
    ) -> torch.Tensor | None:
        """Logits [S, vocab] of the new tokens at ``rows`` if a graph fits this step;
        None: the step runs eagerly."""
        kind = self.graph_for(layout)
        if kind == "decode":
            self.backend.last_plan_kind = "decode"
            return self.decode.run(input_ids, positions, layout)[rows]
        if kind == "cascade":
            hidden = self.cascade.run(input_ids, positions, layout)
        elif kind == "prefill":
            hidden = self.prefill.run(input_ids, positions, layout)
        else:
            return None
        return self.model.compute_logits(hidden[rows])
