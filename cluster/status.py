"""``chunkserve status``: the workers, the directory and the cache hit rate of a
running cluster (found by the config's cluster name)."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayError

from chunkstore.directory import DirectoryStats
from cluster.actors import directory_spec, find_workers
from cluster.config import ClusterConfig
from cluster.ray_session import connect_ray
from workers.runtime.directory_client import connect_directory
from workers.runtime.worker_types import WorkerStatus

_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    state: str  # healthy | draining | not answering | not running
    status: WorkerStatus | None


@dataclass(frozen=True)
class ClusterStatus:
    workers: list[WorkerRow]
    directory: DirectoryStats | None  # None: unreachable or not running


def cluster_status(cfg: ClusterConfig) -> ClusterStatus:
    connect_ray(cfg.ray, must_exist=True)
    rows = [_row(worker_id, handle) for worker_id, handle in find_workers(cfg).items()]
    return ClusterStatus(workers=rows, directory=_directory_stats(cfg))


def _row(worker_id: str, handle) -> WorkerRow:
    if handle is None:
        return WorkerRow(worker_id, "not running", None)
    try:
        status = ray.get(handle.status.remote(), timeout=_TIMEOUT_S)
    except (GetTimeoutError, RayError):
        return WorkerRow(worker_id, "not answering", None)
    return WorkerRow(worker_id, "draining" if status.draining else "healthy", status)


def _directory_stats(cfg: ClusterConfig) -> DirectoryStats | None:
    try:
        directory = connect_directory(directory_spec(cfg))
    except ValueError:  # the embedded host actor is not running
        return None
    try:
        stats = directory.stats()
    finally:
        directory.close()
    return stats if stats.available else None


def format_status(cfg: ClusterConfig, status: ClusterStatus) -> str:
    header = f"{'worker':<28} {'state':<14} {'epoch':>14} {'running':>8} {'served':>8} "
    header += f"{'prompt tok':>11} {'cached tok':>11} {'hit':>5} {'pages':>7}"
    lines = [f"cluster {cfg.name!r} (model {cfg.model.name!r})", header]
    prompt = cached = 0
    for row in status.workers:
        if row.status is None:
            lines.append(f"{row.worker_id:<28} {row.state:<14}")
            continue
        load = row.status.load
        prompt += load.prompt_tokens_total
        cached += load.cached_tokens_total
        lines.append(
            f"{row.worker_id:<28} {row.state:<14} {row.status.info.epoch:>14} "
            f"{load.requests:>8} {load.requests_total:>8} {load.prompt_tokens_total:>11} "
            f"{load.cached_tokens_total:>11} {_share(load.cached_tokens_total, load.prompt_tokens_total):>5} "
            f"{row.status.cached_pages:>7}"
        )
    lines.append(f"cache hit rate (cached / prompt tokens): {_share(cached, prompt)}")
    lines.append(_directory_line(cfg, status.directory))
    return "\n".join(lines)


def _directory_line(cfg: ClusterConfig, stats: DirectoryStats | None) -> str:
    kind = cfg.directory.kind
    if stats is None:
        return f"directory ({kind}): unreachable"
    line = f"directory ({kind}): {stats.live_workers} live workers, {stats.entries} chunk entries"
    if kind == "embedded":  # the host sees every lookup; a Redis client only its own
        line += f", {stats.lookups} lookups, hit rate {stats.hit_rate:.0%}"
    return line


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"
