"""The engine: owns the model runner, KV pool and scheduler; advances all requests
one step at a time. Single-threaded: callers serialize access.

Load (what a router needs to estimate the wait for a new request's first token):
``load_shape()`` gives the prefill backlog (prompt tokens still to compute, waiting
sequences estimated from their ``expected_cached_tokens`` hint, admitted ones
exact) and the number of decoding sequences; ``last_step_prompt_tokens`` says how
many prompt positions the last ``step()`` computed (its prefill work), and
``last_read_back_prompt_tokens`` how many the steps it read back had computed (with
overlapped steps, the call's wall time is mostly waiting for those: the pair gives a
prefill rate).

Overlapped steps (``EngineConfig.overlap_scheduling``, on with CUDA): ``step()``
schedules and queues step N+1 on the device before it reads back step N's tokens,
so the host's scheduling, input building and output processing run while the GPU
computes. A sequence sampling in step N carries a placeholder as its last token
until N is read back; step N+1 takes that token from the device
(``CarriedTokens``). A sequence that N's token finishes was computed once more in
N+1, for nothing: that result is dropped. Outputs are the same token for token; each
comes one ``step()`` call later, except a request's first token: a step that yields
one is read back at once, so time to first token does not wait for the next step's
launch."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chunkstore.chunking import entry_context
from chunkstore.hashing import Namespace, PageKey, pack_tokens, position_free_key
from workers.engine.approximate.chunk_reuse import ChunkReuse
from workers.engine.approximate.entry_fills import EntryFills
from workers.engine.approximate.placement import (
    rope_supports_placement,
)
from workers.engine.attention import make_backend
from workers.engine.attention.base import AttentionShape
from workers.engine.checkpoint import checkpoint_fingerprint, load_tokenizer
from workers.engine.config import EngineConfig, resolve_deviation_layer
from workers.engine.host_tier import WRITE_STAGING_BYTES, HostTier, host_slots
from workers.engine.kv_pool import KVPool
from workers.engine.model_runner import CarriedTokens, ModelRunner
from workers.engine.models.config import ModelConfig
from workers.engine.models.loader import load_model, weight_bytes
from workers.engine.request import ApproximateState, PromptRequest, Sequence
from workers.engine.reuse import NoReuse, Reuse
from workers.engine.reuse_info import ReuseInfo
from workers.engine.sampler import sample_on_device, top_logprobs
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq, Scheduler, SchedulerLimits
from workers.engine.structured import Grammars
from workers.engine.tp.follower import follow
from workers.engine.tp.group import BUILT, Followers, RunnerShape
from workers.engine.tp.shard import SINGLE, Shard, check_divisible
from workers.engine.workload_tally import WorkloadTally

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadShape:
    """The engine's queued work, as ``Engine.load_shape`` counts it."""

    # prompt tokens still to compute: a waiting sequence counts
    # max(0, len(prompt) - expected_cached_tokens); an admitted one its prompt
    # positions not yet computed (uncomputed prompt tail + pending scattered ones);
    # entry fills (position-free chunks, after the entry context) count like prompts
    prefill_backlog_tokens: int
    decode_seqs: int  # running sequences past their prompt


# a sampled token not read back yet (overlapped steps); never a vocabulary id
PLACEHOLDER = -1


@dataclass
class _Launched:
    """A step whose model work is queued on the device; ``Engine._resolve`` reads its
    tokens back and finishes it."""

    batch: list[ScheduledSeq]
    sampling: list[ScheduledSeq]  # the items that sample, in the logits' row order
    # per batch item: its page table at launch (a preempted sequence gets a new one),
    # and the positions [first, ready) whose KV is final once this step has run
    page_tables: list
    published: list[tuple[int, int]]
    tokens: torch.Tensor  # [S] sampled, on the device
    host_tokens: torch.Tensor  # [S] their copy on the host, once ``copied`` has passed
    copied: torch.cuda.Event | None
    logits: torch.Tensor | None  # kept only when some row asks for logprobs
    yields_first_token: bool  # some sequence samples its first output token
    prompt_tokens: int  # prompt positions it computes (``last_step_prompt_tokens``)
    kind: str  # how the model ran it (``ModelRunner.last_run_kind``)
    # its time (``Engine.last_resolved_steps``): on CUDA from ``started`` to ``copied``
    # on the device; else the launch's own host time, which computed it
    started: torch.cuda.Event | None
    launch_s: float
    behind_aside: bool = False  # admission queued work aside just before it (Engine.step)
    # some row's next mask needs this step's token: never overlapped with the next
    constrained: bool = False
    held: bool = False  # placeholders stand for the tokens in the sampling sequences


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    reuse: ReuseInfo  # how the prompt was served (num_cached_tokens == reuse.reused_tokens)
    # (chosen token, logprob), then the top alternatives; None unless requested
    logprobs: tuple[tuple[int, float], ...] | None = None


def _validate_spans(spans: tuple[tuple[int, int], ...], prompt_len: int) -> None:
    previous_end = 0
    for start, end in spans:
        if not previous_end <= start < end <= prompt_len:
            raise ValueError(
                f"placeable spans must be sorted, disjoint and within the prompt "
                f"[0, {prompt_len}); got {list(spans)}"
            )
        previous_end = end


def default_reuse(engine: Engine) -> Reuse:
    """Exact and (on request) approximate reuse, or none when reuse is off."""
    if not engine.config.enable_reuse:
        return NoReuse(engine.pool)
    return ChunkReuse(
        engine.pool,
        engine.runner,
        lambda key, tokens, namespace: engine.entry_fills.queue(key, tokens, namespace),
        engine.config.min_entry_tokens,
        engine.deviation_layer,
        engine.tally,
        engine.config.entries_from_context,
        engine.config.batch_admissions,
        engine.config.placed_low_layers == "entries",
    )


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        stream_text: bool = False,
        reuse_factory: Callable[[Engine], Reuse] | None = None,
    ) -> None:
        """``stream_text``: produce text deltas every step (for streaming clients);
        otherwise text comes with the final output only (and where stop strings
        need it). ``reuse_factory``: builds the reuse component from the engine
        (default: exact prefix reuse, or none when ``config.enable_reuse`` is off)."""
        self.config = config
        self.stream_text = stream_text
        self.model_config = ModelConfig.from_dir(config.model_dir)
        # why this model cannot place chunks (approximate reuse), or None
        raw_config = json.loads((Path(config.model_dir) / "config.json").read_text())
        self.placement_problem = rope_supports_placement(raw_config)
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        if (
            config.max_model_len
            and config.max_model_len > self.model_config.max_position_embeddings
        ):
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}"
            )
        self.deviation_layer = resolve_deviation_layer(
            config.deviation_layer, self.model_config.num_layers
        )
        self.tokenizer = load_tokenizer(config.model_dir)
        # the other ranks of a tensor-parallel worker (``tp.group``), loading their shards
        # while this one loads its own
        self.followers: Followers | None = None
        self._shard = shard = SINGLE
        world = config.tensor_parallel_size
        if world > 1:
            check_divisible(self.model_config, world)
            self._check_devices(world)
        if self.device.type == "cuda":
            self._check_weights_fit(Shard(0, world))
        if world > 1:
            self.followers, shard = Followers.start(config, world, self.device, follow)
            self._shard = shard
        try:
            self._build(config, shard, reuse_factory)
        except BaseException:
            self.close()
            raise

    def _build(
        self, config: EngineConfig, shard: Shard, reuse_factory: Callable[[Engine], Reuse] | None
    ) -> None:
        """The model (this rank's shard), the KV pool, the runner and what uses them."""
        model = load_model(
            config.model_dir, self.model_config, self.dtype, self.device, shard,
            config.load_format,
        )  # fmt: skip
        if shard.kv_replicas(self.model_config) > 1:
            logger.warning(
                "tensor_parallel_size %d exceeds the model's %d KV heads: each KV head is "
                "replicated on %d ranks (their KV pages hold the same values)",
                shard.world, self.model_config.num_kv_heads, shard.kv_replicas(self.model_config),
            )  # fmt: skip
        local = model.config  # this rank's heads and MLP columns
        num_pages = config.num_pages or self._auto_num_pages(local)
        reserve = int(config.resolved_entry_reserve() * num_pages)
        self.pool = KVPool(num_pages, config.page_size, reserve)
        self._tally = WorkloadTally()  # the pool counts entry evictions (``tally``)
        mc = self.model_config
        shape = AttentionShape(
            local.num_heads, local.num_kv_heads, mc.head_dim, config.page_size, self.dtype,
            self.device,
        )  # fmt: skip
        backend = make_backend(config.attention_backend, shape, config.enable_cascade)
        # Invariant: a lone sequence always fits in the pool, so preemption terminates.
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, num_pages * config.page_size
        )
        if self.followers is not None:
            self.followers.build(RunnerShape(num_pages, self.max_model_len))
        self.runner = ModelRunner(
            model,
            backend,
            num_pages,
            config.page_size,
            self.max_model_len,
            config.max_num_seqs,
            config.enable_cuda_graphs,
            config.skinny_matmul,
        )
        self.runner.followers = self.followers
        if self.followers is not None:
            self.followers.expect(BUILT)
        if config.host_kv_gib > 0:
            # a page's bytes over every rank (replicated KV heads counted on each rank
            # that holds them): host_kv_gib is the worker's host memory
            page_bytes = shard.world * ModelRunner.bytes_per_page(
                local, config.page_size, self.dtype
            )
            slots = host_slots(config.host_kv_gib, page_bytes)
            self.pool.attach_host(
                HostTier(self.runner.attach_host_copier(slots)), config.host_kv_write
            )
        if self.runner.device.type == "cuda":
            # The fused sampling kernel compiles on first use: here, not inside the first
            # request's step, whose time the worker's load reports as its prefill rate.
            warm = torch.zeros((2, mc.vocab_size), device=self.runner.device)
            greedy_and_tempered = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
            sample_on_device(warm, greedy_and_tempered, [None, None]).cpu()
        self.reuse = (reuse_factory or default_reuse)(self)
        self.scheduler = Scheduler(
            self.pool,
            self.reuse,
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
        )
        self.overlap = config.resolved_overlap_scheduling(self.device)
        self._in_flight: _Launched | None = None
        self.model_id = config.model_id or Path(config.model_dir).resolve().name
        self.namespace_model = f"{self.model_id}@{checkpoint_fingerprint(config.model_dir)}"
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self._eos_token_ids = frozenset(eos)
        self._grammars = Grammars(self.tokenizer, mc.vocab_size)
        self._sequences: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        # what every position-free entry is computed after (config.entry_system_prompt)
        self.entry_context: tuple[int, ...] = ()
        try:
            self.entry_context = entry_context(self.tokenizer, config.entry_system_prompt)
        except Exception as e:  # a template that cannot render it: no approximate mode
            self.placement_problem = self.placement_problem or (
                f"the chat template cannot render the entry context ({e}); set "
                "engine.entry_system_prompt to null to compute entries alone"
            )
        self.entry_fills = EntryFills(
            self.pool,
            self.runner,
            self.scheduler,
            self.entry_context,
            self.max_model_len,
            self._tally,
            lambda: next(self._arrivals),
        )
        # what the last ``step()`` computed: prompt positions (scattered ones included;
        # entry fills' tokens count as prompt) and sequences scheduled (0: it did nothing)
        self.last_step_prompt_tokens = 0
        self.last_step_seqs = 0
        self.last_read_back_prompt_tokens = 0
        # (kind, seconds) of each step the last ``step()`` read back: its kind as
        # ``ModelRunner.last_run_kind`` and its time on the device, from the moment the
        # device reached its start to its tokens' copy (idle gaps while the host launched
        # it included); without CUDA, its launch's host time (which computed it)
        self.last_resolved_steps: list[tuple[str, float]] = []
        # called with each step's sampling sequences and their logits [S, vocab] just
        # before sampling (benchmarks record first-token distributions with it)
        self.on_logits: Callable[[list[Sequence], torch.Tensor], None] | None = None

    # -- requests --------------------------------------------------------------
    def namespace(self, tenant_salt: str | None = None) -> Namespace:
        salt = self.config.tenant_salt if tenant_salt is None else tenant_salt
        return Namespace(self.namespace_model, salt)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int] | tuple[int, ...],
        params: SamplingParams,
        *fields,
        **named,
    ) -> None:
        """``submit`` with the prompt's other fields after the tokens, in
        ``PromptRequest``'s order (``tenant_salt``, ``placeable``, ...) or by name."""
        self.submit(request_id, params, PromptRequest(tuple(prompt_token_ids), *fields, **named))

    def submit(self, request_id: str, params: SamplingParams, prompt: PromptRequest) -> None:
        """Queue one choice of ``prompt`` (its fields: ``PromptRequest``); ValueError
        names what is wrong with it. Output never depends on ``expected_cached_tokens``
        or ``held_elsewhere``."""
        tokens = list(prompt.token_ids)  # the sequence's own: it grows with the output
        packed = self._validate(request_id, tokens)
        _validate_spans(prompt.placeable, len(tokens))
        if prompt.reuse.mode == "approximate":
            self._check_placement()
        seq = Sequence(
            request_id=request_id,
            arrival=next(self._arrivals),
            prompt_token_ids=tokens,
            params=params,
            namespace=self.namespace(prompt.tenant_salt),
            packed_prompt=packed,
            approx=ApproximateState(tuple(prompt.placeable), prompt.reuse),
            expected_cached_tokens=prompt.expected_cached_tokens,
            held_elsewhere=prompt.held_elsewhere,
        )
        if params.seed is not None and not params.greedy:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.response_format is not None:
            seq.matcher = self._grammars.matcher(params.response_format)
        self._sequences[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._sequences.pop(request_id, None)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    @property
    def tally(self) -> WorkloadTally:
        """Where this engine's work went since it started (``workload_tally``); the
        live object: take ``copy()`` for a snapshot."""
        self._tally.entry_evictions = self.pool.entry_evictions
        return self._tally

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def load_shape(self) -> LoadShape:
        """Prefill backlog and decoding sequences (see ``LoadShape``).

        Cost: one pass over the waiting and running sequences, a few attribute reads
        each (no allocation; no tokens are looked at): O(waiting + running), about
        0.1 us per sequence on CPython, run by the engine loop after every step."""
        backlog = 0
        for seq in self.scheduler.waiting:  # not admitted: the caller's hint
            uncached = len(seq.prompt_token_ids) - seq.expected_cached_tokens
            if uncached > 0:
                backlog += uncached
        decoding = 0
        for seq in self.scheduler.running:  # admitted: exact
            tail = len(seq.prompt_token_ids) - seq.num_computed
            pending = len(seq.pending)  # scattered prompt positions (placed chunks)
            if tail > 0 or pending:
                backlog += max(tail, 0) + pending
            else:
                decoding += 1
        return LoadShape(backlog, decoding)

    # -- stepping --------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule and run one step; returns the tokens it produced or, with
        overlapped steps, those of the step before (this one's come next call)."""
        previous, self._in_flight = self._in_flight, None
        self.last_resolved_steps = []
        batch = self.scheduler.schedule()
        self.last_step_seqs = len(batch)
        self.last_step_prompt_tokens = 0
        launched = self._launch(batch, previous) if batch else None
        outputs, read_back = [], 0
        if previous is not None:
            outputs, read_back = self._resolve(previous), previous.prompt_tokens
        if launched is not None:
            # A step launched behind work admission queued aside (an approximate
            # request's selection forward) is read back now: held, its plan's copy to
            # the device could still be queued when the next step plans its wrapper
            # again, and would copy that plan (FlashInfer plans from a pinned buffer).
            # A step with constrained rows is read back now too: their next token's
            # mask needs this one accepted by their grammar first.
            held = not (launched.yields_first_token or launched.behind_aside)
            if self.overlap and held and not launched.constrained:
                self._hold(launched)
                self._in_flight = launched
            else:
                outputs += self._resolve(launched)
                read_back += launched.prompt_tokens
        self.last_read_back_prompt_tokens = read_back
        return outputs

    def _launch(self, batch: list[ScheduledSeq], previous: _Launched | None) -> _Launched:
        """Queue ``batch``'s model work and sampling on the device and advance its
        sequences past what it computes; nothing waits for the device."""
        sampling = [item for item in batch if item.samples]
        # what the model computes: all but sequences whose logits admission computed
        ready = [item for item in sampling if not item.num_computed_tokens]
        computed, computed_sampling = batch, sampling
        if ready:
            computed = [item for item in batch if item.num_computed_tokens]
            computed_sampling = [item for item in sampling if item.num_computed_tokens]
        carried = None
        if previous is not None and previous.held:
            source = {id(item.seq): row for row, item in enumerate(previous.sampling)}
            pairs = [
                (row, source[id(item.seq)])
                for row, item in enumerate(computed_sampling)
                if item.seq.token_ids[-1] == PLACEHOLDER
            ]
            if pairs:
                rows, source_rows = zip(*pairs, strict=True)
                carried = CarriedTokens(
                    torch.tensor(rows), torch.tensor(source_rows), previous.tokens
                )
        # forwards admission queued aside (repair_selecting) are this step's work:
        # their positions, and their time from the first one's start
        aside = self.runner.take_aside()
        if aside is not None:
            began, started = aside.began, aside.started
        else:
            began, started = time.perf_counter(), None
            if self.device.type == "cuda":
                started = torch.cuda.Event(enable_timing=True)
                started.record()
        logits = None
        if computed:
            logits = self.runner.run(computed, carried) if carried else self.runner.run(computed)
        kind = self.runner.last_run_kind if computed else "admission forward"
        if ready:
            logits = self._with_ready_logits(sampling, logits)
        if self.on_logits is not None:
            self.on_logits([item.seq for item in sampling], logits)
        params = [item.seq.params for item in sampling]
        logits, constrained = self._mask_logits(sampling, logits)
        tokens = sample_on_device(logits, params, [item.seq.generator for item in sampling])
        copied = None
        if tokens.is_cuda:
            host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host_tokens.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record()
        else:
            host_tokens = tokens
        launch_s = time.perf_counter() - began
        # prompt positions computed: a few integer ops per item
        prompt_tokens = aside.tokens if aside is not None else 0
        published = []
        for item in batch:
            seq = item.seq
            prompt_len = len(seq.prompt_token_ids)
            if item.start < prompt_len:
                prompt_tokens += min(item.end, prompt_len) - item.start
            if item.scattered is not None:  # (placed chunks lie within the prompt)
                prompt_tokens += int(np.searchsorted(item.scattered, prompt_len))
                seq.pending = seq.pending[len(item.scattered) :]
            seq.num_computed = item.end
            # final KV once this step has run: up to the first pending position
            published.append(
                (item.first_position, int(seq.pending[0]) if len(seq.pending) else item.end)
            )
        self.last_step_prompt_tokens = prompt_tokens
        self._tally.steps += 1
        self._tally.prompt_positions += prompt_tokens
        if aside is not None:
            self._tally.steps_with_admissions += 1
            self._tally.admission_forwards += aside.forwards
        wants_logprobs = any(p.logprobs for p in params)
        return _Launched(
            batch,
            sampling,
            [item.seq.page_ids for item in batch],
            published,
            tokens,
            host_tokens,
            copied,
            logits if wants_logprobs else None,
            any(item.seq.num_output_tokens == 0 for item in sampling),
            prompt_tokens,
            kind,
            started,
            launch_s,
            behind_aside=aside is not None,
            constrained=constrained,
        )

    @staticmethod
    def _with_ready_logits(sampling: list[ScheduledSeq], logits: torch.Tensor | None):
        """Logits of every sampling row, in order: the model's for the rows it computed
        (``logits``, in their order), admission's for the others (taken from them).
        Joined from runs of rows on the device (no index copied from the host)."""
        pieces, row, run = [], 0, 0  # run: computed rows not yet in pieces
        for item in sampling:
            if item.num_computed_tokens:
                run += 1
                continue
            if run:
                pieces.append(logits[row : row + run])
                row, run = row + run, 0
            approx = item.seq.approx
            pieces.append(approx.ready_logits)
            approx.ready_logits, approx.samples_at_admission = None, False
        if run:
            pieces.append(logits[row : row + run])
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _hold(self, launched: _Launched) -> None:
        """Let the scheduler see ``launched``'s tokens before they are read back: a
        placeholder for each, in every sequence still running."""
        for item in launched.sampling:
            if not item.seq.is_finished:
                item.seq.token_ids.append(PLACEHOLDER)
        launched.held = True

    def _resolve(self, launched: _Launched) -> list[StepOutput]:
        """Read ``launched``'s tokens back (waiting for the device), offer the pages it
        completed to the reuse component, store finished entry fills, and emit the
        tokens of the sequences still running."""
        if launched.copied is not None:
            launched.copied.synchronize()
        seconds = (
            launched.started.elapsed_time(launched.copied) / 1000
            if launched.started is not None and launched.copied is not None
            else launched.launch_s
        )
        self.last_resolved_steps.append((launched.kind, seconds))
        tokens = launched.host_tokens.tolist()
        for item, table, (first, ready) in zip(
            launched.batch, launched.page_tables, launched.published, strict=True
        ):
            seq = item.seq
            if seq.is_finished or seq.page_ids is not table:  # finished or preempted since
                continue
            if ready > first:
                self.reuse.publish(seq, first, ready)
            if seq.approx.fill_key is not None and item.end == len(seq.token_ids):
                self.entry_fills.store(seq)
        params = [item.seq.params for item in launched.sampling]
        if launched.logits is not None:
            logprobs = top_logprobs(launched.logits, tokens, params)
        else:
            logprobs = [None] * len(tokens)
        outputs = []
        for item, token, lp in zip(launched.sampling, tokens, logprobs, strict=True):
            seq = item.seq
            if seq.is_finished:  # the token before finished it (or it was aborted)
                continue
            if launched.held:
                assert seq.token_ids[-1] == PLACEHOLDER, "a held token is the last one"
                seq.token_ids[-1] = token
            else:
                seq.token_ids.append(token)
            outputs.append(self._emit_token(seq, token, lp))
        return outputs

    def fill_entry(self, tokens: list[int], tenant_salt: str | None = None) -> PageKey:
        """Queue the computation of ``tokens``' position-free entry (unless it is held
        or queued already); returns its key. The entry exists once ``step`` has run
        the fill (``pool.entry(key)``)."""
        self._check_placement()
        if not tokens:
            raise ValueError("an entry needs at least one token")
        self._validate("entry-fill", list(tokens))
        room = self.max_model_len - 1 - len(self.entry_context)
        if len(tokens) > room:
            raise ValueError(
                f"a chunk kept as a position-free entry may have at most {room} tokens "
                f"(it is computed after the {len(self.entry_context)}-token entry context, "
                f"engine.entry_system_prompt, within the context length {self.max_model_len}); "
                f"this one has {len(tokens)}"
            )
        namespace = self.namespace(tenant_salt)
        key = position_free_key(namespace, tokens)
        self.entry_fills.queue(key, list(tokens), namespace)
        return key

    def _check_placement(self) -> None:
        if self.placement_problem:
            raise ValueError(
                f"approximate reuse is not available for this model: {self.placement_problem}"
            )

    def _emit_token(
        self, seq: Sequence, token: int, logprobs: tuple[tuple[int, float], ...] | None
    ) -> StepOutput:
        """``token`` is ``seq``'s new last token: finish the sequence if it ends it,
        and say what it produced."""
        params = seq.params
        incremental = self.stream_text or bool(params.stop)
        reason = self._token_finish_reason(seq, token)
        if seq.matcher is not None and reason is None and self._grammar_ends(seq, token):
            reason = "stop"
        output = seq.output
        if incremental:
            # the last step flushes text held back for an incomplete character
            output.add_step(self.tokenizer, seq.token_ids, final=reason is not None)
        if len(seq.output_token_ids) < params.min_tokens:
            output.stop_search_from = len(output.text)
        elif params.stop and output.cut_at_stop_string(params.stop):
            reason = "stop"
        if reason is not None:
            if not incremental:  # decode once at the end: cheaper than per step
                output.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            self.scheduler.finish(seq, reason)
            del self._sequences[seq.request_id]
        holdback = 0 if reason else max((len(s) - 1 for s in params.stop), default=0)
        new_text = output.take_new(holdback)
        return StepOutput(
            request_id=seq.request_id,
            new_token_ids=(token,),
            new_text=new_text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            reuse=seq.reuse,
            logprobs=logprobs,
        )

    @staticmethod
    def _grammar_ends(seq: Sequence, token: int) -> bool:
        """Feed ``token`` to ``seq``'s grammar; True once the output is complete (or,
        never expected of a masked draw, the grammar refused the token)."""
        if not seq.matcher.accept_token(token):
            return True
        return seq.matcher.is_terminated()

    def _mask_logits(self, sampling: list, logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``logits`` with, in one pass over the rows, the EOS and stop tokens masked
        in the rows still short of their ``min_tokens`` (the token sampled now is their
        output's next) and each constrained row masked to what its grammar allows (the
        same tensor where no row is either); and whether some row is constrained."""
        rows, columns, constrained, matchers = [], [], [], []
        for row, item in enumerate(sampling):
            seq = item.seq
            if len(seq.output_token_ids) < seq.params.min_tokens:
                banned = self._eos_token_ids.union(seq.params.stop_token_ids)
                rows += [row] * len(banned)
                columns += banned
            if seq.matcher is not None:
                constrained.append(row)
                matchers.append(seq.matcher)
        if rows:
            index = torch.tensor([rows, columns], dtype=torch.long).to(logits.device)
            logits = logits.index_put(
                (index[0], index[1]), torch.tensor(float("-inf"), device=logits.device)
            )
        return self._grammars.constrain(logits, constrained, matchers), bool(constrained)

    def _token_finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why generation ends at this token, stop strings aside (they need text)."""
        params = seq.params
        if len(seq.output_token_ids) < params.min_tokens:
            return "length" if seq.reached_length(self.max_model_len) else None
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self._eos_token_ids:
            return "stop"
        if seq.reached_length(self.max_model_len):
            return "length"
        return None

    # -- helpers ---------------------------------------------------------------
    def _validate(self, request_id: str, prompt: list[int]) -> bytes:
        """The prompt packed (``pack_tokens``), once it is a valid one."""
        if request_id in self._sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        try:  # integers in [0, 2**32) only, packed in one C pass as keys hash them
            packed = pack_tokens(prompt)
        except ValueError:
            packed = None
        if packed is None or int(np.frombuffer(packed, dtype="<u4").max()) >= vocab:
            bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens but this model serves at most "
                f"{self.max_model_len - 1} prompt tokens (context length {self.max_model_len}); "
                "shorten the prompt"
            )
        return packed

    def close(self) -> None:
        """Stop a tensor-parallel worker's other ranks (nothing for one rank); the
        engine serves nothing after."""
        if self.followers is not None:
            # rank 0's end of the group is aborted while the others abort theirs (NCCL's
            # abort waits for every rank of a node), so that neither this nor the
            # interpreter's exit waits on NCCL for ranks that are gone
            self.followers.close(while_they_stop=self._shard.close)

    def _check_weights_fit(self, shard: Shard) -> None:
        """ValueError, before anything is allocated, when one rank's weights leave no
        room for KV in its share of a GPU (``gpu_memory_utilization``)."""
        need = weight_bytes(self.model_config, self.dtype, shard)
        total = torch.cuda.mem_get_info(self.device)[1]
        room = total * self.config.gpu_memory_utilization - 2**30  # activations
        if need >= room:
            per = "" if shard.world == 1 else f" per GPU at tensor_parallel_size {shard.world}"
            raise ValueError(
                f"the model does not fit: its weights take {need / 2**30:.1f} GiB{per}, and a "
                f"GPU of {total / 2**30:.1f} GiB has {room / 2**30:.1f} GiB for weights and KV "
                f"at gpu_memory_utilization {self.config.gpu_memory_utilization}; split it over "
                "more GPUs (workers.tensor_parallel_size)"
            )

    def _check_devices(self, world: int) -> None:
        if self.device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size {world} needs {world} GPUs; this process sees "
                f"{torch.cuda.device_count()}"
            )

    def _auto_num_pages(self, local: ModelConfig) -> int:
        """Pages that fit this rank's KV memory (``local``: its KV heads)."""
        per_page = ModelRunner.bytes_per_page(local, self.config.page_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = total * (1 - self.config.gpu_memory_utilization)
            budget = free - reserve - 2**30  # room for activations
            if self.config.host_kv_gib > 0:
                budget -= WRITE_STAGING_BYTES  # writes on their way to the host tier
        else:
            budget = self.config.cpu_kv_cache_bytes
        num_pages = int(budget // per_page)
        if num_pages < 2:
            raise ValueError(
                "not enough memory for the KV cache: lower the model size or set num_pages"
            )
        return num_pages
