"""Ray fixtures: one real Ray cluster for the whole session (``ray start --head``, so
``ray job submit`` works against it too), Serve on a free port, and helpers to run
chunkserve apps on it.

Invariants:
- The cluster is ours alone: its own temp dir (so ``/tmp/ray``'s "current cluster"
  is never touched) and free ports; it is stopped by terminating
  the ``ray start --block`` process we started (which stops its children), never by
  ``ray stop``.
- Actors are small (0.5 CPU workers, 0-CPU routers) so two apps fit on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from cluster.config import load_config
from cluster.http.app import build_app
from cluster.ops.actors import ensure_cluster, kill_cluster, wait_ready
from cluster.ops.model_store import ensure_model
from tests.chunkstore.testkit import RedisProcess, free_port, free_ports

REPO = Path(__file__).resolve().parents[2]
NUM_CPUS = 4
START_TIMEOUT_S = 90
STOP_TIMEOUT_S = 10


@dataclass(frozen=True)
class RayCluster:
    gcs_address: str  # host:port for ray.init / RAY_ADDRESS
    dashboard_url: str  # for `ray job submit --address`
    temp_dir: str


@dataclass(frozen=True)
class ServedApp:
    config_path: Path
    base_url: str  # .../v1
    name: str

    def url(self, path: str) -> str:
        return self.base_url.removesuffix("/v1") + path

    def worker(self, index: int = 0):
        """The handle of the app's worker actor ``index`` (``cluster_config``'s namespace)."""
        return ray.get_actor(f"{self.name}-worker-{index}", namespace="chunkserve-tests")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    temp_dir = tempfile.mkdtemp(prefix="csray", dir="/tmp")  # short: socket paths
    port, dashboard, client_server, dashboard_agent = free_ports(4)
    args = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        f"--temp-dir={temp_dir}", f"--port={port}",
        f"--num-cpus={NUM_CPUS}", "--num-gpus=0", "--include-dashboard=true",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client_server}",
        f"--dashboard-agent-listen-port={dashboard_agent}", "--disable-usage-stats",
    ]  # fmt: skip
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 - closed at teardown
    # Token auth off for this private cluster: the test process joins it by explicit
    # address, which in Ray never sends the token.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    cluster = RayCluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", temp_dir)
    try:
        _wait_for_dashboard(cluster, proc, Path(log.name))
        ray.init(address=cluster.gcs_address, namespace="chunkserve-tests", log_to_driver=False)
        yield cluster
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_dashboard(cluster: RayCluster, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited:\n{log.read_text()[-3000:]}")
        try:  # 401: up, and asking for Ray's auth token (ray.init and the job CLI send it)
            status = httpx.get(f"{cluster.dashboard_url}/api/version", timeout=1).status_code
            if status in (200, 401):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Ray did not start in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    ray.shutdown()
    proc.terminate()  # `ray start --block` stops the processes it started
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    try:  # anything left in the group we created, by its id
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture(scope="session")
def serve_port(ray_cluster) -> Iterator[int]:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()  # else the node waits up to 30 s draining Serve's actors


def cluster_config(model_dir: Path, name: str, **sections) -> dict:
    """A small test cluster config (as a dict) for ``model_dir``; ``sections`` override."""
    config = {
        "name": name,
        "model": {"name": "tiny", "path": str(model_dir)},
        "engine": {"page_size": 16, "max_model_len": 1024, "cpu_kv_cache_bytes": 64 * 2**20},
        "workers": {"count": 1, "num_cpus": 0.5, "cpu_threads": 1, "publish_interval_s": 0.1},
        "directory": {"kind": "embedded", "lease_ttl_s": 2.0},
        "router": {"poll_interval_s": 0.2},
        "server": {"replica_num_cpus": 0, "default_max_tokens": 16},
        "ray": {"namespace": "chunkserve-tests"},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    return config


def write_config(directory: Path, config: dict) -> Path:
    path = directory / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session")
def start_app(serve_port, tmp_path_factory) -> Iterator[Callable[[dict], ServedApp]]:
    """``start_app(config_dict)`` runs a chunkserve app on the session's Serve at route
    prefix /<name>, and waits until every worker is healthy. Modules stop theirs with
    ``stop_app``; whatever is left is stopped at session end."""
    started: list[ServedApp] = []

    def start(config: dict) -> ServedApp:
        server = config.get("server", {})
        # replicas listening themselves need a port of their app's own (one app a
        # port); through Serve's proxy every app shares the session's
        proxied = server.get("ingress") == "serve_proxy"
        port = serve_port if proxied else free_port()
        config = {**config, "server": {**server, "port": port}}
        config["server"]["route_prefix"] = f"/{config['name']}"
        path = write_config(tmp_path_factory.mktemp("configs"), config)
        cfg = load_config(path)
        actors = ensure_cluster(cfg, ensure_model(cfg.model), detached=True)
        wait_ready(actors, 120)
        serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.server.route_prefix)
        app = ServedApp(path, f"http://127.0.0.1:{port}/{cfg.name}/v1", cfg.name)
        started.append(app)
        wait_healthy(app, cfg.workers.count)
        return app

    yield start
    for app in started:
        if app.name in serve.status().applications:
            stop_app(app)


def stop_app(app: ServedApp) -> None:
    try:
        serve.delete(app.name)
    finally:
        kill_cluster(load_config(app.config_path))


def wait_healthy(app: ServedApp, workers: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(app.url("/health"), timeout=5)
            if response.status_code == 200 and response.json()["healthy_workers"] == workers:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{app.name}: {workers} worker(s) not healthy within {timeout_s} s")


def default_sigint() -> None:
    """In the child before it starts: Ctrl-C's default action, so the child handles
    SIGINT even under a test runner that ignores it (an ignored signal is inherited,
    and Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    """A private Redis server for one test module."""
    server = RedisProcess()
    server.start()
    yield server
    server.kill()
