"""Properties of the CUDA devices that kernels size their grids by, read once per
device (``torch.cuda.get_device_properties`` costs microseconds; kernels launch per
step). Callers reach them as ``device_properties.sm_count(...)``, so tests may patch
the one attribute (Triton's interpreter on the CPU has no device to ask)."""

from __future__ import annotations

import torch

_SMS_BY_DEVICE: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (its index, or the current one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS_BY_DEVICE:
        _SMS_BY_DEVICE[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS_BY_DEVICE[index]
