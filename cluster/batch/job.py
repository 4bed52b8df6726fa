"""The batch job: a JSONL file of requests through the router, in order, resumable.

Runs in the driver (``chunkserve batch``, locally or under ``ray job submit``): it
starts the job's own workers (owned by the driver, so they die with it), routes
through the same router and completion service as the HTTP app, and writes one
record per input line in input order (see ``cluster.batch.lines``).

Invariants:
- At most ``batch.concurrency`` requests are in flight; a record is written as soon
  as it and every record before it are done.
- Requests refused for want of capacity (429/503, e.g. while a worker restarts)
  are retried with backoff for up to ``_CAPACITY_WAIT_S`` before becoming errors.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from cluster.api.completions import CompletionService
from cluster.api.openai_protocol import ChatCompletionRequest
from cluster.assembly import build_service
from cluster.batch.lines import (
    Answered,
    BatchItem,
    BatchRecord,
    RecordWriter,
    answered_records,
    error_record,
    ok_record,
    read_items,
)
from cluster.config import ClusterConfig
from cluster.errors import APIError, BadRequest, NoHealthyWorker, Overloaded
from cluster.metrics import Metrics
from cluster.ops.actors import ensure_cluster, kill_cluster, wait_ready
from cluster.ops.model_store import ensure_model
from cluster.ops.ray_session import connect_ray

logger = logging.getLogger(__name__)

_CAPACITY_WAIT_S = 60.0
_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass(slots=True)
class _Counts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, record: BatchRecord) -> None:
        self.requests += 1
        if record.error is not None:
            self.errors += 1
            return
        usage = record.response.body.usage
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.prompt_tokens_details.cached_tokens


@dataclass(frozen=True)
class BatchSummary:
    requests: int  # records written by this run
    errors: int
    skipped: int  # lines whose record was already in the output (earlier runs)
    prompt_tokens: int
    cached_tokens: int
    elapsed_s: float

    def describe(self, output: Path) -> str:
        share = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return (
            f"chunkserve batch: {self.requests} requests ({self.errors} errors, "
            f"{self.skipped} already done) in {self.elapsed_s:.1f} s; prompt tokens "
            f"{self.prompt_tokens:,}, cached {self.cached_tokens:,} ({share:.0%}); "
            f"output {output}"
        )


def run_batch(
    cfg: ClusterConfig, input_path: Path, output_path: Path, retry_errors: bool = False
) -> BatchSummary:
    """``retry_errors``: ids whose earlier record is an error run again (their error
    records are removed from the output first)."""
    if not input_path.is_file():
        raise ValueError(f"input file {str(input_path)!r} does not exist")
    started = time.monotonic()
    answered = answered_records(output_path, retry_errors)
    lines = _count_lines(input_path)
    # a first pass to count what is left (the progress bar's total); lines parse twice
    total = sum(1 for _ in _pending(read_items(input_path, cfg.model.name), answered))
    if total == 0:  # every line has its record: no cluster to start
        return BatchSummary(0, 0, lines, 0, 0, elapsed_s=time.monotonic() - started)
    connect_ray(cfg.ray)
    model_dir = ensure_model(cfg.model)
    job = cfg.model_copy(update={"name": f"{cfg.name}-batch-{uuid.uuid4().hex[:8]}"})
    actors = ensure_cluster(job, model_dir, detached=False)
    try:
        wait_ready(actors, cfg.workers.startup_timeout_s)
        service = build_service(job, model_dir, actors, Metrics())
        pending = _pending(read_items(input_path, cfg.model.name), answered)
        with output_path.open("a") as out:
            counts = asyncio.run(_run(service, pending, out, cfg.batch.concurrency, total))
    finally:
        kill_cluster(job)
    return BatchSummary(
        requests=counts.requests,
        errors=counts.errors,
        skipped=lines - total,
        prompt_tokens=counts.prompt_tokens,
        cached_tokens=counts.cached_tokens,
        elapsed_s=time.monotonic() - started,
    )


def _pending(items: Iterator[BatchItem], answered: Answered) -> Iterator[BatchItem]:
    """The items whose record is not in the output yet; a line repeating an earlier
    line's id becomes an error (its own record)."""
    occurrences: dict[bool, Counter[str]] = {True: Counter(), False: Counter()}
    for item in items:
        seen = occurrences[item.keyed]
        occurrence = seen[item.custom_id]
        seen[item.custom_id] += 1
        if answered.holds(item, occurrence):
            continue
        if item.keyed and occurrence > 0:
            duplicate = BadRequest(
                f"custom_id {item.custom_id!r} repeats an earlier line", code="duplicate_custom_id"
            )
            yield BatchItem(item.line_number, item.custom_id, None, duplicate)
            continue
        yield item


async def _run(
    service: CompletionService,
    items: Iterator[BatchItem],
    out: TextIO,
    concurrency: int,
    total: int,
) -> _Counts:
    writer = RecordWriter(out)
    counts = _Counts()
    window: deque[asyncio.Task[BatchRecord]] = deque()
    with tqdm(total=total, file=sys.stderr, unit="req", desc="batch") as progress:

        async def write_oldest() -> None:
            record = await window.popleft()
            writer.write(record)
            counts.add(record)
            progress.update()

        for item in items:
            if len(window) >= concurrency:
                await write_oldest()
            window.append(asyncio.create_task(_answer(service, item)))
        while window:
            await write_oldest()
    await service.router.pool.close()
    return counts


async def _answer(service: CompletionService, item: BatchItem) -> BatchRecord:
    if item.request is None:
        assert item.error is not None
        return error_record(item.custom_id, item.error)
    handle = service.chat if isinstance(item.request, ChatCompletionRequest) else service.completion
    deadline = time.monotonic() + _CAPACITY_WAIT_S
    attempt = 0
    while True:
        try:
            reply = await handle(item.request, "")
            return ok_record(item.custom_id, reply.body)
        except (NoHealthyWorker, Overloaded) as error:
            if time.monotonic() >= deadline:
                return error_record(item.custom_id, error)
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
            attempt += 1
        except APIError as error:
            return error_record(item.custom_id, error)
        except Exception as error:  # one bad request must not stop the job
            logger.exception("batch line %d failed", item.line_number)
            return error_record(item.custom_id, APIError(f"internal error: {error!r}"))


def _count_lines(path: Path) -> int:
    with path.open() as lines:
        return sum(1 for line in lines if line.strip())
