"""Messages between routers and worker actors.

Plain frozen dataclasses: they cross process boundaries by pickle, and both sides
import them from here (``cluster`` imports ``workers``, never the other way).

A worker's stream (``Worker.generate``) yields each item packed (``pack_item``: bytes),
and routers unpack it (``unpack_item``). Ray sends bytes as they are, where a
dataclass goes through its own serializer: measured on the 2-core VM with 24 streams,
an actor spent 290 us of CPU per yielded ``WorkerDelta`` and 210 us per packed one. A
loaded worker yields about a thousand a second, on the GIL its engine thread needs.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import NamedTuple

from chunkstore.ray_access import DirectoryKind, DirectorySpec
from workers.engine.config import DEFAULT_ENTRY_SYSTEM_PROMPT, EngineConfig
from workers.engine.host_tier import TierStats
from workers.engine.request import PromptRequest
from workers.engine.reuse_info import ReuseInfo
from workers.engine.sampling_params import SamplingParams
from workers.engine.workload_tally import StepTally

# Per generated token: (chosen token, logprob), then the top alternatives.
TokenLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker actor needs to start; identical for every restart."""

    worker_id: str  # stable across restarts; the epoch tells incarnations apart
    engine: EngineConfig
    directory: DirectorySpec
    publish_interval_s: float  # chunk events and heartbeats, this often
    cpu_threads: int | None  # torch intra-op threads; None keeps torch's default
    # the engine in a child process of its own (``engine_host.ChildEngine``), not a
    # thread of the actor's
    engine_process: bool = False


@dataclass(frozen=True)
class WorkerRequest:
    """One API request: ``len(params)`` choices (OpenAI ``n``) of one prompt. The
    worker submits each choice with ``prompt`` as it is (``Engine.submit``)."""

    request_id: str  # unique per attempt; the worker appends "#<choice>"
    prompt: PromptRequest  # its tenant salt derived by the server from the caller
    params: tuple[SamplingParams, ...]
    chunk_ids: tuple[str, ...] = ()  # registered chunks the prompt uses (hit counting)
    # After the first delta, at least this long between deltas (what arrives meanwhile
    # is coalesced); math.inf: only the first and the last (callers that buffer).
    stream_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError("a worker request needs at least one choice")
        if not self.stream_interval_s >= 0:
            raise ValueError(f"stream_interval_s must be >= 0, got {self.stream_interval_s}")


@dataclass(frozen=True)
class WorkerDelta:
    """New output of one choice since its previous delta."""

    index: int  # the choice
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    reuse: ReuseInfo  # how the prompt was served (mode, tokens reused and recomputed)
    logprobs: tuple[TokenLogprobs, ...] = ()  # one entry per token when requested
    # the worker's load when the delta was made (never older than the step that
    # produced its last token); the worker actor sets it on every delta it sends
    load: EngineLoad | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the KV cache."""
        return self.reuse.reused_tokens


@dataclass(frozen=True)
class WorkerRefusal:
    """The worker did not run the request (nothing was generated).

    ``retryable``: another worker may take it (this one is draining); otherwise the
    request itself is invalid and ``message`` says how to fix it."""

    message: str
    retryable: bool


def pack_item(item: WorkerDelta | WorkerRefusal) -> bytes:
    """A stream item as ``Worker.generate`` yields it."""
    return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_item(packed: bytes) -> WorkerDelta | WorkerRefusal:
    """A stream item from what a worker yielded (``pack_item``); a worker's stream
    holds nothing else, and only the cluster's own actors reach it."""
    item = pickle.loads(packed)
    if not isinstance(item, WorkerDelta | WorkerRefusal):
        raise TypeError(f"a worker stream yielded {type(item).__name__}, not a delta")
    return item


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    epoch: int  # new on every (re)start of the actor
    namespace_model: str  # model id + checkpoint fingerprint: routers must key with it
    max_model_len: int
    page_size: int
    directory_namespace: str  # where it publishes chunk keys (``directory_namespace``)
    startup_s: float  # this incarnation's start: model load, KV pool, graph capture
    # what its position-free entries are computed after (engine.entry_system_prompt)
    entry_system_prompt: str | None = DEFAULT_ENTRY_SYSTEM_PROMPT


def directory_namespace(spec: DirectorySpec) -> str:
    """Where chunk keys published through ``spec`` can be looked up: routers find a
    worker's keys only where this is equal (the Redis URL is left out: nodes may reach
    one server by different addresses, and it may carry a password)."""
    if spec.kind is DirectoryKind.REDIS:
        return f"redis prefix {spec.redis_prefix!r}"
    return f"embedded directory {spec.host_actor!r} in Ray namespace {spec.ray_namespace!r}"


@dataclass(frozen=True)
class EngineLoad:
    """A worker's load, as its engine loop counts it (``EngineLoop.load``).

    What a router needs to estimate the time until a new request's first token here:
    (``prefill_backlog_tokens`` + the request's uncached tokens)
    / ``prefill_tokens_per_s`` + ``step_s``."""

    requests: int  # choices queued or running
    tokens: int  # prompt + max new tokens of those choices
    requests_total: int  # choices finished or running since start
    prompt_tokens_total: int
    cached_tokens_total: int  # of prompt_tokens_total, served from the cache
    generated_tokens_total: int
    # prompt tokens still to compute for requests waiting or mid-prefill: a request
    # not yet admitted counts max(0, prompt length - its expected_cached_tokens); an
    # admitted one its prompt positions not yet computed (uncomputed tail + pending
    # scattered positions); engine-internal entry fills count like prompts
    prefill_backlog_tokens: int = 0
    decode_seqs: int = 0  # running sequences past their prompt (decoding)
    # EWMA, over steps that computed prompt tokens, of prompt tokens computed / the
    # step's wall time (steps that also decode count as they are); 0.0: not measured
    prefill_tokens_per_s: float = 0.0
    step_s: float = 0.0  # EWMA of the engine step's wall time (steps that ran); 0.0: none yet
    # measured seconds to load one token's KV back from the host tier (0.0: no tier,
    # or nothing loaded yet): what the router charges a host-memory hit
    host_load_s_per_token: float = 0.0
    # grows with every change of this snapshot's counters: of two snapshots of one
    # worker incarnation (same epoch), the larger version is the newer
    version: int = 0


class KVPages(NamedTuple):
    """A worker's KV memory: its device pool and its host tier's counters (None: off)."""

    total: int  # the device pool's pages
    in_use: int  # pages no allocation can take: running sequences' and pinned ones
    host: TierStats | None = None


@dataclass(frozen=True)
class WorkerStatus:
    info: WorkerInfo
    load: EngineLoad
    cached_pages: int  # page and entry keys the worker holds, in either tier
    kv_pages_total: int  # the KV pool's size
    kv_pages_in_use: int  # pages no allocation can take: running sequences' and pinned ones
    draining: bool
    directory_in_sync: bool  # the directory has every chunk event published so far
    directory_superseded: bool  # a newer epoch of this worker id exists
    # since the worker started: steps by kind ("decode graph", "prefill eager", ...)
    # with their time on the device, and the engine loop's wall time inside its steps
    step_tally: StepTally = field(default_factory=StepTally)
    host_tier: TierStats | None = None  # the host-memory KV tier's counters; None: off
