"""Shared fixtures: tiny random checkpoints made by ``make_model`` (once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest


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
