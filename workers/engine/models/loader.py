"""Load a Hugging Face checkpoint directory into a ``DecoderModel``.

Hugging Face stores q/k/v and gate/up projections separately; our layers fuse them,
so each source tensor is copied into its slice of the fused weight. A tensor-parallel
rank (``tp.shard``) reads only its own rows or columns of each tensor from the
safetensors files, so no rank holds the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from workers.engine.models.config import ModelConfig
from workers.engine.models.decoder import DecoderModel
from workers.engine.tp.shard import SINGLE, Shard

# source suffix -> (our parameter suffix, slice index within the fused weight)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def weight_bytes(config: ModelConfig, dtype: torch.dtype, shard: Shard = SINGLE) -> int:
    """Bytes of the weights one rank holds (counted on the meta device: nothing is
    allocated)."""
    with torch.device("meta"):
        model = DecoderModel(config, shard)
    model.tie_weights()
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard = SINGLE,
    load_format: str = "safetensors",
) -> DecoderModel:
    """``config``: the whole model's; ``shard``: the part this rank loads;
    ``load_format``: ``safetensors`` reads the checkpoint's weights, ``dummy`` makes
    random ones in place (``_init_dummy``) and reads no weight file."""
    with torch.device("meta"):
        model = DecoderModel(config, shard)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    # Buffers are not in the checkpoint: rebuild them on the real device.
    model.rope_cache = model.build_rope_cache().to(device)
    if load_format == "dummy":
        _init_dummy(model, shard)
        return model.eval()
    if load_format != "safetensors":
        raise ValueError(f"load_format must be safetensors or dummy, got {load_format!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    local = model.config
    loaded: set[str] = set()
    for name, stored in _iter_tensors(Path(model_dir)):
        target, part = _target(name, config)
        if target is None:
            continue
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in a {config.family} model")
        tensor = _read_part(stored, target, part, config, shard)
        _copy(target, params[target], tensor, part, local)
        loaded.add(f"{target}#{part}")
    _check_complete(params, loaded, config)
    return model.eval()


@torch.no_grad()
def _init_dummy(model: DecoderModel, shard: Shard, seed: int = 0) -> None:
    """Random weights drawn on the device, each rank from its own seed (a dummy model
    is the same shapes, not the same weights, at every tensor_parallel_size): norms 1,
    embeddings N(0, 1), projections N(0, 1/fan_in) (the LM head's too), so activations
    keep their scale through the layers."""
    generator = torch.Generator(device=model.lm_head.weight.device)
    generator.manual_seed(seed * 1_000_003 + shard.rank)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        elif name == "embed_tokens.weight":
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)


def _read_part(stored, target: str, part: int, config: ModelConfig, shard: Shard) -> torch.Tensor:
    """The rows or columns of checkpoint tensor ``stored`` (a safetensors slice) that
    ``shard`` holds, read from the file alone; the whole tensor for one rank. A row
    parallel bias (o_proj's) is rank 0's: the others' are zeros."""
    if not shard.parallel:
        return stored[:]
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None
    head_dim = config.head_dim
    if ".qkv_proj." in target:
        first, last = shard.head_rows(config) if part == 0 else shard.kv_head_rows(config)
        rows = (first * head_dim, last * head_dim)
    elif ".gate_up_proj." in target:
        rows = shard.mlp_columns(config)
    elif target.endswith("self_attn.o_proj.weight"):
        first, last = shard.head_rows(config)
        columns = (first * head_dim, last * head_dim)
    elif target.endswith("mlp.down_proj.weight"):
        columns = shard.mlp_columns(config)
    elif target in ("embed_tokens.weight", "lm_head.weight"):
        first, last = shard.vocab_rows(config.vocab_size)
        return _padded_rows(stored[first:last], shard.vocab_per_rank(config.vocab_size))
    elif target.endswith("self_attn.o_proj.bias"):
        return stored[:] if shard.rank == 0 else torch.zeros(stored.get_shape())
    if rows is not None:
        return stored[rows[0] : rows[1]]
    if columns is not None:
        return stored[:, columns[0] : columns[1]]
    return stored[:]  # norms: every rank holds them whole


def _padded_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows after it up to ``rows``: the last rank's vocabulary
    rows past the end, which then score and embed nothing."""
    if tensor.shape[0] == rows:
        return tensor
    padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: tensor.shape[0]] = tensor
    return padded


def _iter_tensors(model_dir: Path) -> Iterator[tuple[str, object]]:
    """(name, slice) of every tensor in the checkpoint: ``slice[...]`` reads that part
    of the tensor from the file (``slice[:]``: all of it)."""
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
                    yield name, f.get_slice(name)
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
    target: str,
    param: torch.Tensor,
    tensor: torch.Tensor,
    part: int,
    config: ModelConfig,
) -> None:
    """Copy ``tensor`` into ``param`` (its ``part`` of a fused weight); ``config``: the
    shape of the rank's layers."""
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
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # q, k and v parts
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
