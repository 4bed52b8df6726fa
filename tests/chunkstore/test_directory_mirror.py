"""A router's copy of the embedded directory (``chunkstore.directory_mirror``) answers
every lookup as the directory itself does at the version it followed: through
publishes, gaps, snapshots, epochs, removals, expired leases, a log too short for the
follower (a snapshot instead), and a restarted directory."""

from __future__ import annotations

import random

import pytest

from chunkstore import directory as d
from chunkstore.directory_mirror import DirectoryChanges, DirectoryMirror
from chunkstore.embedded_directory import EmbeddedChunkDirectory
from chunkstore.events import CacheEvent, EventKind
from tests.chunkstore.testkit import make_keys

KEYS = make_keys(24, tag="mirror")
ENTRY_KEYS = make_keys(6, tag="mirror-entries")
TTL_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def follow(mirror: DirectoryMirror, directory: EmbeddedChunkDirectory, clock: Clock):
    answer = directory.changes(mirror.directory_id, mirror.version)
    mirror.apply(answer, clock.now)
    return answer


def assert_same_lookups(mirror, directory, clock, rng: random.Random) -> None:
    for _ in range(6):
        start = rng.randrange(len(KEYS) - 4)
        keys = KEYS[start : start + rng.randint(1, 4)]
        ends = [16 * (i + 1) for i in range(len(keys))]
        entries = rng.sample(ENTRY_KEYS, 2)
        assert mirror.lookup(keys, ends, entries, clock.now) == directory.lookup(
            keys, ends, entries
        )


def random_step(directory, rng: random.Random, epochs: dict, seqs: dict, clock: Clock) -> None:
    worker = rng.choice(["w0", "w1", "w2"])
    roll = rng.random()
    if roll < 0.5:  # a batch of events, sometimes with a gap
        kind = rng.choice(
            [EventKind.STORED, EventKind.REMOVED, EventKind.ENTRY_STORED, EventKind.OFFLOADED]
            + [EventKind.RELOADED]
        )  # keys moving between a worker's tiers too: lookups say which are host-only
        pool = ENTRY_KEYS if kind is EventKind.ENTRY_STORED else KEYS
        if kind in (EventKind.OFFLOADED, EventKind.RELOADED) and rng.random() < 0.5:
            pool = ENTRY_KEYS
        events = [CacheEvent(kind, tuple(rng.sample(pool, 3)))]
        if rng.random() < 0.05:
            events.append(CacheEvent(EventKind.CLEARED))
        seq = seqs.get(worker, -1) + (2 if rng.random() < 0.1 else 1)
        if directory.publish(worker, epochs[worker], seq, events).applied:
            seqs[worker] = seq
    elif roll < 0.7:  # a snapshot
        seqs[worker] = 0
        keys = rng.sample(KEYS, 4) + rng.sample(ENTRY_KEYS, 1)
        directory.publish_snapshot(worker, epochs[worker], 0, keys, rng.sample(keys, 2))
    elif roll < 0.8:  # restarted: a new epoch
        epochs[worker] += 1
        seqs.pop(worker, None)
        directory.heartbeat(worker, epochs[worker])
    elif roll < 0.85:
        directory.remove_worker(worker)
        seqs.pop(worker, None)
    elif roll < 0.95:
        directory.heartbeat(worker, epochs[worker])
    else:  # time passes: leases end, records are collected
        clock.now += rng.choice([1.0, TTL_S, 2 * TTL_S])


@pytest.mark.parametrize("max_log", [1 << 20, 12])
def test_the_copy_answers_as_the_directory_at_every_version_it_followed(max_log):
    rng = random.Random(max_log)
    clock = Clock()
    directory = EmbeddedChunkDirectory(lease_ttl_s=TTL_S, clock=clock, max_log=max_log)
    mirror = DirectoryMirror()
    assert mirror.lookup(KEYS[:1], [16], (), clock.now) == d.NO_INFORMATION  # nothing yet
    epochs, seqs = {"w0": 1, "w1": 1, "w2": 1}, {}
    snapshots = changes = 0
    for _ in range(400):
        for _ in range(rng.randint(0, 5)):
            random_step(directory, rng, epochs, seqs, clock)
        answer = follow(mirror, directory, clock)
        snapshots += answer.snapshot is not None
        changes += len(answer.changes)
        assert_same_lookups(mirror, directory, clock, rng)
    assert changes > 100
    if max_log == 12:  # a short log: followers that fell behind got snapshots
        assert snapshots > 5
    else:
        assert snapshots == 1  # the first answer only


def test_an_ended_lease_counts_on_the_copy_as_on_the_directory():
    clock = Clock()
    directory = EmbeddedChunkDirectory(lease_ttl_s=TTL_S, clock=clock)
    directory.publish("w0", 1, 0, [CacheEvent(EventKind.STORED, (KEYS[0],))])
    mirror = DirectoryMirror()
    follow(mirror, directory, clock)
    assert [h.worker_id for h in mirror.lookup(KEYS[:1], [16], (), clock.now).holdings] == ["w0"]
    clock.now += TTL_S + 0.1  # no answer since: the copy's lease ends on its own
    assert mirror.lookup(KEYS[:1], [16], (), clock.now).holdings == ()
    assert directory.lookup(KEYS[:1], [16]).holdings == ()


def test_a_restarted_directory_replaces_the_copy_and_lookups_are_counted_there():
    clock = Clock()
    old = EmbeddedChunkDirectory(lease_ttl_s=TTL_S, clock=clock)
    old.publish("w0", 1, 0, [CacheEvent(EventKind.STORED, (KEYS[0],))])
    mirror = DirectoryMirror()
    follow(mirror, old, clock)
    restarted = EmbeddedChunkDirectory(lease_ttl_s=TTL_S, clock=clock)  # empty, version 0
    restarted.publish("w1", 1, 0, [CacheEvent(EventKind.STORED, (KEYS[1],))])
    answer = restarted.changes(mirror.directory_id, mirror.version, lookups=3, hits=2)
    assert answer.snapshot is not None
    mirror.apply(answer, clock.now)
    assert mirror.lookup(KEYS[:1], [16], (), clock.now).holdings == ()
    assert [h.worker_id for h in mirror.lookup(KEYS[1:2], [16], (), clock.now).holdings] == ["w1"]
    stats = restarted.stats()
    assert (stats.lookups, stats.hits) == (3, 2)
    with pytest.raises(ValueError, match="hits <= lookups"):
        restarted.changes(mirror.directory_id, mirror.version, lookups=1, hits=2)


def test_changes_that_do_not_follow_the_copy_are_refused():
    clock = Clock()
    directory = EmbeddedChunkDirectory(lease_ttl_s=TTL_S, clock=clock)
    mirror = DirectoryMirror()
    follow(mirror, directory, clock)
    directory.publish("w0", 1, 0, [CacheEvent(EventKind.STORED, (KEYS[0],))])
    directory.publish("w0", 1, 1, [CacheEvent(EventKind.STORED, (KEYS[1],))])
    answer = directory.changes(mirror.directory_id, mirror.version)
    skipped = DirectoryChanges(
        answer.directory_id, answer.version, answer.lease_left_s, answer.changes[1:]
    )
    with pytest.raises(ValueError, match="cannot follow"):
        mirror.apply(skipped, clock.now)
    mirror.apply(answer, clock.now)
    assert mirror.version == answer.version


def test_a_hidden_worker_is_left_out_until_the_directory_removes_or_resets_it():
    """A router hides a worker it found dead before the directory removes it; changes
    to that worker keep applying meanwhile, so the copy never holds part of a record."""
    clock = Clock()
    directory = EmbeddedChunkDirectory(lease_ttl_s=TTL_S, clock=clock)
    directory.publish("w0", 1, 0, [CacheEvent(EventKind.STORED, (KEYS[0], KEYS[1]))])
    mirror = DirectoryMirror()
    follow(mirror, directory, clock)
    mirror.hide_worker("w0", until=clock.now + 1.0)
    assert mirror.lookup(KEYS[:2], [16, 32], (), clock.now).holdings == ()
    directory.publish("w0", 1, 1, [CacheEvent(EventKind.STORED, (KEYS[2],))])  # in flight
    follow(mirror, directory, clock)
    assert mirror.lookup(KEYS[:2], [16, 32], (), clock.now).holdings == ()
    clock.now += 1.0  # the hiding ended; the directory never removed it: the whole record
    assert_same_lookups(mirror, directory, clock, random.Random(0))
    assert mirror.lookup(KEYS[:3], [16, 32, 48], (), clock.now) == directory.lookup(
        KEYS[:3], [16, 32, 48]
    )
    mirror.hide_worker("w0", until=clock.now + 60.0)
    directory.heartbeat("w0", 2)  # a new incarnation: its record starts over
    directory.publish_snapshot("w0", 2, 0, [KEYS[3]])
    follow(mirror, directory, clock)
    assert [h.worker_id for h in mirror.lookup(KEYS[3:4], [16], (), clock.now).holdings] == ["w0"]
    mirror.hide_worker("w0", until=clock.now + 60.0)
    directory.remove_worker("w0")
    follow(mirror, directory, clock)
    directory.publish("w0", 3, 0, [CacheEvent(EventKind.STORED, (KEYS[4],))])
    follow(mirror, directory, clock)  # removed, then a new record: shown again
    assert [h.worker_id for h in mirror.lookup(KEYS[4:5], [16], (), clock.now).holdings] == ["w0"]
