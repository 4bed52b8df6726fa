"""Wall time of named host functions during a call, without a profiler: each target
is wrapped for the duration (``perf_counter`` around it, about 1 us a call), so the
times are the ones the call really spends, unlike under the torch profiler (whose
CUDA tracing slows launches and graph replays several-fold) or cProfile.

    with HostPhases(TARGETS) as phases:
        call()
    print(phases.report(calls=1))

Phases nest: an outer phase's time includes its inner ones'.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections import defaultdict


class HostPhases:
    def __init__(self, targets: list[str]) -> None:
        """``targets``: ``"package.module:Class.method"`` or ``"package.module:function"``
        (a module-level function is patched in that module: callers that imported it by
        name elsewhere keep the original, so name it where it is called). Targets in
        modules that do not import here are left out."""
        self.targets = targets
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []

    def __enter__(self) -> HostPhases:
        try:
            for target in self.targets:
                self._patch(target)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _patch(self, target: str) -> None:
        module_name, _, path = target.partition(":")
        try:
            owner = importlib.import_module(module_name)
        except ImportError:  # e.g. the FlashInfer path on a machine without it
            return
        *parents, attr = path.split(".")
        for name in parents:
            owner = getattr(owner, name)
        if isinstance(owner, type) and attr not in owner.__dict__:
            raise ValueError(f"{target}: patch the class that defines {attr}, not a subclass")
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        self._undo.append((owner, attr, original))
        setattr(owner, attr, self._timed(target, original))

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()

    def _timed(self, name: str, original):
        wrapped = (
            original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        )

        @functools.wraps(wrapped)
        def timed(*args, **kwargs):
            start = self._begin(name)
            try:
                return wrapped(*args, **kwargs)
            finally:
                self._end(name, start)

        if isinstance(original, staticmethod):
            return staticmethod(timed)
        if isinstance(original, classmethod):
            return classmethod(timed)
        return timed

    def _begin(self, name: str) -> float:
        """At a target call's start; what it returns goes to ``_end``."""
        return time.perf_counter()

    def _end(self, name: str, start: float) -> None:
        self.seconds[name] += time.perf_counter() - start
        self.calls[name] += 1

    def report(self, calls: int) -> str:
        """Mean microseconds per ``calls`` (e.g. requests) of every phase that ran, in
        the order the targets were given."""
        lines = [f"{'phase':<48} {'us per call':>12} {'times':>6}"]
        for target in self.targets:
            if self.calls.get(target):
                lines.append(
                    f"{_label(target):<48} {1e6 * self.seconds[target] / calls:>12.1f} "
                    f"{self.calls[target] / calls:>6.1f}"
                )
        return "\n".join(lines)


class Timeline(HostPhases):
    """Where the device stood at each phase's start and end: at both edges of every
    target call it notes the host's clock and records a CUDA event, so after the call
    each edge has a host time and the time the device reached that point of its
    stream. Where the device reached an edge about when the host got there, the
    device had run out of work before it (the host was the critical path); where it
    reached it later, it was still busy with earlier work. An event record costs a few
    microseconds of host time, so the phases themselves take a little longer."""

    def __init__(self, targets: list[str]) -> None:
        super().__init__(targets)
        self.edges: list[tuple[str, str, float, object]] = []

    def _begin(self, name: str) -> None:
        self._note(name, "start")

    def _end(self, name: str, start: None) -> None:
        self._note(name, "end")

    def _note(self, name: str, edge: str) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.edges.append((name, edge, time.perf_counter(), event))

    def wrap(self, owner: object, attr: str, label: str) -> None:
        """Also note the edges of ``owner.attr``, a callable attribute of an object
        (e.g. a closure a graph keeps), as ``label`` ("module:name"); undone on exit."""
        original = getattr(owner, attr)
        self._undo.append((owner, attr, original))
        setattr(owner, attr, self._timed(label, original))

    def report(self, calls: int = 1) -> str:
        """The edges noted (clear them before the call to show), in order: host and
        device milliseconds since the first edge, and how far the device was behind."""
        import torch

        torch.cuda.synchronize()
        if not self.edges:
            return "(no edges)"
        _, _, host0, event0 = self.edges[0]
        lines = [f"{'edge':<56} {'host ms':>8} {'device ms':>10} {'behind':>7}"]
        for name, edge, host, event in self.edges:
            device = event0.elapsed_time(event)
            at = 1e3 * (host - host0)
            lines.append(
                f"{_label(name) + ' ' + edge:<56} {at:>8.3f} {device:>10.3f} {device - at:>7.3f}"
            )
        return "\n".join(lines)


def _label(target: str) -> str:
    """``Class.method``, or ``module:function`` (one function may be patched in
    several modules that imported it)."""
    module, _, path = target.partition(":")
    return path if "." in path else f"{module.rsplit('.', 1)[-1]}:{path}"


# What an engine step does on the host, outermost first (for ``HostPhases``).
ENGINE_STEP = [
    "workers.llm:LLM.generate_tokens",
    "workers.engine.engine:Engine.add_request",
    "workers.engine.engine:Engine._validate",
    "workers.engine.engine:Engine.step",
    "workers.engine.scheduler:Scheduler.schedule",
    "workers.engine.approximate.chunk_reuse:ChunkReuse.admit",
    "workers.engine.reuse:ExactPrefixReuse.admit",
    "workers.engine.kv_pool:KVPool.match_chain",
    "workers.engine.kv_pool:KVPool.acquire",
    "workers.engine.scheduler:Scheduler._allocate",
    "workers.engine.engine:Engine._launch",
    "workers.engine.model_runner:ModelRunner.run",
    "workers.engine.model_runner:build_inputs",
    "workers.engine.kv_pool:KVPool.allocate",
    "workers.engine.kv_ops:place_spans",
    "workers.engine.approximate.placement:place_chunk",  # place_spans' copy to the device and launch
    "workers.engine.layers.placement_kernel:place_rows",
    "workers.engine.approximate.chunk_reuse:ChunkReuse.flush",  # a step's admissions' forward
    "workers.engine.model_runner:ModelRunner.repair_selecting_batch",
    "workers.engine.model_runner:ModelRunner._repair_one",
    "workers.engine.graphs.selection:SelectionGraphs.start",
    "workers.engine.graphs.selection:stage_selection",
    "workers.engine.graphs.selection:plan_prefill",  # at a bucket's capture
    "workers.engine.graphs.selection:SelectionGraphs.finish",
    "flashinfer.prefill:BatchPrefillWithPagedKVCacheWrapper.plan",  # FlashInfer's own part
    "workers.engine.graphs.kept:KeptRowsGraphs.run",
    "workers.engine.graphs.step:FlashInferGraphs.replay",
    "workers.engine.attention.flashinfer_backend:FlashInferBackend.plan",
    "workers.engine.attention.flashinfer_backend:plan_prefill",  # eager steps
    "workers.engine.graphs.prefill:plan_prefill",  # (imported by name there)
    "workers.engine.graphs.prefill:PrefillGraphs.run",
    "workers.engine.graphs.decode:DecodeGraphs.run",
    "torch.cuda.graphs:CUDAGraph.replay",
    "workers.engine.engine:sample_on_device",
    "workers.engine.engine:Engine._resolve",
    "torch.cuda:Event.synchronize",
    "workers.engine.approximate.chunk_reuse:ChunkReuse.publish",
    "workers.engine.request:Sequence.extend_page_keys",
    "workers.engine.engine:Engine._emit_token",
    "workers.engine.scheduler:Scheduler.finish",
    "workers.engine.kv_pool:KVPool.release",
]

# The edges ``Timeline`` notes for one approximate admission (bench/approx_profile.py).
ADMISSION_TIMELINE = [
    "workers.engine.engine:Engine.step",
    "workers.engine.approximate.chunk_reuse:ChunkReuse.admit",
    "workers.engine.approximate.chunk_reuse:ChunkReuse.flush",
    "workers.engine.model_runner:ModelRunner.repair_selecting_batch",
    "workers.engine.model_runner:ModelRunner._repair_one",
    "workers.engine.model_runner:build_inputs",
    "workers.engine.graphs.selection:SelectionGraphs.start",
    "workers.engine.graphs.selection:stage_selection",
    "workers.engine.kv_ops:place_spans",
    "workers.engine.graphs.selection:SelectionGraphs.finish",
    "torch.cuda.graphs:CUDAGraph.replay",
    "workers.engine.graphs.kept:KeptRowsGraphs.run",
    "workers.engine.engine:sample_on_device",
    "workers.engine.engine:Engine._resolve",
    "workers.engine.engine:Engine._emit_token",
]
