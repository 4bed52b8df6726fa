"""One rank's part of a tensor-parallel model: which heads, MLP columns and vocabulary
rows it holds, and the collectives that join the parts.

Layout (Megatron's): the QKV and gate-up projections are split by output (column
parallel: each rank computes its heads and its MLP columns whole); the o and down
projections by input (row parallel: each rank's partial product is summed by an
all-reduce, and only rank 0 adds a bias); the embedding and LM head by vocabulary row
(each rank looks up or scores its rows; the lookups are summed, the scores gathered).
Each rank's KV pool holds its own KV heads. Where KV heads are fewer than ranks, each
KV head is replicated on ``world / num_kv_heads`` ranks (``kv_replicas``).

Invariant: every rank runs the same collectives in the same order (rank 0 sends each
operation to the others before it runs it: ``tp.group``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

import torch

from workers.engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# how long closing waits for the other ranks to abort a group with this one (Shard.close)
ABORT_WAIT_S = 30.0


def check_divisible(config: ModelConfig, world: int) -> None:
    """ValueError naming the first shape ``world`` ranks cannot split."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    problems = []
    if config.num_heads % world:
        problems.append(f"{config.num_heads} attention heads")
    if config.intermediate_size % world:
        problems.append(f"intermediate size {config.intermediate_size}")
    kv = config.num_kv_heads
    if kv % world and world % kv:
        problems.append(f"{kv} KV heads (neither a multiple nor a divisor of it)")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {world} does not divide this model's "
            f"{', '.join(problems)}: pick a size that does"
        )


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``; ``group``: a ``torch.distributed`` process group
    object (gloo on the CPU, NCCL on CUDA) over the ranks, or None for one rank."""

    rank: int
    world: int
    group: object = None

    @property
    def parallel(self) -> bool:
        return self.world > 1

    # -- shapes --------------------------------------------------------------
    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The shape one rank's layers have: its query heads, KV heads and MLP columns
        (the vocabulary stays whole: logits are gathered to the full vocabulary)."""
        check_divisible(config, self.world)
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.world,
            num_kv_heads=max(1, config.num_kv_heads // self.world),
            intermediate_size=config.intermediate_size // self.world,
        )

    def kv_replicas(self, config: ModelConfig) -> int:
        """Ranks that hold each KV head (1: every rank holds heads of its own)."""
        return max(1, self.world // config.num_kv_heads)

    def head_rows(self, config: ModelConfig) -> tuple[int, int]:
        """This rank's query heads [first, last)."""
        per = config.num_heads // self.world
        return self.rank * per, (self.rank + 1) * per

    def kv_head_rows(self, config: ModelConfig) -> tuple[int, int]:
        """This rank's KV heads [first, last): the ones its query heads read."""
        replicas = self.kv_replicas(config)
        if replicas > 1:
            head = self.rank // replicas
            return head, head + 1
        per = config.num_kv_heads // self.world
        return self.rank * per, (self.rank + 1) * per

    def mlp_columns(self, config: ModelConfig) -> tuple[int, int]:
        per = config.intermediate_size // self.world
        return self.rank * per, (self.rank + 1) * per

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """This rank's vocabulary rows [first, last); every rank's embedding and LM head
        have ``vocab_per_rank`` rows, the last rank's padded with zeros past the end."""
        per = self.vocab_per_rank(vocab_size)
        return min(self.rank * per, vocab_size), min((self.rank + 1) * per, vocab_size)

    def vocab_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.world)

    # -- collectives ---------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (one rank: itself)."""
        if self.parallel:
            self.group.allreduce([tensor]).wait()
        return tensor

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``local`` [N, vocab_per_rank] (this rank's rows' scores) -> [N, vocab_size],
        every rank's columns in rank order."""
        if not self.parallel:
            return local
        rows, per = local.shape
        gathered = torch.empty((self.world * rows, per), dtype=local.dtype, device=local.device)
        self.group._allgather_base(gathered, local.contiguous()).wait()  # rank-major
        by_rank = gathered.view(self.world, rows, per).permute(1, 0, 2)
        return by_rank.reshape(rows, self.world * per)[:, :vocab_size]

    def close(self) -> bool:
        """Release the group (NCCL's ``abort``, so no destructor waits for ranks that
        exited; gloo's needs nothing); False where the abort was left behind.

        NCCL's abort frees memory the ranks of a node share, so it returns once every
        rank of the node aborts: each rank calls this while the others do
        (``Followers.close``). Where a rank is gone and never will, the abort is left
        behind after ``ABORT_WAIT_S`` with a warning, so that closing ends; the group's
        heartbeat monitor may then end the process minutes later, so a process left so
        should be restarted (the other ranks exit at once: ``tp.follower``)."""
        if not self.parallel or self.group.name() != "nccl":
            return True
        done = threading.Event()

        def abort() -> None:
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 - closing: say so, and go on closing
                logger.warning("aborting rank %d's NCCL group failed", self.rank, exc_info=True)
            finally:
                done.set()

        threading.Thread(target=abort, name=f"tp-abort-rank{self.rank}", daemon=True).start()
        if done.wait(ABORT_WAIT_S):
            return True
        logger.warning(
            "rank %d's NCCL group has not aborted after %.0f s (a rank that did not abort "
            "with it?): left behind; NCCL's heartbeat monitor may end this process within "
            "minutes, so restart it",
            self.rank,
            ABORT_WAIT_S,
        )
        return False

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (in place)."""
        if self.parallel:
            self.group.broadcast(tensor, 0).wait()
        return tensor


SINGLE = Shard(0, 1)
