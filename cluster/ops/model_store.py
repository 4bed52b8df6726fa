"""Locating the checkpoint a config names, making a random one on first use."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from cluster.config import ModelSection


def ensure_model(model: ModelSection) -> Path:
    """The checkpoint directory, made from ``make_if_missing`` when absent.

    Invariant: the directory appears complete or not at all (written to a sibling
    temporary directory, then renamed), so concurrent callers never read half a model.
    """
    path = Path(model.path).expanduser()
    if (path / "config.json").exists():
        return path
    if model.make_if_missing is None:
        raise ValueError(
            f"model.path {str(path)!r} has no checkpoint (config.json); point it at a "
            "Hugging Face checkpoint directory or set model.make_if_missing"
        )
    from modeltools.make_model import make_model

    spec = model.make_if_missing
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        make_model(staging, preset=spec.preset, family=spec.family, seed=spec.seed, overwrite=True)
        try:
            os.rename(staging, path)  # atomic; fails if another caller got there first
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
