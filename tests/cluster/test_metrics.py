"""Metrics without a cluster: snapshots of several replicas sum, stale gauges leave
the sum, weighted histogram observations, and the text format."""

from __future__ import annotations

from cluster.metrics import STALE_S, Metrics, render


def _value(text: str, series: str) -> float:
    [line] = [line for line in text.splitlines() if line.split(" ")[0] == series]
    return float(line.split(" ")[1])


def _replica(requests: int, prompt: int, cached: int, in_flight: int, ttft: float) -> Metrics:
    metrics = Metrics()
    metrics.requests.inc("chat", "200", by=requests)
    metrics.prompt_tokens.inc(by=prompt)
    metrics.cached_tokens.inc(by=cached)
    metrics.ttft.observe(ttft)
    metrics.in_flight = in_flight
    return metrics


def test_snapshots_of_replicas_sum_and_the_hit_rate_is_of_the_sum():
    a = _replica(requests=3, prompt=100, cached=0, in_flight=1, ttft=0.02)
    b = _replica(requests=5, prompt=300, cached=200, in_flight=2, ttft=3.0)
    b.requests.inc("completions", "400")
    text = render([(0.0, a.snapshot()), (0.1, b.snapshot())])
    assert _value(text, 'chunkserve_requests_total{endpoint="chat",status="200"}') == 8
    assert _value(text, 'chunkserve_requests_total{endpoint="completions",status="400"}') == 1
    assert _value(text, "chunkserve_prompt_tokens_total") == 400
    assert _value(text, "chunkserve_cache_hit_rate") == 0.5
    assert _value(text, "chunkserve_requests_in_flight") == 3
    assert _value(text, 'chunkserve_time_to_first_token_seconds_bucket{le="0.025"}') == 1
    assert _value(text, 'chunkserve_time_to_first_token_seconds_bucket{le="5"}') == 2
    assert _value(text, "chunkserve_time_to_first_token_seconds_count") == 2
    # the replicas' own families are left as they were
    assert a.requests.total() == 3 and b.ttft.observations == 1


def test_a_silent_replica_keeps_its_counts_but_not_its_gauges():
    a = _replica(requests=3, prompt=10, cached=0, in_flight=1, ttft=0.1)
    gone = _replica(requests=4, prompt=10, cached=0, in_flight=7, ttft=0.1)
    text = render([(0.0, a.snapshot()), (STALE_S + 1, gone.snapshot())])
    assert _value(text, 'chunkserve_requests_total{endpoint="chat",status="200"}') == 7
    assert _value(text, "chunkserve_requests_in_flight") == 1


def test_weighted_observations_and_a_fresh_process_renders_zeros():
    metrics = Metrics()
    metrics.inter_token.observe(0.004, count=3)
    text = metrics.render()
    assert _value(text, 'chunkserve_inter_token_latency_seconds_bucket{le="0.0025"}') == 0
    assert _value(text, 'chunkserve_inter_token_latency_seconds_bucket{le="0.005"}') == 3
    assert _value(text, "chunkserve_inter_token_latency_seconds_count") == 3
    assert abs(_value(text, "chunkserve_inter_token_latency_seconds_sum") - 0.012) < 1e-12
    assert _value(text, "chunkserve_generated_tokens_total") == 0
    assert _value(text, "chunkserve_e2e_request_latency_seconds_count") == 0
    assert _value(text, "chunkserve_healthy_workers") == 0
