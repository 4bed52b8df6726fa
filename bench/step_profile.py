"""Wall-clock split of engine steps (schedule, model, sampling, bookkeeping), for
benchmarks: wraps the engine's parts, adds a synchronize after the model run."""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class StepProfile:
    def __init__(self, engine) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "run", "model (GPU, synced)", sync=True)
        self._wrap(engine, "_publish_pages", "publish pages")
        self._wrap(engine, "_append_token", "append/detokenize")
        self._wrap(engine, "step", "step total", count=True)

    def _wrap(self, obj, name: str, label: str, sync: bool = False, count: bool = False):
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            if sync:
                torch.cuda.synchronize()
            self.totals[label] += time.perf_counter() - start
            if count:
                self.steps += 1
            return result

        setattr(obj, name, timed)

    def print(self) -> None:
        total = self.totals["step total"] or 1e-9
        print(f"\nstep profile over {self.steps} steps (ms per step, share of step time):")
        for label, seconds in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            per = 1000 * seconds / max(self.steps, 1)
            print(f"  {label:24s} {per:8.3f} ms  {seconds / total:6.1%}")
