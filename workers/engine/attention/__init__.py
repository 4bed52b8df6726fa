"""Attention backends: ``torch`` (reference, any device) and ``flashinfer`` (CUDA)."""

from __future__ import annotations

import importlib.util

from workers.engine.attention.base import AttentionBackend, AttentionShape


def default_backend_name(device_type: str) -> str:
    if device_type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "torch"


def make_backend(
    name: str | None, shape: AttentionShape, enable_cascade: bool = True
) -> AttentionBackend:
    name = name or default_backend_name(shape.device.type)
    if name == "torch":
        from workers.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(shape)
    if name == "flashinfer":
        if shape.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        from workers.engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(shape, enable_cascade=enable_cascade)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'flashinfer'")
