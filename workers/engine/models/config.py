"""The model shape, read from a Hugging Face ``config.json``.

Supported families: Qwen3 (per-head QK RMSNorm) and Llama 3 (optional ``llama3``
RoPE scaling). Both are pre-norm decoders with GQA, SiLU-gated MLPs and
optionally tied embeddings, so one implementation serves both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workers.engine.layers.rotary import RopeScaling

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist or is not a directory")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(
                f"{str(path)!r} has no config.json: expected a Hugging Face checkpoint "
                "directory (make one with `chunkserve make-model DIR`)"
            )
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from e
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: dict, source: Path | str = "<config>") -> ModelConfig:
        family = _family(raw, source)
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope_params = raw.get("rope_parameters") or {}
            return cls(
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope_params),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qk_norm=family == "qwen3",
                attention_bias=bool(raw.get("attention_bias", False)),
                eos_token_ids=_eos_ids(raw.get("eos_token_id")),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            )
        except KeyError as e:
            raise ValueError(f"config in {source} lacks required field {e.args[0]!r}") from e

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )


def _family(raw: dict, source: Path | str) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = raw.get("model_type")
    if model_type in ("qwen3", "llama"):
        return model_type
    raise ValueError(
        f"unsupported model in {source}: architectures={archs}, model_type={model_type!r}; "
        f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _rope_scaling(raw: dict) -> RopeScaling | None:
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: llama3")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
