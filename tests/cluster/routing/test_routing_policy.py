"""The routing policy is a pure function: the expected wait for the first token on
each worker (queued prefill plus the request's uncached tokens, at the worker's
measured rate, plus a step), where cache hits (exact prefixes, approximate hits, and
what the router's memory of its own decisions says) count only as the prefill they
save."""

from __future__ import annotations

from collections import Counter

import pytest

from cluster.routing.policy import (
    DEFAULT_HOST_LOAD_SHARE,
    MIN_RATE_SHARE,
    Decision,
    HostHeld,
    Reason,
    RouteMemory,
    RoutingWeights,
    Unroutable,
    WorkerView,
    choose_worker,
    expected_wait_s,
    host_load_shares,
    placed_saving,
    prefill_saved,
    round_robin,
)

WEIGHTS = RoutingWeights(max_requests_per_worker=10, default_prefill_tokens_per_s=1000.0)
PROMPT = 1000  # prompt tokens of the request being routed
RATE = 1000.0  # prefill tokens/s of a measured worker below, unless given


def view(
    worker_id: str,
    backlog: int = 0,
    rate: float = RATE,
    step_s: float = 0.0,
    requests: int = 0,
    tokens: int = 0,
) -> WorkerView:
    return WorkerView(worker_id, requests, tokens, backlog, rate, step_s)


def idle(n: int) -> list[WorkerView]:
    return [view(f"w{i}") for i in range(n)]


def test_no_workers_and_all_full():
    assert choose_worker([], {}, WEIGHTS, PROMPT) is Unroutable.NO_WORKER
    full = [view("w0", requests=10), view("w1", requests=12)]
    assert choose_worker(full, {}, WEIGHTS, PROMPT) is Unroutable.OVERLOADED


def test_the_shortest_expected_wait_wins():
    workers = [view("w0", backlog=2000), view("w1", backlog=500), view("w2", backlog=900)]
    decision = choose_worker(workers, {}, WEIGHTS, PROMPT)
    assert decision == Decision("w1", Reason.LOAD, 0, pytest.approx((500 + PROMPT) / RATE))


def test_a_faster_worker_wins_despite_a_longer_queue():
    workers = [view("w0", backlog=4000, rate=10_000.0), view("w1", backlog=200)]
    assert choose_worker(workers, {}, WEIGHTS, PROMPT).worker_id == "w0"  # 0.5 s < 1.2 s


def test_the_step_time_counts():
    """A worker deep in a large decode batch (long steps) loses to one that must first
    prefill a little more."""
    workers = [view("w0", step_s=0.5, requests=8), view("w1", backlog=100, step_s=0.01, requests=1)]
    assert choose_worker(workers, {}, WEIGHTS, PROMPT).worker_id == "w1"  # 1.11 s < 1.5 s
    quiet = [view("w0", step_s=0.5), view("w1", backlog=100, step_s=0.01, requests=1)]
    assert choose_worker(quiet, {}, WEIGHTS, PROMPT).worker_id == "w0"  # idle: no step, 1 s


def test_a_holder_wins_while_its_queue_costs_less_than_its_cache_saves():
    workers = [view("w0"), view("w1", backlog=700)]
    decision = choose_worker(workers, {"w1": 800}, WEIGHTS, PROMPT)
    assert decision == Decision("w1", Reason.AFFINITY, 800, pytest.approx(0.9))


def test_a_saturated_holder_spills_to_a_cold_worker():
    """The holder's queue (1,200 tokens) outweighs the 800 its cache saves: the cold
    worker is sooner, and then holds the prefix too."""
    workers = [view("w0"), view("w1", backlog=1200)]
    decision = choose_worker(workers, {"w1": 800}, WEIGHTS, PROMPT)
    assert decision == Decision("w0", Reason.SPILL, 0, pytest.approx(1.0))


def test_a_partial_holder_that_is_chosen_over_a_fuller_one_is_a_spill():
    workers = [view("w0", backlog=100), view("w1", backlog=2000)]
    decision = choose_worker(workers, {"w0": 200, "w1": 900}, WEIGHTS, PROMPT)
    assert decision.worker_id == "w0" and decision.reason is Reason.SPILL
    assert decision.expected_cached_tokens == 200


def test_more_saved_tokens_beat_fewer_at_equal_queues():
    decision = choose_worker(idle(3), {"w0": 64, "w2": 256}, WEIGHTS, PROMPT)
    assert decision.worker_id == "w2" and decision.reason is Reason.AFFINITY


def test_an_unmeasured_worker_is_assumed_as_fast_as_the_median_measured_one():
    """A restarted worker (no rate measured yet, nothing queued) gets a request as
    soon as it is faster for someone: here the holders of a hot prefix are busy."""
    holders = [view(f"w{i}", backlog=3000, rate=rate) for i, rate in enumerate((900, 1000, 5000))]
    restarted = WorkerView("w3", 0, 0)  # measured nothing
    held = {w.worker_id: 800 for w in holders}
    decision = choose_worker([*holders, restarted], held, WEIGHTS, PROMPT)
    # w3 at the median rate 1000: 1.0 s; w2: 3,200 tokens at 5,000/s: 0.64 s
    assert decision.worker_id == "w2"
    slower = [view(f"w{i}", backlog=3000) for i in range(3)]
    decision = choose_worker([*slower, restarted], held, WEIGHTS, PROMPT)
    assert decision == Decision("w3", Reason.SPILL, 0, pytest.approx(1.0))


def test_a_worker_measured_slow_once_still_gets_requests():
    """A rate is measured only where requests run: an idle worker that measured a
    tiny rate (a cold first step) counts at least half the median rate, so it takes a
    request once the others' queues outweigh that, and measures again."""
    busy = [view(f"w{i}", backlog=2000) for i in range(3)]  # 3 s each
    cold = view("w3", rate=RATE / 1000)  # idle: 2 s at the floor, 1,000 s without
    decision = choose_worker([*busy, cold], {}, WEIGHTS, PROMPT)
    assert decision.worker_id == "w3"
    assert decision.expected_wait_s == pytest.approx(PROMPT / (MIN_RATE_SHARE * RATE))
    # measured faster than the floor: its own rate stands
    assert expected_wait_s(view("w", rate=0.8 * RATE), PROMPT, RATE, 0.0) == pytest.approx(
        PROMPT / (0.8 * RATE)
    )


def test_with_no_worker_measured_the_default_rate_is_assumed():
    workers = [WorkerView("w0", 0, 0, prefill_backlog=500), WorkerView("w1", 0, 0)]
    decision = choose_worker(workers, {}, WEIGHTS, PROMPT)
    assert decision.worker_id == "w1"
    assert decision.expected_wait_s == pytest.approx(PROMPT / WEIGHTS.default_prefill_tokens_per_s)


def test_expected_wait_counts_held_tokens_only_as_saved_prefill():
    w = view("w", backlog=300, step_s=0.02, requests=1)
    assert expected_wait_s(w, PROMPT - 600, 1.0, 0.0) == pytest.approx((300 + 400) / RATE + 0.02)
    assert expected_wait_s(w, -5, 1.0, 0.0) == pytest.approx(300 / RATE + 0.02)  # never < 0


def test_no_directory_answer_means_waits_without_hits():
    workers = [view("w0", backlog=3000), view("w1", backlog=100), view("w2", backlog=2000)]
    decision = choose_worker(workers, None, WEIGHTS, PROMPT)
    assert decision == Decision("w1", Reason.NO_DIRECTORY, 0, pytest.approx(1.1))


def test_full_workers_are_never_chosen_even_as_holders():
    workers = [view("w0", requests=10), view("w1", backlog=5000, requests=9)]
    assert choose_worker(workers, {"w0": PROMPT}, WEIGHTS, PROMPT).worker_id == "w1"


def test_ties_rotate_so_equal_workers_share_requests():
    chosen = Counter(choose_worker(idle(3), {}, WEIGHTS, PROMPT, r).worker_id for r in range(9))
    assert chosen == {"w0": 3, "w1": 3, "w2": 3}
    tied_holders = {
        choose_worker(idle(2), {"w0": 64, "w1": 64}, WEIGHTS, PROMPT, r).worker_id for r in range(2)
    }
    assert tied_holders == {"w0", "w1"}


def test_waits_within_the_tolerance_are_as_good_and_go_to_fewer_requests_then_tokens():
    a, b = view("a", backlog=0, requests=2), view("b", backlog=0, requests=1, tokens=900)
    c = view("c", backlog=0, requests=1, tokens=100)
    assert choose_worker([a, b, c], {}, WEIGHTS, PROMPT).worker_id == "c"
    # rates measured 20% apart on alike workers: as good, so an idle pair still alternates
    alike = [view("x", rate=1200.0), view("y", rate=1000.0)]
    chosen = {choose_worker(alike, {}, WEIGHTS, PROMPT, r).worker_id for r in range(2)}
    assert chosen == {"x", "y"}
    # 30% apart: the faster one
    assert choose_worker([view("x", rate=1300.0), view("y")], {}, WEIGHTS, PROMPT).worker_id == "x"


def test_among_as_good_workers_the_fuller_holder_wins():
    """A holder saving 10% of the prompt is within the tolerance of an idle cold
    worker: it keeps the request (no spill for a marginal gain)."""
    workers = [view("w0"), view("w1", backlog=50, requests=3)]
    decision = choose_worker(workers, {"w1": 100}, WEIGHTS, PROMPT)
    assert decision.worker_id == "w1" and decision.reason is Reason.AFFINITY


def test_round_robin_rotates_over_open_workers_ignoring_caches_and_load():
    workers = [WorkerView("w2", 0, 0), WorkerView("w0", 9, 900), WorkerView("w1", 3, 10)]
    chosen = [round_robin(workers, 10, r) for r in range(6)]
    assert [d.worker_id for d in chosen] == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert {d.reason for d in chosen} == {Reason.ROTATION}
    assert (
        round_robin([view("w0", requests=10), view("w1"), view("w2", requests=10)], 10, 5).worker_id
        == "w1"
    )  # full ones are skipped
    assert round_robin([], 10, 0) is Unroutable.NO_WORKER
    assert (
        round_robin([view("w0", requests=10), view("w1", requests=11)], 10, 0)
        is Unroutable.OVERLOADED
    )


SPANS = [(32, 96), (96, 136), (136, 200)]  # placeable chunks of 64, 40 and 64 tokens


def test_an_approximate_hit_saves_the_chunk_less_what_repair_recomputes():
    assert placed_saving(64, first_tokens=4, deviation_ratio=0.0) == 60
    assert placed_saving(40, first_tokens=8, deviation_ratio=0.1) == 40 - 8 - 4
    assert placed_saving(3, first_tokens=4, deviation_ratio=0.0) == 0  # all recomputed
    assert placed_saving(10, first_tokens=4, deviation_ratio=1.0) == 0  # never negative


def test_placed_tokens_left_as_placed_still_cost_the_selection_layers():
    """With a deviation ratio every placed token runs the layers below the selection
    layer (3 of 28: 0.107 of a computed token); without one, placement costs nothing."""
    share = 3 / 28
    assert placed_saving(512, 0, 0.05, share) == round((512 - 26) * (1 - share))
    assert placed_saving(512, 4, 0.0, share) == 508
    saved = prefill_saved({"w0": 32}, {"w0": [0, 2]}, SPANS, 0, 0.05, share)
    assert saved == {"w0": 32 + 2 * round((64 - 3) * (1 - share))}


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


def test_a_host_memory_hit_saves_less_than_a_device_hit_and_more_than_a_miss():
    """Tokens held only in a worker's host tier save a token's compute less their load
    (a share of it, measured per worker), exact prefix and entries alike."""
    workers = [  # rates as expected_wait_s takes them: at least half the median measured
        WorkerView("w0", 0, 0, 0, 2000.0, host_load_s_per_token=5e-5),  # share 0.1
        WorkerView("w1", 0, 0, 0, 0.0, host_load_s_per_token=1e-4),  # median rate: 4000
        WorkerView("w2", 0, 0, 0, 4000.0, host_load_s_per_token=1e-3),  # loads cost all
        WorkerView("w3", 0, 0, 0, 4000.0),  # measured no load yet
    ]
    shares = host_load_shares(workers, WEIGHTS)
    assert shares == pytest.approx({"w0": 0.1, "w1": 0.4, "w2": 1.0, "w3": DEFAULT_HOST_LOAD_SHARE})
    host = {"w0": HostHeld(64, frozenset({2}), 0.1), "w1": HostHeld(0, frozenset({0}), 0.5)}
    saved = prefill_saved(
        {"w0": 96, "w1": 16, "w2": 96}, {"w0": [2], "w1": [0]}, SPANS, 4, 0.0, host=host
    )
    # w0: 32 device + 64 host (less 6.4) + chunk 2 from host (60 less 6); w1: half of 60
    assert saved == {"w0": 96 - 6 + 54, "w1": 16 + 30, "w2": 96}
    decision = choose_worker(idle(3), saved, WEIGHTS, 400)
    assert decision.worker_id == "w0" and decision.expected_cached_tokens == 144
    everything_in_host = {"w2": HostHeld(96, frozenset(), 1.0)}
    assert prefill_saved({"w2": 96}, {}, SPANS, 4, 0.0, host=everything_in_host) == {}


def test_an_approximate_holder_beats_a_short_exact_prefix():
    """A worker holding the documents' entries (after another system prompt) wins over
    one holding just the system prompt exactly, and loses once its queue costs more."""
    saved = prefill_saved({"w0": 32}, {"w1": [0, 1, 2]}, SPANS, 4, 0.0)
    assert saved == {"w0": 32, "w1": 60 + 36 + 60}
    decision = choose_worker(idle(2), saved, WEIGHTS, 200)
    assert decision.worker_id == "w1" and decision.expected_cached_tokens == 156
    busy = [view("w0"), view("w1", backlog=200)]  # 200 + 44 > 168 tokens to compute
    assert choose_worker(busy, saved, WEIGHTS, 200).worker_id == "w0"


KEYS = (b"k0", b"k1", b"k2")  # a prompt's chunk keys, in prompt order
ENDS = (16, 48, 64)  # its tokens up to each


def test_a_recent_decision_attracts_an_identical_repeat():
    """The directory does not list the prefix yet (the worker publishes later); the
    router's memory of sending it to w1 sends the repeat there too."""
    memory = RouteMemory(lease_s=1.0)
    first = choose_worker(
        idle(2), {}, WEIGHTS, PROMPT, rotation=1, recent=memory.recall(KEYS, ENDS, 0)
    )
    assert first.reason is Reason.LOAD
    memory.remember(KEYS, first.worker_id, now=0.0)
    for rotation in range(4):  # whatever turn the tie-breaking rotation is at
        recent = memory.recall(KEYS, ENDS, now=0.1)
        assert recent == {first.worker_id: 64}
        repeat = choose_worker(idle(2), {}, WEIGHTS, PROMPT, rotation, recent)
        assert repeat.worker_id == first.worker_id and repeat.reason is Reason.RECENT
        assert repeat.expected_cached_tokens == 64


def test_an_expired_decision_attracts_nothing():
    memory = RouteMemory(lease_s=1.0)
    memory.remember(KEYS, "w1", now=0.0)
    assert memory.recall(KEYS, ENDS, now=1.0) == {}
    assert len(memory) == 0  # and is dropped
    chosen = {
        choose_worker(idle(2), {}, WEIGHTS, PROMPT, r, memory.recall(KEYS, ENDS, 1.5)).worker_id
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


def test_the_directory_and_memory_combine_by_the_larger_and_queues_still_count():
    memory = RouteMemory(lease_s=1.0)
    memory.remember(KEYS, "w1", now=0.0)
    recent = memory.recall(KEYS, ENDS, now=0.1)
    listed = choose_worker(idle(2), {"w1": 300}, WEIGHTS, PROMPT, 0, recent)
    assert listed.worker_id == "w1" and listed.reason is Reason.AFFINITY  # listed: more
    assert listed.expected_cached_tokens == 300
    busy = [view("w0"), view("w1", backlog=400)]  # 1.336 s: clearly later than 1 s
    decision = choose_worker(busy, {}, WEIGHTS, PROMPT, 0, recent)
    assert decision.worker_id == "w0" and decision.reason is Reason.SPILL
    blind = choose_worker(idle(2), None, WEIGHTS, PROMPT, 0, recent)  # the memory still counts
    assert blind.worker_id == "w1" and blind.reason is Reason.NO_DIRECTORY


def test_a_spilled_prefix_attracts_its_repeats_to_the_new_holder():
    """After a spill the cold worker holds the prefix (the memory says so before the
    directory does), so the next request follows it there, by its memory."""
    memory = RouteMemory(lease_s=1.0)
    workers = [view("w0", backlog=100), view("w1", backlog=1200)]
    first = choose_worker(workers, {"w1": 64}, WEIGHTS, 64, 0, memory.recall(KEYS, ENDS, 0))
    assert first.worker_id == "w0" and first.reason is Reason.SPILL
    memory.remember(KEYS, first.worker_id, now=0.0)
    for rotation in range(3):
        recent = memory.recall(KEYS, ENDS, 0.1)
        again = choose_worker(workers, {"w1": 64}, WEIGHTS, 64, rotation, recent)
        assert again == Decision("w0", Reason.RECENT, 64, pytest.approx(0.1))


def test_merged_deltas_join_each_choice_in_first_seen_order():
    from cluster.routing.router import merge_deltas
    from workers.engine.reuse_info import ReuseInfo
    from workers.runtime.worker_types import WorkerDelta

    reuse = ReuseInfo("exact", 4, 0)

    def delta(index, tokens, text, finished=False):
        return WorkerDelta(index, tokens, text, finished, "length" if finished else None, 9, reuse)

    merged = merge_deltas(
        [
            delta(1, (5,), "a"),
            delta(0, (6,), "b"),
            delta(1, (7, 8), "cd", True),
            delta(0, (9,), "e"),
        ]
    )
    assert [(d.index, d.token_ids, d.text, d.finished) for d in merged] == [
        (1, (5, 7, 8), "acd", True),
        (0, (6, 9), "be", False),
    ]
    single = [delta(0, (1,), "x")]
    assert merge_deltas(single) == single
