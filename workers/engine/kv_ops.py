"""Operations on the KV pool's tensors outside a model forward, as data: moving a
chunk's KV between a sequence and a position-free entry (``approximate.placement``).

They are values rather than closures so that a tensor-parallel worker's rank 0 can send
each one to the other ranks, which run it on their own KV heads
(``ModelRunner.apply``); every rank runs them in the same order. ``apply`` takes the
runner whose ``kv_stack`` and ``model.rope_cache`` it works on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.engine.approximate.placement import (
    place_chunk,
    place_spans,
    sequence_slots,
    take_spans,
)

# (start, end, entry pages): positions [start, end) of a sequence and the pages of the
# entry holding them from position 0
Span = tuple[int, int, Sequence[int]]


@dataclass(frozen=True)
class PlaceSpans:
    """``place_spans``: entries into a sequence at their spans, keys rotated by each
    span's start. ``apply(runner, first_layer, end_layer)`` places the layers from
    ``first_layer`` up to ``end_layer`` (``ModelRunner.repair_selecting`` places between
    its layers). ``below_selection``: the positions a selecting forward does not
    recompute also take the entries' KV in the layers below the selection layer,
    instead of keeping what that forward computed there (``EngineConfig
    .placed_low_layers``)."""

    page_table: Sequence[int]
    spans: Sequence[Span]
    page_size: int
    below_selection: bool = False

    def apply(self, runner, first_layer: int = 0, end_layer: int | None = None) -> None:
        place_spans(
            runner.kv_stack,
            runner.model.rope_cache,
            self.page_table,
            self.spans,
            self.page_size,
            first_layer,
            end_layer,
        )


@dataclass(frozen=True)
class TakeSpans:
    """``take_spans``: a sequence's spans into fresh entry pages at position 0."""

    page_table: Sequence[int]
    spans: Sequence[Span]
    page_size: int

    def apply(self, runner) -> None:
        take_spans(
            runner.kv_stack, runner.model.rope_cache, self.page_table, self.spans, self.page_size
        )


@dataclass(frozen=True)
class ShiftToStart:
    """Positions ``[skip, skip + length)`` of the sequence whose pages are ``page_table``
    moved to ``[0, length)`` of the same pages, keys rotated back by ``skip`` (an entry
    fill's chunk, computed after the entry context)."""

    page_table: Sequence[int]
    skip: int
    length: int
    page_size: int

    def apply(self, runner) -> None:
        place_chunk(
            runner.kv_stack,
            sequence_slots(self.page_table, self.skip, self.skip + self.length, self.page_size),
            sequence_slots(self.page_table, 0, self.length, self.page_size),
            -self.skip,
            runner.model.rope_cache,
            self.page_size,
        )
