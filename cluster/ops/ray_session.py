"""Joining or starting Ray as a config says.

A Ray cluster that cannot be reached is a ``RayUnreachable`` naming the address
tried and how to give another, raised within ``_PROBE_TIMEOUT_S`` (``ray.init``
itself waits minutes on an address where nothing listens).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from cluster.config import RaySection

_JOINING_ERROR = "When connecting to an existing cluster"
_PROBE_TIMEOUT_S = 3.0
_HOW_TO_POINT = (
    "start one (`chunkserve serve`, `ray start --head`) or point at a running one with "
    "--set ray.address=HOST:PORT (its GCS address, as `ray start` prints it) or RAY_ADDRESS"
)


class RayUnreachable(ConnectionError):
    """No Ray cluster answers where the config (or RAY_ADDRESS) points."""


def connect_ray(section: RaySection, *, must_exist: bool = False) -> None:
    """``ray.init`` for this process (no-op when already connected).

    ``must_exist``: only join a running cluster (address null means "auto"), never
    start one (for commands that inspect a cluster)."""
    if ray.is_initialized():
        return
    address = section.address
    if must_exist and address is None:
        address = "auto"
    _probe(address)
    kwargs = {"namespace": section.namespace, "log_to_driver": True}
    if section.num_cpus is None or must_exist:
        _init(address, kwargs)
        return
    try:
        with quiet(_TOKEN_NOTES):
            ray.init(address=address, num_cpus=section.num_cpus, **kwargs)
    except ValueError as error:  # joining a running cluster: its size is not ours to set
        if _JOINING_ERROR not in str(error):
            raise
        _init(address, kwargs)


@contextmanager
def quiet(*loggers: str, level: int = logging.ERROR) -> Iterator[None]:
    """Raise ``loggers``' levels to ``level`` meanwhile: Ray's notes on routine steps
    that a chunkserve user has nothing to do about (the CLI says what happens)."""
    previous = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, old in previous.items():
            logging.getLogger(name).setLevel(old)


# on every start of a local cluster: token authentication is on, a token was saved
_TOKEN_NOTES = "ray._private.authentication.authentication_token_setup"


def _init(address: str | None, kwargs: dict) -> None:
    try:
        with quiet(_TOKEN_NOTES):
            ray.init(address=address, **kwargs)
    except ConnectionError:  # "auto" found no cluster
        tried = os.environ.get("RAY_ADDRESS") or "this machine (ray.address null, no RAY_ADDRESS)"
        raise RayUnreachable(f"no running Ray cluster found on {tried}; {_HOW_TO_POINT}") from None


def _probe(address: str | None) -> None:
    """Fail fast where a GCS address (host:port, here or from RAY_ADDRESS) does not
    accept connections. Other forms (auto, local, ray://) are left to ``ray.init``."""
    if address in (None, "auto"):
        address, source = os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"
    else:
        source = "ray.address"
    if not address or "://" in address or address == "local":
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise RayUnreachable(
            f"no Ray cluster at {address} ({source}): {reason}; {_HOW_TO_POINT}"
        ) from None
