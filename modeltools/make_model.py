"""Random-weight checkpoints in the Hugging Face layout, for tests and benchmarks.

``make_model(out_dir)`` writes config.json, model.safetensors (or shards plus
model.safetensors.index.json), generation_config.json and the tokenizer files, so that
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load the directory as is.

Invariants:
- Weights are drawn in float32 from a generator seeded by (seed, parameter name), then
  cast to the checkpoint dtype: the same arguments give byte-identical files, and a
  tensor's values do not depend on which other tensors exist.
- Activations stay O(1) and logits are peaked (top-1 clearly above top-2), so greedy
  decoding is not decided by rounding noise: linear weights ~ N(0, 1/fan_in), RMSNorm
  weights ~ 1 + N(0, 0.1^2) (q_norm and k_norm included), and logits have a standard
  deviation of about LM_HEAD_LOGIT_STD: untied, embeddings ~ N(0, 1) and
  lm_head ~ N(0, LM_HEAD_LOGIT_STD^2 / hidden); tied, see ``parameter_specs``.
- Embedding and lm_head rows past the tokenizer's size are zero (see ``parameter_specs``).
- The parameter names and shapes written equal the state dict of the transformers model
  class (checked on the meta device before any weight is drawn); a tied lm_head is not
  written, as in Hugging Face checkpoints.
- After a successful call, the directory's weight files are exactly those written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import (
    PretrainedConfig,
)

from modeltools.model_config import (
    DTYPES,
    MODEL_CLASSES,
    TRAINED_PRESETS,
    build_config,
    check_out_dir,
    clear_stale_weights,
    dtype_name,
    write_config,
    write_generation_config,
)
from modeltools.tokenizer_builder import build_tokenizer, save_tokenizer

LM_HEAD_LOGIT_STD = 6.0
NORM_WEIGHT_STD = 0.1
DEFAULT_SHARD_SIZE_MB = 2048


@dataclass(frozen=True)
class ParamSpec:
    """One checkpoint tensor: values are ``mean + std * N(0, 1)``, except that rows at
    and after ``live_rows`` (vocabulary padding) are zero."""

    name: str
    shape: tuple[int, ...]
    mean: float
    std: float
    live_rows: int | None = None


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    family: str = "qwen3",
    seed: int = 0,
    overrides: Mapping[str, object] | None = None,
    dtype: str | torch.dtype | None = None,
    shard_size_mb: float = DEFAULT_SHARD_SIZE_MB,
    overwrite: bool = False,
    weights: bool = True,
) -> Path:
    """Writes a random-weight checkpoint into ``out_dir`` and returns its path.
    Every argument is validated before anything is written. ``weights=False`` writes
    the config and tokenizer alone: a model for ``engine.load_format: dummy`` (shapes
    too large to write, e.g. ``llama3-70b``).

    ``preset="docqa"`` trains the doc-QA model instead (``modeltools.docqa_train``, with
    its default training options; qwen3 family only)."""
    if preset in TRAINED_PRESETS:
        if family != "qwen3":
            raise ValueError(f"preset {preset!r} exists for the qwen3 family only")
        from modeltools.docqa_train import make_docqa_model

        return make_docqa_model(out_dir, seed, overrides, dtype, overwrite)
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    if shard_size_mb <= 0:
        raise ValueError(f"shard size must be positive, got {shard_size_mb} MB")
    tokenizer = build_tokenizer(family)
    config = build_config(preset, family, tokenizer, overrides, dtype)
    specs = parameter_specs(config, len(tokenizer))
    check_names_against_transformers(config, specs)
    clear_stale_weights(out)
    if weights:
        dtype_ = DTYPES[dtype_name(config.dtype)]
        write_weights(out, specs, seed, dtype_, int(shard_size_mb * 2**20))
    write_config(out, config)
    write_generation_config(out, tokenizer, family)
    tokenizer.model_max_length = config.max_position_embeddings
    save_tokenizer(tokenizer, out)
    return out


def parameter_specs(config: PretrainedConfig, tokenizer_size: int) -> list[ParamSpec]:
    """Every tensor the checkpoint holds, in Hugging Face naming, in write order.

    Embedding and lm_head rows of ids the tokenizer never produces are zero, so their
    logit is exactly 0 while the top logits are far above it: greedy decoding never
    emits an id the tokenizer cannot decode."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    tied = config.tie_word_embeddings
    # A tied matrix is also the lm_head, so it is drawn like one (fan_in = hidden) and the
    # logit scale moves into the final norm. At N(0, 1) a token's own embedding would
    # dominate the final hidden state and greedy decoding would repeat the input token.
    embed_std = hidden**-0.5 if tied else 1.0
    final_norm_scale = LM_HEAD_LOGIT_STD if tied else 1.0
    vocab = (config.vocab_size, hidden)
    specs = [ParamSpec("model.embed_tokens.weight", vocab, 0.0, embed_std, tokenizer_size)]
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        specs += [
            _norm(f"{layer}.input_layernorm.weight", hidden),
            _linear(f"{layer}.self_attn.q_proj.weight", q_dim, hidden),
            _linear(f"{layer}.self_attn.k_proj.weight", kv_dim, hidden),
            _linear(f"{layer}.self_attn.v_proj.weight", kv_dim, hidden),
            _linear(f"{layer}.self_attn.o_proj.weight", hidden, q_dim),
        ]
        if config.model_type == "qwen3":  # per-head RMSNorm of queries and keys
            specs += [
                _norm(f"{layer}.self_attn.q_norm.weight", head_dim),
                _norm(f"{layer}.self_attn.k_norm.weight", head_dim),
            ]
        specs += [
            _norm(f"{layer}.post_attention_layernorm.weight", hidden),
            _linear(f"{layer}.mlp.gate_proj.weight", inter, hidden),
            _linear(f"{layer}.mlp.up_proj.weight", inter, hidden),
            _linear(f"{layer}.mlp.down_proj.weight", hidden, inter),
        ]
    specs.append(_norm("model.norm.weight", hidden, final_norm_scale))
    if not tied:
        lm_std = LM_HEAD_LOGIT_STD / hidden**0.5
        specs.append(ParamSpec("lm_head.weight", vocab, 0.0, lm_std, tokenizer_size))
    return specs


def _linear(name: str, out_features: int, in_features: int) -> ParamSpec:
    return ParamSpec(name, (out_features, in_features), 0.0, in_features**-0.5)


def _norm(name: str, size: int, scale: float = 1.0) -> ParamSpec:
    return ParamSpec(name, (size,), scale, scale * NORM_WEIGHT_STD)


def check_names_against_transformers(config: PretrainedConfig, specs: list[ParamSpec]) -> None:
    """Raises ValueError unless ``specs`` match the model class's state dict exactly."""
    with torch.device("meta"):
        model = MODEL_CLASSES[config.model_type][1](config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    ours = {s.name: s.shape for s in specs}
    if ours != expected:
        differing = sorted(set(ours.items()) ^ set(expected.items()))[:6]
        raise ValueError(
            "these config overrides change the model's parameters beyond what make-model "
            f"generates (first differences: {differing}); drop them"
        )


def write_weights(
    out: Path, specs: list[ParamSpec], seed: int, dtype: torch.dtype, shard_bytes: int
) -> None:
    """Writes model.safetensors, or shards plus an index when above ``shard_bytes``.
    Holds one shard in memory at a time."""
    shards = _plan_shards(specs, dtype, shard_bytes)
    names = _shard_file_names(len(shards))
    for shard, file_name in zip(shards, names, strict=True):
        tensors = {s.name: _draw(s, seed).to(dtype) for s in shard}
        save_file(tensors, out / file_name, metadata={"format": "pt"})
    if len(shards) > 1:
        _write_index(out, shards, names, dtype)


def _plan_shards(
    specs: list[ParamSpec], dtype: torch.dtype, shard_bytes: int
) -> list[list[ParamSpec]]:
    """Greedy, in order; a tensor larger than a shard gets a shard of its own."""
    shards: list[list[ParamSpec]] = [[]]
    used = 0
    for spec in specs:
        size = _nbytes(spec, dtype)
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def _nbytes(spec: ParamSpec, dtype: torch.dtype) -> int:
    return torch.Size(spec.shape).numel() * dtype.itemsize


def _shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _write_index(
    out: Path, shards: list[list[ParamSpec]], names: list[str], dtype: torch.dtype
) -> None:
    weight_map = {s.name: name for shard, name in zip(shards, names, strict=True) for s in shard}
    total = sum(_nbytes(s, dtype) for shard in shards for s in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _draw(spec: ParamSpec, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    values = torch.randn(spec.shape, generator=generator, dtype=torch.float32)
    values.mul_(spec.std).add_(spec.mean)
    if spec.live_rows is not None:
        values[spec.live_rows :] = 0.0
    return values


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes < 2**63
