"""The routing policy is a pure function: saved prefill (exact prefixes and approximate
hits) against load."""

from __future__ import annotations

from collections import Counter

from cluster.routing_policy import (
    Decision,
    Reason,
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
