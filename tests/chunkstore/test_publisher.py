"""EventPublisher against the embedded directory, with losses and outages injected."""

from __future__ import annotations

import pytest

from chunkstore import directory as d
from chunkstore.embedded_directory import EmbeddedChunkDirectory
from chunkstore.publisher import EventPublisher
from tests.chunkstore.testkit import LossyDirectory, SimPool, holders, make_keys, wait_until

KEYS = make_keys(20)


def setup(epoch: int = 1, **options) -> tuple[SimPool, LossyDirectory, EventPublisher]:
    pool = SimPool()
    lossy = LossyDirectory(EmbeddedChunkDirectory(lease_ttl_s=5.0))
    publisher = EventPublisher(lossy, "w", epoch, pool.drain, pool.snapshot, **options)
    return pool, lossy, publisher


def view(directory: d.ChunkDirectory) -> set[bytes]:
    return {k for k in KEYS if holders(directory, k)}


def test_first_cycle_snapshots_then_batches_follow():
    pool, lossy, publisher = setup()
    pool.store(KEYS[:3])
    assert publisher.flush().applied
    pool.remove(KEYS[:1])
    pool.store(KEYS[3:4])
    assert publisher.flush().applied
    assert publisher.flush().applied  # an empty batch: the heartbeat
    stats = publisher.stats()
    assert (stats.snapshots, stats.batches, stats.next_seq, stats.in_sync) == (1, 2, 3, True)
    assert view(lossy) == pool.keys


def test_lost_batch_is_repaired_by_a_snapshot_on_the_next_cycle():
    pool, lossy, publisher = setup()
    publisher.flush()
    pool.store(KEYS[:2])
    lossy.lose_next.add("w")
    publisher.flush()
    assert view(lossy) == set()  # lost in transit
    assert publisher.flush().applied  # idle cycle: its seq reveals the gap
    assert view(lossy) == pool.keys
    assert publisher.stats().snapshots == 2


def test_outage_buffers_and_retries_with_the_same_seq():
    pool, lossy, publisher = setup()
    publisher.flush()
    lossy.down = True
    pool.store(KEYS[:2])
    assert publisher.flush().status is d.PublishStatus.UNAVAILABLE
    pool.remove(KEYS[:1])
    publisher.flush()
    lossy.down = False
    assert publisher.flush().applied
    stats = publisher.stats()
    assert (stats.snapshots, stats.batches, stats.unavailable) == (1, 1, 2)
    assert view(lossy) == pool.keys == {KEYS[1]}


def test_call_that_landed_but_failed_is_never_applied_twice():
    pool, lossy, publisher = setup()
    publisher.flush()
    pool.store(KEYS[:2])
    lossy.inner.publish("w", 1, 1, pool.drain())  # it landed; the answer was lost
    pool.store(KEYS[2:3])
    pool.remove(KEYS[:1])
    lossy.down = True
    publisher.flush()
    lossy.down = False
    publisher.flush()  # retried seq 1 is a gap: re-synced by snapshot
    assert view(lossy) == pool.keys == set(KEYS[1:3])


def test_buffer_overflow_drops_events_and_resyncs_with_a_snapshot():
    pool, lossy, publisher = setup(max_buffered_keys=5)
    publisher.flush()
    lossy.down = True
    for key in KEYS[:8]:
        pool.store([key])
        publisher.flush()
    assert publisher.stats().dropped_buffers == 1
    lossy.down = False
    publisher.flush()
    assert view(lossy) == set(KEYS[:8])
    assert publisher.stats().snapshots == 2


def test_cleared_makes_earlier_buffered_events_moot():
    pool, lossy, publisher = setup(max_buffered_keys=5)
    publisher.flush()
    lossy.down = True
    pool.store(KEYS[:4])
    publisher.flush()
    pool.clear()
    pool.store(KEYS[4:6])
    publisher.flush()
    assert publisher.stats().dropped_buffers == 0
    lossy.down = False
    publisher.flush()
    assert view(lossy) == set(KEYS[4:6])


def test_superseded_epoch_stops_publishing():
    pool, lossy, publisher = setup(epoch=1)
    publisher.flush()
    lossy.inner.heartbeat("w", 2)  # a newer incarnation exists
    assert publisher.flush().status is d.PublishStatus.STALE_EPOCH
    assert publisher.stats().superseded


def test_background_thread_publishes_and_survives_a_faulty_pool():
    pool = SimPool()
    directory = EmbeddedChunkDirectory()
    failures = iter([True, False])

    def drain():
        if next(failures, False):
            raise RuntimeError("pool hiccup")
        return pool.drain()

    publisher = EventPublisher(directory, "w", 1, drain, pool.snapshot, interval_s=0.01)
    pool.store(KEYS[:3])
    publisher.start()
    try:
        assert wait_until(lambda: view(directory) == pool.keys, timeout_s=5)
        pool.remove(KEYS[:1])
        assert wait_until(lambda: view(directory) == pool.keys, timeout_s=5)
    finally:
        publisher.stop()
    with pytest.raises(ValueError, match="already"):
        publisher.start()


def test_stop_flushes_what_is_queued():
    pool = SimPool()
    directory = EmbeddedChunkDirectory()
    publisher = EventPublisher(directory, "w", 1, pool.drain, pool.snapshot, interval_s=60)
    publisher.start()
    pool.store(KEYS[:2])
    publisher.stop()
    assert view(directory) == set(KEYS[:2])


def test_bad_arguments_raise_value_error():
    pool = SimPool()
    directory = EmbeddedChunkDirectory()
    with pytest.raises(ValueError, match="interval_s"):
        EventPublisher(directory, "w", 1, pool.drain, pool.snapshot, interval_s=0)
    with pytest.raises(ValueError, match="worker_id"):
        EventPublisher(directory, "", 1, pool.drain, pool.snapshot)


class RecordingDirectory(EmbeddedChunkDirectory):
    def __init__(self) -> None:
        super().__init__(lease_ttl_s=5.0)
        self.batches: list[list] = []

    def publish(self, worker_id, epoch, seq, events):
        self.batches.append([(e.kind.value, e.keys) for e in events])
        return super().publish(worker_id, epoch, seq, events)


def test_adjacent_events_of_one_kind_travel_as_one():
    """The pool emits one event per page stored: a batch carries each run of one kind
    as one event, in order, and the directory ends up the same."""
    pool = SimPool()
    directory = RecordingDirectory()
    publisher = EventPublisher(directory, "w", 1, pool.drain, pool.snapshot)
    publisher.flush()  # the first cycle is a snapshot
    for key in KEYS[:3]:
        pool.store([key])
    pool.remove(KEYS[:1])
    pool.remove(KEYS[1:2])
    pool.store(KEYS[3:4])
    assert publisher.flush().applied
    assert directory.batches == [
        [("stored", tuple(KEYS[:3])), ("removed", tuple(KEYS[:2])), ("stored", (KEYS[3],))]
    ]
    assert view(directory) == pool.keys == {KEYS[2], KEYS[3]}
