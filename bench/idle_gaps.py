"""Where the device sat idle during a profiled call, and what the host was doing then.

From a torch profiler run with CPU and CUDA activities (``with_stack=True`` for Python
frames): the device's busy intervals (kernels, copies, sets), the gaps between them
within the call's window, and each gap's time charged to the innermost host event
running then (a sync, a plan, a launch, Python between ops), labelled by its name and
the first frame of our code on its stack. A call whose device time is small against its
wall time is host-bound; this says on what.

    report = idle_report(prof)  # after ``with profile(...) as prof: call()``
"""

from __future__ import annotations

import re
from collections import defaultdict

NO_HOST_EVENT = "(no host event: Python between profiled ops)"
OUR_CODE = ("workers/", "cluster/", "chunkstore/", "bench/")


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def idle_gaps(
    busy: list[tuple[float, float]], start: float, end: float
) -> list[tuple[float, float]]:
    """The parts of ``[start, end)`` that no busy interval covers, in order."""
    gaps = []
    cursor = start
    for b_start, b_end in merge(busy):
        if b_end <= cursor:
            continue
        if b_start >= end:
            break
        if b_start > cursor:
            gaps.append((cursor, b_start))
        cursor = max(cursor, b_end)
    if cursor < end:
        gaps.append((cursor, end))
    return gaps


def charge(
    gaps: list[tuple[float, float]], host: list[tuple[float, float, str]]
) -> dict[str, float]:
    """Time of ``gaps`` per label of the innermost ``host`` event covering it (the one
    that started last; nested profiler events start inside their parents), or
    ``NO_HOST_EVENT``. The totals add up to the gaps' total."""
    totals: dict[str, float] = defaultdict(float)
    if not gaps:
        return {}
    events = sorted(host)
    cuts = sorted({t for g in gaps for t in g} | {t for s, e, _ in events for t in (s, e)})
    active: list[tuple[float, float, str]] = []
    next_event = 0
    gap_index = 0
    for a, b in zip(cuts, cuts[1:], strict=False):
        while next_event < len(events) and events[next_event][0] <= a:
            active.append(events[next_event])
            next_event += 1
        active = [e for e in active if e[1] > a]
        while gap_index < len(gaps) and gaps[gap_index][1] <= a:
            gap_index += 1
        if gap_index == len(gaps):
            break
        g_start, g_end = gaps[gap_index]
        if not (g_start <= a and b <= g_end):
            continue  # this segment is device-busy
        inner = max(active, key=lambda e: (e[0], -e[1]), default=None)
        totals[inner[2] if inner else NO_HOST_EVENT] += b - a
    return dict(totals)


def our_frame(stack) -> str:
    """The innermost frame of ``stack`` (the profiler's, innermost first) in our
    code, from the package folder on; "" when none is."""
    for frame in stack or ():
        for package in OUR_CODE:
            at = frame.find(package)
            if at == 0 or (at > 0 and frame[at - 1] == "/"):
                return frame[at:]
    return ""


def _label(event) -> str:
    """The event's name (object addresses dropped: one label per method, not per
    object), with the innermost frame of our code that ran it."""
    name = re.sub(r" (of \S+ object )?at 0x[0-9a-f]+", "", event.name)
    frame = our_frame(getattr(event, "stack", None))
    return f"{name} @ {frame}" if frame and frame != name else name


def idle_report(prof, top: int = 15) -> str:
    """The device's idle time during ``prof``'s window (first to last event), charged
    to host events, largest first (times in ms)."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    device = [
        (e.time_range.start, e.time_range.end) for e in events if e.device_type != DeviceType.CPU
    ]
    host = [
        (e.time_range.start, e.time_range.end, _label(e))
        for e in events
        if e.device_type == DeviceType.CPU
    ]
    if not device:
        return "no device events in this profile (a CPU run): nothing to charge"
    start = min(s for s, _, _ in host) if host else min(s for s, _ in device)
    end = max(e for _, e, _ in host) if host else max(e for _, e in device)
    gaps = idle_gaps(device, start, end)
    totals = charge(gaps, host)
    idle = sum(totals.values())
    lines = [
        f"device idle {idle / 1e3:.2f} of {(end - start) / 1e3:.2f} ms "
        f"({len(gaps)} gaps), by the innermost host event running then:"
    ]
    for label, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / 1e3:7.3f} ms  {label}")
    return "\n".join(lines)
