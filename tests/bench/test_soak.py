"""bench/soak.py for a minute on this machine (its own Ray head and ``chunkserve serve``
of configs/local.yaml): the mixed traffic, client timeouts and streams closed early
included, leaves no 5xx, no restarted worker and no KV page in use beyond the baseline."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
# The app's start (about a minute on 2 cores), a minute of traffic and two waits for
# the chunks' 10 s TTL: about 3 minutes; within pytest's 600 s.
SOAK_TIMEOUT_S = 480
STOP_TIMEOUT_S = 100  # the soak stops its app and Ray head on SIGTERM


def run_soak(json_path: Path) -> subprocess.CompletedProcess:
    """The soak as a subprocess; past SOAK_TIMEOUT_S it is stopped with SIGTERM (so that
    it stops what it started) and the test fails with its output."""
    cmd = [
        sys.executable, "bench/soak.py", "--minutes", "1", "--warmup-minutes", "0.25",
        "--rate", "15", "--ttl-s", "10", "--sample-s", "5", "--json", str(json_path),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=SOAK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
        pytest.fail(f"the soak ran past {SOAK_TIMEOUT_S} s:\n{out}\n{err[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_a_minute_of_mixed_traffic_leaves_no_failure_restart_or_pinned_page(tmp_path):
    from bench.soak import KINDS  # here: collecting this file imports nothing heavy

    done = run_soak(tmp_path / "soak.json")
    assert (tmp_path / "soak.json").exists(), f"exit {done.returncode}:\n{done.stderr[-5000:]}"
    summary = json.loads((tmp_path / "soak.json").read_text())
    context = f"{done.stdout}\n{summary['tracebacks']['examples']}"
    classes = {row: counts["classes"] for row, counts in summary["outcomes"].items()}

    # every kind was sent and answered, and the clients' own give-ups happened
    assert all(classes[kind].get("2xx", 0) > 0 for kind in KINDS), context
    assert sum(c.get("client_timeout", 0) for c in classes.values()) > 0, context
    assert sum(c.get("early_close", 0) for c in classes.values()) > 0, context

    assert not {row: c["5xx"] for row, c in classes.items() if c.get("5xx")}, context
    assert summary["restarted"] is False, context
    assert summary["pages_back_to_baseline"] is True, context
    assert all(w["end"]["requests"] == 0 for w in summary["workers"].values()), context
