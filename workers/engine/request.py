"""A request's state inside the engine."""

from __future__ import annotations

import enum
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from chunkstore.hashing import Namespace, PageKey, chain_page_keys, pack_tokens, root_key
from workers.engine.detokenizer import OutputText
from workers.engine.reuse_info import ReuseInfo, ReuseRequest
from workers.engine.sampling_params import SamplingParams

ALL_EXACT = sys.maxsize  # ``exact_until`` of a sequence with no approximated position


@dataclass(frozen=True)
class PromptRequest:
    """What one prompt asks of an engine, beside the sampling of each choice. Built
    once (by the router, the offline ``LLM`` or ``Engine.add_request``) and passed on
    as it is, through a worker's actor, engine host and loop, to ``Engine.submit``,
    which makes the ``Sequence``: a request field is added here and where it is used.

    ``tenant_salt``: the key namespace's salt (None: the engine's configured one).
    ``placeable``: sorted, disjoint (start, end) spans of the prompt (its chunks) that
    approximate reuse may take from position-free entries; exact reuse ignores them.
    ``reuse``: what the request asks of reuse (exact by default; None is taken as the default).
    ``expected_cached_tokens``:
    the router's estimate of the prompt tokens the engine holds, used only for its
    prefill backlog while the request waits (``Engine.load_shape``); nothing computed
    depends on it. ``held_elsewhere``: the router sent it here although another worker
    holds more of the prompt (a spill): the pages it computes are released cold."""

    token_ids: tuple[int, ...]
    tenant_salt: str | None = None
    placeable: tuple[tuple[int, int], ...] = ()
    reuse: ReuseRequest = ReuseRequest()
    expected_cached_tokens: int = 0
    held_elsewhere: bool = False

    def __post_init__(self) -> None:
        if self.reuse is None:  # callers with nothing to ask pass None
            object.__setattr__(self, "reuse", ReuseRequest())
        cached = self.expected_cached_tokens
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValueError(
                f"expected_cached_tokens must be an integer >= 0 (prompt tokens the "
                f"router expects this worker to hold), got {cached!r}"
            )


@dataclass
class ApproximateState:
    """What approximate reuse keeps on a sequence (``approximate.chunk_reuse``,
    ``approximate.entry_fills``); the scheduler and the engine read the admission's
    ``admission_tokens`` and ``ready_logits``."""

    # (start, end) prompt spans that a placing reuse mode may take from position-free
    # entries (the chunks of documents); sorted, disjoint
    placeable: tuple[tuple[int, int], ...] = ()
    request: ReuseRequest = ReuseRequest()
    # missed chunks (start, end, position-free key) whose KV this sequence computes in
    # context and which become entries once computed (``ChunkReuse.publish``); set at
    # each admission
    harvests: list[tuple[int, int, PageKey]] = field(default_factory=list)
    # positions the forward queued at admission computed through every layer from the
    # selection layer on (approximate repair; 0: none), charged once to the token
    # budget of the step that admits the sequence
    admission_tokens: int = 0
    # that forward computes every position, and with them the last token's logits
    # (``ready_logits``): the step that admits the sequence only samples (set only with
    # ``num_computed == len(token_ids)``; that step takes the logits and clears both)
    samples_at_admission: bool = False
    # those logits, float32 [1, vocab] on the device; set once the forward is queued
    # (``Reuse.flush``, at the end of the scheduling pass that admitted the sequence)
    ready_logits: torch.Tensor | None = None
    # set on the engine's internal sequences that compute a position-free entry: no
    # token is sampled; the pages become the entry under this key when done
    fill_key: PageKey | None = None
    # an entry fill's prompt is the engine's entry context, then the chunk: this many
    # leading tokens are context, computed but not part of the entry
    fill_context: int = 0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Invariants: ``num_computed <= len(token_ids)``; positions ``[0, num_computed)``
    have their KV in ``page_ids`` except those in ``pending`` (sorted, all below
    ``num_computed``: placed chunks' gaps and repairs, computed before anything after
    them); positions before ``exact_until`` hold exactly the KV plain generation
    computes (``ALL_EXACT``: every position); ``page_keys[i]`` is the chain key of
    page i (a function of the tokens alone, whether or not page i is exact)."""

    request_id: str
    arrival: int
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: Namespace
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # int32 array: build_inputs copies page tables with memcpy, not per element
    page_ids: array = field(default_factory=lambda: array("i"))
    num_computed: int = 0
    pending: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    exact_until: int = ALL_EXACT
    reuse: ReuseInfo | None = None  # how the prompt was served; set on first admission
    approx: ApproximateState = field(default_factory=ApproximateState)
    # the router's estimate of prompt tokens this engine holds: used only to estimate
    # the prefill backlog of the sequence while it waits (``Engine.load_shape``); it
    # never changes what is computed (admission finds the real cache hits)
    expected_cached_tokens: int = 0
    # the router sent it here although another worker holds more of its prompt (a
    # spill): the pages it computes are released cold (``KVPool.release``), so this
    # copy displaces nothing unless it is used again
    held_elsewhere: bool = False
    # leading pages of ``page_ids`` its latest admission found cached (its exact
    # prefix; ``reuse.start_from``): the rest it computed or placed itself
    cached_pages: int = 0
    page_keys: list[PageKey] = field(default_factory=list)
    # the prompt's token ids packed as keys hash them (``pack_tokens``), when the caller
    # packed them already (validating them); else packed on first use
    packed_prompt: bytes | None = None
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    matcher: Any = None  # its grammar's matcher (``params.response_format``), or None
    output: OutputText = field(init=False)  # its output text, made and returned

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.output = OutputText.after(len(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def reached_length(self, max_model_len: int | None) -> bool:
        """It has all the tokens it may have: ``max_tokens`` outputs, or the context
        length (None: no context limit checked)."""
        return self.num_output_tokens >= self.params.max_tokens or (
            max_model_len is not None and len(self.token_ids) >= max_model_len
        )

    @property
    def num_uncomputed(self) -> int:
        """Tokens of the contiguous tail still to compute (``pending`` aside)."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the cache (0 before admission)."""
        return self.reuse.reused_tokens if self.reuse else 0

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def packed_tokens(self, upto: int) -> bytes:
        """The first ``upto`` token ids, packed (``pack_tokens``)."""
        prompt_len = len(self.prompt_token_ids)
        if self.packed_prompt is None:
            self.packed_prompt = pack_tokens(self.prompt_token_ids)
        if upto <= prompt_len:
            return self.packed_prompt[: 4 * upto]
        return self.packed_prompt + pack_tokens(self.token_ids[prompt_len:upto])

    def extend_page_keys(self, page_size: int, upto_tokens: int) -> list[PageKey]:
        """Extend ``page_keys`` to cover every full page within the first
        ``upto_tokens`` tokens; returns ``page_keys`` itself (may cover more)."""
        full = min(upto_tokens, len(self.token_ids)) // page_size
        done = len(self.page_keys)
        if done < full:
            parent = self.page_keys[-1] if self.page_keys else root_key(self.namespace)
            packed = self.packed_tokens(full * page_size)[4 * done * page_size :]
            self.page_keys += chain_page_keys(parent, self.namespace.digest, packed, page_size)
        return self.page_keys
