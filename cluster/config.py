"""Cluster configuration: pydantic models loaded from YAML (every field described).

``load_config(path, overrides)`` reads a file, applies ``dotted.key=value``
overrides (values parsed as YAML), validates, and raises ``ValueError`` with one
readable line per problem ("workers.count: Input should be greater than 0").
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from cluster.routing.policy import DEFAULT_PREFILL_TOKENS_PER_S
from workers.engine.config import BUILT_BY_CALLER, EngineConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MakeModelConfig(_Section):
    preset: str = Field("tiny", description="make-model preset, e.g. tiny or qwen3-0.6b")
    family: Literal["qwen3", "llama"] = Field(
        "qwen3", description="model family (and chat template): qwen3 or llama"
    )
    seed: int = Field(0, description="weight seed")


class ModelSection(_Section):
    name: str = Field(
        description="model id clients send in the `model` field; also the model part of "
        "the chunk-key namespace",
        min_length=1,
    )
    path: str = Field(
        description="checkpoint directory in the Hugging Face layout (~ expanded); "
        "must be readable at this path on every node"
    )
    make_if_missing: MakeModelConfig | None = Field(
        None,
        description="if set and `path` does not exist, write a random-weight checkpoint "
        "there on first use (for trying chunkserve out; outputs are gibberish)",
    )


def _engine_section() -> type[_Section]:
    """The ``engine`` section: every ``EngineConfig`` field but those its builder sets
    (``BUILT_BY_CALLER``), with the same types, defaults, documentation and bounds."""
    hints = typing.get_type_hints(EngineConfig)
    fields = {
        f.name: (
            hints[f.name],
            Field(f.default, description=f.metadata["doc"], **f.metadata["bounds"]),
        )
        for f in dataclasses.fields(EngineConfig)
        if f.name not in BUILT_BY_CALLER
    }
    return create_model("EngineSection", __base__=_Section, **fields)


EngineSection = _engine_section()


class WorkersSection(_Section):
    count: int = Field(1, gt=0, description="worker actors (one engine each)")
    num_gpus: float = Field(
        0, ge=0, description="GPUs per worker (1 on GPU clusters; tensor_parallel_size with it)"
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs one worker's model is split over: the worker reserves them on one "
        "node (num_gpus must equal it on GPU workers) and runs a process a GPU, joined by "
        "NCCL; gloo on CPU workers. It must divide the model's attention heads and MLP size "
        "and divide or be a multiple of its KV heads. To the router and the directory the "
        "worker is still one holder",
    )
    num_cpus: float = Field(1, ge=0, description="Ray CPUs reserved per worker")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each worker asks for, e.g. {gpu_node: 1} to keep "
        "workers on the nodes started with --resources '{\"gpu_node\": 8}' (CPU and GPU "
        "are num_cpus and num_gpus)",
    )
    cpu_threads: int | None = Field(
        1, gt=0, description="torch threads per worker; null keeps torch's default"
    )
    engine_process: bool | None = Field(
        None,
        description="run each worker's engine in a process of its own, apart from the "
        "actor's event loop that streams outputs, so the engine never waits for the GIL "
        "behind the streaming (on 4 H200s it served 1.3-1.6x the requests/s of an engine "
        "thread); false: a thread of the actor's process; null: a process for GPU "
        "workers (num_gpus > 0), a thread for CPU workers",
    )
    max_restarts: int = Field(
        3, gt=0, description="times Ray restarts a crashed worker (each with a new epoch)"
    )
    publish_interval_s: float = Field(
        0.25, gt=0, description="how often a worker ships chunk events and heartbeats"
    )
    startup_timeout_s: float = Field(
        600, gt=0, description="how long to wait for workers to load their model"
    )

    @model_validator(mode="after")
    def _a_gpu_per_rank(self) -> WorkersSection:
        tp = self.tensor_parallel_size
        if self.num_gpus > 0 and tp > 1 and self.num_gpus != tp:
            raise ValueError(
                f"workers.num_gpus ({self.num_gpus:g}) must equal workers.tensor_parallel_size "
                f"({tp}): each of a worker's {tp} ranks runs on a GPU of its own"
            )
        return self

    @model_validator(mode="after")
    def _custom_resources_only(self) -> WorkersSection:
        for name, amount in self.resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory") or amount < 0:
                raise ValueError(
                    f"workers.resources: {name}: {amount} is not a custom resource amount "
                    "(>= 0; CPU and GPU are workers.num_cpus and workers.num_gpus)"
                )
        return self

    node_wait_s: float = Field(
        0,
        ge=0,
        description="how long to wait for nodes when the Ray cluster cannot hold the "
        "workers and router replicas yet (nodes still joining: KubeRay submits the app "
        "as soon as the head is ready), saying what it waits for; 0: refuse at once",
    )


class RedisSection(_Section):
    url: str = Field(
        "redis://127.0.0.1:6380/0",
        description="redis://[[user]:password@]host:port/db or rediss://... (TLS); the "
        "default port 6380 stays clear of Ray's GCS, which `ray start --head` puts on "
        "Redis's own default, 6379",
    )
    prefix: str = Field(
        "chunkserve", min_length=1, description="key prefix; clusters sharing a Redis differ"
    )
    timeout_s: float = Field(
        0.05, gt=0, le=1, description="socket timeout of every Redis call; keep it short"
    )


class DirectorySection(_Section):
    kind: Literal["embedded", "redis"] = Field(
        "embedded",
        description="embedded: in one Ray actor, for single-node clusters; redis: shared "
        "by every node and router",
    )
    lease_ttl_s: float = Field(
        5.0, gt=0, description="a worker's entries count only this long after its heartbeat"
    )
    call_timeout_s: float = Field(
        1.0, gt=0, description="timeout of one call to the embedded directory's actor"
    )
    router_sync_interval_s: float = Field(
        0.05,
        ge=0,
        description="embedded: each router keeps a copy of the directory, brought up to "
        "date from its actor this often, and looks requests up there (no call per "
        "request); 0: every lookup calls the actor",
    )
    redis: RedisSection = Field(
        default_factory=RedisSection, description="Redis settings (kind: redis)"
    )


class RouterSection(_Section):
    policy: Literal["chunk_aware", "round_robin"] = Field(
        "chunk_aware",
        description="chunk_aware: send a request where its prompt's chunks are cached, "
        "weighed against load; round_robin: ignore caches and load, rotate over workers "
        "(a baseline for comparisons)",
    )
    default_prefill_tokens_per_s: float = Field(
        DEFAULT_PREFILL_TOKENS_PER_S,
        gt=0,
        description="chunk_aware: the prefill rate assumed for a worker until it reports "
        "one measured (workers report theirs with every poll and output); the router "
        "sends a request to the worker expected to give its first token soonest: the "
        "prefill queued there plus the request's uncached tokens, at that rate, plus a step",
    )
    max_requests_per_worker: int = Field(
        1024, gt=0, description="above this many queued requests everywhere, answer 429"
    )
    max_attempts: int = Field(
        3,
        gt=0,
        description="worker starts per request, all retries together (the router's one "
        "retry layer): a worker that dies or drains before output, and a buffered "
        "(non-streaming) answer whose worker dies mid-answer, are retried on another "
        "worker while starts remain; never the same worker twice",
    )
    recent_route_lease_s: float | None = Field(
        None,
        ge=0,
        description="chunk_aware: how long a prompt prefix this router just sent to a "
        "worker counts as held there, until the directory lists it (workers publish every "
        "workers.publish_interval_s), so an identical prompt sent again at once, or a burst "
        "of a new prefix, lands on the same worker; null: 4 times "
        "workers.publish_interval_s; 0: off",
    )
    poll_interval_s: float = Field(0.5, gt=0, description="how often worker load is polled")

    @model_validator(mode="before")
    @classmethod
    def _removed_settings(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        removed = sorted({"load_penalty_tokens", "imbalance_slack"} & set(data))
        if removed:
            raise ValueError(
                f"router.{' and router.'.join(removed)} no longer exist: the router now "
                "weighs cache hits against load in time (the prefill each worker has "
                "queued, at its measured rate); delete them (router."
                "default_prefill_tokens_per_s sets the rate assumed before one is measured)"
            )
        return data

    poll_timeout_s: float = Field(
        5.0, gt=0, description="a worker not answering a poll this fast counts as down"
    )


class ServerSection(_Section):
    host: str = Field("127.0.0.1", description="HTTP bind address (0.0.0.0 for all)")
    port: int = Field(8000, gt=0, lt=65536, description="HTTP port")
    route_prefix: str = Field("/", description="URL prefix of the app, e.g. / or /chunkserve")
    ingress: Literal["replicas", "serve_proxy"] = Field(
        "replicas",
        description="how HTTP reaches the router replicas: replicas (each listens on "
        "host:port itself, sharing the port with the node's other replicas; one app a "
        "port) or serve_proxy (through Serve's HTTP proxy, one a node, whose host and "
        "port Serve's own http_options decide; its CPU bounds a node's requests/s)",
    )
    num_replicas: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto",
        description="router (HTTP ingress) replicas; auto: one per worker (one replica "
        "carries about one GPU worker's requests; bench/RESULTS.md, 'HTTP path')",
    )
    replica_num_cpus: float = Field(0.5, ge=0, description="Ray CPUs per router replica")
    max_ongoing_requests: int = Field(
        512, gt=0, description="requests one router replica handles at once"
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="accepted bearer keys; empty: no authentication. Each key is its own "
        "tenant: caches are never shared across keys",
    )
    metrics_token: str | None = Field(
        None,
        min_length=1,
        description="bearer token that /metrics requires; null: /metrics is open on a "
        "server without api_keys and closed (401, naming this key) on one with them, "
        "since it counts every tenant's requests",
    )
    max_request_bytes: int = Field(
        4 * 2**20,
        gt=0,
        description="largest request body accepted, in bytes; a larger one is answered 413 "
        "before any of it is parsed",
    )
    max_prompt_chars: int | None = Field(
        None,
        gt=0,
        description="longest prompt text accepted, in characters (a chat's message texts, "
        "chunks expanded, or a completion's prompt), checked before tokenizing (400); "
        "null: the most that could fit the context (context length times the most "
        "characters one token stands for), so an over-long prompt is never tokenized",
    )
    max_messages: int | None = Field(
        None,
        gt=0,
        description="most messages a chat request (chunks expanded) or a chunk may have, "
        "checked before anything is rendered (400); null: the context length, since each "
        "message takes at least one token",
    )
    default_max_tokens: int = Field(
        256, gt=0, description="max_tokens of requests that give none (capped by context)"
    )
    default_reuse: Literal["exact", "approximate"] = Field(
        "exact",
        description="reuse mode of requests whose `reuse` field is absent: exact (KV reused "
        "only after identical preceding tokens; output equals plain generation) or "
        "approximate (also documents' position-free KV placed wherever they appear, then "
        "repaired with the engine's default settings; output differs from plain generation, "
        "and models whose RoPE cannot be moved answer 400)",
    )
    stream_interval_s: float = Field(
        0.02,
        ge=0,
        description="streamed answers: after the first token, at most one update per this "
        "many seconds per choice, carrying every token made meanwhile; the first token is "
        "never held back. 0: each token as it is made, merged only where the router falls "
        "behind, so clients measure real inter-token latency; it costs about twice the "
        "router CPU per streamed request (bench/RESULTS.md, 'Streaming each token')",
    )

    @model_validator(mode="after")
    def _check_prefix(self) -> ServerSection:
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")
        return self


class BatchSection(_Section):
    concurrency: int = Field(32, gt=0, description="requests in flight at once")


class RaySection(_Section):
    address: str | None = Field(
        None,
        description="Ray cluster to join: null joins the one this process runs in (as "
        "under `ray job submit`) or the one `ray start` runs on this machine, else starts "
        "a local Ray; 'local' always starts one; or host:port",
    )
    num_cpus: int | None = Field(
        None, gt=0, description="CPUs of a Ray started by this process (ignored when joining)"
    )
    namespace: str = Field(
        "chunkserve", min_length=1, description="Ray namespace of the cluster's named actors"
    )


class ClusterConfig(_Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")] = Field(
        "chunkserve",
        description="cluster name: prefixes worker ids, actor names and the Serve app name",
    )
    model: ModelSection = Field(description="the model to serve")
    engine: EngineSection = Field(default_factory=EngineSection, description="engine settings")
    workers: WorkersSection = Field(default_factory=WorkersSection, description="worker actors")
    directory: DirectorySection = Field(
        default_factory=DirectorySection, description="chunk directory"
    )
    router: RouterSection = Field(default_factory=RouterSection, description="routing")
    server: ServerSection = Field(default_factory=ServerSection, description="HTTP app")
    batch: BatchSection = Field(default_factory=BatchSection, description="batch jobs")
    ray: RaySection = Field(default_factory=RaySection, description="Ray connection")

    @property
    def router_replicas(self) -> int:
        """``server.num_replicas``, with auto resolved: one per worker."""
        replicas = self.server.num_replicas
        return max(1, self.workers.count) if replicas == "auto" else replicas


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ClusterConfig:
    """Read, override and validate a config file; ``ValueError`` says what is wrong."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"cannot read config {str(path)!r}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections")
    for override in overrides:
        apply_override(raw, override)
    return parse_config(raw, source=str(path))


def parse_config(raw: dict, source: str = "config") -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(raw)
    except ValidationError as error:
        lines = [f"  {_location(e['loc'])}: {e['msg']}" for e in error.errors()]
        raise ValueError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def apply_override(raw: dict, override: str) -> None:
    """Set ``dotted.key=value`` in ``raw`` (value parsed as YAML: 3, true, [a, b])."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ValueError(f"--set expects dotted.key=value, got {override!r}")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _location(loc: tuple) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"
