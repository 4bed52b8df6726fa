"""The Hugging Face config and checkpoint files of chunkserve's model presets, shared by
``make_model`` (random weights) and ``docqa_train`` (the trained doc-QA model)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from modeltools.tokenizer_builder import chat_family

VOCAB_MULTIPLE = 64

MODEL_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config fields that make_model owns; everything else in the config class is overridable.
_RESERVED_FIELDS = {"architectures", "model_type", "transformers_version", "_name_or_path"}
_POSITIVE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
)
# ``rope_theta`` lives inside ``rope_parameters`` in transformers 5; accepted as a shortcut.
_ROPE_THETA = "rope_theta"


@dataclass(frozen=True)
class Preset:
    """Model shapes shared by both families."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    vocab_size: int | None  # None: the tokenizer's size rounded up to VOCAB_MULTIPLE
    llama3_original_max_position: int  # original_max_position_embeddings of llama3 RoPE
    dtype: torch.dtype


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        vocab_size=None,
        # Small, so llama3 frequency scaling changes the output at test lengths.
        llama3_original_max_position=256,
        dtype=torch.float32,
    ),
    "qwen3-0.6b": Preset(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        vocab_size=151936,
        llama3_original_max_position=8192,
        dtype=torch.bfloat16,
    ),
    # Qwen3-4B's shapes: a model whose prefill costs far more per token than moving its
    # KV over the host link (bench/host_tier.py), and a size to split across GPUs.
    "qwen3-4b": Preset(
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        vocab_size=151936,
        llama3_original_max_position=8192,
        dtype=torch.bfloat16,
    ),
    # Qwen3-8B's shapes: decode throughput over GPUs (tensor parallelism, issue figures in
    # bench/RESULTS.md); with --no-weights for engine.load_format dummy.
    "qwen3-8b": Preset(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        vocab_size=151936,
        llama3_original_max_position=8192,
        dtype=torch.bfloat16,
    ),
    # Llama 3 70B's shapes (use --family llama): 141 GB in bf16, more than one H200
    # holds; written with --no-weights and served with engine.load_format dummy.
    "llama3-70b": Preset(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=28672,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        vocab_size=128256,
        llama3_original_max_position=8192,
        dtype=torch.bfloat16,
    ),
    # Trained, not random: make_model delegates to modeltools.docqa_train (the tokenizer
    # is the doc-QA one, so vocab_size follows it).
    "docqa": Preset(
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=640,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        vocab_size=None,
        llama3_original_max_position=2048,
        dtype=torch.bfloat16,
    ),
}
TRAINED_PRESETS = ("docqa",)


def check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace")


def clear_stale_weights(out: Path) -> None:
    """Removes weight files an earlier checkpoint may have left (e.g. other shard counts)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()


def build_config(
    preset: str,
    family: str,
    tokenizer: PreTrainedTokenizerFast,
    overrides: Mapping[str, object] | None = None,
    dtype: str | torch.dtype | None = None,
) -> PretrainedConfig:
    """The transformers config of a preset, family and overrides."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    chat_family(family)  # rejects an unknown family
    p = PRESETS[preset]
    config_cls, model_cls = MODEL_CLASSES[family]
    kwargs: dict[str, object] = {
        "vocab_size": p.vocab_size or _round_up(len(tokenizer), VOCAB_MULTIPLE),
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": p.rms_norm_eps,
        "tie_word_embeddings": p.tie_word_embeddings,
        "attention_bias": False,
        "rope_parameters": _rope_parameters(family, p),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    _apply_overrides(kwargs, config_cls, overrides or {})
    config = config_cls(
        **kwargs,
        architectures=[model_cls.__name__],
        dtype=dtype_name(dtype or p.dtype),
    )
    _check_config(config, len(tokenizer))
    return config


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _rope_parameters(family: str, p: Preset) -> dict[str, object]:
    if family == "qwen3":
        return {"rope_type": "default", "rope_theta": p.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": p.rope_theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": p.llama3_original_max_position,
    }


def _apply_overrides(
    kwargs: dict[str, object],
    config_cls: type[PretrainedConfig],
    overrides: Mapping[str, object],
) -> None:
    defaults = config_cls().to_dict()
    fields = set(defaults) - _RESERVED_FIELDS - {"dtype"}
    unknown = sorted(k for k in overrides if k not in fields and k != _ROPE_THETA)
    if unknown:
        hint = " (use the dtype argument / --dtype)" if "dtype" in unknown else ""
        raise ValueError(
            f"unknown or reserved config field(s) {unknown} for {config_cls.__name__}{hint}; "
            f"overridable fields: {', '.join(sorted(fields))}, {_ROPE_THETA}"
        )
    for key, value in overrides.items():
        value = _typed_override(key, value, defaults.get(key, 0.0))
        if key == _ROPE_THETA:
            kwargs["rope_parameters"] = {**kwargs["rope_parameters"], "rope_theta": value}
        else:
            kwargs[key] = value


def _typed_override(key: str, value: object, default: object) -> object:
    """A field whose default is a bool, number, string, list or dict takes only that type,
    an int standing in for a float; fields that default to None take anything."""
    if type(default) is float and type(value) is int:
        return float(value)
    if default is not None and type(value) is not type(default):
        raise ValueError(
            f"config field {key!r} takes type {type(default).__name__}, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def dtype_name(dtype: str | torch.dtype) -> str:
    """The dtype's name as config.json spells it."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return name


def _check_config(config: PretrainedConfig, tokenizer_size: int) -> None:
    for field in _POSITIVE_FIELDS:
        if getattr(config, field) < 1:
            raise ValueError(f"{field} must be positive, got {getattr(config, field)}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    if config.vocab_size < tokenizer_size:
        raise ValueError(
            f"vocab_size {config.vocab_size} is smaller than the tokenizer ({tokenizer_size})"
        )


def write_config(out: Path, config: PretrainedConfig) -> None:
    """config.json via save_pretrained, plus the pre-5.0 names of dtype and RoPE
    (``torch_dtype``, ``rope_theta``, ``rope_scaling``) with equal values, so readers
    of either convention agree."""
    config.save_pretrained(out)
    path = out / "config.json"
    data = json.loads(path.read_text())
    rope = dict(data["rope_parameters"])
    data["torch_dtype"] = data["dtype"]
    data["rope_theta"] = rope.pop("rope_theta")
    data["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_generation_config(out: Path, tokenizer: PreTrainedTokenizerFast, family: str) -> None:
    stop_ids = tokenizer.convert_tokens_to_ids(list(chat_family(family).stop_tokens))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
