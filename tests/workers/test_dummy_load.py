"""``engine.load_format: dummy``: a checkpoint of config and tokenizer alone
(``make-model --no-weights``) serves with random weights made in place, on one rank
or several; how much of a GPU a rank's weights take is counted without allocating."""

from __future__ import annotations

import pytest
import torch

from modeltools.make_model import make_model
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.models.config import ModelConfig
from workers.engine.models.loader import weight_bytes
from workers.engine.sampling_params import SamplingParams
from workers.engine.tp.shard import Shard


@pytest.fixture(scope="module")
def no_weights(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("dummy"), preset="tiny", weights=False)


@pytest.mark.integration  # the 2-rank engine's ranks are processes
def test_a_config_without_weights_serves_with_load_format_dummy(no_weights):
    assert not list(no_weights.glob("*.safetensors"))
    with pytest.raises(ValueError, match="has no model.safetensors"):
        Engine(EngineConfig(str(no_weights), device="cpu", num_pages=64))
    outputs = []
    for world in (1, 2):
        engine = Engine(
            EngineConfig(
                str(no_weights), device="cpu", num_pages=64, load_format="dummy",
                tensor_parallel_size=world,
            )
        )  # fmt: skip
        try:
            embed = engine.runner.model.embed_tokens.weight
            assert embed.abs().sum() > 0 and torch.isfinite(embed).all()
            engine.add_request("r", list(range(5, 40)), SamplingParams(max_tokens=4, temperature=0))
            tokens = []
            while engine.has_unfinished():
                for out in engine.step():
                    tokens += out.new_token_ids
            outputs.append(tokens)
        finally:
            engine.close()
    assert [len(t) for t in outputs] == [4, 4]


def test_weight_bytes_counts_one_ranks_part(tmp_path):
    path = make_model(tmp_path / "70b", preset="llama3-70b", family="llama", weights=False)
    config = ModelConfig.from_dir(path)
    whole = weight_bytes(config, torch.bfloat16)
    assert 140e9 < whole < 142e9  # Llama 3 70B in bf16: more than an H200's 141 GB
    halves = [weight_bytes(config, torch.bfloat16, Shard(rank, 2)) for rank in (0, 1)]
    assert halves[0] == halves[1]
    # every matrix but the norms splits in two (the norms are whole on each rank)
    norms = (2 * config.num_layers + 1) * config.hidden_size * 2
    assert halves[0] == pytest.approx((whole - norms) / 2 + norms, rel=1e-6)
