"""How a request's prompt was served: which reuse mode, how many prompt tokens came
from cached KV and how many placed tokens were recomputed. Carried unchanged from
the engine to every output (offline, worker deltas, HTTP, batch lines)."""

from __future__ import annotations

from dataclasses import dataclass

# naive_placement: a measurement mode (workers/engine/naive_placement.py), never offered
REUSE_MODES = ("off", "exact", "naive_placement")


@dataclass(frozen=True)
class ReuseInfo:
    """Invariants: ``mode`` is one of ``REUSE_MODES``; ``reused_tokens`` counts prompt
    tokens whose KV was taken from the cache (``cached_tokens`` in usage);
    ``recomputed_tokens`` counts tokens taken from the cache and then computed again
    in context (always 0 in exact mode, whose KV needs no repair); mode ``off``
    reuses nothing."""

    mode: str
    reused_tokens: int = 0
    recomputed_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in REUSE_MODES:
            raise ValueError(f"unknown reuse mode {self.mode!r}; choose one of {REUSE_MODES}")
        if self.reused_tokens < 0 or self.recomputed_tokens < 0:
            raise ValueError("reused and recomputed token counts must be >= 0")

    def as_dict(self) -> dict[str, int | str]:
        return {
            "mode": self.mode,
            "reused_tokens": self.reused_tokens,
            "recomputed_tokens": self.recomputed_tokens,
        }
