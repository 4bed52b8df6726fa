"""Tensor parallelism: one worker's model split over several devices (``shard``: the
split and its collectives; ``group``: the ranks and what rank 0 sends them)."""
