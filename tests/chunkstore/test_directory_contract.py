"""The ChunkDirectory contract, run against the embedded and the Redis implementation."""

from __future__ import annotations

import time

import pytest

from chunkstore import directory as d
from chunkstore.events import CacheEvent, EventKind
from tests.chunkstore.testkit import holders, make_keys

KEYS = make_keys(8)
ENDS = [16 * (i + 1) for i in range(8)]


def stored(*keys: bytes) -> CacheEvent:
    return CacheEvent(EventKind.STORED, keys)


def removed(*keys: bytes) -> CacheEvent:
    return CacheEvent(EventKind.REMOVED, keys)


CLEARED = CacheEvent(EventKind.CLEARED)


def test_lookup_counts_leading_chunks_and_tokens(make_directory):
    directory = make_directory()
    assert directory.publish("w1", 1, 0, [stored(*KEYS[:3], KEYS[5])]).applied
    result = directory.lookup(KEYS[:6], ENDS[:6])
    assert result.available
    assert result.holdings == (d.WorkerHolding("w1", chunks=3, tokens=48),)
    assert directory.lookup(KEYS[1:4], ENDS[1:4]).holdings == (d.WorkerHolding("w1", 2, 48),)
    assert directory.lookup([KEYS[4], KEYS[0]], [10, 20]).holdings == ()


def test_holdings_sorted_by_chunks_then_worker(make_directory):
    directory = make_directory()
    directory.publish_snapshot("b", 1, 0, KEYS[:2])
    directory.publish_snapshot("a", 1, 0, KEYS[:2])
    directory.publish_snapshot("c", 1, 0, KEYS[:4])
    result = directory.lookup(KEYS[:4], ENDS[:4])
    assert [(h.worker_id, h.chunks) for h in result.holdings] == [("c", 4), ("a", 2), ("b", 2)]
    assert result.holding("a") == d.WorkerHolding("a", 2, 32)
    assert result.holding("zz") is None


def entry_stored(*keys: bytes) -> CacheEvent:
    return CacheEvent(EventKind.ENTRY_STORED, keys)


def test_one_lookup_answers_chain_keys_and_entry_keys(make_directory):
    """Entries are held in any subset (no prefix rule); a worker holding entries but
    no leading chain key appears in ``entries`` only; entry indices are ascending."""
    directory = make_directory()
    chain, entry = KEYS[:4], make_keys(4, "entry")
    directory.publish("w1", 1, 0, [stored(*chain[:2]), entry_stored(entry[3], entry[1])])
    directory.publish("w2", 1, 0, [entry_stored(entry[2])])
    directory.publish("w3", 1, 0, [stored(chain[0])])
    result = directory.lookup(chain, ENDS[:4], entry)
    assert result.available
    assert result.holdings == (d.WorkerHolding("w1", 2, 32), d.WorkerHolding("w3", 1, 16))
    assert result.entries == (d.EntryHolding("w1", (1, 3)), d.EntryHolding("w2", (2,)))
    assert (result.entries_of("w1"), result.entries_of("w3")) == ((1, 3), ())
    # entries alone, and a removed entry
    directory.publish("w1", 1, 1, [CacheEvent(EventKind.ENTRY_REMOVED, (entry[1],))])
    only_entries = directory.lookup([], [], entry)
    assert only_entries.holdings == ()
    assert only_entries.entries == (d.EntryHolding("w1", (3,)), d.EntryHolding("w2", (2,)))
    # without entry keys: the exact answer as before
    assert directory.lookup(chain, ENDS[:4]).entries == ()


def test_lookups_say_which_held_keys_sit_only_in_host_memory(make_directory):
    """``offloaded`` keys stay held and count as host-only, in the chain run (their
    tokens) and among entries; ``reloaded`` / ``stored`` bring them back to device
    memory, ``removed`` drops them, ``cleared`` forgets them, and a snapshot without
    host keys puts every key in device memory."""
    directory = make_directory()
    chain, entry = KEYS[:4], make_keys(3, "entry")
    offloaded = lambda *keys: CacheEvent(EventKind.OFFLOADED, keys)  # noqa: E731
    reloaded = lambda *keys: CacheEvent(EventKind.RELOADED, keys)  # noqa: E731
    directory.publish("w1", 1, 0, [stored(*chain), entry_stored(*entry)])
    directory.publish("w1", 1, 1, [offloaded(chain[1], chain[3], entry[2])])
    directory.publish("w2", 1, 0, [stored(chain[0]), offloaded(chain[0])])
    result = directory.lookup(chain, ENDS[:4], entry)
    assert result.holdings == (
        d.WorkerHolding("w1", 4, 64, host_tokens=32),
        d.WorkerHolding("w2", 1, 16, host_tokens=16),
    )
    assert result.entries == (d.EntryHolding("w1", (0, 1, 2), host_entries=(2,)),)
    assert directory.lookup(chain[:2], ENDS[:2]).holding("w1").host_tokens == 16  # in the run
    directory.publish("w1", 1, 2, [reloaded(chain[1]), stored(chain[3]), removed(entry[2])])
    result = directory.lookup(chain, ENDS[:4], entry)
    assert result.holding("w1") == d.WorkerHolding("w1", 4, 64)
    assert result.entries == (d.EntryHolding("w1", (0, 1)),)
    directory.publish("w1", 1, 3, [offloaded(chain[0]), CLEARED, stored(chain[0])])
    assert directory.lookup(chain, ENDS[:4]).holding("w1") == d.WorkerHolding("w1", 1, 16)
    directory.publish_snapshot("w2", 1, 5, chain[:2])
    assert directory.lookup(chain, ENDS[:4]).holding("w2") == d.WorkerHolding("w2", 2, 32)


def test_a_snapshot_carries_the_tiers(make_directory):
    """Of a snapshot's keys, ``host_keys`` count as host-only (chain run and entries);
    the rest as in device memory; a later snapshot replaces both; host keys outside
    the keys are refused."""
    directory = make_directory()
    chain, entry = KEYS[:4], make_keys(2, "entry")
    directory.publish("w", 1, 0, [stored(*chain), CacheEvent(EventKind.OFFLOADED, chain[:1])])
    assert directory.publish_snapshot("w", 1, 3, [*chain[:3], *entry], [chain[1], entry[0]]).applied
    result = directory.lookup(chain, ENDS[:4], entry)
    assert result.holding("w") == d.WorkerHolding("w", 3, 48, host_tokens=16)
    assert result.entries == (d.EntryHolding("w", (0, 1), host_entries=(0,)),)
    assert directory.publish("w", 1, 4, [CacheEvent(EventKind.RELOADED, (chain[1],))]).applied
    assert directory.lookup(chain, ENDS[:4]).holding("w").host_tokens == 0
    assert directory.publish_snapshot("w", 1, 5, chain[:2], chain[:2]).applied
    assert directory.lookup(chain, ENDS[:4]).holding("w") == d.WorkerHolding(
        "w", 2, 32, host_tokens=32
    )
    with pytest.raises(ValueError, match="among its keys"):
        directory.publish_snapshot("w", 1, 6, chain[:1], chain[1:2])


def test_entry_lookup_counts_live_workers_only(make_directory):
    directory = make_directory(lease_ttl_s=1.0)  # a stall up to 1 s between the two calls
    entry = make_keys(1, "entry")
    directory.publish("w", 1, 0, [entry_stored(*entry)])
    assert directory.lookup([], [], entry).entries_of("w") == (0,)
    time.sleep(1.5)
    assert directory.lookup([], [], entry).entries == ()


def test_events_apply_in_order(make_directory):
    directory = make_directory()
    k0, k1, k2 = KEYS[:3]
    batch = [stored(k0, k1), removed(k1), CLEARED, stored(k2), removed(k0), stored(k1)]
    assert directory.publish("w", 1, 0, batch).applied
    assert holders(directory, k0) == set()
    assert holders(directory, k1) == {"w"}
    assert holders(directory, k2) == {"w"}
    assert directory.publish("w", 1, 1, [CLEARED]).applied
    assert directory.lookup([k1], [1]).holdings == ()


def test_snapshot_replaces_everything_and_restarts_the_stream(make_directory):
    directory = make_directory()
    directory.publish("w", 1, 0, [stored(*KEYS[:4])])
    assert directory.publish_snapshot("w", 1, 10, KEYS[4:6]).applied
    assert holders(directory, KEYS[0]) == set()
    assert holders(directory, KEYS[4]) == {"w"}
    assert directory.publish("w", 1, 11, [stored(KEYS[6])]).applied
    assert holders(directory, KEYS[6]) == {"w"}
    assert directory.publish_snapshot("w", 1, 12, []).applied
    assert directory.stats().entries == 0


def test_gap_is_not_applied_voids_and_asks_for_snapshot(make_directory):
    directory = make_directory()
    directory.publish("w", 1, 0, [stored(KEYS[0])])
    result = directory.publish("w", 1, 2, [stored(KEYS[1])])
    assert result.needs_snapshot and not result.applied
    assert holders(directory, KEYS[1]) == set()
    assert holders(directory, KEYS[0]) == set()  # no longer known to be right
    # the stream stays broken until a snapshot, whatever seq comes next
    assert directory.publish("w", 1, 3, [stored(KEYS[1])]).needs_snapshot
    assert directory.heartbeat("w", 1).needs_snapshot
    assert directory.publish_snapshot("w", 1, 4, KEYS[:2]).applied
    assert directory.publish("w", 1, 5, []).applied
    assert holders(directory, KEYS[1]) == {"w"}


def test_duplicate_seq_is_a_gap(make_directory):
    directory = make_directory()
    directory.publish("w", 1, 0, [stored(KEYS[0])])
    assert directory.publish("w", 1, 0, [stored(KEYS[0])]).needs_snapshot


def test_unknown_epoch_mid_stream_asks_for_snapshot(make_directory):
    directory = make_directory()
    assert directory.publish("w", 1, 0, [stored(KEYS[0])]).applied
    assert directory.publish("w", 2, 7, [stored(KEYS[1])]).needs_snapshot
    assert holders(directory, KEYS[0]) == set()  # epoch 1 is void
    assert holders(directory, KEYS[1]) == set()
    assert directory.publish("x", 1, 3, [stored(KEYS[2])]).needs_snapshot  # unknown worker


def test_new_epoch_voids_everything_of_older_epochs(make_directory):
    directory = make_directory()
    directory.publish_snapshot("w", 1, 0, KEYS[:3])
    assert directory.heartbeat("w", 2).needs_snapshot
    assert directory.lookup(KEYS[:3], ENDS[:3]).holdings == ()
    assert directory.publish("w", 2, 0, [stored(KEYS[3])]).applied  # a fresh stream at 0
    assert holders(directory, KEYS[3]) == {"w"}


def test_stale_epoch_is_dropped(make_directory):
    directory = make_directory()
    directory.publish_snapshot("w", 5, 0, KEYS[:1])
    for result in (
        directory.publish("w", 4, 1, [stored(KEYS[1])]),
        directory.publish_snapshot("w", 4, 1, KEYS[1:2]),
        directory.heartbeat("w", 4),
    ):
        assert result.status is d.PublishStatus.STALE_EPOCH
    assert holders(directory, KEYS[0]) == {"w"}
    assert holders(directory, KEYS[1]) == set()
    assert directory.publish("w", 5, 1, []).applied  # the stale calls changed nothing


def test_heartbeat_asks_for_snapshot_only_without_a_stream(make_directory):
    directory = make_directory()
    assert directory.heartbeat("w", 1).needs_snapshot  # never heard of
    assert directory.publish_snapshot("w", 1, 0, KEYS[:1]).applied
    assert directory.heartbeat("w", 1).applied


def test_expired_lease_never_counts_and_is_collected_after_one_ttl(make_directory):
    ttl = 1.0  # the steps below have 0.4 TTL of slack each: 0.4 s stalls on a loaded box
    directory = make_directory(lease_ttl_s=ttl)
    directory.publish_snapshot("w", 1, 0, KEYS[:2])
    directory.publish_snapshot("keep", 1, 0, KEYS[:1])
    assert holders(directory, KEYS[0]) == {"w", "keep"}
    time.sleep(ttl * 0.6)
    directory.heartbeat("keep", 1)
    time.sleep(ttl * 0.6)  # w's lease is over, keep's is not
    assert holders(directory, KEYS[0]) == {"keep"}
    assert directory.stats().live_workers == 1
    # within one TTL after its lease, a renewed worker still has its keys
    assert directory.heartbeat("w", 1).applied
    assert holders(directory, KEYS[1]) == {"w"}
    time.sleep(ttl * 2.4)  # beyond lease + one TTL: everything about w is gone
    assert directory.heartbeat("w", 1).needs_snapshot
    assert holders(directory, KEYS[1]) == set()


def test_remove_worker(make_directory):
    directory = make_directory()
    directory.publish_snapshot("w", 1, 0, KEYS[:2])
    directory.publish_snapshot("v", 1, 0, KEYS[:1])
    directory.remove_worker("w")
    directory.remove_worker("never-seen")
    assert holders(directory, KEYS[0]) == {"v"}
    assert directory.publish("w", 1, 1, []).needs_snapshot


def test_stats(make_directory):
    directory = make_directory()
    directory.publish_snapshot("w", 1, 0, KEYS[:3])
    directory.publish_snapshot("v", 1, 0, KEYS[:2])
    directory.lookup(KEYS[:2], ENDS[:2])
    directory.lookup(KEYS[5:6], ENDS[:1])
    directory.lookup([], [])
    stats = directory.stats()
    assert (stats.available, stats.entries, stats.live_workers) == (True, 5, 2)
    assert (stats.lookups, stats.hits, stats.failures) == (3, 1, 0)
    assert stats.hit_rate == pytest.approx(1 / 3)


def test_empty_lookup(make_directory):
    result = make_directory().lookup([], [])
    assert result.available and result.holdings == ()


@pytest.mark.parametrize(
    ("keys", "ends", "message"),
    [
        (KEYS[:2], [1], "one count per key"),
        ([KEYS[0], None], [1, 2], "None"),
        ([b"short"], [1], "32-byte"),
        (["text"], [1], "32-byte"),
        (KEYS[:2], [5, 3], "non-decreasing"),
        (KEYS[:1], [-1], "non-decreasing"),
        (KEYS[:1] * (d.MAX_LOOKUP_KEYS + 1), [1] * (d.MAX_LOOKUP_KEYS + 1), "at most"),
    ],
)
def test_bad_lookup_raises_value_error(make_directory, keys, ends, message):
    with pytest.raises(ValueError, match=message):
        make_directory().lookup(keys, ends)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([b"short"], "32-byte"),
        ([KEYS[0], None], "None"),
        (KEYS[:1] * d.MAX_LOOKUP_KEYS, "at most"),  # chain and entry keys count together
    ],
)
def test_bad_entry_lookup_raises_value_error(make_directory, entries, message):
    with pytest.raises(ValueError, match=message):
        make_directory().lookup(KEYS[:1], ENDS[:1], entries)


@pytest.mark.parametrize(
    ("worker", "epoch", "seq", "message"),
    [
        ("", 1, 0, "worker_id"),
        (7, 1, 0, "worker_id"),
        ("w", -1, 0, "epoch"),
        ("w", True, 0, "epoch"),
        ("w", 2**53, 0, "epoch"),
        ("w", 1, -1, "seq"),
        ("w", 1, 1.5, "seq"),
    ],
)
def test_bad_publish_raises_value_error(make_directory, worker, epoch, seq, message):
    directory = make_directory()
    with pytest.raises(ValueError, match=message):
        directory.publish(worker, epoch, seq, [])
    with pytest.raises(ValueError, match=message):
        directory.publish_snapshot(worker, epoch, seq, [])


def test_bad_events_raise_value_error(make_directory):
    directory = make_directory()
    with pytest.raises(ValueError, match="CacheEvent"):
        directory.publish("w", 1, 0, [("stored", KEYS[0])])
    with pytest.raises(ValueError, match="32-byte"):
        directory.publish("w", 1, 0, [stored(b"not-a-digest")])
    with pytest.raises(ValueError, match="32-byte"):
        directory.publish_snapshot("w", 1, 0, [b"x" * 31])
    assert directory.heartbeat("w", 1).needs_snapshot  # nothing was recorded
