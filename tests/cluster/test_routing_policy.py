"""The routing policy is a pure function: saved prefill (exact prefixes and approximate
hits, and what the router's memory of its own decisions says) against load."""

from __future__ import annotations

from collections import Counter

from cluster.routing_policy import (
    Decision,
    Reason,
    RouteMemory,
    RoutingWeights,
    Unroutable,
    WorkerView,
    choose_worker,
    placed_saving,
    prefill_saved,
    round_robin,
)

WEIGHTS = RoutingWeights(load_penalty_tokens=100, imbalance_slack=4, max_requests_per_worker=10)


def views(*loads: int) -> list[WorkerView]:
    return [WorkerView(f"w{i}", requests, requests * 50) for i, requests in enumerate(loads)]


def test_no_workers_and_all_full():
    assert choose_worker([], {}, WEIGHTS) is Unroutable.NO_WORKER
    assert choose_worker(views(10, 12), {}, WEIGHTS) is Unroutable.OVERLOADED


def test_holder_wins_when_its_cache_outweighs_its_queue():
    decision = choose_worker(views(0, 2), {"w1": 320}, WEIGHTS)
    assert decision == Decision("w1", Reason.AFFINITY, 320)


def test_least_loaded_wins_when_the_cache_saves_less_than_the_queue_costs():
    decision = choose_worker(views(0, 2), {"w1": 150}, WEIGHTS)  # 150 - 200 < 0
    assert decision.worker_id == "w0" and decision.reason is Reason.LOAD


def test_badly_imbalanced_holder_is_skipped_whatever_it_holds():
    decision = choose_worker(views(0, 5), {"w1": 10_000}, WEIGHTS)  # 5 > 0 + slack 4
    assert decision.worker_id == "w0" and decision.reason is Reason.LOAD


def test_more_cached_tokens_beat_fewer():
    decision = choose_worker(views(1, 1, 1), {"w0": 64, "w2": 256}, WEIGHTS)
    assert decision.worker_id == "w2"


def test_no_directory_answer_means_least_loaded():
    decision = choose_worker(views(3, 1, 2), None, WEIGHTS)
    assert decision == Decision("w1", Reason.NO_DIRECTORY, 0)


def test_full_workers_are_never_chosen_even_as_holders():
    decision = choose_worker(views(10, 9), {"w0": 10_000}, WEIGHTS)
    assert decision.worker_id == "w1"


def test_ties_rotate_so_equal_workers_share_requests():
    chosen = Counter(choose_worker(views(0, 0, 0), {}, WEIGHTS, r).worker_id for r in range(9))
    assert chosen == {"w0": 3, "w1": 3, "w2": 3}
    tied_holders = {
        choose_worker(views(0, 0), {"w0": 64, "w1": 64}, WEIGHTS, r).worker_id for r in range(2)
    }
    assert tied_holders == {"w0", "w1"}


def test_ties_on_requests_go_to_fewer_tokens_in_flight():
    workers = [WorkerView("a", 1, 900), WorkerView("b", 1, 100)]
    assert choose_worker(workers, {}, WEIGHTS).worker_id == "b"


def test_round_robin_rotates_over_open_workers_ignoring_caches_and_load():
    workers = [WorkerView("w2", 0, 0), WorkerView("w0", 9, 900), WorkerView("w1", 3, 10)]
    chosen = [round_robin(workers, 10, r) for r in range(6)]
    assert [d.worker_id for d in chosen] == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert {d.reason for d in chosen} == {Reason.ROTATION}
    assert round_robin(views(10, 0, 10), 10, 5).worker_id == "w1"  # full ones are skipped
    assert round_robin([], 10, 0) is Unroutable.NO_WORKER
    assert round_robin(views(10, 11), 10, 0) is Unroutable.OVERLOADED


SPANS = [(32, 96), (96, 136), (136, 200)]  # placeable chunks of 64, 40 and 64 tokens


def test_an_approximate_hit_saves_the_chunk_less_what_repair_recomputes():
    assert placed_saving(64, first_tokens=4, deviation_ratio=0.0) == 60
    assert placed_saving(40, first_tokens=8, deviation_ratio=0.1) == 40 - 8 - 4
    assert placed_saving(3, first_tokens=4, deviation_ratio=0.0) == 0  # all recomputed
    assert placed_saving(10, first_tokens=4, deviation_ratio=1.0) == 0  # never negative


def test_prefill_saved_adds_held_entries_after_the_exact_prefix():
    saved = prefill_saved(
        exact_tokens={"w0": 32, "w1": 96, "w2": 16},
        entries={"w0": [0, 2], "w1": [0, 1], "w3": [1]},
        spans=SPANS,
        first_tokens=4,
        deviation_ratio=0.0,
    )
    assert saved == {
        "w0": 32 + 60 + 60,  # both entries start at or after its prefix
        "w1": 96 + 36,  # chunk 0 lies inside its exact prefix: not placed again
        "w2": 16,  # exact prefix only
        "w3": 36,  # entries alone, no exact prefix
    }
    # exact requests look up no entries: the exact prefixes as they were
    assert prefill_saved({"w0": 32}, {}, SPANS, 4, 0.0) == {"w0": 32}
    assert prefill_saved({}, {"w0": [0]}, [(10, 12)], 4, 0.0) == {}  # saves nothing


def test_an_approximate_holder_beats_a_short_exact_prefix():
    """A worker holding the documents' entries (after another system prompt) wins over
    one holding just the system prompt exactly, and loses once its queue costs more."""
    saved = prefill_saved({"w0": 32}, {"w1": [0, 1, 2]}, SPANS, 4, 0.0)
    assert saved == {"w0": 32, "w1": 60 + 36 + 60}
    decision = choose_worker(views(0, 0), saved, WEIGHTS)
    assert decision == Decision("w1", Reason.AFFINITY, 156)
    busy = choose_worker(views(0, 2), saved, WEIGHTS)  # 156 - 200 < 32 - 0
    assert busy.worker_id == "w0" and busy.reason is Reason.AFFINITY


KEYS = (b"k0", b"k1", b"k2")  # a prompt's chunk keys, in prompt order
ENDS = (16, 48, 64)  # its tokens up to each


def test_a_recent_decision_attracts_an_identical_repeat():
    """The directory does not list the prefix yet (the worker publishes later); the
    router's memory of sending it to w1 sends the repeat there too."""
    memory = RouteMemory(lease_s=1.0)
    first = choose_worker(views(0, 0), {}, WEIGHTS, rotation=1, recent=memory.recall(KEYS, ENDS, 0))
    assert first.reason is Reason.LOAD
    memory.remember(KEYS, first.worker_id, now=0.0)
    for rotation in range(4):  # whatever turn the tie-breaking rotation is at
        recent = memory.recall(KEYS, ENDS, now=0.1)
        assert recent == {first.worker_id: 64}
        repeat = choose_worker(views(0, 0), {}, WEIGHTS, rotation, recent)
        assert repeat == Decision(first.worker_id, Reason.RECENT, 64)


def test_an_expired_decision_attracts_nothing():
    memory = RouteMemory(lease_s=1.0)
    memory.remember(KEYS, "w1", now=0.0)
    assert memory.recall(KEYS, ENDS, now=1.0) == {}
    assert len(memory) == 0  # and is dropped
    chosen = {
        choose_worker(views(0, 0), {}, WEIGHTS, r, memory.recall(KEYS, ENDS, 1.5)).worker_id
        for r in range(2)
    }
    assert chosen == {"w0", "w1"}  # plain rotation again


def test_a_renewed_decision_lives_on_and_others_keep_their_own_lease():
    memory = RouteMemory(lease_s=1.0)
    memory.remember(KEYS, "w0", now=0.0)
    memory.remember(KEYS[:1], "w1", now=0.5)  # w1 got a prompt sharing only the first chunk
    memory.remember(KEYS, "w0", now=0.8)  # renewed
    assert memory.recall(KEYS, ENDS, now=0.9) == {"w0": 64, "w1": 16}
    assert memory.recall(KEYS, ENDS, now=1.6) == {"w0": 64}
    assert memory.recall(KEYS, ENDS, now=1.8) == {}


def test_memory_counts_the_longest_remembered_prefix_and_forgets_dead_workers():
    memory = RouteMemory(lease_s=1.0)
    memory.remember(KEYS[:2], "w0", now=0.0)
    memory.remember((b"other", *KEYS[1:]), "w1", now=0.0)  # another first chunk: no prefix
    assert memory.recall(KEYS, ENDS, now=0.1) == {"w0": 48}
    memory.forget("w0")
    assert memory.recall(KEYS, ENDS, now=0.1) == {}


def test_memory_keeps_at_most_max_keys_and_zero_lease_keeps_none():
    memory = RouteMemory(lease_s=10.0, max_keys=2)
    memory.remember(KEYS, "w0", now=0.0)
    assert len(memory) == 2 and memory.recall(KEYS, ENDS, now=0.1) == {}  # k0 dropped
    off = RouteMemory(lease_s=0.0)
    off.remember(KEYS, "w0", now=0.0)
    assert len(off) == 0


def test_the_directory_and_memory_combine_by_the_larger_and_load_still_counts():
    memory = RouteMemory(lease_s=1.0)
    memory.remember(KEYS, "w1", now=0.0)
    recent = memory.recall(KEYS, ENDS, now=0.1)
    listed = choose_worker(views(0, 0), {"w1": 300}, WEIGHTS, 0, recent)
    assert listed == Decision("w1", Reason.AFFINITY, 300)  # the directory lists more
    busy = choose_worker(views(0, 1), {}, WEIGHTS, 0, recent)  # 64 - 100 < 0
    assert busy.worker_id == "w0" and busy.reason is Reason.LOAD
    assert choose_worker(views(0, 0), None, WEIGHTS, 0, recent).reason is Reason.NO_DIRECTORY


def test_a_cold_idle_worker_beats_a_holder_whose_queue_is_long():
    """w0 restarted: idle, holds nothing. The holder w1 has 3 requests of 1,256 tokens
    in flight; less the 640 held for each, 1,848 tokens of work queue ahead, more than
    the 640 its cache would save: w0 starts sooner, and the prefix spreads to it."""
    workers = [WorkerView("w0", 0, 0), WorkerView("w1", 3, 3 * 1256)]
    assert 640 - WEIGHTS.load_penalty_tokens * 3 > 0  # the load penalty alone keeps w1
    decision = choose_worker(workers, {"w1": 640}, WEIGHTS)
    assert decision == Decision("w0", Reason.SPILL, 0)


def test_a_holder_whose_queue_costs_less_than_its_cache_saves_keeps_the_request():
    workers = [WorkerView("w0", 0, 0), WorkerView("w1", 1, 700)]  # 60 queued < 640 saved
    assert choose_worker(workers, {"w1": 640}, WEIGHTS) == Decision("w1", Reason.AFFINITY, 640)


def test_without_an_idle_worker_nothing_spills():
    workers = [WorkerView("w0", 1, 100), WorkerView("w1", 3, 3 * 1256)]
    assert choose_worker(workers, {"w1": 640}, WEIGHTS).worker_id == "w1"


def test_a_restarted_worker_gets_requests_again_while_holders_are_busy():
    """Three holders of a hot prefix, each with a long queue, and a restarted worker:
    it takes the first request, and then holds the prefix with the shortest queue, so
    it wins the next one by affinity."""
    holders = [WorkerView(f"w{i}", 4, 4 * 1256) for i in range(3)]
    restarted = WorkerView("w3", 0, 0)
    first = choose_worker([*holders, restarted], {w.worker_id: 640 for w in holders}, WEIGHTS)
    assert first == Decision("w3", Reason.SPILL, 0)
    busy = WorkerView("w3", 1, 1256)
    held = {"w0": 640, "w1": 640, "w2": 640, "w3": 640}
    assert choose_worker([*holders, busy], held, WEIGHTS) == Decision("w3", Reason.AFFINITY, 640)
