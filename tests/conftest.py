"""Shared fixtures: tiny random checkpoints made by ``make_model`` (once per session).

Two lanes: ``python -m pytest`` runs the fast one (pyproject's addopts deselect the
``integration`` marker), ``python -m pytest -m integration`` the other: every test that
starts Ray or Redis (marked ``ray`` or ``redis``), processes or benchmarks."""

from __future__ import annotations

from pathlib import Path

import pytest

_INTEGRATION_MARKERS = ("ray", "redis")
# Modules that start processes (the engine's child process, the CLI under pexpect) or
# run benchmarks: the integration lane's too.
_INTEGRATION_MODULES = (
    "tests/bench/",
    "tests/workers/runtime/test_engine_host.py",
    "tests/cluster/ops/test_chat_cli.py",
    "tests/cluster/ops/test_serve_command.py",
    "tests/cluster/routing/test_routing_bench.py",
)


@pytest.hookimpl(tryfirst=True)  # before -m selects: the lane marker must be there
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parents[1]
    for item in items:
        where = item.path.resolve().relative_to(root).as_posix()
        marked = any(item.get_closest_marker(name) for name in _INTEGRATION_MARKERS)
        if marked or where.startswith(_INTEGRATION_MODULES):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """Returns ``make(family="qwen3", tied=False, **overrides) -> Path``, cached."""
    from modeltools.make_model import make_model

    cache: dict[tuple, Path] = {}

    def make(family: str = "qwen3", tied: bool = False, **overrides) -> Path:
        key = (family, tied, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{family}-{'tied' if tied else 'untied'}")
            make_model(
                out,
                preset="tiny",
                family=family,
                seed=0,
                overrides={"tie_word_embeddings": tied, **overrides},
                overwrite=True,
            )
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_qwen3(model_factory) -> Path:
    return model_factory("qwen3", tied=False)


@pytest.fixture(scope="session")
def tiny_llama(model_factory) -> Path:
    return model_factory("llama", tied=False)


@pytest.fixture(scope="session")
def hf_reference():
    """Loads the transformers model for a checkpoint directory (cached)."""
    import torch
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(model_dir: Path):
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32
            ).eval()
        return cache[model_dir]

    return load
