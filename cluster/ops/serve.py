"""Starting and stopping a serving cluster: Ray, directory, workers, HTTP app.

Invariants:
- Nothing starts that the Ray cluster cannot place: the workers and router replicas
  are checked against its resources first, and a shortfall is a ``ValueError``
  (``cluster.ops.actors.check_placement``), before any actor exists.
- ``serve_until_stopped`` removes the app and its actors however it ends: a stop
  signal, Ctrl-C (even during start) or an error.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ray import serve

from cluster.config import ClusterConfig
from cluster.http.app import build_app
from cluster.ops.actors import (
    check_placement,
    ensure_cluster,
    kill_cluster,
    replica_demand,
    wait_ready,
    worker_demand,
)
from cluster.ops.model_store import ensure_model
from cluster.ops.ray_session import connect_ray, quiet

# Signals that stop serving as a request (exit 0); SIGINT (Ctrl-C) interrupts (130).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def api_url(cfg: ClusterConfig) -> str:
    """Base URL of the OpenAI API (what clients pass as ``base_url``)."""
    host = cfg.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    prefix = cfg.server.route_prefix.rstrip("/")
    return f"http://{host}:{cfg.server.port}{prefix}/v1"


def start_serving(cfg: ClusterConfig, log: Callable[[str], None] = print) -> str:
    """Start (or join) everything the config describes; returns the API URL.

    If Serve already runs on the cluster, its proxies, HTTP host and port stay as they
    are (with ``server.ingress: serve_proxy`` the app is then reached at Serve's port).
    """
    return _launch(cfg, _prepare(cfg, log), log)


def stop_serving(cfg: ClusterConfig) -> None:
    """Remove the app and the cluster's actors (Serve itself keeps running)."""
    if cfg.name in serve.status().applications:  # status() never starts Serve
        serve.delete(cfg.name)
    kill_cluster(cfg)


def serve_until_stopped(cfg: ClusterConfig, log: Callable[[str], None] = print) -> None:
    """Serve until SIGTERM or SIGHUP (then return) or Ctrl-C (then raise
    ``KeyboardInterrupt``), removing the app and its actors on the way out."""
    model_dir = _prepare(cfg, log)  # before anything exists that needs removing
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    try:
        url = _launch(cfg, model_dir, log)
        log(f"chunkserve: serving {cfg.model.name!r} at {url} (Ctrl-C to stop)")
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log("chunkserve: stopping (removing the app and its workers) ...")
        with _uninterrupted():
            stop_serving(cfg)


def _prepare(cfg: ClusterConfig, log: Callable[[str], None]) -> Path:
    """Join or start Ray, find the model, and check that the cluster fits."""
    connect_ray(cfg.ray)
    model_dir = ensure_model(cfg.model)
    log(f"model {cfg.model.name}: {model_dir}")
    running = cfg.name in serve.status().applications  # a redeploy keeps its replicas
    check_placement(cfg, lambda: [worker_demand(cfg), replica_demand(cfg, running=running)])
    return model_dir


def _launch(cfg: ClusterConfig, model_dir: Path, log: Callable[[str], None]) -> str:
    actors = ensure_cluster(cfg, model_dir, detached=True)
    log(f"starting {len(actors.workers)} worker(s) ({cfg.directory.kind} directory) ...")
    wait_ready(actors, cfg.workers.startup_timeout_s)
    # Serve's INFO lines ("Connecting to existing Serve app ... will not be applied",
    # said by serve.run after the start below; "ready at" Serve's proxy address) would
    # mislead: the CLI prints where the API is
    with quiet("ray.serve", level=logging.WARNING):
        if cfg.server.ingress == "replicas":  # the replicas listen themselves: no proxy
            serve.start(proxy_location="Disabled")
        else:
            serve.start(http_options={"host": cfg.server.host, "port": cfg.server.port})
        serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.server.route_prefix)
    return api_url(cfg)


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ctrl-C is ignored inside (a second Ctrl-C must not leave workers running)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
