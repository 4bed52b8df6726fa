"""``bench/routing_model.py`` on a small workload: every request is answered once, the
model is deterministic, and chunk-aware routing keeps more of each prompt cached
than round-robin. Hit rates and counts only: the model's speeds are not asserted."""

from __future__ import annotations

from bench import routing_model

SMALL = ["--workers", "2", "--docs", "12", "--requests-per-worker", "60",
         "--concurrency", "4", "--cache-pairs", "6", "--max-tokens", "4"]  # fmt: skip


def test_chunk_aware_keeps_more_cached_and_every_request_is_answered():
    results = routing_model.main(SMALL)[2]
    aware, rr = results["chunk_aware"], results["round_robin"]
    assert rr.reasons == {"rotation": 120}
    assert sum(aware.reasons.values()) == 120
    assert set(aware.reasons) <= {"affinity", "recent", "spill", "load"}
    assert 0 < rr.hit_rate < aware.hit_rate <= 1
    cold = routing_model.main([*SMALL, "--cold-spills"])[2]["chunk_aware"]
    assert sum(cold.reasons.values()) == 120
    assert routing_model.main(SMALL)[2] == results  # deterministic
