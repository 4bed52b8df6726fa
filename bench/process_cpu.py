"""CPU seconds spent by each kind of process on this machine over a measured run, read
from ``/proc`` (Linux): what a request costs in Serve's HTTP proxy, the router
replicas, the worker actors and their engine processes, Ray's own daemons, Redis.

Processes are told apart by their command lines (Ray sets an actor's to
``ray::ClassName`` or ``ray::ClassName.method``). A process that starts or ends
between the two snapshots counts from zero or up to its last snapshot, so only what
lives through the run is exact; the benches take their snapshots right around it.

    before = cpu_snapshot()
    ...  # the run
    seconds = cpu_by_role(before, cpu_snapshot())  # role -> CPU seconds
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# (role, pattern on the command line), first match wins
ROLES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("serve proxy", re.compile(r"^ray::ProxyActor\b")),
    ("router replicas", re.compile(r"^ray::ServeReplica:")),
    ("bench routers", re.compile(r"^ray::RouterReplica\b")),
    ("worker actors", re.compile(r"^ray::Worker\b")),
    ("engine processes", re.compile(r"workers\.runtime\.engine_child")),
    ("serve controller", re.compile(r"^ray::ServeController\b")),
    ("other actors", re.compile(r"^ray::(?!IDLE)")),
    ("raylet", re.compile(r"/raylet\b|^raylet\b")),
    ("gcs", re.compile(r"gcs_server")),
    ("redis", re.compile(r"redis-server")),
)
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

Snapshot = dict[int, tuple[str, float]]  # pid -> (role, CPU seconds so far)


def role_of(cmdline: str) -> str | None:
    for role, pattern in ROLES:
        if pattern.search(cmdline):
            return role
    return None


def cpu_snapshot(extra: dict[int, str] | None = None) -> Snapshot:
    """Every classified process's CPU seconds (user + system) now. ``extra``: pids whose
    role is known (the bench's client processes)."""
    extra = extra or {}
    snapshot: Snapshot = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        role = extra.get(pid) or role_of(cmdline)
        if role is None:
            continue
        # fields after the command's closing parenthesis: utime and stime are 14 and 15
        fields = stat[stat.rindex(")") + 2 :].split()
        snapshot[pid] = (role, (int(fields[11]) + int(fields[12])) * _TICK_S)
    return snapshot


def cpu_by_role(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """Role -> CPU seconds spent between the snapshots, largest first."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        _, earlier = before.get(pid, (role, 0.0))
        spent[role] = spent.get(role, 0.0) + max(0.0, seconds - earlier)
    return dict(sorted(spent.items(), key=lambda item: -item[1]))


def per_request_ms(spent: dict[str, float], requests: int) -> dict[str, float]:
    """Role -> CPU milliseconds a request."""
    return {role: round(1000 * s / requests, 3) for role, s in spent.items()} if requests else {}
