"""Where an engine's work goes over a workload (for benchmarks and operators): totals
since the engine started; the difference of two copies gives a window.

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
from dataclasses import dataclass


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
