"""A tensor-parallel worker's rank other than 0 (``tp.group``): its shard of the model,
its KV heads' pages, and a loop running what rank 0 sends."""

from __future__ import annotations

import logging
import pickle
import traceback
from multiprocessing.connection import Connection

import torch

from workers.engine.attention import make_backend
from workers.engine.attention.base import AttentionShape
from workers.engine.model_runner import ModelRunner
from workers.engine.models.config import ModelConfig
from workers.engine.models.loader import load_model
from workers.engine.tp.group import STARTED, RunnerShape, process_group
from workers.engine.tp.shard import Shard

logger = logging.getLogger(__name__)


def follow(conn: Connection, config, rank: int, world: int, port: int, threads: int) -> None:
    """A rank other than 0: load this rank's shard, join the group, build the runner
    when rank 0 says, then run each call rank 0 sends until its pipe closes."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    conn.send_bytes(STARTED)
    try:
        runner = _Follower(config, rank, world, port)
        while True:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 closed the pipe or is gone
            method, args = pickle.loads(message)
            runner.call(method, args)
    except Exception:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None


class _Follower:
    """One other rank's model and, once built, its runner."""

    def __init__(self, config, rank: int, world: int, port: int) -> None:
        self.config = config
        device = config.resolved_device()
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        self.device = device
        dtype = config.resolved_dtype()
        model_config = ModelConfig.from_dir(config.model_dir)
        group = process_group(port, rank, world, device)
        self.shard = Shard(rank, world, group)
        self.model = load_model(
            config.model_dir, model_config, dtype, device, self.shard, config.load_format
        )
        local = self.model.config
        shape = AttentionShape(
            local.num_heads, local.num_kv_heads, local.head_dim, config.page_size, dtype, device
        )
        self.backend = make_backend(config.attention_backend, shape, config.enable_cascade)
        self.runner = None

    def call(self, method: str, args: tuple) -> None:
        if method == "__build__":
            self._build(*args)
            return
        with torch.inference_mode():
            getattr(self.runner, method)(*args)
        if self.runner.aside is not None:  # counted on rank 0 alone
            self.runner.take_aside()

    def _build(self, shape: RunnerShape) -> None:
        config = self.config
        self.runner = ModelRunner(
            self.model,
            self.backend,
            shape.num_pages,
            config.page_size,
            shape.max_model_len,
            config.max_num_seqs,
            config.enable_cuda_graphs,
            config.skinny_matmul,
        )
