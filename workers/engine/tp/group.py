"""A tensor-parallel worker's ranks: rank 0 is the engine (scheduler, KV pool
bookkeeping, reuse, sampling); ranks 1..N-1 are processes it starts, each holding its
shard of the model and its KV heads' pages, running what rank 0 sends.

Protocol: rank 0's ``ModelRunner`` sends each operation on the model or the KV tensors
(``Followers.call``: a method name and its arguments, pickled by ``wire_dumps``, over
one pipe a rank) before it runs the operation itself; every rank then runs the same
forwards, so their collectives (``tp.shard``) meet in the same order. A step's input
tokens still on rank 0's device (overlapped steps) reach the others by broadcast inside
the step. The other ranks sample nothing: rank 0 alone turns logits into tokens.

Start: rank 0 serves the group's store and starts the others; each says on its pipe
that it started, loaded its shard and built its runner, and rank 0 waits for each stage
(``Followers.expect``), so an engine is ready only once every rank is, and a rank that
fails while starting fails the engine with its traceback.

Lifetime: the other ranks exit when rank 0 closes their pipes (``Followers.close``) or
when its process is gone (their pipe's end reads EOF), and they are daemonic children;
each aborts its end of an NCCL group on the way out, and rank 0 aborts its own while
they do (NCCL's abort returns once every rank of a node has aborted). A rank that fails
later reports why on its pipe and exits; rank 0's next send or collective then fails
(the group's timeout, ``GROUP_TIMEOUT``, bounds it), so the worker fails as a whole and
is restarted with all its ranks.
"""

from __future__ import annotations

import datetime
import io
import logging
import multiprocessing
import pickle
import time
from collections import deque
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
# ... and to load their shards (a 70B model's half from disk) and build their runners
LOAD_TIMEOUT_S = 1800.0
# ... and, once closed, to exit (after rank 0's own abort, which theirs meet) before
# they are terminated
STOP_TIMEOUT_S = 10.0
# What a rank other than 0 says on its pipe, in order: started (about to join the
# group), loaded (its shard), built (its runner, after rank 0's ``build``); or, at any
# point, FAILED followed by its traceback, before it exits.
STARTED, LOADED, BUILT, FAILED = b"started", b"loaded", b"built", b"failed:"


def wire_dumps(message) -> bytes:
    """``message`` pickled for the other ranks (``pickle.loads`` reads it), its CPU
    tensors as numpy arrays: torch's own pickling of a tensor costs about 100 times
    more, and a step's inputs go out every step (on the 2-core VM a decode step's
    message took 1.0-1.3 ms to pickle and 1.4-1.8 ms to read, against 90 and 45 us)."""
    out = io.BytesIO()
    _WirePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return out.getvalue()


class _WirePickler(pickle.Pickler):
    def reducer_override(self, obj):
        # numpy has no bfloat16, and a tensor on a device or needing grad keeps
        # torch's own reduction
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.dtype != torch.bfloat16
            and not obj.requires_grad
        ):
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


@dataclass(frozen=True)
class RunnerShape:
    """What the other ranks need to build their ``ModelRunner`` like rank 0's."""

    num_pages: int
    max_model_len: int


def group_store(port: int, rank: int, world: int) -> dist.TCPStore:
    """Where the ranks meet: rank 0 serves it (``port`` 0: a free port, taken by the
    store itself, so nothing else can take it between choosing and binding)."""
    return dist.TCPStore(
        "127.0.0.1", port, world, rank == 0, timeout=GROUP_TIMEOUT, wait_for_workers=False
    )


def process_group(store: dist.TCPStore, rank: int, world: int, device: torch.device):
    """The ranks' process group: NCCL on CUDA, gloo on the CPU, both with
    ``GROUP_TIMEOUT``."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, GROUP_TIMEOUT)


class Followers:
    """Rank 0's handle on ranks 1..N-1 of a worker (module docstring)."""

    def __init__(self, conns: list[Connection], processes: list, store) -> None:
        self._conns = conns
        self._processes = processes
        self._store = store  # rank 0 serves it for as long as the group lives
        self.closed = False

    @property
    def world(self) -> int:
        """Ranks in all, rank 0 included."""
        return len(self._conns) + 1

    @classmethod
    def start(
        cls, config, world: int, device: torch.device, follow: Callable
    ) -> tuple[Followers, Shard]:
        """Start ranks 1..``world``-1 for engine ``config``, each running ``follow``
        (``tp.follower.follow``), and join them; returns the handle and rank 0's shard.
        They load their shards while rank 0 loads its own."""
        store = group_store(0, 0, world)
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        followers = cls([], [], store)
        try:
            for rank in range(1, world):
                mine, theirs = context.Pipe()
                process = context.Process(
                    target=follow,
                    args=(theirs, config, rank, world, store.port, torch.get_num_threads()),
                    name=f"chunkserve-tp-rank{rank}",
                    daemon=True,
                )
                process.start()
                theirs.close()
                followers._conns.append(mine)
                followers._processes.append(process)
            followers.expect(STARTED, START_TIMEOUT_S)
            group = process_group(store, 0, world, device)
        except BaseException:
            followers.close()
            raise
        return followers, Shard(0, world, group)

    def expect(self, what: bytes, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Wait until every other rank has said ``what`` on its pipe; RuntimeError
        naming a rank that failed (with its traceback) or exited first."""
        deadline = time.monotonic() + timeout_s
        name = what.decode()
        for rank, (conn, process) in enumerate(zip(self._conns, self._processes, strict=True), 1):
            while not conn.poll(0.2):
                if not process.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited (code {process.exitcode}) before "
                        f"it {name}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} has not {name} after "
                                       f"{timeout_s:.0f} s")  # fmt: skip
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                raise RuntimeError(
                    f"tensor-parallel rank {rank} closed its pipe before it {name}"
                ) from None
            if message.startswith(FAILED):
                raise RuntimeError(
                    f"tensor-parallel rank {rank} failed:\n{message[len(FAILED) :].decode()}"
                )
            if message != what:
                raise RuntimeError(f"tensor-parallel rank {rank} said {message[:40]!r}, not {name}")

    def call(self, method: str, *args) -> None:
        """Have every other rank call ``runner.method(*args)``."""
        message = wire_dumps((method, args))
        for conn in self._conns:
            conn.send_bytes(message)

    def build(self, shape: RunnerShape) -> None:
        """Have the other ranks build their runners, once they have loaded their
        shards (they capture CUDA graphs, whose collectives meet rank 0's: call this
        just before rank 0 builds its own, then ``expect(BUILT)``)."""
        self.expect(LOADED)
        self.call("__build__", shape)

    def close(self, while_they_stop: Callable[[], None] | None = None) -> None:
        """Stop the other ranks (idempotent): close their pipes, run
        ``while_they_stop`` (rank 0's end of the group: ``Shard.close``, whose NCCL
        abort returns once the others abort theirs, which they do on the way out), then
        wait for them to exit."""
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        try:
            if while_they_stop is not None:
                while_they_stop()
        finally:
            for process in self._processes:
                process.join(timeout=STOP_TIMEOUT_S)
                if process.is_alive():
                    process.terminate()


class MirroredCopier:
    """Rank 0's host-tier copier on a tensor-parallel worker: each copy is sent to the
    other ranks (each copies its KV heads between its pages and its host slots) before
    it runs here; what is only read (sizes, timing) is rank 0's.

    Loads rank 0 does not fence (a host hit's, which the pool tracks until it lands)
    are not fenced on the other ranks either, so they overlap the other requests'
    steps there too. Each such load with an event (a CUDA one; a CPU load is done when
    it returns, on every rank) has a number, counted alike on every rank (they receive
    the same reads in the same order, on devices of one type); when rank 0's pool lands
    loads (``landed``), the other ranks' compute waits for their copy of the latest of
    them (``FollowingCopier.land``) before any step rank 0 sends after, which is the
    first that may read those pages."""

    def __init__(self, local, followers: Followers) -> None:
        self._local = local
        self._followers = followers
        self._unfenced = 0  # unfenced loads with an event sent so far
        self._number: dict[object, int] = {}  # rank 0's event of a load -> its number

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
        self._followers.call("host_copy", "read", list(slots), list(pages), fence)
        done = self._local.read(slots, pages, fence)
        if not fence and done is not None:
            self._unfenced += 1
            self._number[done] = self._unfenced
        return done

    def landed(self, events) -> None:
        """Rank 0's loads that ``events`` end have landed: the other ranks' compute
        waits for theirs before the next step."""
        numbers = [self._number.pop(event) for event in events if event in self._number]
        if numbers:
            self._followers.call("host_copy", "land", max(numbers))

    def fence(self) -> None:
        self._followers.call("host_copy", "fence")
        self._local.fence()
        self._number.clear()


class FollowingCopier:
    """A rank other than 0's host-tier copier: runs the copies rank 0's
    ``MirroredCopier`` sends, keeping its unfenced loads until rank 0 lands them."""

    def __init__(self, local) -> None:
        self._local = local
        self._unfenced = 0
        self._loads: deque[tuple[int, torch.cuda.Event]] = deque()  # (number, its end)

    def call(self, method: str, *args) -> None:
        """``method(*args)``; then the writes and timings finished are let go of (rank
        0's own bookkeeping, which this rank never runs, would do it)."""
        getattr(self, method)(*args)
        self._local.writable()
        self._local.resolve_timing()

    def write(self, pages, slots) -> None:
        self._local.write(pages, slots)

    def read(self, slots, pages, fence: bool) -> None:
        done = self._local.read(slots, pages, fence)
        if not fence and done is not None:
            self._unfenced += 1
            self._loads.append((self._unfenced, done))

    def land(self, upto: int) -> None:
        """Rank 0 landed its loads up to number ``upto``: this rank's compute waits for
        its copies of them (the copy stream runs them in order: the last one's event
        covers the others)."""
        last = None
        while self._loads and self._loads[0][0] <= upto:
            last = self._loads.popleft()[1]
        if last is not None:
            torch.cuda.current_stream(self._local.device).wait_event(last)

    def fence(self) -> None:
        self._local.fence()
        self._loads.clear()
