"""What a request asks of reuse (``ReuseRequest``) and how its prompt was served
(``ReuseInfo``: which mode, how many prompt tokens came from cached KV and how many
placed tokens were recomputed). ``ReuseInfo`` is carried unchanged from the engine to
every output (offline, worker deltas, HTTP, batch lines)."""

from __future__ import annotations

from dataclasses import dataclass

# naive_placement: a measurement mode (workers/engine/approximate/naive.py), never offered
REUSE_MODES = ("off", "exact", "approximate", "naive_placement")
REQUEST_MODES = ("exact", "approximate")  # what a request may ask for
# Repair defaults of the approximate mode, chosen with bench/reuse_quality.py on the
# doc-QA model with entries computed after the entry context (bench/RESULTS.md, "Reuse
# quality"): recomputing first tokens changed nothing measurable (k = 0, 1 and 4 alike,
# --repairs k=0 k=1 k=4); with selection at layer 3 (EngineConfig.deviation_layer) the
# 5% most deviating tokens keep 4, 8 and 16 documents within 0.3 points of full
# prefill, where 3% lose a point at 4 documents (--device cpu --docs 4 --repairs k=0,r=0.03
# k=0,r=0.05).
DEFAULT_FIRST_TOKENS = 0
DEFAULT_DEVIATION_RATIO = 0.05


@dataclass(frozen=True)
class ReuseRequest:
    """How a request wants its prompt's cached KV used.

    ``exact``: only KV computed after exactly the same preceding tokens (output equal
    to plain generation). ``approximate``: additionally, each chunk whose position-free
    entry is held is placed wherever it appears; then ``first_tokens`` tokens at the
    start of every placed chunk, and the ``deviation_ratio`` share of its tokens whose
    KV deviates most in this context (at the engine's ``deviation_layer``), are
    recomputed (the rest is reused as placed)."""

    mode: str = "exact"
    first_tokens: int = DEFAULT_FIRST_TOKENS
    deviation_ratio: float = DEFAULT_DEVIATION_RATIO

    def __post_init__(self) -> None:
        if self.mode not in REQUEST_MODES:
            raise ValueError(f"unknown reuse mode {self.mode!r}; choose one of {REQUEST_MODES}")
        if not isinstance(self.first_tokens, int) or self.first_tokens < 0:
            raise ValueError(f"first_tokens must be an integer >= 0, got {self.first_tokens!r}")
        if not 0.0 <= self.deviation_ratio <= 1.0:
            raise ValueError(f"deviation_ratio must be in [0, 1], got {self.deviation_ratio!r}")


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
