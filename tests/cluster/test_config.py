"""Cluster configs: the shipped files load, overrides apply, bad files read well."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.api.openai_protocol import ChatCompletionRequest
from cluster.config import ClusterConfig, load_config
from cluster.ops.cli import main
from workers.engine.reuse_info import ReuseRequest

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, ClusterConfig) and cfg.model.name


def test_shipped_configs_cover_local_redis_and_h200():
    by_name = {p.name: load_config(p) for p in CONFIGS}
    assert by_name["local.yaml"].directory.kind == "embedded"
    assert by_name["local.yaml"].workers.count == 1
    assert (REPO / by_name["local.yaml"].model.path / "config.json").is_file()  # shipped model
    assert by_name["redis.yaml"].directory.kind == "redis"
    assert by_name["redis.yaml"].workers.count > 1
    h200 = by_name["h200x8.yaml"]  # 8 GPUs as 2 workers x 4 ranks
    workers = h200.workers
    assert workers.count * workers.num_gpus == 8 and workers.tensor_parallel_size == 4


def test_tensor_parallel_workers_take_a_gpu_a_rank(tmp_path):
    from cluster.ops.actors import engine_config

    with pytest.raises(ValueError, match=r"num_gpus \(1\) must equal .*tensor_parallel_size \(2\)"):
        load_config(
            REPO / "configs" / "local.yaml",
            ["workers.num_gpus=1", "workers.tensor_parallel_size=2"],
        )
    cfg = load_config(
        REPO / "configs" / "local.yaml", ["workers.num_gpus=2", "workers.tensor_parallel_size=2"]
    )
    assert engine_config(cfg, tmp_path).tensor_parallel_size == 2
    # the engine section does not take it: the workers' GPUs go with it
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        load_config(REPO / "configs" / "local.yaml", ["engine.tensor_parallel_size=2"])


def test_every_field_is_described():
    def walk(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            annotation = field.annotation
            for candidate in getattr(annotation, "__args__", (annotation,)):
                if isinstance(candidate, type) and hasattr(candidate, "model_fields"):
                    missing += walk(candidate)
        return missing

    assert walk(ClusterConfig) == []


def test_overrides_parse_values_as_yaml():
    cfg = load_config(
        REPO / "configs" / "local.yaml",
        ["workers.count=3", "server.api_keys=[a, b]", "directory.redis.url=redis://h:1/0"],
    )
    assert cfg.workers.count == 3
    assert cfg.server.api_keys == ["a", "b"]
    assert cfg.directory.redis.url == "redis://h:1/0"


def test_default_reuse_serves_requests_that_name_no_reuse():
    cfg = load_config(REPO / "configs" / "local.yaml", ["server.default_reuse=approximate"])
    default = ReuseRequest(cfg.server.default_reuse)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    unnamed = ChatCompletionRequest.model_validate(body)
    named = ChatCompletionRequest.model_validate({**body, "reuse": "exact"})
    assert unnamed.reuse_request(default) == ReuseRequest("approximate")
    assert named.reuse_request(default) == ReuseRequest("exact")
    assert load_config(REPO / "configs" / "local.yaml").server.default_reuse == "exact"


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("model: {name: m, path: /x}\nworkers: {count: 0}\n", [], "workers.count: Input should be greater than 0"),
        ("model: {name: m, path: /x}\nworkerz: {}\n", [], "workerz: Extra inputs are not permitted"),
        ("model: {name: m, path: /x}\n", ["workers.count=lots"], "workers.count: Input should be a valid integer"),
        ("model: {name: m}\n", [], "model.path: Field required"),
        ("model: [unclosed\n", [], "not valid YAML"),
        ("- a list\n", [], "the top level must be a mapping"),
        ("model: {name: m, path: /x}\n", ["model.name.x=1"], "is not a section"),
        ("model: {name: m, path: /x}\n", ["router.policy=random"], "router.policy: Input should be 'chunk_aware' or 'round_robin'"),
        ("model: {name: m, path: /x}\n", ["server.stream_interval_s=-1"], "server.stream_interval_s: Input should be greater than or equal to 0"),
        ("model: {name: m, path: /x}\n", ["server.default_reuse=sloppy"], "server.default_reuse: Input should be 'exact' or 'approximate'"),
        ("model: {name: m, path: /x}\nrouter: {imbalance_slack: 8}\n", [], "router.imbalance_slack no longer exist"),
        ("model: {name: m, path: /x}\n", ["router.load_penalty_tokens=1"], "router.load_penalty_tokens no longer exist: the router now weighs"),
    ],
)  # fmt: skip
def test_bad_configs_say_what_is_wrong(tmp_path, text, overrides, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        load_config(path, overrides)
    assert expected in str(error.value)


def test_cli_reports_a_bad_config_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name: m, path: /x}\nworkers: {count: -1}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "workers.count: Input should be greater than 0" in err and "Traceback" not in err
    assert (
        main(["batch", "--config", str(tmp_path / "missing.yaml"), "--input", "x", "--output", "y"])
        == 2
    )
    assert "cannot read config" in capsys.readouterr().err


def test_serve_app_builder_takes_a_config_file():
    from ray.serve import Application

    from cluster.http.app import AppArgs, app_builder

    app = app_builder(AppArgs(config=str(REPO / "configs" / "redis.yaml"), overrides=["name=x"]))
    assert isinstance(app, Application)


def test_serve_refuses_an_unknown_app_argument_naming_it():
    """What ``serve deploy`` does with a Serve config's ``args``: a misspelled key is
    refused, named, instead of silently dropped."""
    from pydantic import ValidationError
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from cluster.http.app import app_builder

    args = {"config": str(REPO / "configs" / "redis.yaml"), "overides": ["name=x"]}
    with pytest.raises(ValidationError, match="overides"):
        call_user_app_builder_with_args_if_necessary(app_builder, args)


def test_router_replicas_default_to_one_per_worker():
    model = {"name": "m", "path": "/m"}
    auto = ClusterConfig.model_validate({"model": model, "workers": {"count": 3}})
    assert auto.server.num_replicas == "auto" and auto.router_replicas == 3
    fixed = {"model": model, "workers": {"count": 3}, "server": {"num_replicas": 2}}
    assert ClusterConfig.model_validate(fixed).router_replicas == 2
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"model": model, "server": {"num_replicas": 0}})
    with pytest.raises(ValueError):
        ClusterConfig.model_validate({"model": model, "server": {"ingress": "proxy"}})


def test_metrics_need_a_token_on_a_server_with_api_keys_and_none_without():
    from cluster.errors import Unauthorized
    from cluster.http.tenancy import ScrapeGuard

    ScrapeGuard(None, []).check(None)  # no keys, no token: open
    with pytest.raises(Unauthorized, match="server.metrics_token"):
        ScrapeGuard(None, ["sk-a"]).check("Bearer sk-a")  # a tenant's key does not open it
    guard = ScrapeGuard("scrape", ["sk-a"])
    guard.check("Bearer scrape")
    for wrong in (None, "Bearer sk-a", "Basic scrape"):
        with pytest.raises(Unauthorized):
            guard.check(wrong)
