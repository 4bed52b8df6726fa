"""The named Ray actors of a cluster: its workers, (embedded) directory host and keeper.

Invariants:
- Names derive from the cluster name only, so every router replica, the ``serve``
  and ``status`` commands and the app builder find the same actors; ``ensure_*``
  is get-or-create (atomic in Ray), so concurrent callers never start two.
- A worker's id equals its actor name and is stable across restarts (its epoch is
  what changes); the Redis directory needs ids unique per key prefix.
- Serving clusters are detached and live as long as their Serve app: their keeper
  removes them once the app is gone (``serve delete``, ``serve shutdown``, the end of
  ``serve run``); ``kill_cluster`` removes them at once. A batch job's are owned by
  the job's driver and die with it.
- A serving cluster's worker is never gone for good while its app lives: once Ray
  has spent its in-place restarts, the keeper creates it again (``ClusterKeeper``).
- Nothing is created that the Ray cluster cannot place: ``ensure_cluster`` first
  checks the workers' resource requests against the cluster's (``check_placement``)
  and refuses with a ``ValueError`` naming the shortfall and the config keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from chunkstore.ray_access import DirectoryHostActor, DirectoryKind, DirectorySpec
from cluster.config import ClusterConfig
from workers.engine.config import EngineConfig
from workers.runtime.actor import WorkerActor
from workers.runtime.worker_types import WorkerInfo, WorkerSpec

logger = logging.getLogger(__name__)

# An async actor runs this many method calls at once (streams included).
_WORKER_CONCURRENCY = 4096
# Ray's view of free resources lags actors that just ended: a want of them is asked
# about again for this long before it is refused.
_PLACEMENT_WAIT_S = 5.0
_PLACEMENT_POLL_S = 0.5
_NODE_WAIT_LOG_S = 30.0  # while waiting for nodes, what is missing is logged this often
_EPSILON = 1e-6  # below Ray's resource granularity (1e-4)


@dataclass(frozen=True)
class ClusterActors:
    workers: dict[str, ActorHandle]  # worker id -> handle, in index order
    directory: DirectorySpec
    # Held so that a driver-owned host lives as long as its workers (Ray kills a
    # non-detached actor once no handle to it remains).
    directory_host: ActorHandle | None


def worker_ids(cfg: ClusterConfig) -> list[str]:
    return [f"{cfg.name}-worker-{i}" for i in range(cfg.workers.count)]


def keeper_name(cfg: ClusterConfig) -> str:
    return f"{cfg.name}-keeper"


def directory_spec(cfg: ClusterConfig) -> DirectorySpec:
    section = cfg.directory
    return DirectorySpec(
        kind=DirectoryKind(section.kind),
        lease_ttl_s=section.lease_ttl_s,
        host_actor=f"{cfg.name}-directory",
        ray_namespace=cfg.ray.namespace,
        call_timeout_s=section.call_timeout_s,
        router_sync_interval_s=section.router_sync_interval_s,
        redis_url=section.redis.url,
        redis_prefix=section.redis.prefix,
        redis_timeout_s=section.redis.timeout_s,
    )


def engine_config(cfg: ClusterConfig, model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model_dir=str(model_dir),
        model_id=cfg.model.name,
        tensor_parallel_size=cfg.workers.tensor_parallel_size,
        **cfg.engine.model_dump(),
    )


# -- resources -------------------------------------------------------------------------


def worker_resources(cfg: ClusterConfig) -> dict[str, float]:
    """What one worker actor asks Ray for (Ray's resource names)."""
    return {"CPU": cfg.workers.num_cpus, "GPU": cfg.workers.num_gpus, **cfg.workers.resources}


def engine_in_process(cfg: ClusterConfig) -> bool:
    """Whether each worker's engine runs in a process of its own (``workers.engine_process``;
    unset: for GPU workers, whose step time a streaming thread's GIL would take)."""
    if cfg.workers.engine_process is not None:
        return cfg.workers.engine_process
    return cfg.workers.num_gpus > 0


def replica_resources(cfg: ClusterConfig) -> dict[str, float]:
    """What one router replica asks Ray for (``cluster.http.app.build_app``'s options)."""
    return {"CPU": cfg.server.replica_num_cpus}


@dataclass(frozen=True)
class Demand:
    """Actors of one kind that a config asks Ray to place."""

    what: str  # "worker", "router replica"
    count: int  # all of them
    new: int  # of those, not running yet (they need free resources)
    resources: Mapping[str, float]  # one actor's request, by Ray resource name
    count_key: str  # the config key that sets ``count``
    resource_keys: Mapping[str, str]  # Ray resource name -> the config key that sets it


def worker_demand(cfg: ClusterConfig) -> Demand:
    running = sum(handle is not None for handle in find_workers(cfg).values())
    return Demand(
        "worker",
        cfg.workers.count,
        cfg.workers.count - running,
        worker_resources(cfg),
        "workers.count",
        {
            "CPU": "workers.num_cpus",
            # a worker of several ranks takes a GPU a rank, all on one node
            "GPU": "workers.num_gpus"
            + (
                " with workers.tensor_parallel_size" if cfg.workers.tensor_parallel_size > 1 else ""
            ),
            **{name: "workers.resources" for name in cfg.workers.resources},
        },
    )


def replica_demand(cfg: ClusterConfig, *, running: bool) -> Demand:
    """``running``: the app's replicas exist already (a redeploy keeps them)."""
    count = cfg.router_replicas
    return Demand(
        "router replica",
        count,
        0 if running else count,
        replica_resources(cfg),
        "server.num_replicas",
        {"CPU": "server.replica_num_cpus"},
    )


def placement_problem(
    demands: Sequence[Demand],
    nodes: Sequence[Mapping[str, float]],
    free: Mapping[str, float] | None,
) -> str | None:
    """Why ``demands`` cannot be placed, or None if they can.

    ``nodes``: each node's total resources; every actor must fit on one node, all
    of them together (first fit, largest first). ``free``: resources free now in
    the whole cluster, which the actors not yet running must fit in (None: not
    checked, as where an autoscaler adds nodes). A request of 0 fits anywhere.
    """
    totals = _sum(nodes)
    short = _short(demands, totals, new=False)
    if short:
        where = f"the Ray cluster has {{}} in all ({_count(len(nodes), 'node')})"
        return _explain(demands, short, totals, where, new=False)
    unplaced = _pack(demands, nodes)
    if unplaced:
        actor = unplaced[0]  # the largest request left over
        left = sum(d.what == actor.what for d in unplaced)
        return (
            f"no node has room for {_count(left, actor.what)} (each needs "
            f"{_amounts(actor.resources)} on one node; the nodes have "
            f"{'; '.join(_amounts(node) for node in nodes)}). Change "
            f"{_keys([actor], actor.resources)}, or add larger nodes (see `ray status`)"
        )
    if free is not None:
        short = _short(demands, free, new=True)
        if short:
            where = "only {} are free now (other actors hold the rest: see `ray status`)"
            return _explain(demands, short, free, where, new=True)
    return None


def check_placement(cfg: ClusterConfig, demands: Callable[[], Sequence[Demand]]) -> None:
    """Refuse (``ValueError``) unless the connected Ray cluster can place ``demands()``.

    What the cluster's nodes can never hold is refused once ``workers.node_wait_s``
    passed without a node joining that changes it (at once by default), logging what
    it waits for meanwhile; a want of free resources only after it lasted
    ``_PLACEMENT_WAIT_S`` (Ray's view of them lags actors that just ended). A cluster
    with an autoscaler is checked against the most it can grow to, and its free
    resources are not checked.
    """
    started = time.monotonic()
    deadline = started + _PLACEMENT_WAIT_S
    nodes_deadline = started + cfg.workers.node_wait_s
    next_log = started
    while True:
        ceiling = _autoscaler_ceiling()
        nodes = [ceiling] if ceiling is not None else _alive_nodes()
        wanted = demands()
        problem = placement_problem(wanted, nodes, None)
        now = time.monotonic()
        if problem is not None and now < nodes_deadline:
            if now >= next_log:
                logger.warning(
                    "cluster %r waits up to %.0f s more for Ray nodes (workers.node_wait_s): %s",
                    cfg.name, nodes_deadline - now, problem,
                )  # fmt: skip
                next_log = now + _NODE_WAIT_LOG_S
            time.sleep(_PLACEMENT_POLL_S)
            continue
        if problem is not None and cfg.workers.node_wait_s > 0:
            problem += (
                f" (after waiting {cfg.workers.node_wait_s:g} s for nodes: workers.node_wait_s)"
            )
        if problem is None and ceiling is None:
            problem = placement_problem(wanted, nodes, ray.available_resources())
            if problem is not None and time.monotonic() < deadline:
                time.sleep(_PLACEMENT_POLL_S)
                continue
        if problem is None:
            return
        raise ValueError(f"cluster {cfg.name!r} cannot be placed: {problem}")


def _alive_nodes() -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


def _autoscaler_ceiling() -> dict[str, float] | None:
    """The most resources an autoscaling cluster can grow to (None: no autoscaler).

    The private accessor Ray Train and Ray Data use for the same question; Ray
    releases without it count as clusters of fixed size."""
    from ray._private import state

    accessor = getattr(state.state, "get_max_resources_from_cluster_config", None)
    return None if accessor is None else accessor()


def _sum(pools: Sequence[Mapping[str, float]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pool in pools:
        for name, amount in pool.items():
            totals[name] = totals.get(name, 0.0) + amount
    return totals


def _short(demands: Sequence[Demand], have: Mapping[str, float], *, new: bool) -> dict[str, float]:
    """Resource -> amount asked, where more is asked than ``have``."""
    asked = _sum([{k: v * _n(d, new) for k, v in d.resources.items()} for d in demands])
    return {k: v for k, v in asked.items() if v > have.get(k, 0.0) + _EPSILON}


def _pack(demands: Sequence[Demand], nodes: Sequence[Mapping[str, float]]) -> list[Demand]:
    """The actors that find no node with room (first fit, largest request first)."""
    room = [dict(node) for node in nodes]
    actors = [d for d in demands for _ in range(d.count)]
    actors.sort(key=lambda d: (d.resources.get("GPU", 0), sum(d.resources.values())), reverse=True)
    unplaced = []
    for actor in actors:
        need = {k: v for k, v in actor.resources.items() if v > 0}
        node = next((n for n in room if all(n.get(k, 0) + _EPSILON >= need[k] for k in need)), None)
        if node is None:
            unplaced.append(actor)
            continue
        for k, v in need.items():
            node[k] -= v
    return unplaced


def _explain(
    demands: Sequence[Demand],
    short: Mapping[str, float],
    have: Mapping[str, float],
    where: str,
    *,
    new: bool,
) -> str:
    """The shortfall in words: it asks for 2.5 CPU (2 workers x 1 CPU + ...) but
    <where>. Change <keys> ...; ``where`` has a {} for the amount there is."""
    parts = []
    for name, amount in sorted(short.items()):
        terms = " + ".join(
            f"{_count(_n(d, new), d.what)} x {d.resources[name]:g} {name}"
            for d in demands
            if d.resources.get(name, 0) > 0 and _n(d, new)
        )
        parts.append(
            f"{amount:g} {name} ({terms}) but " + where.format(f"{have.get(name, 0):g} {name}")
        )
    asking = [d for d in demands if _n(d, new) and any(d.resources.get(k, 0) > 0 for k in short)]
    lead = "the actors it has yet to start ask for " if new else "it asks for "
    return (
        f"{lead}{'; '.join(parts)}. Change {_keys(asking, short)} (e.g. with --set), "
        "or use a larger Ray cluster (ray.address)"
    )


def _n(demand: Demand, new: bool) -> int:
    return demand.new if new else demand.count


def _keys(demands: Sequence[Demand], resources: Mapping[str, float]) -> str:
    keys = [d.count_key for d in demands]
    keys += [d.resource_keys[k] for d in demands for k in resources if k in d.resource_keys]
    keys = list(dict.fromkeys(keys))
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " or " + keys[-1]


def _amounts(resources: Mapping[str, float]) -> str:
    """What a request or node has ("4 CPU, 1 GPU"), without Ray's bookkeeping resources."""
    shown = sorted(
        (k, v)
        for k, v in resources.items()
        if v > 0 and k not in ("memory", "object_store_memory") and ":" not in k
    )
    return ", ".join(f"{v:g} {k}" for k, v in shown) or "nothing"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


# -- creating and removing ------------------------------------------------------------


def ensure_cluster(cfg: ClusterConfig, model_dir: Path, *, detached: bool) -> ClusterActors:
    """Get or create the cluster's directory host (embedded), workers and (detached)
    keeper; ``ValueError`` if the Ray cluster cannot place the workers."""
    check_placement(cfg, lambda: [worker_demand(cfg)])
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
    placement = worker_placement(cfg, detached=detached)
    specs = worker_specs(cfg, model_dir)
    workers = {worker_id: start_worker(s, placement) for worker_id, s in specs.items()}
    if detached:
        _ensure_keeper(cfg, spec, specs, placement)
    return ClusterActors(workers=workers, directory=spec, directory_host=host)


@dataclass(frozen=True)
class WorkerPlacement:
    """How Ray starts a worker actor: the same for every worker of a cluster, and for
    the keeper's recreation of one."""

    namespace: str
    detached: bool
    num_cpus: float
    num_gpus: float
    max_restarts: int  # in-place restarts by Ray before the keeper takes over
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources (workers.resources)


def worker_placement(cfg: ClusterConfig, *, detached: bool) -> WorkerPlacement:
    resources = worker_resources(cfg)
    return WorkerPlacement(
        namespace=cfg.ray.namespace,
        detached=detached,
        num_cpus=resources["CPU"],
        num_gpus=resources["GPU"],
        max_restarts=cfg.workers.max_restarts,
        resources=tuple(sorted(cfg.workers.resources.items())),
    )


def worker_specs(cfg: ClusterConfig, model_dir: Path) -> dict[str, WorkerSpec]:
    engine = engine_config(cfg, model_dir)
    return {
        worker_id: WorkerSpec(
            worker_id=worker_id,
            engine=engine,
            directory=directory_spec(cfg),
            publish_interval_s=cfg.workers.publish_interval_s,
            cpu_threads=cfg.workers.cpu_threads,
            engine_process=engine_in_process(cfg),
        )
        for worker_id in worker_ids(cfg)
    }


def start_worker(spec: WorkerSpec, placement: WorkerPlacement) -> ActorHandle:
    """Get or create the worker actor named ``spec.worker_id``."""
    return WorkerActor.options(
        name=spec.worker_id,
        namespace=placement.namespace,
        lifetime="detached" if placement.detached else None,
        get_if_exists=True,
        num_cpus=placement.num_cpus,
        num_gpus=placement.num_gpus,
        resources=dict(placement.resources),
        max_restarts=placement.max_restarts,
        max_task_retries=0,  # the router decides what may be retried
        max_concurrency=_WORKER_CONCURRENCY,
    ).remote(spec)


def find_workers(cfg: ClusterConfig) -> dict[str, ActorHandle | None]:
    """The cluster's worker actors by id (None where none runs)."""
    return {worker_id: find_actor(worker_id, cfg.ray.namespace) for worker_id in worker_ids(cfg)}


def find_keeper(cfg: ClusterConfig) -> ActorHandle | None:
    return find_actor(keeper_name(cfg), cfg.ray.namespace)


def kill_cluster(cfg: ClusterConfig) -> None:
    """Kill the cluster's named actors for good (no restart), its keeper first."""
    names = [keeper_name(cfg), *worker_ids(cfg), directory_spec(cfg).host_actor]
    _kill(names, cfg.ray.namespace)


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


def find_actor(name: str, namespace: str) -> ActorHandle | None:
    """The live (or restarting) actor of that name, None if none answers to it (also
    once Ray gave up restarting it: the name is free again). Blocks on the GCS."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _kill(names: Sequence[str], namespace: str) -> None:
    for name in names:
        handle = find_actor(name, namespace)
        if handle is not None:
            ray.kill(handle, no_restart=True)


# -- the keeper -------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterRecord:
    """What a serving cluster was started with (``chunkserve status`` reads it)."""

    app_name: str  # the Serve app whose lifetime the cluster shares
    directory: DirectorySpec


@dataclass(frozen=True)
class Recovery:
    """What a keeper does about a worker that Ray gave up restarting (its in-place
    restarts, ``workers.max_restarts``, are spent): it creates the actor again, the
    attempts spaced by a backoff, for as long as the app lives."""

    worker_id: str
    attempts: int  # creations tried so far
    last_attempt_at: float  # Unix seconds
    next_attempt_at: float  # Unix seconds; the next creation if it is gone again
    last_error: str | None  # why the last creation failed (None: it was created)

    def describe(self, now: float) -> str:
        wait = max(0.0, self.next_attempt_at - now)
        failed = f"; the last attempt failed: {self.last_error}" if self.last_error else ""
        return (
            f"Ray gave up restarting it; the keeper creates it again (attempt "
            f"{self.attempts}, the next one in {wait:.0f} s if it is still gone{failed})"
        )


# The keeper's backoff between creations of a worker: doubling from the first to the
# most; a worker that stayed up this long since its creation starts over at the first.
RECREATE_FIRST_S = 1.0
RECREATE_MOST_S = 60.0
RECREATED_STABLE_S = 120.0


class ClusterKeeper:
    """A serving cluster's record, its workers' last resort, and the end of its actors
    once its app is gone.

    Invariants:
    - After the keeper has seen its Serve app, the cluster's actors live as long as
      the app does: when Serve has had no such app for ``gone_polls`` polls in a row,
      the keeper kills the actors named in ``actor_names`` and then itself. Before it
      has seen the app (while ``chunkserve serve`` loads the workers) it kills nothing.
    - While the app lives, no worker is gone for good: Ray restarts a crashed worker in
      place (``workers.max_restarts`` times); once Ray gives up (no actor answers to its
      name), the keeper creates it again from its ``WorkerSpec``, the attempts spaced
      by a doubling backoff (``RECREATE_FIRST_S`` to ``RECREATE_MOST_S``), for ever.
      ``recovery()`` says what it is doing, for ``/health``.
    """

    def __init__(
        self,
        record: ClusterRecord,
        actor_names: list[str],
        namespace: str,
        workers: Mapping[str, WorkerSpec] | None = None,
        placement: WorkerPlacement | None = None,
        poll_interval_s: float = 1.0,
        gone_polls: int = 5,
    ) -> None:
        self._record = record
        self._names = actor_names
        self._namespace = namespace
        self._workers = dict(workers or {})
        self._placement = placement
        self._interval_s = poll_interval_s
        self._gone_polls = gone_polls
        self._recovering: dict[str, Recovery] = {}
        threading.Thread(target=self._watch, name="keeper", daemon=True).start()

    def record(self) -> ClusterRecord:
        return self._record

    def recovery(self) -> dict[str, Recovery]:
        """Workers the keeper has created again and that have not stayed up
        ``RECREATED_STABLE_S`` since, by id."""
        return dict(self._recovering)

    def _watch(self) -> None:
        seen, missing = False, 0
        while True:
            time.sleep(self._interval_s)
            try:
                present = _app_present(self._record.app_name)
                if present and self._placement is not None:
                    self._recover(time.time())
            except Exception:  # a watchdog that stops watching leaks the workers
                logger.exception("keeper of app %r: a poll failed", self._record.app_name)
                continue
            seen = seen or present
            missing = 0 if present else missing + 1
            if seen and missing >= self._gone_polls:
                break
        logger.warning(
            "Serve app %r is gone: removing its actors %s", self._record.app_name, self._names
        )
        _kill(self._names, self._namespace)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _recover(self, now: float) -> None:
        """Create again each worker no actor answers for, when its backoff allows."""
        for worker_id, spec in self._workers.items():
            state = self._recovering.get(worker_id)
            if find_actor(worker_id, self._namespace) is not None:  # up, or Ray restarts it
                if state is not None and now - state.last_attempt_at >= RECREATED_STABLE_S:
                    logger.info("worker %s stayed up since it was created again", worker_id)
                    del self._recovering[worker_id]
                continue
            if state is not None and now < state.next_attempt_at:
                continue
            attempts = 1 if state is None else state.attempts + 1
            logger.warning(
                "worker %s is gone for good (Ray gave up restarting it): creating it "
                "again (attempt %d)",
                worker_id,
                attempts,
            )
            try:
                start_worker(spec, self._placement)
                error = None
            except Exception as failure:  # noqa: BLE001 - said in /health, tried again
                error = repr(failure)
                logger.exception("creating worker %s again failed", worker_id)
            delay = min(RECREATE_MOST_S, RECREATE_FIRST_S * 2 ** (attempts - 1))
            self._recovering[worker_id] = Recovery(worker_id, attempts, now, now + delay, error)


KeeperActor = ray.remote(enable_task_events=False)(ClusterKeeper)  # as WorkerActor


def _app_present(app_name: str) -> bool:
    """Whether Serve runs ``app_name`` now (False while Serve is not running)."""
    from ray import serve
    from ray.serve import context
    from ray.serve.exceptions import RayServeException

    try:
        return app_name in serve.status().applications
    except (RayError, RayServeException):
        # The controller this process knew has ended (``serve shutdown``): forget it,
        # so that the next poll finds a new one or none.
        context._set_global_client(None)
        return False


def _ensure_keeper(
    cfg: ClusterConfig,
    spec: DirectorySpec,
    workers: Mapping[str, WorkerSpec],
    placement: WorkerPlacement,
) -> None:
    names = [*worker_ids(cfg), spec.host_actor]
    record = ClusterRecord(app_name=_serve_app_name(cfg), directory=spec)
    KeeperActor.options(
        name=keeper_name(cfg),
        namespace=cfg.ray.namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
    ).remote(record, names, cfg.ray.namespace, dict(workers), placement)


def _serve_app_name(cfg: ClusterConfig) -> str:
    """The app of the replica calling, else the config's name (as ``chunkserve serve``
    names its app)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().app_name
    except RayServeException:
        return cfg.name
