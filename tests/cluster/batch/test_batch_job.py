"""``ray job submit`` of ``chunkserve batch --config configs/local.yaml`` against the
session's real ``ray start --head``: a job stopped half-way and resubmitted writes
every id exactly once, in input order, with bad lines as error records; lines asking
for approximate reuse are served (and labelled) so."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.chunkstore.testkit import wait_until
from tests.cluster.conftest import REPO

pytestmark = pytest.mark.ray

EXAMPLE = REPO / "configs" / "examples" / "rag_requests.jsonl"
SLOW_LINES = 12  # long answers first, so the job is surely mid-way when stopped
FAST_LINES = 24
# lines asking for approximate reuse (the body's `reuse` field, as over HTTP)
APPROXIMATE = {
    f"req-{SLOW_LINES + 5:03d}": "approximate",
    f"req-{SLOW_LINES + 6:03d}": {"mode": "approximate", "first_tokens": 8},
}


def make_input(path: Path) -> list[str]:
    """Example RAG requests under new ids, plus two bad lines; returns the ids in order."""
    examples = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    lines, ids = [], []
    for i in range(SLOW_LINES + FAST_LINES):
        line = json.loads(json.dumps(examples[i % len(examples)]))
        body = line.get("body", line)
        body["max_tokens"] = 200 if i < SLOW_LINES else 8
        line["custom_id"] = f"req-{i:03d}"
        if line["custom_id"] in APPROXIMATE:
            body["reuse"] = APPROXIMATE[line["custom_id"]]
        lines.append(json.dumps(line))
        ids.append(line["custom_id"])
        if i == SLOW_LINES + 3:
            lines.append('{"custom_id": "broken", "body": {')  # not JSON: id line-<n>
            ids.append(f"line-{len(lines)}")
            lines.append(json.dumps({"custom_id": "typed", "messages": [], "max_tokens": "x"}))
            ids.append("typed")
            bad_reuse = {"mode": "approximate", "deviation_ratio": 2}
            lines.append(json.dumps({**body, "custom_id": "bad-reuse", "reuse": bad_reuse}))
            ids.append("bad-reuse")
    path.write_text("\n".join(lines) + "\n")
    return ids


def submit(ray_cluster, entrypoint: str, wait: bool) -> subprocess.CompletedProcess | str:
    submission_id = f"chunkserve-batch-{uuid.uuid4().hex[:8]}"
    args = [
        sys.executable, "-m", "ray.scripts.scripts", "job", "submit",
        "--address", ray_cluster.dashboard_url, "--submission-id", submission_id,
        *([] if wait else ["--no-wait"]), "--", "bash", "-c", entrypoint,
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result if wait else submission_id


def output_ids(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines() if line]


def test_job_stopped_half_way_and_resubmitted_writes_each_id_once(
    ray_cluster, tmp_path, model_factory
):
    """On the tiny random-weight model, which never stops early, so the long answers
    keep the job busy until it is stopped."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    ids = make_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    command = (
        f"cd {REPO} && {sys.executable} -m cluster.ops.cli batch --config configs/local.yaml "
        f"--input {tmp_path / 'in.jsonl'} --output {out} "
        f"--set model.path={model_factory('qwen3')} --set workers.num_cpus=0.5 "
        "--set batch.concurrency=2"
    )
    jobs = JobSubmissionClient(ray_cluster.dashboard_url)
    first = submit(ray_cluster, command, wait=False)
    wait_until(
        lambda: len(output_ids(out)) >= 2 or jobs.get_job_status(first).is_terminal(),
        timeout_s=180,
        step_s=0.05,
    )
    assert len(output_ids(out)) >= 2, jobs.get_job_logs(first)[-3000:]
    jobs.stop_job(first)
    assert wait_until(lambda: jobs.get_job_status(first).is_terminal(), timeout_s=60)
    assert jobs.get_job_status(first) == JobStatus.STOPPED
    written = output_ids(out)
    assert 0 < len(written) < len(ids) and written == ids[: len(written)]

    second = submit(ray_cluster, command, wait=True)
    assert "chunkserve batch:" in second.stdout and "already done" in second.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ids  # complete, in order, each id once
    errors = {r["custom_id"]: r for r in records if r["error"] is not None}
    assert set(errors) == {ids[ids.index("typed") - 1], "typed", "bad-reuse"}
    assert errors["typed"]["response"]["status_code"] == 400
    assert errors["bad-reuse"]["response"]["status_code"] == 400
    assert '"exact", "approximate"' in errors["bad-reuse"]["error"]["message"]
    ok = [r for r in records if r["error"] is None]
    assert all(r["response"]["body"]["choices"][0]["finish_reason"] for r in ok)
    cached = [r["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok]
    assert sum(cached) > 0  # the requests share a system prompt and documents
    reuse = {r["custom_id"]: r["response"]["body"]["reuse"] for r in ok}
    for record, tokens in zip(ok, cached, strict=True):
        got = reuse[record["custom_id"]]
        assert got["reused_tokens"] == tokens
        if record["custom_id"] in APPROXIMATE:
            assert got["mode"] == "approximate"
        else:
            assert got == {"mode": "exact", "reused_tokens": tokens, "recomputed_tokens": 0}
