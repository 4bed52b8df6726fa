"""``chunkserve serve`` and ``chunkserve status`` as a user runs them: serve prints the
URL, serves the OpenAI API, and on Ctrl-C (while serving or still starting) removes
its app and workers and exits 130 with one line, no traceback; status finds the
directory the running cluster uses, and without a cluster says where it looked."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys

import httpx
import pexpect
import pytest
import ray

from tests.chunkstore.testkit import free_port
from tests.cluster.conftest import (
    REPO,
    cluster_config,
    default_sigint,
    stop_app,
    unique_name,
    write_config,
)

EXIT_INTERRUPTED = 130
EXIT_UNREACHABLE = 1
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its log lines (and resets at exit)


def spawn_serve(config_path, gcs_address: str) -> tuple[pexpect.spawn, io.StringIO]:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "cluster.ops.cli", "serve", "--config", str(config_path),
         "--set", f"ray.address={gcs_address}"],
        cwd=str(REPO), timeout=180, encoding="utf-8", preexec_fn=default_sigint,
    )  # fmt: skip
    child.logfile_read = transcript = io.StringIO()
    return child, transcript


# Ray forwards its processes' log lines to the driver's terminal as they come, each
# prefixed "(pid=N)" or "(Name pid=N)": one may land after the CLI's last line (once a
# core worker's "Mismatched ActorID: ignoring KillActor" error, from the teardown)
RAY_FORWARDED = re.compile(r"^\((?:\S+ )?pid=\d+\)")


def worker_alive(name: str) -> bool:
    try:
        ray.get_actor(f"{name}-worker-0", namespace="chunkserve-tests")
    except ValueError:
        return False
    return True


def assert_interrupted_cleanly(child: pexpect.spawn, transcript: io.StringIO, name: str) -> None:
    child.expect(pexpect.EOF, timeout=120)
    child.close()
    output = transcript.getvalue()
    assert child.exitstatus == EXIT_INTERRUPTED, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [
        line
        for line in ANSI.sub("", output).splitlines()
        if line.strip() and not RAY_FORWARDED.match(line)
    ]
    assert lines[-1].startswith("chunkserve serve: interrupted;"), lines[-5:]
    assert not worker_alive(name)


@pytest.mark.ray
def test_serve_prints_the_url_serves_and_stops_on_ctrl_c(
    ray_cluster, serve_port, tiny_qwen3, tmp_path
):
    """The default ingress: the router replicas listen on the configured port themselves
    (the session's Serve proxy holds another)."""
    config = cluster_config(tiny_qwen3, unique_name("cli"))
    port = free_port()
    config["server"].update({"port": port, "route_prefix": "/cli"})
    child, transcript = spawn_serve(write_config(tmp_path, config), ray_cluster.gcs_address)
    try:
        child.expect(r"serving 'tiny' at (http://\S+/v1)")
        url = child.match.group(1)
        assert url == f"http://127.0.0.1:{port}/cli/v1"
        models = httpx.get(f"{url}/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        reply = httpx.post(
            f"{url}/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=60,
        )
        assert reply.status_code == 200 and re.match(
            r".*-worker-0$", reply.headers["x-chunkserve-worker"]
        )
        child.kill(signal.SIGINT)
        child.expect("stopping")
        assert_interrupted_cleanly(child, transcript, config["name"])
    finally:
        child.close(force=True)


@pytest.mark.ray
def test_ctrl_c_while_starting_removes_what_was_started(
    ray_cluster, serve_port, tiny_qwen3, tmp_path
):
    config = cluster_config(tiny_qwen3, unique_name("cli-start"))
    config["server"].update({"port": serve_port, "route_prefix": "/cli-start"})
    child, transcript = spawn_serve(write_config(tmp_path, config), ray_cluster.gcs_address)
    try:
        child.expect(r"starting 1 worker")
        child.kill(signal.SIGINT)
        assert_interrupted_cleanly(child, transcript, config["name"])
    finally:
        child.close(force=True)


def run_status(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster.ops.cli", "status", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )  # fmt: skip


def test_status_without_a_cluster_at_the_address_says_where_it_looked():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = run_status("--config", "configs/local.yaml", "--set", f"ray.address={address}")
    assert result.returncode == EXIT_UNREACHABLE
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"chunkserve status: error: no Ray cluster at {address} (ray.address)")
    assert "--set ray.address=HOST:PORT" in line and "RAY_ADDRESS" in line
    assert result.stdout == ""


def test_status_without_a_cluster_at_ray_address_names_the_variable():
    address = f"127.0.0.1:{free_port()}"
    result = run_status(
        "--config", "configs/local.yaml", env={**os.environ, "RAY_ADDRESS": address}
    )
    assert result.returncode == EXIT_UNREACHABLE
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"chunkserve status: error: no Ray cluster at {address} (RAY_ADDRESS)")


@pytest.mark.ray
@pytest.mark.redis
def test_status_reports_the_directory_the_running_cluster_uses(
    ray_cluster, start_app, tiny_qwen3, redis_server, tmp_path
):
    prefix = unique_name("cs-status")
    redis = {
        "kind": "redis",
        "lease_ttl_s": 2.0,
        # calls get 0.5 s, not the 0.05 s default: a loaded box must not read "unreachable"
        "redis": {"url": redis_server.url, "prefix": prefix, "timeout_s": 0.5},
    }
    config = cluster_config(tiny_qwen3, unique_name("status"), directory=redis)
    app = start_app(config)
    try:
        # The config as the user has it, without the server's --set of the Redis URL.
        elsewhere = {**redis, "redis": {"url": f"redis://127.0.0.1:{free_port()}/0"}}
        stale = write_config(tmp_path, {**config, "directory": elsewhere})
        result = run_status(
            "--config", str(stale), "--set", f"ray.address={ray_cluster.gcs_address}"
        )
        assert result.returncode == 0, result.stderr[-2000:]
        out = result.stdout
        port = ray_cluster.gcs_address.rsplit(":", 1)[1]
        assert re.search(rf"on Ray at \S+:{port}, namespace 'chunkserve-tests'", out), out
        assert f"{app.name}-worker-0" in out and "healthy" in out
        line = next(line for line in out.splitlines() if line.startswith("directory"))
        assert line.startswith("directory (redis): 1 live workers")
        assert f"at {redis_server.url}, prefix {prefix!r} (the running cluster's)" in line
    finally:
        stop_app(app)
