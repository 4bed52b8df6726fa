"""make-model writes checkpoints that transformers loads, with a working tokenizer and
chat template, deterministic weights and peaked logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.ops.cli import main
from modeltools.make_model import check_names_against_transformers, make_model, parameter_specs
from modeltools.model_config import PRESETS, build_config
from modeltools.tokenizer_builder import build_tokenizer

FAMILIES = ["qwen3", "llama"]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hi, "}, {"type": "text", "text": "you"}],
    },
]
EXPECTED_CHAT = {
    "qwen3": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi, you<|im_end|>\n",
        "<|im_start|>assistant\n",
    ),
    "llama": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi, you<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, make_model(tmp_path_factory.mktemp(family) / "m", family=family)


def _load(path: Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _logits(model: torch.nn.Module, batch: int = 4, length: int = 64, seed: int = 0):
    ids = torch.randint(0, 1000, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return ids, model(ids).logits


def _top_gap(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).flatten()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def test_tiny_loads_in_transformers_with_preset_shapes(tiny):
    family, path = tiny
    model = _load(path)
    config = model.config
    assert config.model_type == family
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size % 64 == 0 and not config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32
    raw = json.loads((path / "config.json").read_text())
    assert raw["dtype"] == raw["torch_dtype"] == "float32"
    expected_rope = "default" if family == "qwen3" else "llama3"
    assert raw["rope_parameters"]["rope_type"] == expected_rope
    if family == "llama":
        assert raw["rope_scaling"]["original_max_position_embeddings"] == 256


def test_chat_template_renders_as_specified(tiny):
    family, path = tiny
    tokenizer = AutoTokenizer.from_pretrained(path)
    body, generation_prompt = EXPECTED_CHAT[family]
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == body
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert rendered == body + generation_prompt


def test_tokenizer_round_trips_and_adds_no_special_tokens(tiny):
    family, path = tiny
    tokenizer = AutoTokenizer.from_pretrained(path)
    for text in ["Hello, world!", "café 3.14 ünïcödé 日本", "def f(x):\n    return x  # ok\n"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert not set(ids) & set(tokenizer.all_special_ids)
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == tokenizer.eos_token_id
    assert tokenizer.eos_token == ("<|im_end|>" if family == "qwen3" else "<|eot_id|>")


def test_written_names_match_transformers_state_dict(tiny):
    _, path = tiny
    model = _load(path)
    weights = _weights(path)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }


def test_logits_are_peaked(tiny):
    _, path = tiny
    _, logits = _logits(_load(path))
    gap = _top_gap(logits)
    assert 4.0 < logits.std().item() < 8.0
    assert (gap > 0.1).float().mean().item() >= 0.9


def test_tied_model_omits_lm_head_and_does_not_echo_its_input(tmp_path):
    path = make_model(tmp_path / "m", overrides={"tie_word_embeddings": True})
    assert "lm_head.weight" not in _weights(path)
    ids, logits = _logits(_load(path))
    assert (_top_gap(logits) > 0.1).float().mean().item() >= 0.9
    assert (logits.argmax(-1) == ids).float().mean().item() < 0.1


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a, b, c = (make_model(tmp_path / n, seed=s) for n, s in [("a", 1), ("b", 1), ("c", 2)])
    for name in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc = _weights(a), _weights(c)
    assert all(not torch.equal(wa[k], wc[k]) for k in wa)


def test_sharded_checkpoint_loads_and_equals_unsharded(tmp_path):
    single = make_model(tmp_path / "single", family="llama")
    sharded = make_model(tmp_path / "sharded", family="llama", shard_size_mb=0.1)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and files == {p.name for p in sharded.glob("*.safetensors")}
    assert not (sharded / "model.safetensors").exists()
    _, expected = _logits(_load(single))
    _, actual = _logits(_load(sharded))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_overwrite_replaces_shards(tmp_path):
    make_model(tmp_path, shard_size_mb=0.1)
    with pytest.raises(ValueError, match="not empty"):
        make_model(tmp_path)
    make_model(tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    _load(tmp_path)


def test_overrides_dtype_and_vocab_padding(tmp_path):
    path = make_model(
        tmp_path, overrides={"num_hidden_layers": 3, "vocab_size": 1088}, dtype="bfloat16"
    )
    weights = _weights(path)
    assert "model.layers.2.mlp.up_proj.weight" in weights
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    tokenizer_size = len(AutoTokenizer.from_pretrained(path))
    for name in ["model.embed_tokens.weight", "lm_head.weight"]:
        assert not weights[name][tokenizer_size:].any()
        assert weights[name][:tokenizer_size].abs().sum(-1).min() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen3_0_6b_preset_has_real_shapes(family):
    config = build_config("qwen3-0.6b", family, build_tokenizer(family))
    specs = parameter_specs(config, 1024)
    check_names_against_transformers(config, specs)
    total = sum(torch.Size(s.shape).numel() for s in specs)
    assert config.tie_word_embeddings and config.vocab_size == 151936
    assert str(config.dtype).endswith("bfloat16") and PRESETS["qwen3-0.6b"].head_dim == 128
    qk_norms = 28 * 2 * 128 if family == "qwen3" else 0
    assert total == 596042752 + qk_norms  # Qwen3-0.6B without the tied lm_head


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "huge"}, "unknown preset"),
        ({"family": "gpt2"}, "unknown model family"),
        ({"overrides": {"hidden_sise": 32}}, "unknown or reserved config field"),
        ({"overrides": {"dtype": "float16"}}, "--dtype"),
        ({"overrides": {"hidden_size": "big"}}, "takes type int"),
        ({"overrides": {"num_key_value_heads": 3}}, "multiple of num_key_value_heads"),
        ({"overrides": {"attention_bias": True}}, "change the model's parameters"),
        ({"dtype": "int8"}, "unsupported dtype"),
        ({"shard_size_mb": 0}, "shard size must be positive"),
    ],
)
def test_bad_input_raises_value_error_and_writes_nothing(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_cli_make_model(tmp_path, capsys):
    out = tmp_path / "m"
    argv = ["make-model", str(out), "--family", "llama", "--seed", "3", "--set"]
    assert main([*argv, "num_hidden_layers=3", "--shard-size-mb", "0.2"]) == 0
    printed = capsys.readouterr().out
    assert "model.safetensors.index.json" in printed and str(out) in printed
    assert _load(out).config.num_hidden_layers == 3

    assert main(["make-model", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["make-model", str(tmp_path / "x"), "--preset", "huge"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown preset" in err
    assert main(["make-model", str(tmp_path / "x"), "--set", "nokey"]) == 2
