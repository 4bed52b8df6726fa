"""``chunkserve status``: the workers, the directory and the cache hit rate of a
running cluster (found by the config's cluster name and Ray namespace).

The directory is the one the running cluster uses, as its keeper recorded it at
start (``--set``s of the server included); the config's only where no keeper runs
(a cluster started by an older chunkserve, or not running), and the report says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import ray
from ray.exceptions import GetTimeoutError, RayError

from chunkstore.directory import DirectoryStats
from chunkstore.ray_access import DirectoryKind, DirectorySpec, connect_directory
from cluster.config import ClusterConfig
from cluster.ops.actors import ClusterRecord, directory_spec, find_keeper, find_workers
from cluster.ops.ray_session import connect_ray
from workers.engine.host_tier import TierStats
from workers.runtime.worker_types import WorkerStatus

_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    state: str  # healthy | draining | not answering | not running
    status: WorkerStatus | None


@dataclass(frozen=True)
class ClusterStatus:
    ray_address: str  # the GCS address of the Ray cluster asked
    workers: list[WorkerRow]
    directory_spec: DirectorySpec  # the directory asked
    recorded: bool  # directory_spec is the running cluster's (else the config's)
    directory: DirectoryStats | None  # None: unreachable or not running


def cluster_status(cfg: ClusterConfig) -> ClusterStatus:
    """``RayUnreachable`` where no Ray cluster answers at the config's address."""
    connect_ray(cfg.ray, must_exist=True)
    record = _record(cfg)
    spec = record.directory if record is not None else directory_spec(cfg)
    return ClusterStatus(
        ray_address=ray.get_runtime_context().gcs_address,
        workers=[_row(worker_id, handle) for worker_id, handle in find_workers(cfg).items()],
        directory_spec=spec,
        recorded=record is not None,
        directory=_directory_stats(spec),
    )


def _record(cfg: ClusterConfig) -> ClusterRecord | None:
    keeper = find_keeper(cfg)
    if keeper is None:
        return None
    try:
        return ray.get(keeper.record.remote(), timeout=_TIMEOUT_S)
    except (GetTimeoutError, RayError):
        return None


def _row(worker_id: str, handle) -> WorkerRow:
    if handle is None:
        return WorkerRow(worker_id, "not running", None)
    try:
        status = ray.get(handle.status.remote(), timeout=_TIMEOUT_S)
    except (GetTimeoutError, RayError):
        return WorkerRow(worker_id, "not answering", None)
    return WorkerRow(worker_id, "draining" if status.draining else "healthy", status)


def _directory_stats(spec: DirectorySpec) -> DirectoryStats | None:
    try:
        directory = connect_directory(spec)
    except ValueError:  # the embedded host actor is not running
        return None
    try:
        stats = directory.stats()
    finally:
        directory.close()
    return stats if stats.available else None


def format_status(cfg: ClusterConfig, status: ClusterStatus) -> str:
    header = f"{'worker':<28} {'state':<14} {'up':>10} {'running':>8} {'served':>8} "
    header += f"{'prompt tok':>11} {'cached tok':>11} {'hit':>5} {'pages':>7}"
    lines = [
        f"cluster {cfg.name!r} (model {cfg.model.name!r}) on Ray at {status.ray_address}, "
        f"namespace {cfg.ray.namespace!r}",
        header,
    ]
    prompt = cached = 0
    for row in status.workers:
        if row.status is None:
            lines.append(f"{row.worker_id:<28} {row.state:<14}")
            continue
        load = row.status.load
        prompt += load.prompt_tokens_total
        cached += load.cached_tokens_total
        lines.append(
            f"{row.worker_id:<28} {row.state:<14} {_uptime(row.status.info.epoch):>10} "
            f"{load.requests:>8} {load.requests_total:>8} {load.prompt_tokens_total:>11} "
            f"{load.cached_tokens_total:>11} {_share(load.cached_tokens_total, load.prompt_tokens_total):>5} "
            f"{row.status.cached_pages:>7}"
        )
        if row.status.host_tier is not None:
            lines.append(_host_tier_line(row.status.host_tier))
    lines.append(f"cache hit rate (cached / prompt tokens): {_share(cached, prompt)}")
    lines.append(_directory_line(status))
    return "\n".join(lines)


def _host_tier_line(tier: TierStats) -> str:
    used = tier.pages + tier.entry_pages
    return (
        f"  host KV tier: {used}/{tier.slots} pages ({tier.pages} prefix, "
        f"{tier.entry_pages} in entries), {tier.hits} hits, "
        f"{tier.bytes_written / 2**30:.2f} GiB written ({tier.pages_skipped} pages skipped: "
        f"the link was busy), {tier.bytes_loaded / 2**30:.2f} GiB loaded, "
        f"{tier.load_s_per_page * 1e3:.3f} ms per page loaded"
    )


def _uptime(epoch_ms: int) -> str:
    """Time since a worker's start (its epoch is its start's Unix time in ms)."""
    seconds = max(0, int(time.time() - epoch_ms / 1000))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _directory_line(status: ClusterStatus) -> str:
    spec, stats = status.directory_spec, status.directory
    if stats is None:
        line = f"directory ({spec.kind}): unreachable"
    else:
        line = f"directory ({spec.kind}): {stats.live_workers} live workers, "
        line += f"{stats.entries} chunk entries (the routers look up in their own copies: "
        line += "their lookups are chunkserve_directory_lookups_total in /metrics)"
    whose = "the running cluster's" if status.recorded else "the config's: no keeper runs"
    return f"{line}; {_where(spec)} ({whose})"


def _where(spec: DirectorySpec) -> str:
    """Where the directory is: at redis://host:6380/0, prefix 'p' (no password), or
    the host actor's name."""
    if spec.kind is not DirectoryKind.REDIS:
        return f"in actor {spec.host_actor!r}"
    url = urlsplit(spec.redis_url)
    netloc = (url.hostname or "") + ("" if url.port is None else f":{url.port}")
    return f"at {url._replace(netloc=netloc).geturl()}, prefix {spec.redis_prefix!r}"


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"
