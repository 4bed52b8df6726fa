"""Engine configuration (frozen; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

# The system turn position-free entries are computed after (``chunking.entry_context``):
# a chunk computed alone from position 0 sees no conversation opening and, in a model
# that binds facts across its context, its KV placed elsewhere answers little better
# than chance (bench/RESULTS.md); after an ordinary system turn it stays close to the
# KV computed in context, whichever system prompt the request has.
DEFAULT_ENTRY_SYSTEM_PROMPT = "You are a helpful assistant."

# Approximate reuse: the layer whose K/V deviation (placed vs this context) selects the
# tokens to recompute; the layers before it run over every position up to the last
# placed chunk, and their KV is kept. On the doc-QA model (8 layers), selecting at layer 3
# instead of 1 (CacheBlend's choice) gives 99.7% 16-document two-hop accuracy against
# 96.7%, with fewer tokens recomputed (bench/reuse_quality.py --device cpu --docs 16
# --deviation-layer L, in bench/RESULTS.md). Models shallower than this use their last.
DEFAULT_DEVIATION_LAYER = 3


def resolve_deviation_layer(configured: int | None, num_layers: int) -> int:
    """The layer approximate repair selects at: the configured one (it must exist), or
    the default capped at the model's last layer."""
    if configured is None:
        return max(0, min(DEFAULT_DEVIATION_LAYER, num_layers - 1))
    if configured >= num_layers:
        raise ValueError(
            f"deviation_layer {configured} is not a layer of this model "
            f"({num_layers} layers: 1 to {num_layers - 1})"
        )
    return configured


def setting(default: object, doc: str, **bounds: float) -> object:
    """An engine setting: its default, its documentation (what the cluster config's
    ``engine`` section and its checks show users) and its bounds as pydantic spells
    them (``gt``, ``ge``, ``le``), checked again by ``EngineConfig.__post_init__``."""
    return field(default=default, metadata={"doc": doc, "bounds": bounds})


# Set by whoever builds the engine, never by the cluster config's engine section
# (a cluster sets tensor_parallel_size from workers.tensor_parallel_size, beside the
# GPUs each worker reserves).
BUILT_BY_CALLER = ("model_dir", "model_id", "tenant_salt", "tensor_parallel_size")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings: written once here, with their documentation; the cluster
    config's ``engine`` section is derived from these fields (``cluster.config``)."""

    model_dir: str
    device: str | None = setting(None, "cuda or cpu; null: cuda where available")
    dtype: Literal["float32", "bfloat16", "float16"] | None = setting(
        None, "null: bfloat16 on cuda, float32 on cpu"
    )
    load_format: Literal["safetensors", "dummy"] = setting(
        "safetensors",
        "safetensors: the checkpoint's weights; dummy: random weights made in place on the "
        "device, none read (speed work on shapes too large to write: `chunkserve "
        "make-model DIR --no-weights`); outputs are gibberish",
    )
    page_size: int = setting(16, "tokens per KV page (a power of two)", gt=0)
    num_pages: int | None = setting(
        None, "KV pages per worker; null: sized from free memory (kv_cache_memory)", ge=2
    )
    gpu_memory_utilization: float = setting(
        0.85, "share of GPU memory for weights and KV cache", gt=0, le=1
    )
    cpu_kv_cache_bytes: int = setting(256 * 2**20, "KV cache size on CPU workers, in bytes", gt=0)
    host_kv_gib: float = setting(
        0.0,
        "GiB of host memory (pinned on cuda) for a second KV tier: pages and chunk "
        "entries the pool evicts for room are kept there and loaded back instead of "
        "computed again; 0: off. A size above the host's available memory is refused",
        ge=0,
    )
    host_kv_write: Literal["all", "reused"] = setting(
        "all",
        "which evictions the host KV tier keeps: all; or reused, a page once a later "
        "request matched it and an entry once placed, or either on its second eviction "
        "(KV seen once costs no write)",
    )
    tensor_parallel_size: int = setting(
        1,
        "devices one worker's model is split over (its heads, MLP columns and vocabulary; "
        "each device holds its KV heads' pages): N ranks, one process each, joined by "
        "NCCL (gloo on CPU workers). It must divide the model's attention heads and MLP "
        "size, and divide or be a multiple of its KV heads (then replicated)",
        ge=1,
    )
    max_num_seqs: int = setting(256, "sequences running at once per worker", gt=0)
    max_num_batched_tokens: int = setting(
        8192, "tokens computed per engine step (prefill chunking)", gt=0
    )
    max_model_len: int | None = setting(
        None, "context length; null: the model's, capped by the KV pool", ge=2
    )
    enable_reuse: bool = setting(True, "reuse cached KV pages of equal prefixes")
    min_entry_tokens: int = setting(
        32,
        "approximate reuse: a chunk that misses is kept as a position-free entry only "
        "if it has at least this many tokens",
        gt=0,
    )
    entries_from_context: bool = setting(
        True,
        "approximate reuse: a missed chunk's entry is the KV its request computed in "
        "context, moved to position 0 (no second forward; repaired like any entry where "
        "it is placed); false: computed again after the entry context, in the background",
    )
    entry_reserve: float | None = setting(
        None,
        "approximate reuse: the share of the KV pool that entries placed at least once "
        "keep against new requests while others run (such a request waits for their "
        "pages instead of evicting what saves most); 0: entries give way to any request; "
        "null: 0.5 without a host KV tier, 0 with one (an entry evicted there comes back "
        "from host memory, so holding it costs more than it saves; with a tier far "
        "smaller than the entries in use, set it)",
        ge=0,
        le=1,
    )
    batch_admissions: bool = setting(
        True,
        "approximate reuse: the selection forwards of the requests one step admits run "
        "as one forward (the projections read the weights once for all of them); false: "
        "one forward each (bench/approx_speed.py's 'one forward each' variant)",
    )
    entry_system_prompt: str | None = setting(
        DEFAULT_ENTRY_SYSTEM_PROMPT,
        "approximate reuse: position-free entries are computed after a system turn with "
        "this prompt and the opening of a user turn (use the system prompt most of your "
        "traffic has); null: each chunk alone from position 0, which on models that read "
        "their context answers far worse",
    )
    deviation_layer: int | None = setting(
        None,
        "approximate reuse: the layer whose K/V deviation selects the placed tokens to "
        "recompute (the layers before it run over every placed token); null: layer 3, or "
        "the last layer of a shallower model. Measure your model with "
        "bench/reuse_quality.py --deviation-layer",
        ge=1,
    )
    placed_low_layers: Literal["context", "entries"] = setting(
        "context",
        "approximate reuse: the KV of placed positions that are not recomputed, in the "
        "layers below deviation_layer: context (what the selecting forward computed there "
        "in this prompt, kept) or entries (the chunk entries' own, placed as in the layers "
        "above: the numerics of placement without per-request copies; measure it with "
        "bench/reuse_quality.py --low-layers)",
    )
    pin_quota_tokens: int | None = setting(
        None,
        "registered chunks: the most tokens one tenant (API key) may pin per worker; "
        "null: no quota beyond the worker's room",
        ge=0,
    )
    attention_backend: Literal["torch", "flashinfer"] | None = setting(
        None, "null: flashinfer on cuda, torch elsewhere"
    )
    enable_cascade: bool = setting(
        True, "cascade attention for shared prefixes, where the cost model says it pays"
    )
    enable_cuda_graphs: bool = setting(
        True, "CUDA graphs for decode and prefill steps (flashinfer)"
    )
    skinny_matmul: bool = setting(
        True,
        "batch-1 steps run each projection (QKV and gate-up with the norm before them) "
        "through the skinny Triton kernel where it measured faster than cuBLAS at start "
        "(layers/skinny_choice; fused ops and CUDA graphs only)",
    )
    overlap_scheduling: bool | None = setting(
        None,
        "schedule and prepare each step while the GPU runs the one before (outputs "
        "unchanged, one step later); null: on with CUDA, off on CPU workers",
    )
    model_id: str | None = None  # name in the key namespace; None: the directory's name
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError(f"cpu_kv_cache_bytes must be > 0, got {self.cpu_kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.pin_quota_tokens is not None and self.pin_quota_tokens < 0:
            raise ValueError(f"pin_quota_tokens must be >= 0, got {self.pin_quota_tokens}")
        if self.entry_reserve is not None and not 0 <= self.entry_reserve <= 1:
            raise ValueError(f"entry_reserve must be in [0, 1], got {self.entry_reserve}")
        if self.min_entry_tokens < 1:
            raise ValueError(f"min_entry_tokens must be >= 1, got {self.min_entry_tokens}")
        if self.deviation_layer is not None and self.deviation_layer < 1:
            raise ValueError(
                f"deviation_layer must be >= 1 (layer 0's KV depends on the token and its "
                f"position alone), got {self.deviation_layer}"
            )
        if not 0 <= self.host_kv_gib < float("inf"):
            raise ValueError(f"host_kv_gib must be a number of GiB >= 0, got {self.host_kv_gib}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    def resolved_overlap_scheduling(self, device: torch.device) -> bool:
        if self.overlap_scheduling is None:
            return device.type == "cuda"
        return self.overlap_scheduling

    def resolved_entry_reserve(self) -> float:
        """``entry_reserve``, or where null its default: 0.5 of the pool without a host
        tier, 0 with one (``bench/RESULTS.md``, "The entry reserve beside a host tier")."""
        if self.entry_reserve is not None:
            return self.entry_reserve
        return 0.0 if self.host_kv_gib > 0 else 0.5

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in names:
            raise ValueError(f"dtype must be one of {sorted(names)}, got {self.dtype!r}")
        return names[self.dtype]
