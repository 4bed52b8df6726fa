"""Wiring a config's router and completion service (shared by app and batch)."""

from __future__ import annotations

import functools
from pathlib import Path

from chunkstore.ray_access import open_directory
from cluster.api.completions import CompletionService, ServiceSettings
from cluster.config import ClusterConfig
from cluster.metrics import Metrics
from cluster.ops.actors import ClusterActors, find_actor
from cluster.routing.policy import Policy, RoutingWeights
from cluster.routing.router import Router, RouterSettings
from cluster.routing.worker_pool import Agreement, WorkerPool
from workers.engine.checkpoint import checkpoint_fingerprint, load_tokenizer
from workers.engine.config import resolve_deviation_layer
from workers.engine.models.config import ModelConfig
from workers.engine.reuse_info import ReuseRequest
from workers.runtime.worker_types import directory_namespace


def namespace_model(cfg: ClusterConfig, model_dir: Path) -> str:
    """The engine's ``namespace_model`` for this config (model id + fingerprint)."""
    return f"{cfg.model.name}@{checkpoint_fingerprint(model_dir)}"


def recent_route_lease_s(cfg: ClusterConfig) -> float:
    """``router.recent_route_lease_s``, its default (null) resolved."""
    lease = cfg.router.recent_route_lease_s
    return 4 * cfg.workers.publish_interval_s if lease is None else lease


def selection_share(cfg: ClusterConfig, model_dir: Path) -> float:
    """The share of the model's layers that a placed token repair does not recompute
    still runs through: the layers below the workers' deviation layer."""
    layers = ModelConfig.from_dir(model_dir).num_layers
    return resolve_deviation_layer(cfg.engine.deviation_layer, layers) / layers


def build_service(
    cfg: ClusterConfig, model_dir: Path, actors: ClusterActors, metrics: Metrics
) -> CompletionService:
    keyed_as = namespace_model(cfg, model_dir)
    agreement = Agreement(
        namespace_model=keyed_as,
        page_size=cfg.engine.page_size,
        directory_namespace=directory_namespace(actors.directory),
        entry_system_prompt=cfg.engine.entry_system_prompt,
    )
    pool = WorkerPool(
        actors.workers,
        agreement,
        cfg.router.poll_interval_s,
        cfg.router.poll_timeout_s,
        find=functools.partial(find_actor, namespace=cfg.ray.namespace),
    )
    metrics.healthy_workers = pool.healthy_count
    weights = RoutingWeights(
        max_requests_per_worker=cfg.router.max_requests_per_worker,
        default_prefill_tokens_per_s=cfg.router.default_prefill_tokens_per_s,
    )
    router = Router(
        pool,
        open_directory(actors.directory),
        RouterSettings(
            weights=weights,
            max_attempts=cfg.router.max_attempts,
            policy=Policy(cfg.router.policy),
            recent_route_lease_s=recent_route_lease_s(cfg),
            selection_share=selection_share(cfg, model_dir),
        ),
        metrics,
    )
    settings = ServiceSettings(
        model_name=cfg.model.name,
        namespace_model=keyed_as,
        page_size=cfg.engine.page_size,
        default_max_tokens=cfg.server.default_max_tokens,
        stream_interval_s=cfg.server.stream_interval_s,
        default_reuse=ReuseRequest(cfg.server.default_reuse),
    )
    return CompletionService(router, load_tokenizer(model_dir), settings, metrics)
