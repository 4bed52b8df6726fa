"""A tensor-parallel worker's rank other than 0 (``tp.group``): its shard of the model,
its KV heads' pages, and a loop running what rank 0 sends."""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection

import torch

from workers.engine.attention import make_backend
from workers.engine.attention.base import AttentionShape
from workers.engine.model_runner import ModelRunner
from workers.engine.models.config import ModelConfig
from workers.engine.models.loader import load_model
from workers.engine.tp.group import (
    BUILT,
    FAILED,
    LOADED,
    STARTED,
    FollowingCopier,
    RunnerShape,
    group_store,
    process_group,
)
from workers.engine.tp.shard import Shard

logger = logging.getLogger(__name__)


def follow(conn: Connection, config, rank: int, world: int, port: int, threads: int) -> None:
    """A rank other than 0: join the group at rank 0's store (``port``), load this
    rank's shard, build the runner when rank 0 says, then run each call rank 0 sends
    until its pipe closes; saying each stage on the pipe (``tp.group``), or why it
    failed. Its end of the group is aborted on the way out, so no teardown waits for a
    rank 0 that is gone."""
    logging.basicConfig(level=logging.WARNING)
    # `kill -USR1 PID` prints where each of this rank's threads is (a rank that seems
    # stuck, say, in a collective the others never reached)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.enable()  # and a fatal signal, where it struck
    torch.set_num_threads(threads)
    conn.send_bytes(STARTED)
    runner = None
    try:
        runner = _Follower(config, rank, world, port)
        conn.send_bytes(LOADED)
        while True:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                return  # rank 0 closed the pipe or is gone
            method, args = pickle.loads(message)
            runner.call(method, args)
            if method == "__build__":
                conn.send_bytes(BUILT)
    except Exception:
        why = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", rank, why)
        try:
            conn.send_bytes(FAILED + why.encode())
        except OSError:
            pass  # rank 0 is gone: the log has it
        raise SystemExit(1) from None
    finally:
        if runner is not None and not runner.shard.close():
            # its abort is still running: an interpreter teardown beside it could
            # hang, and with rank 0 gone nothing would end this process
            logging.shutdown()
            os._exit(1)


class _Follower:
    """One other rank's model and, once built, its runner."""

    def __init__(self, config, rank: int, world: int, port: int) -> None:
        self.config = config
        device = config.resolved_device()
        if device.type == "cuda":  # rank 0's GPU, then the next ones
            device = torch.device("cuda", (device.index or 0) + rank)
            torch.cuda.set_device(device)
        self.device = device
        dtype = config.resolved_dtype()
        model_config = ModelConfig.from_dir(config.model_dir)
        group = process_group(group_store(port, rank, world), rank, world, device)
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
        self.copier: FollowingCopier | None = None  # once the host tier is attached

    def call(self, method: str, args: tuple) -> None:
        if method == "__build__":
            self._build(*args)
            return
        with torch.inference_mode():
            if method == "host_copy":
                self.copier.call(*args)
                return
            getattr(self.runner, method)(*args)
        if method == "attach_host_copier":
            self.copier = FollowingCopier(self.runner.host_copier)
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
