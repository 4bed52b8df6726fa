"""What a cluster may start and how long it lives: placement is checked against the
Ray cluster's resources before any actor exists (a shortfall is an error naming it
and the config keys), and a serving cluster's workers end with its Serve app
(``serve delete``, ``serve shutdown``) and with an interrupted ``chunkserve batch``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml
from ray import serve
from ray.util.state import list_actors

from cluster.config import load_config, parse_config
from cluster.http.app import AppArgs, app_builder, build_app
from cluster.ops.actors import (
    Demand,
    check_placement,
    ensure_cluster,
    find_keeper,
    find_workers,
    kill_cluster,
    placement_problem,
    replica_demand,
    worker_demand,
    worker_ids,
)
from tests.chunkstore.testkit import free_ports, wait_until
from tests.cluster.conftest import (
    NUM_CPUS,
    REPO,
    cluster_config,
    default_sigint,
    unique_name,
    write_config,
)

GONE_TIMEOUT_S = 60  # the keeper polls every second; Serve's deletion takes its time


def worker(count: int, cpus: float, gpus: float = 0, running: int = 0) -> Demand:
    return Demand(
        "worker",
        count,
        count - running,
        {"CPU": cpus, "GPU": gpus},
        "workers.count",
        {"CPU": "workers.num_cpus", "GPU": "workers.num_gpus"},
    )


def replicas(count: int, cpus: float) -> Demand:
    return Demand(
        "router replica",
        count,
        count,
        {"CPU": cpus},
        "server.num_replicas",
        {"CPU": "server.replica_num_cpus"},
    )


RAY_NODE = {"CPU": 2.0, "memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0}


# -- placement, as a pure function -----------------------------------------------------


def test_redis_example_on_two_cpus_is_short_of_half_a_cpu():
    problem = placement_problem([worker(2, 1), replicas(2, 0.25)], [RAY_NODE], RAY_NODE)
    assert problem is not None
    assert "2.5 CPU (2 workers x 1 CPU + 2 router replicas x 0.25 CPU)" in problem
    assert "the Ray cluster has 2 CPU in all (1 node)" in problem
    for key in ("workers.count", "workers.num_cpus", "server.num_replicas"):
        assert key in problem
    assert "server.replica_num_cpus" in problem and "GPU" not in problem


def test_what_fits_is_no_problem():
    assert placement_problem([worker(2, 0.5), replicas(2, 0.25)], [RAY_NODE], RAY_NODE) is None
    assert placement_problem([worker(1, 0), replicas(1, 0)], [{"CPU": 0}], {}) is None


def test_gpus_asked_of_a_cpu_cluster():
    problem = placement_problem([worker(2, 1, gpus=1)], [RAY_NODE, RAY_NODE], None)
    assert "2 GPU (2 workers x 1 GPU) but the Ray cluster has 0 GPU in all (2 nodes)" in problem
    assert "workers.num_gpus" in problem and "CPU (" not in problem


def test_a_worker_of_more_ranks_than_a_node_has_gpus_is_refused(monkeypatch):
    """A worker's ranks take a GPU each on one node: 4 ranks do not fit two nodes of 2
    GPUs (4 GPUs in all), and the refusal names the setting."""
    from cluster.ops import actors

    monkeypatch.setattr(actors, "find_workers", lambda cfg: {"w": None})
    cfg = load_config(
        REPO / "configs" / "local.yaml",
        ["workers.count=1", "workers.num_gpus=4", "workers.tensor_parallel_size=4"],
    )
    nodes = [{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 2}]
    problem = placement_problem([actors.worker_demand(cfg)], nodes, None)
    assert "no node has room for 1 worker (each needs 1 CPU, 4 GPU on one node" in problem
    assert "workers.num_gpus with workers.tensor_parallel_size" in problem


def test_every_actor_must_fit_on_one_node():
    nodes = [{"CPU": 3, "GPU": 1}, {"CPU": 1, "GPU": 1}]
    assert placement_problem([worker(2, 1, gpus=1)], nodes, None) is None
    problem = placement_problem([worker(2, 2, gpus=1)], nodes, None)  # 4 CPU, 2 GPU in all
    assert "no node has room for 1 worker (each needs 2 CPU, 1 GPU on one node" in problem


def test_actors_not_yet_running_need_free_resources():
    free = {"CPU": 1.0}
    demands = [worker(2, 1, running=1), replicas(2, 0.25)]
    problem = placement_problem(demands, [{"CPU": 4}], free)
    assert "1.5 CPU (1 worker x 1 CPU + 2 router replicas x 0.25 CPU)" in problem
    assert "only 1 CPU are free now" in problem
    assert (
        placement_problem([worker(2, 1, running=2), replicas(2, 0.25)], [{"CPU": 4}], free) is None
    )
    assert placement_problem(demands, [{"CPU": 4}], None) is None  # autoscaled: not checked


@pytest.mark.ray
def test_custom_worker_resources_are_asked_for_and_checked(ray_cluster, tiny_qwen3):
    """``workers.resources`` goes into each worker's demand: a cluster without them is
    refused naming the key; CPU and GPU are refused there (they have keys of their own)."""
    cfg = parse_config(cluster_config(tiny_qwen3, "custom", workers={"resources": {"slot": 1}}))
    demand = worker_demand(cfg)
    assert demand.resources == {"CPU": 0.5, "GPU": 0, "slot": 1}
    problem = placement_problem([demand], [{"CPU": 4}], None)
    assert problem is not None and "workers.resources" in problem, problem
    assert placement_problem([demand], [{"CPU": 4, "slot": 1}], None) is None
    with pytest.raises(ValueError, match="workers.num_gpus"):
        parse_config(cluster_config(tiny_qwen3, "custom", workers={"resources": {"GPU": 1}}))


def test_replica_demand_is_what_the_app_asks_serve_for(tiny_qwen3):
    cfg = parse_config(
        cluster_config(tiny_qwen3, "fit", server={"num_replicas": 3, "replica_num_cpus": 0.3})
    )
    deployment = build_app(cfg)._bound_deployment
    demand = replica_demand(cfg, running=False)
    assert demand.count == deployment.num_replicas == 3
    assert demand.resources == {"CPU": deployment.ray_actor_options["num_cpus"]}


# -- on the session's Ray cluster ------------------------------------------------------


@pytest.mark.ray
def test_ensure_cluster_refuses_what_ray_cannot_place_and_starts_nothing(ray_cluster, tiny_qwen3):
    cfg = parse_config(cluster_config(tiny_qwen3, unique_name("nogpu"), workers={"num_gpus": 1}))
    with pytest.raises(ValueError, match=r"1 GPU \(1 worker x 1 GPU\) but the Ray cluster has 0"):
        ensure_cluster(cfg, tiny_qwen3, detached=True)
    assert all(handle is None for handle in find_workers(cfg).values())
    assert find_keeper(cfg) is None
    assert worker_demand(cfg).new == 1


@pytest.mark.ray
def test_placement_waits_for_nodes_that_join_then_places(ray_cluster, tiny_qwen3, tmp_path):
    """As KubeRay submits the app before its GPU pods join: with ``workers.node_wait_s``
    a worker asking for a GPU no node has is refused only after the wait, naming it,
    and placed as soon as a node with a GPU joins within it."""
    config = cluster_config(
        tiny_qwen3, unique_name("nodes"), workers={"num_gpus": 1, "node_wait_s": 1}
    )
    cfg = parse_config(config)
    with pytest.raises(ValueError, match=r"after waiting 1 s for nodes: workers.node_wait_s"):
        check_placement(cfg, lambda: [worker_demand(cfg)])
    config["workers"]["node_wait_s"] = 120
    cfg = parse_config(config)
    (agent,) = free_ports(1)
    node = subprocess.Popen(
        [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
            f"--address={ray_cluster.gcs_address}", "--num-cpus=1", "--num-gpus=1",
            f"--dashboard-agent-listen-port={agent}", "--disable-usage-stats",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    try:
        check_placement(cfg, lambda: [worker_demand(cfg)])  # returns once the node joined
        assert ray.cluster_resources().get("GPU") == 1
    finally:
        node.terminate()  # `ray start --block` stops the node it started
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
    assert wait_until(lambda: not ray.cluster_resources().get("GPU"), timeout_s=60)


@pytest.mark.ray
def test_serve_command_refuses_more_cpus_than_the_cluster_has(ray_cluster, tiny_qwen3, tmp_path):
    name = unique_name("toobig")
    per_worker = NUM_CPUS / 2 + 0.5  # 2 of them: one CPU more than the cluster has
    config = cluster_config(tiny_qwen3, name, workers={"count": 2, "num_cpus": per_worker})
    path = write_config(tmp_path, config)
    result = subprocess.run(
        [sys.executable, "-m", "cluster.ops.cli", "serve", "--config", str(path),
         "--set", f"ray.address={ray_cluster.gcs_address}"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"chunkserve serve: error: cluster {name!r} cannot be placed")
    assert f"{NUM_CPUS + 1:g} CPU (2 workers x {per_worker:g} CPU)" in error
    assert f"the Ray cluster has {NUM_CPUS:g} CPU in all" in error
    assert "workers.num_cpus" in error
    assert "serving" not in result.stdout
    assert all(handle is None for handle in find_workers(parse_config(config)).values())


@pytest.mark.ray
def test_serve_app_start_path_refuses_too(serve_port, tiny_qwen3, tmp_path):
    """As under `serve run deploy/serve.yaml`: the replica starting the workers refuses,
    so the app fails to deploy with the shortfall, instead of waiting for ever."""
    name = unique_name("appgpu")
    path = write_config(tmp_path, cluster_config(tiny_qwen3, name, workers={"num_gpus": 1}))
    app = app_builder(AppArgs(config=str(path)))
    try:
        with pytest.raises(RuntimeError, match="failed"):
            serve.run(app, name=name, route_prefix=f"/{name}")
        status = serve.status().applications[name]
        assert status.status == "DEPLOY_FAILED"
        message = status.deployments[f"{name}-router"].message
        assert "cannot be placed: it asks for 1 GPU (1 worker x 1 GPU)" in message, message
        assert all(
            handle is None for handle in find_workers(parse_config(read_config(path))).values()
        )
    finally:
        serve.delete(name)


@pytest.mark.ray
def test_serve_app_builder_refuses_replicas_no_node_can_hold(serve_port, tiny_qwen3, tmp_path):
    """Under `serve run`, replicas too large for every node are refused when the app is
    built, naming the key, instead of waiting for a node that never comes."""
    config = cluster_config(tiny_qwen3, unique_name("bigreplica"))
    config["server"]["replica_num_cpus"] = NUM_CPUS + 1
    path = write_config(tmp_path, config)
    with pytest.raises(ValueError, match="server.replica_num_cpus") as refused:
        app_builder(AppArgs(config=str(path)))
    assert "router replica" in str(refused.value), refused.value
    config["server"]["replica_num_cpus"] = 0.1
    app_builder(AppArgs(config=str(write_config(tmp_path, config))))  # fits: no refusal


@pytest.mark.ray
def test_deleting_the_app_ends_its_workers(start_app, tiny_qwen3):
    app = start_app(cluster_config(tiny_qwen3, unique_name("gone")))
    cfg = parse_config(read_config(app.config_path))
    assert find_keeper(cfg) is not None
    serve.delete(app.name)
    assert wait_until(lambda: no_actor_left(cfg), timeout_s=GONE_TIMEOUT_S), alive(cfg)


@pytest.mark.ray
def test_serve_shutdown_ends_the_workers(start_app, serve_port, tiny_qwen3):
    app = start_app(cluster_config(tiny_qwen3, unique_name("shut")))
    cfg = parse_config(read_config(app.config_path))
    try:
        serve.shutdown()
        assert wait_until(lambda: no_actor_left(cfg), timeout_s=GONE_TIMEOUT_S), alive(cfg)
    finally:  # Serve again, on the session's port, for the tests after this one
        serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
        kill_cluster(cfg)


@pytest.mark.ray
def test_ctrl_c_in_batch_exits_130_without_a_traceback(ray_cluster, tiny_qwen3, tmp_path):
    name = unique_name("batchint")
    path = write_config(tmp_path, cluster_config(tiny_qwen3, name, batch={"concurrency": 2}))
    lines = [
        {"custom_id": f"r{i}", "messages": [{"role": "user", "content": f"hi {i}"}],
         "max_tokens": 16}
        for i in range(2000)
    ]  # fmt: skip
    requests, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.ops.cli", "batch", "--config", str(path),
         "--input", str(requests), "--output", str(out),
         "--set", f"ray.address={ray_cluster.gcs_address}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        assert wait_until(lambda: out.exists() and out.read_text().count("\n") >= 1, 180, 0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert stderr.strip().splitlines()[-1].startswith("chunkserve batch: interrupted;")
    written = out.read_text().count("\n")
    assert 1 <= written < len(lines)
    prefix = f"{name}-batch-"
    assert wait_until(lambda: not alive_named(prefix), timeout_s=GONE_TIMEOUT_S), alive_named(
        prefix
    )


def read_config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def no_actor_left(cfg) -> bool:
    return not alive(cfg)


def alive(cfg) -> list[str]:
    """The cluster's named actors that still exist."""
    names = [*worker_ids(cfg), f"{cfg.name}-directory", f"{cfg.name}-keeper"]
    return [name for name in names if _exists(name, cfg.ray.namespace)]


def alive_named(prefix: str) -> list[str]:
    # this session's cluster by its address: another Ray may run on the machine
    address = ray.get_runtime_context().gcs_address
    actors = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=10_000)
    return [a.name for a in actors if (a.name or "").startswith(prefix)]


def _exists(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True
