"""Where an engine's work and time go over a workload (for benchmarks and operators):
totals since the engine started; the difference of two copies gives a window.
``WorkloadTally`` counts the work, ``StepTally`` (kept by the engine loop) the time.

Counted where the work is decided, never estimated:
- ``prompt_positions``: prompt positions computed through every layer (steps' prefill
  rows, entry fills, approximate admissions' forwards queued aside), as the step's
  ``prompt_tokens`` counts them;
- ``selection_only_positions``: positions an approximate admission ran only through the
  layers up to its selection layer (candidates for selection it did not keep);
- ``entry_hits`` / ``entry_misses``: placeable chunks of approximate requests' first
  admissions found held as a position-free entry / not held (computed in context);
- ``entries_taken``: missed chunks whose in-context KV became their entry (no second
  forward: ``EngineConfig.entries_from_context``);
- ``fills_queued`` / ``fills_stored``: entry computations queued (a miss without
  ``entries_from_context``, no room to take the entry, or asked for) / stored as
  entries; ``entry_evictions``: entries the pool dropped for room;
- ``steps``, ``steps_with_admissions``, ``admission_forwards``: engine steps launched,
  those carrying approximate admissions' forwards, and those forwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkloadTally:
    prompt_positions: int = 0
    selection_only_positions: int = 0
    entry_hits: int = 0
    entry_misses: int = 0
    entries_taken: int = 0
    fills_queued: int = 0
    fills_stored: int = 0
    entry_evictions: int = 0
    steps: int = 0
    steps_with_admissions: int = 0
    admission_forwards: int = 0

    def copy(self) -> WorkloadTally:
        return dataclasses.replace(self)

    def since(self, earlier: WorkloadTally) -> WorkloadTally:
        """What was counted after ``earlier`` (a copy of this tally taken then)."""
        return WorkloadTally(
            *(getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self))
        )


@dataclass(slots=True)
class StepTally:
    """Where an engine's time went since its loop started (``EngineLoop.step_tally``).
    Not frozen: the loop's counters add to theirs under their lock; what leaves the
    loop is a copy."""

    # kind -> (steps, their seconds)
    steps_by_kind: dict[str, tuple[int, float]] = field(default_factory=dict)
    busy_s: float = 0.0  # wall time inside Engine.step
    # the engine's work as of the last step (a copy of ``Engine.tally``): what the time
    # above was spent on, and how approximate reuse's entries fared
    workload: WorkloadTally = field(default_factory=WorkloadTally)

    def add(self, call_s: float, resolved: list[tuple[str, float]]) -> None:
        """One ``Engine.step`` call of ``call_s`` seconds that read back ``resolved``."""
        self.busy_s += call_s
        for kind, seconds in resolved:
            steps, total = self.steps_by_kind.get(kind, (0, 0.0))
            self.steps_by_kind[kind] = (steps + 1, total + seconds)
