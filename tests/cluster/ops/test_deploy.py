"""The files in ``deploy/`` parse, pass Ray's own schemas, and name things that exist:
import paths, config files (loaded with the project's loader), the CLI they run.
Fast: nothing here starts Ray."""

from __future__ import annotations

import copy
import importlib
import os
import re
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ClusterConfig, load_config
from cluster.ops.cli import build_parser

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
# Where both GPU clusters keep the repository (synced by `ray up`, copied by the Dockerfile).
CLUSTER_REPO = "/home/ray/chunkserve"
SERVE_FILES = ["serve.yaml", "serve-gpu.yaml", "rayservice.yaml"]


def load_yaml(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def manifests() -> dict[str, dict]:
    """The Kubernetes objects of rayservice.yaml, by kind."""
    docs = yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text())
    return {doc["kind"]: doc for doc in docs}


def serve_config(name: str) -> dict:
    if name == "rayservice.yaml":
        return yaml.safe_load(manifests()["RayService"]["spec"]["serveConfigV2"])
    return load_yaml(name)


def repo_path(path: str) -> Path:
    """A path as the app builder sees it, mapped into this checkout."""
    if path.startswith(CLUSTER_REPO + "/"):
        return REPO / path.removeprefix(CLUSTER_REPO + "/")
    assert not Path(path).is_absolute(), f"{path} is outside the repository"
    return REPO / path


def resolve(import_path: str) -> object:
    """``module:attr`` or ``module.attr``, as Ray Serve resolves import paths."""
    module, sep, attr = import_path.partition(":")
    if not sep:
        module, _, attr = import_path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def app_config(app: dict) -> ClusterConfig:
    args = app["args"]
    return load_config(repo_path(args["config"]), args.get("overrides", []))


def gpu_app() -> dict:
    (app,) = serve_config("serve-gpu.yaml")["applications"]
    return app


@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_config_passes_rays_schema(name):
    ServeDeploySchema.model_validate(serve_config(name))


@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_apps_build_from_their_args(name, monkeypatch):
    # Built as outside any Ray cluster: the app_builder's placement check would judge
    # the GPU configs against whatever test cluster this process joined earlier.
    monkeypatch.setattr("cluster.http.app.ray.is_initialized", lambda: False)
    try:  # Ray's own builder call: signature check, args -> the builder's pydantic model
        from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    except ImportError:
        pytest.skip("this Ray has no call_user_app_builder_with_args_if_necessary")
    from ray.serve import Application

    for app in serve_config(name)["applications"]:
        builder = resolve(app["import_path"])
        assert callable(builder)
        args = {**app["args"], "config": str(repo_path(app["args"]["config"]))}
        built = call_user_app_builder_with_args_if_necessary(builder, args)
        assert isinstance(built, Application)


@pytest.mark.parametrize("name", SERVE_FILES)
def test_serve_apps_name_config_files_that_load(name):
    for app in serve_config(name)["applications"]:
        cfg = app_config(app)
        assert app["name"] == cfg.name  # as `chunkserve serve` names the app
        assert app.get("route_prefix", "/") == cfg.server.route_prefix


def test_rayservice_runs_the_gpu_serve_config():
    assert serve_config("rayservice.yaml") == {"applications": [gpu_app()]}


def test_cluster_launcher_has_what_ray_up_requires():
    config = load_yaml("cluster.yaml")
    for field in ("cluster_name", "provider", "available_node_types", "head_node_type"):
        assert field in config, field
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    assert any(t["resources"].get("GPU", 0) > 0 for t in types.values())
    assert all((REPO / local).exists() for local in config["file_mounts"].values())
    # every node names its image (Ray's default AMI predates H200s): a current GPU AMI
    for node_type in types.values():
        image = node_type["node_config"]["ImageId"]
        assert image.startswith("resolve:ssm:/aws/service/deeplearning/ami/x86_64/"), image
    # Ray's own checks: defaults filled in, then validated against ray-schema.json.
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


def test_gpu_clusters_provide_the_gpus_the_app_asks_for():
    cfg = app_config(gpu_app())
    launcher = load_yaml("cluster.yaml")["available_node_types"].values()
    assert sum(t.get("min_workers", 0) * t["resources"].get("GPU", 0) for t in launcher) == (
        cfg.workers.count * cfg.workers.num_gpus
    )
    groups = manifests()["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    pods = sum(
        g["minReplicas"] * int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
        for g in groups
        for c in g["template"]["spec"]["containers"]
    )
    assert pods == cfg.workers.count * cfg.workers.num_gpus


def test_gpu_clusters_serve_redis_where_the_app_looks():
    cfg = app_config(gpu_app())
    assert cfg.directory.kind == "redis"
    url = urlsplit(cfg.directory.redis.url)
    service = manifests()["Service"]
    assert service["metadata"]["name"] == url.hostname
    assert [p["port"] for p in service["spec"]["ports"]] == [url.port]
    launcher = (DEPLOY / "cluster.yaml").read_text()
    assert f"redis-server --port {url.port} " in launcher
    for line in (f"127.0.0.1 {url.hostname}", f"$RAY_HEAD_IP {url.hostname}"):  # /etc/hosts
        assert line in launcher


def test_rayservice_fields():
    spec = manifests()["RayService"]["spec"]
    assert manifests()["RayService"]["apiVersion"] == "ray.io/v1"
    cluster = spec["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:  # KubeRay takes rayStartParams as map[string]string
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert group["template"]["spec"]["containers"]
    assert all(g["groupName"] for g in cluster["workerGroupSpecs"])


def test_rayservice_pods_run_the_image_given_as_its_one_parameter():
    """Every container but Redis runs ``${CHUNKSERVE_IMAGE}`` (an image with a registry,
    filled in by ``envsubst '$CHUNKSERVE_IMAGE'``); nothing else is a parameter."""
    text = (DEPLOY / "rayservice.yaml").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert set(re.findall(r"\$\{?(\w+)", body)) == {"CHUNKSERVE_IMAGE"}
    cluster = manifests()["RayService"]["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {"${CHUNKSERVE_IMAGE}"}
    assert "envsubst '$CHUNKSERVE_IMAGE' < deploy/rayservice.yaml | kubectl apply" in text


def test_images_carry_one_ray_version_and_the_repository_path():
    ray_version = manifests()["RayService"]["spec"]["rayClusterConfig"]["rayVersion"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray_version}-" in dockerfile
    assert f"WORKDIR {CLUSTER_REPO}\n" in dockerfile
    assert load_yaml("cluster.yaml")["docker"]["image"].startswith(f"rayproject/ray:{ray_version}-")
    assert load_yaml("cluster.yaml")["file_mounts"] == {"~/chunkserve": "."}  # ~ is /home/ray


def test_submit_batch_script():
    script = DEPLOY / "submit_batch.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "ray job submit --working-dir . --" in text
    defaults = dict(re.findall(r"^(\w+)=\$\{positional\[\d\]:-(\S+)\}$", text, re.MULTILINE))
    assert set(defaults) == {"config", "input", "output"}
    load_config(REPO / defaults["config"])
    assert (REPO / defaults["input"]).is_file()
    assert Path(defaults["output"]).is_absolute()  # written on the driver's node
    args = ["batch", "--config", defaults["config"], "--input", defaults["input"]]
    assert build_parser().parse_args([*args, "--output", defaults["output"]]).handler
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert callable(resolve(scripts["chunkserve"]))


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], ["configs/local.yaml", "configs/examples/rag_requests.jsonl",
              "/tmp/chunkserve-batch-output.jsonl"]),
        (["--set", "a.b=1", "c.yaml", "--set=d=2", "in.jsonl", "/o.jsonl", "--retry-errors"],
         ["c.yaml", "in.jsonl", "/o.jsonl", "--set", "a.b=1", "--set=d=2", "--retry-errors"]),
        (["c.yaml", "--set", "x=a b"], ["c.yaml", "configs/examples/rag_requests.jsonl",
                                        "/tmp/chunkserve-batch-output.jsonl", "--set", "x=a b"]),
    ],
)  # fmt: skip
def test_submit_batch_takes_options_anywhere(tmp_path, args, expected):
    """A stub ``ray`` on PATH records what the script submits: --set given before,
    between or after the positional arguments reaches ``chunkserve batch`` whole."""
    stub = tmp_path / "ray"
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$RECORD"\n')
    stub.chmod(0o755)
    record = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "RECORD": str(record)}
    subprocess.run(["bash", str(DEPLOY / "submit_batch.sh"), *args], env=env, check=True)
    argv = record.read_text().splitlines()
    head = ["job", "submit", "--working-dir", ".", "--", "chunkserve", "batch"]
    config, input_, output, *rest = expected
    assert argv == [*head, "--config", config, "--input", input_, "--output", output, *rest]
    for bad in (["--input", "x"], ["a", "b", "c", "d"], ["--set"]):
        refused = subprocess.run(
            ["bash", str(DEPLOY / "submit_batch.sh"), *bad], env=env, capture_output=True, text=True
        )
        assert refused.returncode == 2 and "submit_batch.sh:" in refused.stderr


RAY_GCS_DEFAULT_PORT = 6379  # `ray start --head` without --port
REDIS_DEFAULT_PORT = 6379  # `redis-server` without --port


def _ports(text: str, command: str, default: int) -> list[int]:
    """The port of each shell command in ``text`` (script or comment) that starts with
    ``command``: its --port, else the default. Prose naming the command is skipped."""
    starts = r"(?:^[\s#-]*|&&\s*|\|\|\s*|;\s*)"
    pattern = re.compile(starts + re.escape(command) + r"(?P<args>[^&|;\n]*)", re.MULTILINE)
    ports = []
    for match in pattern.finditer(text):
        given = re.search(r"--port[= ](\d+)", match.group("args"))
        ports.append(int(given.group(1)) if given else default)
    return ports


@pytest.mark.parametrize("name", ["serve.yaml", "cluster.yaml"])
def test_setup_steps_keep_redis_off_rays_gcs_port(name):
    text = (DEPLOY / name).read_text()
    redis_ports = _ports(text, "redis-server", REDIS_DEFAULT_PORT)
    gcs_ports = _ports(text, "ray start --head", RAY_GCS_DEFAULT_PORT)
    assert redis_ports and gcs_ports, f"{name} should show how Redis and Ray start"
    assert not set(redis_ports) & set(gcs_ports), (name, redis_ports, gcs_ports)


def test_serve_yaml_app_uses_the_redis_its_setup_starts():
    (app,) = serve_config("serve.yaml")["applications"]
    url = urlsplit(app_config(app).directory.redis.url)
    assert url.hostname == "127.0.0.1"
    assert url.port != RAY_GCS_DEFAULT_PORT  # `serve deploy` runs on a `ray start --head`
    assert _ports((DEPLOY / "serve.yaml").read_text(), "redis-server", REDIS_DEFAULT_PORT) == [
        url.port
    ]
