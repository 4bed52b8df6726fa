"""The named Ray actors of a cluster: its workers and (embedded) directory host.

Invariants:
- Names derive from the cluster name only, so every router replica, the ``serve``
  and ``status`` commands and the app builder find the same actors; ``ensure_*``
  is get-or-create (atomic in Ray), so concurrent callers never start two.
- A worker's id equals its actor name and is stable across restarts (its epoch is
  what changes); the Redis directory needs ids unique per key prefix.
- Serving clusters are detached (they outlive whichever process created them and are
  removed by ``kill_cluster``); a batch job's are owned by the job's driver and die
  with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from cluster.config import ClusterConfig
from workers.engine.config import EngineConfig
from workers.runtime.actor import WorkerActor
from workers.runtime.directory_client import DirectoryHostActor, DirectoryKind, DirectorySpec
from workers.runtime.worker_types import WorkerInfo, WorkerSpec

# An async actor runs this many method calls at once (streams included).
_WORKER_CONCURRENCY = 4096


@dataclass(frozen=True)
class ClusterActors:
    workers: dict[str, ActorHandle]  # worker id -> handle, in index order
    directory: DirectorySpec
    # Held so that a driver-owned host lives as long as its workers (Ray kills a
    # non-detached actor once no handle to it remains).
    directory_host: ActorHandle | None


def worker_ids(cfg: ClusterConfig) -> list[str]:
    return [f"{cfg.name}-worker-{i}" for i in range(cfg.workers.count)]


def directory_spec(cfg: ClusterConfig) -> DirectorySpec:
    section = cfg.directory
    return DirectorySpec(
        kind=DirectoryKind(section.kind),
        lease_ttl_s=section.lease_ttl_s,
        host_actor=f"{cfg.name}-directory",
        ray_namespace=cfg.ray.namespace,
        call_timeout_s=section.call_timeout_s,
        redis_url=section.redis.url,
        redis_prefix=section.redis.prefix,
        redis_timeout_s=section.redis.timeout_s,
    )


def engine_config(cfg: ClusterConfig, model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir),
        model_id=cfg.model.name,
        **cfg.engine.model_dump(),
    )


def ensure_cluster(cfg: ClusterConfig, model_dir: Path, *, detached: bool) -> ClusterActors:
    """Get or create the cluster's directory host (embedded) and workers."""
    spec = directory_spec(cfg)
    lifetime = "detached" if detached else None
    host = None
    if spec.kind is DirectoryKind.EMBEDDED:
        host = DirectoryHostActor.options(
            name=spec.host_actor,
            namespace=spec.ray_namespace,
            lifetime=lifetime,
            get_if_exists=True,
            num_cpus=0,
            max_restarts=-1,  # a restarted host is empty; publishers re-sync with snapshots
        ).remote(cfg.directory.lease_ttl_s)
    engine = engine_config(cfg, model_dir)
    workers = {}
    for worker_id in worker_ids(cfg):
        worker_spec = WorkerSpec(
            worker_id=worker_id,
            engine=engine,
            directory=spec,
            publish_interval_s=cfg.workers.publish_interval_s,
            cpu_threads=cfg.workers.cpu_threads,
        )
        workers[worker_id] = WorkerActor.options(
            name=worker_id,
            namespace=spec.ray_namespace,
            lifetime=lifetime,
            get_if_exists=True,
            num_cpus=cfg.workers.num_cpus,
            num_gpus=cfg.workers.num_gpus,
            max_restarts=cfg.workers.max_restarts,
            max_task_retries=0,  # the router decides what may be retried
            max_concurrency=_WORKER_CONCURRENCY,
        ).remote(worker_spec)
    return ClusterActors(workers=workers, directory=spec, directory_host=host)


def find_workers(cfg: ClusterConfig) -> dict[str, ActorHandle | None]:
    """The cluster's worker actors by id (None where none runs)."""
    return {worker_id: _find(worker_id, cfg.ray.namespace) for worker_id in worker_ids(cfg)}


def kill_cluster(cfg: ClusterConfig) -> None:
    """Kill the cluster's named actors for good (no restart)."""
    names = [*worker_ids(cfg), directory_spec(cfg).host_actor]
    for name in names:
        handle = _find(name, cfg.ray.namespace)
        if handle is not None:
            ray.kill(handle, no_restart=True)


def wait_ready(actors: ClusterActors, timeout_s: float) -> list[WorkerInfo]:
    """Block until every worker loaded its model (for drivers, never async code)."""
    refs = [handle.info.remote() for handle in actors.workers.values()]
    deadline = time.monotonic() + timeout_s
    try:
        return ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
    except GetTimeoutError:
        raise ValueError(
            f"workers did not start within {timeout_s:.0f} s; check `ray status` for "
            "free CPUs/GPUs and the worker logs"
        ) from None
    except RayActorError as error:
        raise ValueError(f"a worker failed to start: {error}") from None


def _find(name: str, namespace: str) -> ActorHandle | None:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
