"""Randomized: 8 workers store, remove, clear, restart, lose batches and die; after
one heartbeat period the directory's view equals the union of what live workers hold.

Each step mutates the simulated pools, runs one publisher cycle per running worker
(some batches lost in transit), then one more cycle (the heartbeat period) and
compares every key's holders and some multi-key lookups with the pools. A worker
that went silent less than one lease TTL ago may still be reported (only for keys
it held); after that it must not be. A restarted worker announces its new epoch
with a heartbeat and publishes only one step later (its old keys must vanish at
once), while its old incarnation lives on as a zombie whose calls must be dropped.
"""

from __future__ import annotations

import random
import time

import pytest

from chunkstore import directory as d
from chunkstore.publisher import EventPublisher
from tests.chunkstore.testkit import LossyDirectory, SimPool, make_keys

TTL_S = 0.6
MARGIN_S = 0.25  # clock and scheduling slack before a silent worker must be gone
UNIVERSE = make_keys(48, tag="property")


class SimWorker:
    def __init__(self, name: str, directory: LossyDirectory) -> None:
        self.name = name
        self._directory = directory
        self.epoch = 0
        self.silent_since: float | None = None  # when it last reached the directory
        self.starting = False  # announced its epoch, has not published yet
        self.zombie: tuple[SimPool, EventPublisher, int] | None = None  # old incarnation
        self.pool = SimPool()
        self.publisher = self._new_publisher()

    def _new_publisher(self) -> EventPublisher:
        self.epoch += 1
        pool = self.pool
        return EventPublisher(self._directory, self.name, self.epoch, pool.drain, pool.snapshot)

    def restart(self, rng: random.Random) -> None:
        """A new incarnation: new epoch, empty pool, new publisher."""
        if self.silent_since is None and rng.random() < 0.5:
            self.zombie = (self.pool, self.publisher, 3)
        self.pool = SimPool()
        self.publisher = self._new_publisher()
        self.silent_since = None
        self.starting = True
        assert self._directory.heartbeat(self.name, self.epoch).needs_snapshot

    def haunt(self, rng: random.Random) -> None:
        """The old incarnation keeps publishing for a few steps: always dropped."""
        if self.zombie is None:
            return
        pool, publisher, steps = self.zombie
        pool.store(rng.sample(UNIVERSE, 2))
        assert publisher.flush().status is d.PublishStatus.STALE_EPOCH
        self.zombie = (pool, publisher, steps - 1) if steps > 1 else None

    def may_be_reported(self, now: float) -> bool:
        return self.silent_since is not None and now - self.silent_since < TTL_S + MARGIN_S

    def mutate(self, rng: random.Random) -> None:
        roll = rng.random()
        held = sorted(self.pool.keys)
        if roll < 0.5:
            self.pool.store(rng.sample(UNIVERSE, rng.randint(1, 5)))
        elif roll < 0.7 and held:
            self.pool.remove(rng.sample(held, rng.randint(1, min(3, len(held)))))
        elif roll < 0.74:
            self.pool.clear()
        elif roll < 0.78:
            self.restart(rng)
        elif roll < 0.81:
            self.silent_since = time.monotonic()


def run_cycles(workers: list[SimWorker]) -> None:
    for worker in workers:
        if worker.silent_since is None and not worker.starting:
            assert worker.publisher.flush().applied


def check_view(directory: d.ChunkDirectory, workers: list[SimWorker], rng: random.Random) -> None:
    now = time.monotonic()
    running = [w for w in workers if w.silent_since is None]
    maybe = {w.name: w.pool.keys for w in workers if w.may_be_reported(now)}
    for key in UNIVERSE:
        result = directory.lookup([key], [16])
        reported = {h.worker_id for h in result.holdings}
        expected = {w.name for w in running if key in w.pool.keys}
        assert expected <= reported, f"missing holders of {key.hex()[:8]}"
        extra = reported - expected
        assert all(name in maybe and key in maybe[name] for name in extra), extra
    for _ in range(4):
        keys = rng.sample(UNIVERSE, rng.randint(2, 6))
        ends = [16 * (i + 1) for i in range(len(keys))]
        result = directory.lookup(keys, ends)
        for worker in running:
            run = d.leading_run(k in worker.pool.keys for k in keys)
            got = result.holding(worker.name)
            assert (got.chunks if got else 0) == run


def idle(workers: list[SimWorker], seconds: float) -> None:
    """Let time pass while running workers keep heart-beating."""
    for worker in workers:
        worker.starting = False
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run_cycles(workers)
        time.sleep(0.05)


@pytest.mark.parametrize("seed", [1, 2])
def test_view_equals_union_of_live_pools(make_directory, seed):
    rng = random.Random(seed)
    directory = make_directory(lease_ttl_s=TTL_S)
    lossy = LossyDirectory(directory)
    workers = [SimWorker(f"worker-{i}", lossy) for i in range(8)]
    for step in range(60):
        for worker in workers:
            worker.starting = False
            if worker.silent_since is None:
                worker.mutate(rng)
            elif rng.random() < 0.1:
                worker.restart(rng)  # a dead worker comes back as a new incarnation
            if rng.random() < 0.06:
                lossy.lose_next.add(worker.name)
            worker.haunt(rng)
        run_cycles(workers)  # some batches are lost here
        lossy.lose_next.clear()
        run_cycles(workers)  # one heartbeat period later
        check_view(directory, workers, rng)
        if step % 20 == 19:
            idle(workers, TTL_S + MARGIN_S)
            check_view(directory, workers, rng)
    stats = directory.stats()
    live = [w for w in workers if w.silent_since is None]
    assert stats.live_workers == len(live)
    assert stats.entries == sum(len(w.pool.keys) for w in live)
