"""Wall-clock split of engine steps, for benchmarks: wraps the engine's parts without
adding any synchronization (overlapped steps keep overlapping). "launch" is the
host's time to build a step and queue it; "read back" includes waiting for the
device, so with overlap it is the time the host had nothing left to do. Steps are
also tallied by how the model ran them (``Engine.last_resolved_steps``: a CUDA graph
or eagerly, and which attention plan), with their time on the device."""

from __future__ import annotations

import time
from collections import defaultdict


class StepProfile:
    def __init__(self, engine) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.engine = engine
        self.kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # count, s
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_launch", "launch (inputs, model, sampling queued)")
        self._wrap(engine, "_resolve", "read back (waits for the device)")
        self._wrap(engine, "_emit_token", "finish checks, detokenize")
        self._wrap(engine, "step", "step total", count=True)

    def _wrap(self, obj, name: str, label: str, count: bool = False):
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = original(*args, **kwargs)
            self.totals[label] += time.perf_counter() - start
            if count:
                self.steps += 1
                for kind, seconds in self.engine.last_resolved_steps:
                    self.kinds[kind][0] += 1
                    self.kinds[kind][1] += seconds
            return result

        setattr(obj, name, timed)

    def print(self) -> None:
        total = self.totals["step total"] or 1e-9
        print(f"\nstep profile over {self.steps} steps (ms per step, share of step time):")
        for label, seconds in sorted(self.totals.items(), key=lambda kv: -kv[1]):
            per = 1000 * seconds / max(self.steps, 1)
            print(f"  {label:42s} {per:8.3f} ms  {seconds / total:6.1%}")
        device = sum(seconds for _, seconds in self.kinds.values()) or 1e-9
        print("steps by how the model ran them (count, device ms each, share of device time):")
        for kind, (n, seconds) in sorted(self.kinds.items(), key=lambda kv: -kv[1][1]):
            print(f"  {kind:42s} {n:6d} {1000 * seconds / n:8.3f} ms  {seconds / device:6.1%}")
