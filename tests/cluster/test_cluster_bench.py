"""``bench/cluster_rag.py`` on the test Ray cluster with CPU workers: both routing
policies through real worker actors and router replicas, and a worker killed
mid-run with nothing lost. Counts only: speed is measured by the bench, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from modeltools.make_model import make_model
from tests.chunkstore.testkit import wait_until
from tests.cluster.conftest import REPO

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _engine_processes() -> list[str]:
    found = subprocess.run(
        ["pgrep", "-f", "workers.runtime.engine_child"], capture_output=True, text=True
    )
    return found.stdout.split()


def _run_bench(ray_cluster, args: list[str]) -> subprocess.CompletedProcess:
    """``bench/cluster_rag.py args`` on the test cluster; it must succeed."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cluster_rag.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_cluster_bench_answers_everything_and_survives_a_killed_worker(
    ray_cluster, tiny_qwen3, tmp_path, engine_process
):
    """With the engine on the actor's thread or in its own process (there, the killed
    actor's engine process ends with it and the restarted actor starts a new one). The
    engine-thread run also runs each policy open-loop at half the closed-loop rate."""
    out = tmp_path / "runs.json"
    args = ["--model", str(tiny_qwen3), "--workers", "1,2", "--gpus-per-worker", "0",
            "--pages", "400", "--docs", "12", "--system-tokens", "48", "--doc-tokens", "160",
            "--max-tokens", "4", "--requests-per-worker", "24", "--concurrency", "3",
            "--kill", "--kill-at", "0.3", "--json", str(out)]  # fmt: skip
    args += ["--engine", "process"] if engine_process else ["--engine", "thread"]
    args += [] if engine_process else ["--rate-share", "0.5"]
    _run_bench(ray_cluster, args)
    if engine_process:  # the killed worker's engine process and every other one ended
        assert wait_until(lambda: not _engine_processes(), timeout_s=20), _engine_processes()
    everything = json.loads(out.read_text())
    runs = {(r["workers"], r["policy"]): r for r in everything if r["open_rate"] is None}
    assert set(runs) == {
        (1, "chunk_aware"), (1, "round_robin"), (2, "chunk_aware"), (2, "round_robin"),
        (2, "chunk_aware (kill)"),
    }  # fmt: skip
    open_runs = {(r["workers"], r["policy"]): r for r in everything if r["open_rate"]}
    if engine_process:
        assert not open_runs
    else:  # each policy again at half the slower policy's closed-loop rate
        assert set(open_runs) == set(runs) - {(2, "chunk_aware (kill)")}
        for (workers, _), run in open_runs.items():
            closed = min(runs[workers, p]["requests_per_s"] for p in ("chunk_aware", "round_robin"))
            assert run["open_rate"] == pytest.approx(0.5 * closed)
            assert run["answered"] == 24 * workers and run["errors"] == []
            assert sum(run["routing"][r]["requests"] for r in run["routing"]) == 24 * workers
    for (workers, _), run in runs.items():
        assert run["answered"] == 24 * workers and run["errors"] == []
        assert len(run["requests_per_worker"]) == workers
    for (_, policy), run in runs.items():  # every request says how it was routed
        views = run["views"]  # and what the router saw of the worker it chose
        assert {w: v["requests"] for w, v in views.items()} == run["requests_per_worker"]
        assert all(v["seen_prefill_tokens_per_s"] >= 0 for v in views.values())
        routing = run["routing"]
        assert sum(r["requests"] for r in routing.values()) == run["answered"]
        if policy == "round_robin":
            assert set(routing) == {"rotation"}
        else:
            # one worker open: routed without a lookup ("sole"; in the kill run too,
            # while the killed worker is away)
            assert set(routing) <= {"affinity", "recent", "spill", "load", "sole"}, routing
            if run["workers"] == 1:
                assert set(routing) == {"sole"}
            waits = [r[-1] for r in run["requests"]]  # the router's expected wait, ms
            assert all(w >= 0 for w in waits) and any(w > 0 for w in waits)
    for (workers, policy), run in runs.items():  # where each worker's steps went
        if "kill" in policy:
            continue
        assert len(run["steps_by_kind"]) == workers
        for tally in run["steps_by_kind"].values():
            assert set(tally["kinds"]) == {"torch eager"}  # CPU workers: the torch backend
            steps, seconds = tally["kinds"]["torch eager"]
            # a CPU step's time is its launch, which computes it: within the loop's
            # busy time, which is within the run
            assert steps >= 4 and 0 < seconds <= tally["busy"] < run["seconds"]
    for (workers, policy), run in runs.items():  # where each streamed TTFT went
        phases = run["ttft_phases_ms"]
        if "kill" in policy:  # buffered answers: no first delta to time
            assert phases == {}
            continue
        assert set(phases) == {"prepare", "route", "lookup", "worker"}
        assert all(0 <= p50 <= p90 for p50, p90 in phases.values()), phases
        looked_up = policy == "chunk_aware" and workers > 1  # one worker open: no lookup
        assert (phases["lookup"][1] > 0) == looked_up, (policy, workers, phases)
        assert phases["worker"][0] > 0
    assert sorted(runs[2, "round_robin"]["requests_per_worker"].values()) == [24, 24]
    assert runs[2, "chunk_aware"]["hit_rate"] > 0
    kill = runs[2, "chunk_aware (kill)"]["kill"]
    assert kill["answered_before_kill"] >= 14 and "back_after_s" in kill
    assert kill["epoch_after"] != kill["epoch_before"]  # it was killed and restarted


def test_cluster_bench_compares_reuse_modes_over_ranked_documents(
    ray_cluster, tiny_qwen3, tmp_path
):
    """``--reuse exact approximate`` runs each policy in both modes over requests of
    several ranked documents after one of several system prompts, each run on a cluster
    of its own (``--cluster-per-run``: empty pools): every request is answered, each run
    says its mode, and approximate reuse serves more of the prompts from cached KV than
    exact reuse does (it places a document after any system prompt and documents; exact
    reuse needs the same ones before it). The workers' engines count the entries the
    approximate runs placed and took, and none in the exact runs. With ``--rate-share``
    each pair then runs open-loop on a fresh cluster of its own at half the slowest
    closed-loop rate, and answers everything there too."""
    out = tmp_path / "runs.json"
    args = ["--model", str(tiny_qwen3), "--workers", "2", "--gpus-per-worker", "0",
            "--pages", "600", "--docs", "10", "--docs-per-request", "3", "--systems", "4",
            "--system-tokens", "24", "--doc-tokens", "64", "--max-tokens", "2",
            "--requests-per-worker", "16", "--concurrency", "2", "--engine", "thread",
            "--reuse", "exact", "approximate", "--cluster-per-run", "--rate-share", "0.5",
            "--json", str(out)]  # fmt: skip
    done = _run_bench(ray_cluster, args)
    assert "3 x document 64 (of 10" in done.stdout
    assert done.stdout.count("2 workers ready in") == 8  # a cluster for each run
    everything = json.loads(out.read_text())
    runs = {r["policy"]: r for r in everything if r["open_rate"] is None}
    open_runs = {r["policy"]: r for r in everything if r["open_rate"] is not None}
    assert set(open_runs) == set(runs)
    slowest = min(run["requests_per_s"] for run in runs.values())
    for run in open_runs.values():
        assert run["open_rate"] == pytest.approx(0.5 * slowest)
        assert run["answered"] == 32 and run["errors"] == []
    assert set(runs) == {
        f"{policy}, {mode}"
        for policy in ("chunk_aware", "round_robin")
        for mode in ("exact", "approximate")
    }
    for name, run in runs.items():
        assert run["reuse"] == name.split(", ")[1]
        assert run["answered"] == 32 and run["errors"] == []
    for policy in ("chunk_aware", "round_robin"):
        exact, approximate = runs[f"{policy}, exact"], runs[f"{policy}, approximate"]
        assert approximate["hit_rate"] > exact["hit_rate"], (policy, exact, approximate)
        work = {mode: [w["work"] for w in runs[f"{policy}, {mode}"]["steps_by_kind"].values()]
                for mode in ("exact", "approximate")}  # fmt: skip
        assert sum(w["entry_hits"] for w in work["approximate"]) > 0
        assert sum(w["entries_taken"] for w in work["approximate"]) > 0
        assert all(w["entry_hits"] == w["entries_taken"] == 0 for w in work["exact"])
        assert all(sum(w["prompt_positions"] for w in work[mode]) > 0 for mode in work)


def test_cluster_bench_runs_with_the_host_tier_off_and_on(ray_cluster, tiny_qwen3, tmp_path):
    """``--host-kv-gib 0 0.05`` runs the comparison on a cluster without a host tier,
    then on one with: device pools of 60 pages hold a few of the documents, the tier all
    of them, so documents seen before hit from host memory and the hit rate rises (48
    requests a worker: with 24, the rise ran 0.07-0.08 in one run of three, as routing
    timing varied; with 48 it ran 0.23-0.25 in three)."""
    out = tmp_path / "runs.json"
    args = ["--model", str(tiny_qwen3), "--workers", "2", "--gpus-per-worker", "0",
            "--pages", "60", "--docs", "12", "--system-tokens", "24", "--doc-tokens", "128",
            "--zipf", "0.5", "--max-tokens", "2", "--requests-per-worker", "48",
            "--concurrency", "2", "--engine", "thread", "--policies", "chunk_aware",
            "--host-kv-gib", "0", "0.05", "--json", str(out)]  # fmt: skip
    done = _run_bench(ray_cluster, args)
    assert "(host KV tier 0.05 GiB)" in done.stdout
    runs = {r["policy"]: r for r in json.loads(out.read_text())}
    off, on = runs["chunk_aware, host tier 0 GiB"], runs["chunk_aware, host tier 0.05 GiB"]
    assert off["answered"] == on["answered"] == 96 and off["errors"] == on["errors"] == []
    assert on["hit_rate"] > off["hit_rate"] + 0.1, (off["hit_rate"], on["hit_rate"])


def test_cluster_bench_serves_tensor_parallel_workers_through_a_kill(ray_cluster, tmp_path):
    """Workers of two ranks each (CPU, gloo) on a checkpoint without weights
    (``--load-format dummy``, as for shapes larger than the GPU host has weights of): to
    the router and the directory each is one holder; a killed one comes back with both
    ranks (its engine starts only once every rank has joined) and no request is lost."""
    out = tmp_path / "runs.json"
    model = make_model(tmp_path / "model", preset="tiny", weights=False)
    args = ["--model", str(model), "--load-format", "dummy", "--workers", "2",
            "--gpus-per-worker", "0", "--tensor-parallel-size", "2", "--pages", "300",
            "--docs", "8", "--system-tokens", "32", "--doc-tokens", "96", "--max-tokens", "3",
            "--requests-per-worker", "12", "--concurrency", "2", "--engine", "thread",
            "--policies", "chunk_aware", "--kill", "--kill-at", "0.3",
            "--json", str(out)]  # fmt: skip
    done = _run_bench(ray_cluster, args)
    assert "2 workers of 2 ranks ready" in done.stdout
    runs = {r["policy"]: r for r in json.loads(out.read_text())}
    assert set(runs) == {"chunk_aware", "chunk_aware (kill)"}
    for run in runs.values():
        assert run["answered"] == 24 and run["errors"] == []
        assert len(run["requests_per_worker"]) == 2
    assert runs["chunk_aware"]["hit_rate"] > 0  # each worker's cache, one holder each
    kill = runs["chunk_aware (kill)"]["kill"]
    assert kill["epoch_after"] != kill["epoch_before"] and "back_after_s" in kill
