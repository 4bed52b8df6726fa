"""The pool's view of a worker's load: the worker's newest report (a poll answer or
an output delta, newest by version), plus what this router sent since. No Ray: the
worker handles are in-process stand-ins answering ``status.remote()``."""

from __future__ import annotations

import asyncio
import dataclasses

from cluster.routing.worker_pool import Agreement, WorkerPool
from workers.runtime.worker_types import EngineLoad, WorkerInfo, WorkerStatus

AGREEMENT = Agreement("tiny@0123abcd", 16, "redis prefix 'chunkserve'")
INFO = WorkerInfo("w0", 1, AGREEMENT.namespace_model, 1024, 16, AGREEMENT.directory_namespace, 0)


def load(version: int, backlog: int = 0, requests: int = 0, tokens: int = 0) -> EngineLoad:
    return EngineLoad(
        requests, tokens, 0, 0, 0, 0,
        prefill_backlog_tokens=backlog, decode_seqs=0, prefill_tokens_per_s=4000.0,
        step_s=0.02, version=version,
    )  # fmt: skip


class Handle:
    """A worker handle whose ``status.remote()`` answers ``self.answer``."""

    def __init__(self, answer: EngineLoad) -> None:
        self.answer = answer
        self.info = INFO
        self.status = self  # handle.status.remote()

    def remote(self):
        async def answer() -> WorkerStatus:
            return WorkerStatus(self.info, self.answer, 0, 64, 0, False, True, False)

        return answer()


def run(test) -> None:
    async def body() -> None:
        handle = Handle(load(version=1, backlog=500, requests=2, tokens=800))
        pool = WorkerPool({"w0": handle}, AGREEMENT, poll_interval_s=3600, poll_timeout_s=5)
        await pool.start()
        try:
            await test(pool, handle)
        finally:
            await pool.close()

    asyncio.run(body())


def test_the_view_is_the_report_plus_what_this_router_sent_since():
    async def test(pool: WorkerPool, handle: Handle) -> None:
        (view,) = pool.views()
        assert (view.requests, view.tokens, view.prefill_backlog) == (2, 800, 500)
        assert (view.prefill_tokens_per_s, view.step_s) == (4000.0, 0.02)
        pool.begin("w0", choices=1, tokens=300, uncached=250)
        (view,) = pool.views()
        assert (view.requests, view.tokens, view.prefill_backlog) == (3, 1100, 750)

    run(test)


def test_a_delta_report_replaces_an_older_one_and_an_older_one_is_ignored():
    """Deltas carry the worker's load, so a router replica sees the other replicas'
    work as fresh as its latest delta: here the worker's backlog drained to 40 and
    it runs 5 requests (4 from elsewhere)."""

    async def test(pool: WorkerPool, handle: Handle) -> None:
        pool.begin("w0", choices=1, tokens=300, uncached=250)
        pool.observe("w0", load(version=2, backlog=40, requests=5, tokens=1500))
        (view,) = pool.views()  # the report counts what was sent before it
        assert (view.requests, view.tokens, view.prefill_backlog) == (5, 1500, 40)
        pool.observe("w0", load(version=1, backlog=999, requests=9, tokens=9999))
        assert pool.views()[0].prefill_backlog == 40  # older: ignored
        pool.end("w0", choices=1, tokens=300)  # this router's request finished
        (view,) = pool.views()
        assert (view.requests, view.tokens) == (4, 1200)

    run(test)


def test_a_poll_counts_what_was_sent_while_it_was_in_flight():
    """A request sent while a poll is on its way may be in the answer or not: the
    others' share is what the answer holds beyond it (here 3 requests, 1 maybe ours),
    and the backlog keeps the request's prefill (it may not have arrived)."""

    async def test(pool: WorkerPool, handle: Handle) -> None:
        handle.answer = load(version=3, backlog=100, requests=3, tokens=700)
        poll = asyncio.ensure_future(pool._poll("w0"))
        await asyncio.sleep(0)  # asked now ...
        pool.begin("w0", choices=1, tokens=300, uncached=250)  # ... sent before it answers
        await poll
        (view,) = pool.views()
        assert (view.requests, view.tokens, view.prefill_backlog) == (3, 700, 350)

    run(test)


def test_a_slow_poll_answer_never_makes_an_idle_worker_look_full():
    """A poll asked for before this router's requests began, answered while they ran
    on the worker, and taken after they ended: they must not count as the other
    routers' (the worker would look full, and the router answer 429, until the next
    report)."""

    async def test(pool: WorkerPool, handle: Handle) -> None:
        handle.answer = load(version=1)
        await pool._poll("w0")
        release = asyncio.Event()
        answer = handle.remote

        def slow_remote():
            async def later() -> WorkerStatus:
                await release.wait()
                return await answer()

            return later()

        handle.remote = slow_remote
        poll = asyncio.ensure_future(pool._poll("w0"))
        await asyncio.sleep(0)  # asked while idle ...
        pool.begin("w0", choices=2, tokens=1800, uncached=10)
        handle.answer = load(version=5, requests=2, tokens=1800)  # ... answered mid-run
        pool.end("w0", choices=2, tokens=1800)  # ... and taken after the requests ended
        release.set()
        await poll
        (view,) = pool.views()
        assert (view.requests, view.tokens) == (0, 0)

    run(test)


def test_work_abandoned_before_a_poll_never_makes_an_idle_worker_look_full():
    """A client left; this router closed its requests and asked the worker to cancel
    them. A poll asked for right after may still find them there: they are this
    router's, not the others', so the worker does not look full until the next report.
    The report after that counts them as others' again (the worker kept them)."""

    async def test(pool: WorkerPool, handle: Handle) -> None:
        handle.answer = load(version=1)
        await pool._poll("w0")
        pool.begin("w0", choices=2, tokens=1800, uncached=10)
        pool.end("w0", choices=2, tokens=1800, abandoned=True)  # closed: the client left
        handle.answer = load(version=2, requests=2, tokens=1800)  # not cancelled there yet
        await pool._poll("w0")
        (view,) = pool.views()
        assert (view.requests, view.tokens) == (0, 0)
        handle.answer = load(version=3, requests=2, tokens=1800)  # still there: others'
        await pool._poll("w0")
        (view,) = pool.views()
        assert (view.requests, view.tokens) == (2, 1800)
        pool.begin("w0", choices=1, tokens=100, uncached=10)
        pool.end("w0", choices=1, tokens=100)  # finished by the worker: not abandoned
        handle.answer = load(version=4, requests=1, tokens=100)
        await pool._poll("w0")
        assert pool.views()[0].requests == 1  # another router's, the worker says

    run(test)


def test_a_restarted_worker_report_replaces_any_version_and_changes_its_incarnation():
    async def test(pool: WorkerPool, handle: Handle) -> None:
        pool.observe("w0", load(version=50, backlog=900))
        before = pool.incarnation("w0")
        handle.info = dataclasses.replace(INFO, epoch=2)
        handle.answer = load(version=1, backlog=0)
        await pool._poll("w0")
        assert pool.views()[0].prefill_backlog == 0
        assert pool.incarnation("w0") != before

    run(test)
