"""Capturing one CUDA graph (plain torch: importable without FlashInfer, as the skinny
kernel's timing in ``layers/skinny_choice`` needs)."""

from __future__ import annotations

import torch


def capture(forward, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm ``forward`` up on a side stream (kernel selection, lazy allocations), then
    capture it into a graph drawing on the shared memory ``pool``; returns the graph
    and the output tensor that each replay overwrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    torch.cuda.synchronize()
    return graph, output
