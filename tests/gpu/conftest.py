"""GPU tests: skipped without CUDA and FlashInfer; run on the GPU host (bench/gpu_run.sh)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not HAS_GPU:
                item.add_marker(pytest.mark.skip(reason="needs CUDA and flashinfer"))


@pytest.fixture(scope="session")
def qwen3_06b(tmp_path_factory) -> Path:
    """A random-weight checkpoint with the real Qwen3-0.6B shapes (bf16)."""
    from modeltools.make_model import make_model

    existing = os.environ.get("CHUNKSERVE_QWEN3_06B")
    if existing:
        return Path(existing)
    out = tmp_path_factory.mktemp("qwen3-0.6b")
    make_model(out, preset="qwen3-0.6b", family="qwen3", seed=0, overwrite=True)
    return out
