"""Starting and stopping a serving cluster: Ray, directory, workers, HTTP app."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from ray import serve

from cluster.actors import ensure_cluster, kill_cluster, wait_ready
from cluster.app import build_app
from cluster.config import ClusterConfig
from cluster.model_store import ensure_model
from cluster.ray_session import connect_ray


def api_url(cfg: ClusterConfig) -> str:
    """Base URL of the OpenAI API (what clients pass as ``base_url``)."""
    host = cfg.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    prefix = cfg.server.route_prefix.rstrip("/")
    return f"http://{host}:{cfg.server.port}{prefix}/v1"


def start_serving(cfg: ClusterConfig, log: Callable[[str], None] = print) -> str:
    """Start (or join) everything the config describes; returns the API URL.

    If Serve already runs on the cluster, its HTTP host and port stay as they are.
    """
    connect_ray(cfg.ray)
    model_dir = ensure_model(cfg.model)
    log(f"model {cfg.model.name}: {model_dir}")
    actors = ensure_cluster(cfg, model_dir, detached=True)
    log(f"starting {len(actors.workers)} worker(s) ({cfg.directory.kind} directory) ...")
    wait_ready(actors, cfg.workers.startup_timeout_s)
    serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.server.route_prefix)
    return api_url(cfg)


def stop_serving(cfg: ClusterConfig) -> None:
    """Remove the app and the cluster's actors (Serve itself keeps running)."""
    serve.delete(cfg.name)
    kill_cluster(cfg)


def serve_until_stopped(cfg: ClusterConfig, log: Callable[[str], None] = print) -> None:
    """Serve until Ctrl-C or SIGTERM, then clean up."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        url = start_serving(cfg, log)
        log(f"chunkserve: serving {cfg.model.name!r} at {url} (Ctrl-C to stop)")
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        log("chunkserve: stopping ...")
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_serving(cfg)
