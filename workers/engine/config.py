"""Engine configuration (frozen; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    page_size: int = 16
    num_pages: int | None = None  # None: sized from memory (see kv_cache_memory)
    gpu_memory_utilization: float = 0.85  # share of GPU memory for weights + KV
    cpu_kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's, capped at the pool's capacity
    enable_reuse: bool = True
    # approximate reuse: chunks shorter than this are computed, never kept as entries
    min_entry_tokens: int = 32
    # approximate reuse: entries are computed after this system turn (and the opening of
    # a user turn); None: after nothing, the chunk alone from position 0
    entry_system_prompt: str | None = DEFAULT_ENTRY_SYSTEM_PROMPT
    # approximate reuse: the layer whose K/V deviation selects the tokens to recompute
    # (>= 1, below the model's layer count); None: DEFAULT_DEVIATION_LAYER, or the last
    # layer of a shallower model
    deviation_layer: int | None = None
    # registered chunks: the most tokens one tenant may pin on this engine (None: no quota
    # beyond the engine's room)
    pin_quota_tokens: int | None = None
    attention_backend: str | None = None  # None: flashinfer on cuda, torch elsewhere
    enable_cascade: bool = True  # cascade decode where the cost model says it pays
    enable_cuda_graphs: bool = True  # CUDA graphs for plain decode steps (flashinfer only)
    # one-row steps (batch-1 decode) run a projection (QKV and gate-up with the norm
    # before them) through the skinny Triton kernel where it measured faster than cuBLAS
    # at start (layers/skinny_choice; fused ops and CUDA graphs only)
    skinny_matmul: bool = True
    # queue step N+1 on the device before reading step N's tokens back (Engine); None:
    # on with CUDA, off on the CPU (where nothing runs asynchronously to overlap)
    overlap_scheduling: bool | None = None
    model_id: str | None = None  # name in the key namespace; None: the directory's name
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.pin_quota_tokens is not None and self.pin_quota_tokens < 0:
            raise ValueError(f"pin_quota_tokens must be >= 0, got {self.pin_quota_tokens}")
        if self.min_entry_tokens < 1:
            raise ValueError(f"min_entry_tokens must be >= 1, got {self.min_entry_tokens}")
        if self.deviation_layer is not None and self.deviation_layer < 1:
            raise ValueError(
                f"deviation_layer must be >= 1 (layer 0's KV depends on the token and its "
                f"position alone), got {self.deviation_layer}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    def resolved_overlap_scheduling(self, device: torch.device) -> bool:
        if self.overlap_scheduling is None:
            return device.type == "cuda"
        return self.overlap_scheduling

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
