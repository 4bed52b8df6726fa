"""A tensor-parallel worker's ranks: rank 0 is the engine (scheduler, KV pool
bookkeeping, reuse, sampling); ranks 1..N-1 are processes it starts, each holding its
shard of the model and its KV heads' pages, running what rank 0 sends.

Protocol: rank 0's ``ModelRunner`` sends each operation on the model or the KV tensors
(``Followers.call``: a method name and its arguments, pickled, over one pipe a rank)
before it runs the operation itself; every rank then runs the same forwards, so their
collectives (``tp.shard``) meet in the same order. A step's input tokens still on rank
0's device (overlapped steps) reach the others by broadcast inside the step. The
other ranks sample nothing: rank 0 alone turns logits into tokens.

Lifetime: the other ranks exit when rank 0 closes their pipes (``Followers.close``) or
when its process is gone (their pipe's end reads EOF), and they are daemonic children.
A rank that fails reports why on its pipe and exits; rank 0's next collective then
fails (the group's timeout bounds it), so the worker fails as a whole and is restarted
with all its ranks.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import pickle
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from workers.engine.tp.shard import Shard

logger = logging.getLogger(__name__)

# how long a collective waits for the other ranks before it fails: longer than any
# step's compute, short enough that a dead rank fails the worker soon
GROUP_TIMEOUT = datetime.timedelta(seconds=120)
# how long rank 0 waits for the others to start (a process each, importing torch)
START_TIMEOUT_S = 300.0
STARTED = b"started"  # a rank's first message, before it joins the group


@dataclass(frozen=True)
class RunnerShape:
    """What the other ranks need to build their ``ModelRunner`` like rank 0's."""

    num_pages: int
    max_model_len: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_group(port: int, rank: int, world: int, device: torch.device):
    """The ranks' process group (NCCL on CUDA, gloo on the CPU), met at rank 0's store."""
    store = dist.TCPStore(
        "127.0.0.1", port, world, rank == 0, timeout=GROUP_TIMEOUT, wait_for_workers=False
    )
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, GROUP_TIMEOUT)


class Followers:
    """Rank 0's handle on ranks 1..N-1 of a worker (module docstring)."""

    def __init__(self, conns: list[Connection], processes: list) -> None:
        self.world = len(conns) + 1
        self._conns = conns
        self._processes = processes
        self.closed = False

    @classmethod
    def start(
        cls, config, world: int, device: torch.device, follow: Callable
    ) -> tuple[Followers, Shard]:
        """Start ranks 1..``world``-1 for engine ``config``, each running ``follow``
        (``tp.follower.follow``), and join them; returns the handle and rank 0's shard.
        They load their shards while rank 0 loads its own."""
        port = _free_port()
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        conns, processes = [], []
        for rank in range(1, world):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=follow,
                args=(theirs, config, rank, world, port, torch.get_num_threads()),
                name=f"chunkserve-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            conns.append(mine)
            processes.append(process)
        followers = cls(conns, processes)
        try:
            followers._wait_started()
            group = process_group(port, 0, world, device)
        except BaseException:
            followers.close()
            raise
        return followers, Shard(0, world, group)

    def _wait_started(self) -> None:
        """Wait until every other rank has started (imported, about to join the
        group); RuntimeError naming a rank that exited first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (conn, process) in enumerate(zip(self._conns, self._processes, strict=True), 1):
            while not conn.poll(0.2):
                if not process.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited (code {process.exitcode}) "
                        "before joining; its log says why"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start")
            if conn.recv_bytes() != STARTED:
                raise RuntimeError(f"tensor-parallel rank {rank} sent an unexpected message")

    def call(self, method: str, *args) -> None:
        """Have every other rank call ``runner.method(*args)``."""
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._conns:
            conn.send_bytes(message)

    def build(self, shape: RunnerShape) -> None:
        """Have the other ranks build their runners (they capture CUDA graphs, whose
        collectives meet rank 0's: call this just before rank 0 builds its own)."""
        self.call("__build__", shape)

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()


class MirroredCopier:
    """Rank 0's host-tier copier on a tensor-parallel worker: each copy is sent to the
    other ranks (each copies its KV heads between its pages and its host slots) before
    it runs here; what is only read (sizes, timing) is rank 0's."""

    def __init__(self, local, followers: Followers) -> None:
        self._local = local
        self._followers = followers

    def __getattr__(self, name: str):
        return getattr(self._local, name)

    @property
    def bytes_per_slot(self) -> int:
        """A slot's bytes over every rank (each holds its KV heads' part)."""
        return self._local.bytes_per_slot * self._followers.world

    def write(self, pages, slots) -> None:
        self._followers.call("host_copy", "write", list(pages), list(slots))
        self._local.write(pages, slots)

    def read(self, slots, pages, fence: bool = True):
        # the other ranks' compute waits for their copy: rank 0's fence decides when
        # anything reads the pages, and they run nothing rank 0 does not
        self._followers.call("host_copy", "read", list(slots), list(pages), True)
        return self._local.read(slots, pages, fence)

    def fence(self) -> None:
        self._followers.call("host_copy", "fence")
        self._local.fence()
