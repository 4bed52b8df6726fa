"""Joining or starting Ray as a config says."""

from __future__ import annotations

import ray

from cluster.config import RaySection

_JOINING_ERROR = "When connecting to an existing cluster"


def connect_ray(section: RaySection, *, must_exist: bool = False) -> None:
    """``ray.init`` for this process (no-op when already connected).

    ``must_exist``: only join a running cluster (address null means "auto"), never
    start one (for commands that inspect a cluster)."""
    if ray.is_initialized():
        return
    address = section.address
    if must_exist and address is None:
        address = "auto"
    kwargs = {"namespace": section.namespace, "log_to_driver": True}
    if section.num_cpus is None or must_exist:
        ray.init(address=address, **kwargs)
        return
    try:
        ray.init(address=address, num_cpus=section.num_cpus, **kwargs)
    except ValueError as error:  # joining a running cluster: its size is not ours to set
        if _JOINING_ERROR not in str(error):
            raise
        ray.init(address=address, **kwargs)
