"""Stand-ins for worker actors, for router tests that need workers to disagree or to
die on cue: real Ray actors answering ``status`` and ``generate`` like a worker,
without an engine. Pickled by value, so Ray's worker processes need not import
``tests``."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import AsyncIterator, Sequence

import ray
from ray import cloudpickle

from chunkstore import directory as d
from chunkstore.hashing import PageKey
from cluster.routing.worker_pool import Agreement
from workers.engine.reuse_info import ReuseInfo
from workers.runtime.worker_types import (
    EngineLoad,
    WorkerDelta,
    WorkerInfo,
    WorkerRefusal,
    WorkerRequest,
    WorkerStatus,
    pack_item,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

AGREEMENT = Agreement(
    namespace_model="tiny@0123abcd",
    page_size=16,
    directory_namespace="redis prefix 'chunkserve'",
)

REFUSE_AS_DRAINING = "refuse as draining"  # before output: the router tries another
DIE_AFTER_FIRST_DELTA = "die after the first delta"
HANG_AFTER_FIRST_DELTA = "answer one delta, then wait to be cancelled"
# a death Ray never reports: the call hangs while polls meet a new epoch
RESTART_SILENTLY = "hang, and answer polls as restarted"
RESTART_SILENTLY_AFTER_FIRST_DELTA = "one delta, then hang and answer polls as restarted"


def worker_info(worker_id: str, agreement: Agreement = AGREEMENT) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        epoch=1,
        namespace_model=agreement.namespace_model,
        max_model_len=1024,
        page_size=agreement.page_size,
        directory_namespace=agreement.directory_namespace,
        startup_s=0.0,
        entry_system_prompt=agreement.entry_system_prompt,
    )


@ray.remote(num_cpus=0)
class StartLog:
    """Counts worker starts of requests, records what each start was sent, and tells
    each start how to fail, in turn."""

    def __init__(self, behaviours: Sequence[str]) -> None:
        self._behaviours = list(behaviours)
        self.starts = 0
        self.sent: list[tuple[str, WorkerRequest]] = []  # (worker id, request)

    def start(self, worker_id: str = "", request: WorkerRequest | None = None) -> str:
        behaviour = self._behaviours[self.starts % len(self._behaviours)]
        self.starts += 1
        if request is not None:
            self.sent.append((worker_id, request))
        return behaviour

    def count(self) -> int:
        return self.starts

    def requests(self) -> list[tuple[str, WorkerRequest]]:
        return self.sent


@ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
class FakeWorker:
    """Answers polls with ``info``; every ``generate`` asks ``log`` how to fail, and
    fails so (refuses; sends one delta and exits: callers see the actor die; or
    hangs, before or after one delta, while polls see a new epoch, as if the
    worker had restarted without Ray failing the call)."""

    def __init__(
        self,
        info: WorkerInfo,
        log: ray.actor.ActorHandle | None = None,
        load: EngineLoad | None = None,
    ) -> None:
        self._info = info
        self._log = log
        self._load = load or EngineLoad(0, 0, 0, 0, 0, 0)  # what polls report, always

    async def status(self) -> WorkerStatus:
        return WorkerStatus(
            info=self._info,
            load=self._load,
            cached_pages=0,
            kv_pages_total=64,
            kv_pages_in_use=0,
            draining=False,
            directory_in_sync=True,
            directory_superseded=False,
        )

    async def generate(self, request: WorkerRequest) -> AsyncIterator[bytes]:
        behaviour = await self._log.start.remote(self._info.worker_id, request)
        if behaviour == REFUSE_AS_DRAINING:
            yield pack_item(WorkerRefusal("worker is draining", retryable=True))
            return
        if behaviour == RESTART_SILENTLY:
            await self._restart_silently()
        yield pack_item(
            WorkerDelta(
                index=0,
                token_ids=(1,),
                text="a",
                finished=False,
                finish_reason=None,
                prompt_tokens=len(request.prompt.token_ids),
                reuse=ReuseInfo("exact"),
            )
        )
        if behaviour == RESTART_SILENTLY_AFTER_FIRST_DELTA:
            await self._restart_silently()
        if behaviour == HANG_AFTER_FIRST_DELTA:
            await asyncio.sleep(3600)  # until the caller closes the stream
        await asyncio.sleep(0.5)  # the first delta reaches the router before the exit
        os._exit(1)

    async def _restart_silently(self) -> None:
        self._info = dataclasses.replace(self._info, epoch=self._info.epoch + 1)
        await asyncio.sleep(3600)


class NoDirectory:
    """An ``AsyncDirectory`` that knows nothing (lookups: no information)."""

    async def lookup(
        self,
        keys: Sequence[PageKey],
        token_ends: Sequence[int],
        entry_keys: Sequence[PageKey] = (),
    ) -> d.LookupResult:
        return d.NO_INFORMATION

    async def stats(self) -> d.DirectoryStats | None:
        return None

    async def remove_worker(self, worker_id: str) -> None:
        pass

    def close(self) -> None:
        pass
