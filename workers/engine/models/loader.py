"""Load a Hugging Face checkpoint directory into a ``DecoderModel``.

Hugging Face stores q/k/v and gate/up projections separately; our layers fuse them,
so each source tensor is copied into its slice of the fused weight.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from workers.engine.models.config import ModelConfig
from workers.engine.models.decoder import DecoderModel

# source suffix -> (our parameter suffix, slice index within the fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def load_model(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> DecoderModel:
    with torch.device("meta"):
        model = DecoderModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    # Buffers are not in the checkpoint: rebuild them on the real device.
    model.rope_cache = model.build_rope_cache().to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in _iter_tensors(Path(model_dir)):
        target, part = _target(name, config)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in a {config.family} model")
        _copy(target, params[target], tensor, part, config)
        loaded.add(f"{target}#{part}")
    _check_complete(params, loaded, config)
    return model.eval()


def _iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(
            f"{str(model_dir)!r} has no model.safetensors or model.safetensors.index.json"
        )
    for file in files:
        path = model_dir / file
        if not path.is_file():
            raise ValueError(f"checkpoint shard {str(path)!r} listed in the index is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (
            OSError,
            RuntimeError,
            SafetensorError,
        ) as e:  # how safetensors reports a corrupt file
            raise ValueError(f"cannot read {str(path)!r}: {e}") from e


def _target(name: str, config: ModelConfig) -> tuple[str | None, int]:
    if name.startswith("model."):
        name = name[len("model.") :]
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None, 0
    if "rotary_emb" in name:
        return None, 0
    for source, (fused, part) in _FUSED.items():
        if f".{source}." in f".{name}":
            return name.replace(source, fused), part
    return name, -1


def _copy(
    target: str, param: torch.Tensor, tensor: torch.Tensor, part: int, config: ModelConfig
) -> None:
    if part < 0:
        dest = param
    elif ".qkv_proj." in target:
        sizes = [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
        dest = param.data.split(sizes, dim=0)[part]
    else:
        dest = param.data.split(config.intermediate_size, dim=0)[part]
    if dest.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor shape {tuple(tensor.shape)} does not match the model's "
            f"{tuple(dest.shape)}: config.json and weights disagree"
        )
    with torch.no_grad():
        dest.copy_(tensor.to(dest.dtype))


def _check_complete(params: dict[str, torch.Tensor], loaded: set[str], config: ModelConfig) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("qkv_proj.weight"):
            parts = [f"{name}#{i}" for i in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            parts = [f"{name}#{i}" for i in range(2)]
        else:
            parts = [f"{name}#-1"]
        missing += [p for p in parts if p not in loaded]
    if missing:
        raise ValueError(
            f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}: "
            "it does not match config.json"
        )
