"""Several Ray nodes on one host: the session's head (routers, Serve) and worker nodes
joined with ``ray start --address``, each carrying one slot of a custom resource that
the workers ask for (``workers.resources``), so each worker runs on a node of its own.
Requests are served; a worker node removed mid-load loses no request (the router
retries the lost worker's requests on the other), ``/health`` says the service runs
degraded, and the worker comes back once a node with room joins. An app deployed
before any node can hold its workers becomes healthy once they join."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from ray import serve
from ray.util.state import list_actors

from cluster.http.app import AppArgs, app_builder
from tests.chunkstore.testkit import free_port, free_ports, wait_until
from tests.cluster.conftest import (
    ServedApp,
    cluster_config,
    stop_app,
    unique_name,
    wait_healthy,
    write_config,
)

pytestmark = [pytest.mark.ray, pytest.mark.redis]

SLOT = "chunkserve_test_worker_slot"  # one a worker node: one worker each


class Node:
    """A Ray worker node of this host, joined to the session's cluster."""

    def __init__(self, gcs_address: str, slot: str = SLOT) -> None:
        (agent,) = free_ports(1)
        tag = uuid.uuid4().hex[:8]
        self.label = f"chunkserve_test_node_{tag}"  # finds its node id
        self.temp_dir = f"/tmp/csnode{tag}"  # short: socket paths
        # a temp dir (sockets) of its own: two nodes of one host must not share one
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
                f"--address={gcs_address}", "--num-cpus=1", "--num-gpus=0",
                f'--resources={{"{slot}": 1, "{self.label}": 1}}',
                f"--dashboard-agent-listen-port={agent}",
                f"--temp-dir={self.temp_dir}",
                "--disable-usage-stats",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "RAY_AUTH_MODE": "disabled"},
        )  # fmt: skip

    @property
    def node_id(self) -> str | None:
        alive = [n for n in ray.nodes() if n["Alive"] and self.label in n["Resources"]]
        return alive[0]["NodeID"] if alive else None

    def stop(self) -> None:
        """Its raylet and every process on it end (a node removed)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def slots(slot: str = SLOT) -> float:
    return ray.cluster_resources().get(slot, 0.0)


@pytest.fixture(scope="module")
def nodes(ray_cluster):
    started = []
    for count in (1, 2):  # one after the other: each registers before the next starts
        started.append(Node(ray_cluster.gcs_address))
        assert wait_until(lambda count=count: slots() == count, timeout_s=60)
    yield started
    for node in started:
        node.stop()
    assert wait_until(lambda: slots() == 0, timeout_s=60)


@pytest.fixture(scope="module")
def app(start_app, tiny_qwen3, redis_server, nodes):
    config = cluster_config(
        tiny_qwen3,
        unique_name("nodes"),
        # one CPU each: a worker fills its node, and nothing else of the app goes there
        workers={"count": 2, "num_cpus": 1, "resources": {SLOT: 1}, "max_restarts": 5},
        directory={
            "kind": "redis",
            "lease_ttl_s": 2.0,
            "redis": {"url": redis_server.url, "prefix": f"cstest-{uuid.uuid4().hex[:8]}"},
        },
        server={"num_replicas": 1, "replica_num_cpus": 0.25, "default_max_tokens": 8},
    )
    app = start_app(config)
    yield app
    stop_app(app)


def node_of(actor_name: str) -> str | None:
    for actor in list_actors(filters=[("name", "=", actor_name)]):
        if actor.state == "ALIVE":
            return actor.node_id
    return None


def ask(app, i: int) -> tuple[int, str]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}? " * 8}]}
    response = httpx.post(app.url("/v1/chat/completions"), json=body, timeout=120)
    return response.status_code, response.headers.get("x-chunkserve-worker", "")


def health(app) -> dict:
    return httpx.get(app.url("/health"), timeout=30).json()


def test_workers_run_on_the_worker_nodes_and_a_removed_node_loses_no_request(
    app, nodes, ray_cluster
):
    head = ray.get_runtime_context().get_node_id()  # the test process runs on the head
    workers = [f"{app.name}-worker-{i}" for i in range(2)]
    placed = {w: node_of(w) for w in workers}
    assert None not in placed.values() and head not in placed.values()
    assert len(set(placed.values())) == 2  # a node each
    replicas = [
        a.node_id
        for a in list_actors(filters=[("state", "=", "ALIVE")])
        if a.class_name.startswith("ServeReplica:") and app.name in a.class_name
    ]
    assert replicas and set(replicas) == {head}  # the router replicas stay on the head

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: ask(app, i), range(8)))
    assert {status for status, _ in answers} == {200}
    assert {worker for _, worker in answers} == set(workers)

    # a node removed while 40 requests are in flight and queued
    victim = next(node for node in nodes if node.node_id == placed[workers[0]])
    with ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(ask, app, 100 + i) for i in range(40)]
        assert wait_until(lambda: sum(f.done() for f in pending) >= 6, timeout_s=120)
        victim.stop()
        answers = [f.result() for f in pending]
    assert [status for status, _ in answers] == [200] * 40, answers
    assert {worker for _, worker in answers} >= {workers[1]}
    assert node_of(workers[1]) == placed[workers[1]]  # the other worker never moved

    assert wait_until(lambda: health(app)["healthy_workers"] == 1, timeout_s=60), health(app)
    degraded = health(app)
    assert degraded["status"] == "degraded" and degraded["workers"] == 2, degraded

    replacement = Node(ray_cluster.gcs_address)  # room again: the lost worker comes back
    nodes[nodes.index(victim)] = replacement
    assert wait_until(lambda: health(app)["healthy_workers"] == 2, timeout_s=180), health(app)
    assert node_of(workers[0]) == replacement.node_id
    assert ask(app, 999)[0] == 200


def test_an_app_deployed_before_its_worker_nodes_becomes_healthy_when_they_join(
    serve_port, tiny_qwen3, redis_server, ray_cluster, tmp_path
):
    """As KubeRay deploys the Serve config once the head is ready: the app is built
    and deployed while no node can hold a worker; its router replica waits for nodes
    (``workers.node_wait_s``) and the app becomes healthy once they join, with no
    second deployment."""
    late = "chunkserve_test_late_slot"
    name, port = unique_name("late"), free_port()
    config = cluster_config(
        tiny_qwen3,
        name,
        workers={"count": 2, "num_cpus": 1, "resources": {late: 1}, "node_wait_s": 300},
        directory={
            "kind": "redis",
            "redis": {"url": redis_server.url, "prefix": f"cstest-{uuid.uuid4().hex[:8]}"},
        },
        server={"num_replicas": 1, "replica_num_cpus": 0.25, "port": port},
    )
    config["server"]["route_prefix"] = f"/{name}"
    path = write_config(tmp_path, config)
    served = ServedApp(path, f"http://127.0.0.1:{port}/{name}/v1", name)
    joined: list[Node] = []
    try:
        with ThreadPoolExecutor(1) as pool:
            built = app_builder(AppArgs(config=str(path)))  # what `serve deploy` builds
            deploying = pool.submit(serve.run, built, name=name, route_prefix=f"/{name}")
            assert wait_until(lambda: name in serve.status().applications, timeout_s=60)
            assert not deploying.done()  # its replica waits for nodes to hold the workers
            for count in (1, 2):
                joined.append(Node(ray_cluster.gcs_address, late))
                assert wait_until(lambda count=count: slots(late) == count, timeout_s=60)
            deploying.result(timeout=300)
        wait_healthy(served, 2, timeout_s=120)
        assert ask(served, 1)[0] == 200
    finally:
        stop_app(served)
        for node in joined:
            node.stop()
