"""Runs the model on one scheduled batch: builds inputs and attention metadata once
per step, runs the forward pass, returns logits of the sequences that sample."""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.engine.attention.base import (
    AttentionBackend,
    AttentionShape,
    BatchLayout,
    StepGraphs,
)
from workers.engine.attention.scattered import ScatteredAttention
from workers.engine.host_tier import PageCopier
from workers.engine.layers.skinny_choice import SkinnyChoice
from workers.engine.layers.skinny_choice import choose as choose_skinny
from workers.engine.models.decoder import DecoderModel
from workers.engine.request import ApproximateState
from workers.engine.scheduler import ScheduledSeq
from workers.engine.tp.group import Followers, MirroredCopier

if TYPE_CHECKING:
    from workers.engine.kv_ops import PlaceSpans


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    layout: BatchLayout
    logits_indices: torch.Tensor  # [S] rows of the last token of each sampling sequence


@dataclass
class AsideWork:
    """Forwards queued outside the steps (``ModelRunner.repair_selecting``, at
    admission) since the engine last took them: the prompt positions they computed
    through every layer, how many forwards, and when the first began (on the device
    where there is one; on the host)."""

    tokens: int
    started: torch.cuda.Event | None
    began: float  # time.perf_counter()
    forwards: int = 0


@dataclass(frozen=True)
class Selection:
    """One sequence's part of ``ModelRunner.repair_selecting_batch``: the arguments
    ``repair_selecting`` takes for it."""

    seq: object  # request.Sequence
    start: int
    end: int
    candidates: np.ndarray
    keep: int
    logits: bool = False
    # the entries' placement, from the selection layer on (``repair_selecting``)
    place: PlaceSpans | None = None

    def __post_init__(self) -> None:
        # the top-k takes the non-candidates and ``keep`` candidates: at most every row
        assert 0 < self.keep <= len(self.candidates), (self.keep, len(self.candidates))
        # the logits are position end - 1's, which must go on past the selection layer
        assert not (self.logits and self.candidates[-1] == self.end - 1)

    @property
    def kept_rows(self) -> int:
        """Rows that go on past the selection layer: all but the candidates, plus the
        ``keep`` candidates kept."""
        return self.end - self.start - len(self.candidates) + self.keep

    def detached(self) -> Selection:
        """This selection with its sequence as ``SeqView`` (what the other ranks of a
        tensor-parallel worker are sent)."""
        return dataclasses.replace(self, seq=SeqView.of(self.seq, self.end))


@dataclass
class SeqView:
    """What ``build_inputs`` and the selection forward read of a sequence's first
    ``len(token_ids)`` tokens, without the rest of it."""

    token_ids: list[int]
    page_ids: array
    num_prompt_tokens: int
    packed_prompt: bytes  # the prompt's ids packed (``Sequence.packed_tokens``)
    approx: ApproximateState = field(default_factory=ApproximateState)

    @classmethod
    def of(cls, seq, end: int) -> SeqView:
        prompt = seq.num_prompt_tokens
        return cls(seq.token_ids[:end], array("i", seq.page_ids), prompt, seq.packed_tokens(prompt))

    def packed_tokens(self, upto: int) -> bytes:
        assert upto <= self.num_prompt_tokens, "a view packs its prompt only"
        return self.packed_prompt[: 4 * upto]


@dataclass(frozen=True)
class CarriedTokens:
    """Input tokens that exist only on the device: for sampling row ``rows[i]`` of a
    step (its index among the batch's sampling items), the last input token is
    ``tokens[source_rows[i]]``, sampled by the step before and not yet read back."""

    rows: torch.Tensor  # int64 [K], CPU
    source_rows: torch.Tensor  # int64 [K], CPU
    tokens: torch.Tensor  # int64 [S'], on the device


def build_inputs(batch: list[ScheduledSeq], page_size: int) -> StepInputs:
    """Flatten a batch (CPU tensors). Pure function of the batch; no device work.
    Page tables are copied as int32 buffers (this runs every step, for every request).

    Layout rows are runs of consecutive positions: a sequence whose step computes
    scattered positions contributes one row per maximal run, each seeing the KV up to
    its own end. A row's new tokens are then always the last ones of its KV, so the
    plain causal kernel attends exactly by position (a query at p sees 0..p), with
    no custom mask."""
    ids = _InputIds()
    listed, array_run = ids.listed, _InputIds.ARRAY_RUN
    tables, positions, counts, ends, row_tokens, logits_indices = [], [], [], [], [], []
    for item in batch:
        seq = item.seq
        table = _int32(seq.page_ids)
        if item.scattered is None:  # the common case: one run
            if item.num_tokens >= array_run and item.end <= seq.num_prompt_tokens:
                ids.add_array(_prompt_ids(seq)[item.start : item.end])
            else:  # a decode step's token, a short run or one past the prompt
                listed += seq.token_ids[item.start : item.end]
            positions.append(np.arange(item.start, item.end, dtype=np.int64))
            _add_row(tables, counts, ends, row_tokens, table, item.end, item.num_tokens, page_size)
        else:
            computed = np.concatenate(
                (item.scattered, np.arange(item.start, item.end, dtype=np.int64))
            )
            if len(computed) >= array_run and computed[-1] < seq.num_prompt_tokens:
                ids.add_array(_prompt_ids(seq)[computed])
            else:
                tokens = seq.token_ids  # a list: index it, not a copy of the whole prompt
                listed += [tokens[i] for i in computed.tolist()]
            positions.append(computed)
            _add_runs(tables, counts, ends, row_tokens, table, computed, page_size)
        if item.samples:
            logits_indices.append(ids.count - 1)
    pos = np.concatenate(positions)
    ends_np = np.asarray(ends, dtype=np.int32)
    counts_np = np.asarray(counts, dtype=np.int32)
    page_indptr = np.zeros(len(ends) + 1, dtype=np.int32)
    np.cumsum(counts_np, out=page_indptr[1:])
    qo_indptr = np.zeros(len(ends) + 1, dtype=np.int32)
    np.cumsum(row_tokens, out=qo_indptr[1:])
    page_indices = np.concatenate(tables)
    # slot of each new token: its row's page for that position, plus the offset
    owner = np.repeat(np.arange(len(ends)), np.diff(qo_indptr))
    pages = page_indices[page_indptr[owner] + pos // page_size]
    slots = (pages.astype(np.int64) * page_size + pos % page_size).astype(np.int32)
    pos_tensor = torch.from_numpy(pos)
    layout = BatchLayout(
        qo_indptr=torch.from_numpy(qo_indptr),
        kv_page_indptr=torch.from_numpy(page_indptr),
        kv_page_indices=torch.from_numpy(page_indices),
        kv_last_page_len=torch.from_numpy(ends_np - (counts_np - 1) * page_size),
        kv_lens=torch.from_numpy(ends_np),
        slot_mapping=torch.from_numpy(slots),
        page_size=page_size,
        positions=pos_tensor.to(torch.int32),
    )
    return StepInputs(
        torch.from_numpy(ids.array()),
        pos_tensor,
        layout,
        torch.tensor(logits_indices, dtype=torch.long),
    )


class _InputIds:
    """A step's input token ids, gathered in order: runs of at least ``ARRAY_RUN``
    prompt tokens as arrays read from the prompt's packed ids (``_prompt_ids``: one C
    conversion), the rest appended to ``listed`` (a decode token is one append,
    cheaper than an array). Through numpy either way: ``torch.tensor(list)`` takes
    3-4x as long as ``np.fromiter`` (220 us for 4K ids), and that about twice as long
    as the whole of ``build_inputs`` over a 4K-token run from the packed ids."""

    ARRAY_RUN = 64

    def __init__(self) -> None:
        self.listed: list[int] = []  # ids after the last array (callers append here)
        self._parts: list[np.ndarray] = []
        self._in_parts = 0

    @property
    def count(self) -> int:
        return self._in_parts + len(self.listed)

    def add_array(self, ids: np.ndarray) -> None:
        self._flush()
        self._parts.append(ids.astype(np.int64))
        self._in_parts += len(ids)

    def _flush(self) -> None:
        if self.listed:
            listed = self.listed
            self._parts.append(np.fromiter(listed, dtype=np.int64, count=len(listed)))
            self._in_parts += len(listed)
            listed.clear()  # the same list: callers hold it

    def array(self) -> np.ndarray:
        """int64 [count]."""
        self._flush()
        if len(self._parts) == 1:
            return self._parts[0]
        return np.concatenate(self._parts) if self._parts else np.empty(0, dtype=np.int64)


def _prompt_ids(seq) -> np.ndarray:
    """The prompt's token ids as uint32, a view of its packed bytes (little-endian)."""
    return np.frombuffer(seq.packed_tokens(seq.num_prompt_tokens), dtype="<u4")


def _run_ids(seq, start: int, end: int) -> np.ndarray:
    """The token ids at positions ``[start, end)``: a view of the packed prompt where
    they are prompt tokens."""
    if end <= seq.num_prompt_tokens:
        return _prompt_ids(seq)[start:end]
    return np.asarray(seq.token_ids[start:end], dtype=np.int64)


def _add_row(tables, counts, ends, row_tokens, table, end, num_tokens, page_size) -> None:
    """One layout row: ``num_tokens`` queries ending at position ``end`` - 1."""
    num_pages = -(-end // page_size)
    tables.append(table[:num_pages])
    counts.append(num_pages)
    ends.append(end)
    row_tokens.append(num_tokens)


def _add_runs(tables, counts, ends, row_tokens, table, computed, page_size) -> None:
    """``_add_row`` for each maximal run of consecutive positions in ``computed``
    (sorted), in a few array operations: a step may have hundreds of runs."""
    last = np.flatnonzero(np.diff(computed) != 1)  # each run's last index but the final's
    run_ends = np.append(last, len(computed) - 1)
    run_starts = np.concatenate(([0], last + 1))
    end_positions = computed[run_ends] + 1
    num_pages = -(-end_positions // page_size)
    # each row's page table is a prefix of the sequence's: their concatenation at once
    first_of_row = np.repeat(np.cumsum(num_pages) - num_pages, num_pages)
    tables.append(table[np.arange(int(num_pages.sum())) - first_of_row])
    counts += num_pages.tolist()
    ends += end_positions.tolist()
    row_tokens += (run_ends - run_starts + 1).tolist()


def _int32(page_ids) -> np.ndarray:
    if isinstance(page_ids, array):
        return np.frombuffer(page_ids, dtype=np.int32)
    return np.asarray(page_ids, dtype=np.int32)


# (model, backend, kv_caches, scratch_page=, max_batch_size=, max_pages_per_seq=) -> the
# step graphs; ``graphs.step.capture_step_graphs`` is the one a CUDA engine uses
CaptureGraphs = Callable[..., StepGraphs]


class ModelRunner:
    """Owns the KV tensors: ``num_pages`` pool pages plus one scratch page (index
    ``num_pages``) that padded CUDA-graph rows read and write."""

    def __init__(
        self,
        model: DecoderModel,
        backend: AttentionBackend,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        max_num_seqs: int,
        enable_cuda_graphs: bool,
        skinny_matmul: bool = True,
        capture_graphs: CaptureGraphs | None = None,
    ) -> None:
        """``capture_graphs``: what captures the step graphs over a backend with
        ``graph_hooks`` (None: ``graphs.step.capture_step_graphs``, CUDA only)."""
        self.model = model
        self.backend = backend
        self.page_size = page_size
        # how the last ``run`` ran: "<attention kind> graph" or "<attention kind> eager"
        self.last_run_kind = ""
        config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (num_pages + 1, 2, page_size, config.num_kv_heads, config.head_dim)
        # One allocation for all layers: ``kv_caches[i]`` is a contiguous view of
        # ``kv_stack[i]``, so a copy across every layer (placement) is one operation.
        self.kv_stack = torch.zeros(
            (config.num_layers, *shape), dtype=self.dtype, device=self.device
        )
        self.kv_caches = list(self.kv_stack.unbind(0))
        model.use_fused_ops(backend.fused_ops)
        # rows kept past an approximate request's selection layer (repair_selecting):
        # the Triton kernel on CUDA (fused ops), plain torch elsewhere
        self.scattered = ScatteredAttention(
            AttentionShape(
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                page_size,
                self.dtype,
                self.device,
            ),
            use_kernel=backend.fused_ops,
        )
        # what repair_selecting queued since the engine last asked (take_aside)
        self.aside: AsideWork | None = None
        # a tensor-parallel worker's other ranks, on its rank 0 (``tp.group``): each
        # operation on the model or the KV tensors is sent to them before it runs here
        self.followers: Followers | None = None
        self.host_copier: PageCopier | None = None  # the host KV tier's (``host_copier``)
        # before any graph is captured: graphs bake the projections' path in
        if not skinny_matmul:
            self.skinny = SkinnyChoice(error="off in the engine config")
        elif not backend.fused_ops:
            self.skinny = SkinnyChoice(error="no fused ops (the torch backend)")
        elif not enable_cuda_graphs:  # measured in graphs; eager, Triton's launch costs more
            self.skinny = SkinnyChoice(error="CUDA graphs off")
        else:
            self.skinny = choose_skinny(model)
            model.use_skinny(self.skinny.chosen)
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.scratch_page = num_pages  # the page after the pool's: padding rows use it
        # graphs of repair_selecting's two halves (use_admission_graphs)
        self.selection_graphs = None
        self.kept_graphs = None
        # CUDA graphs of the steps (None: off, or a backend without graph hooks)
        self.graphs: StepGraphs | None = None
        if enable_cuda_graphs and backend.graph_hooks:
            if capture_graphs is None:
                from workers.engine.graphs.step import capture_step_graphs  # CUDA only

                capture_graphs = capture_step_graphs
            self.graphs = capture_graphs(
                model,
                backend,
                self.kv_caches,
                scratch_page=self.scratch_page,
                max_batch_size=max_num_seqs,
                max_pages_per_seq=self.max_pages_per_seq,
            )

    @staticmethod
    def bytes_per_page(config, page_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * page_size * config.num_kv_heads * config.head_dim * element

    def _mirror(self, method: str, *args) -> None:
        """Have the other ranks (if any) call ``method(*args)`` on their runners."""
        if self.followers is not None:
            self.followers.call(method, *args)

    def run(self, batch: list[ScheduledSeq], carried: CarriedTokens | None = None) -> torch.Tensor:
        """Logits [S, vocab] (float32) for the sequences in ``batch`` that sample.
        ``carried``: sampling rows whose last input token is still on the device (the
        previous step's, not yet read back); it is copied in there."""
        inputs = build_inputs(batch, self.page_size)
        if self.followers is not None:  # the carried tokens follow by broadcast
            sent = None if carried is None else dataclasses.replace(carried, tokens=None)
            self._mirror("run_inputs", inputs, sent)
        return self.run_inputs(inputs, carried)

    @torch.inference_mode()
    def run_inputs(self, inputs: StepInputs, carried: CarriedTokens | None = None) -> torch.Tensor:
        """``run`` of a built batch. On a tensor-parallel worker's other ranks,
        ``carried.tokens`` is None: rank 0's are broadcast."""
        layout = inputs.layout
        input_ids = inputs.input_ids.to(self.device, non_blocking=True)
        if carried is not None:
            tokens = carried.tokens
            if self.model.shard.parallel:  # the rows read, broadcast from rank 0
                count = int(carried.source_rows.max()) + 1
                if tokens is None:
                    tokens = torch.empty(count, dtype=torch.int64, device=self.device)
                else:
                    tokens = tokens[:count].contiguous()
                self.model.shard.broadcast(tokens)
            into = inputs.logits_indices[carried.rows].to(self.device, non_blocking=True)
            source = carried.source_rows.to(self.device, non_blocking=True)
            input_ids[into] = tokens[source]
        positions = inputs.positions.to(self.device, non_blocking=True)
        rows = inputs.logits_indices.to(self.device, non_blocking=True)
        if self.graphs is not None:
            logits = self.graphs.replay(input_ids, positions, layout, rows)
            if logits is not None:
                self.last_run_kind = f"{self.backend.last_plan_kind} graph"
                return logits
        metadata = self.backend.plan(layout)
        self.last_run_kind = f"{self.backend.last_plan_kind} eager"
        hidden = self.model(input_ids, positions, self.kv_caches, self.backend, metadata)
        return self.model.compute_logits(hidden[rows])

    def repair_selecting(
        self,
        seq,
        start: int,
        end: int,
        candidates: np.ndarray,
        keep: int,
        layer: int,
        logits: bool = False,
        place: PlaceSpans | None = None,
    ) -> torch.Tensor | None:
        """Compute positions ``[start, end)`` of ``seq`` in context, where every position
        below ``start`` holds KV and those in ``candidates`` hold placed KV: the layers
        before ``layer`` over all of them; from ``layer`` on, all but the candidates
        plus the ``keep`` candidates whose K/V at ``layer`` deviate most (squared
        distance) from the placed K/V. The other candidates keep their placed KV from
        ``layer`` on. One forward, chosen on the device: nothing waits for it (but
        see ``graphs.selection`` on two of one bucket back to back, and a graph's
        capture on first use, which synchronizes).
        ``logits``: also return position ``end - 1``'s logits [1, vocab] (float32; it
        must not be a candidate), so that no step computes it again.
        ``place``: the placement of the entries' KV (every placed position, all within
        ``[start, end)``), applied from ``layer`` on once the layers before it are queued
        (they overwrite every placed position's KV below ``layer`` and read no other
        layer's), so its host work overlaps them."""
        selection = Selection(seq, start, end, candidates, keep, logits, place)
        return self.repair_selecting_batch([selection], layer)[0]

    @torch.inference_mode()
    def _repair_one(self, selection: Selection, layer: int) -> torch.Tensor | None:
        """``repair_selecting`` of one selection, through its CUDA graphs where they
        are captured."""
        seq, start, end = selection.seq, selection.start, selection.end
        candidates, place = selection.candidates, selection.place
        self._note_aside()
        graphs = self.selection_graphs
        early = None  # launched first: the device waits for nothing else here
        if graphs is not None and graphs.layer == layer:
            candidate = np.zeros(end - start, dtype=bool)
            candidate[candidates - start] = True
            early = graphs.start(_run_ids(seq, start, end), start, _int32(seq.page_ids), candidate)
        if early is None:
            qkv, residual, deviation, positions, slots, table, _ = self._select_eagerly(
                [selection], layer
            )
        else:
            if place is not None:
                place.apply(self, layer)
            qkv, residual, deviation, positions, slots, table = graphs.finish(early)
        # non-candidates' deviation is +inf: the top-k takes them all, then the keep
        # candidates that deviate most; sorted rows keep positions ascending
        kept = selection.kept_rows
        rows = torch.topk(deviation, kept, sorted=False).indices.sort().values
        qkv, residual, positions, slots = qkv[rows], residual[rows], positions[rows], slots[rows]
        self.aside.tokens += kept
        self.aside.forwards += 1
        hidden = None
        if self.kept_graphs is not None and self.kept_graphs.layer == layer:
            hidden = self.kept_graphs.run(qkv, residual, positions, slots, table, end)
        if hidden is None:
            metadata = self.scattered.metadata(positions, slots, table, end)
            hidden = self.model.forward_kept(
                qkv, residual, positions, self.kv_caches, layer, self.scattered, metadata
            )
        self._place_below([selection], layer, slots)
        # rows are sorted by position: the last one is end - 1 (read before the graph's
        # output buffer is reused: later work queues behind this on the one stream)
        return self.model.compute_logits(hidden[-1:]) if selection.logits else None

    @torch.inference_mode()
    def repair_selecting_batch(
        self, selections: list[Selection], layer: int
    ) -> list[torch.Tensor | None]:
        """``repair_selecting`` for several sequences in one forward: the layers before
        ``layer`` over all of their positions, each one's ``place(layer)``, the
        deviation at ``layer``, each sequence's own top-k, then every kept row through
        the rest of the model, attending over its own sequence's KV. Per selection, its
        logits where asked (else None). One selection takes ``repair_selecting`` (and
        its CUDA graphs); several run eagerly: the projections then read the weights
        once for all of them, which is what makes the batch pay."""
        if self.followers is not None:
            self._mirror("repair_selecting_batch", [one.detached() for one in selections], layer)
        if len(selections) == 1:
            return [self._repair_one(selections[0], layer)]
        self._note_aside()
        qkv, residual, deviation, positions, slots, tables, page_indptr = self._select_eagerly(
            selections, layer
        )
        rows, segments, offset, kept_offset = [], [], 0, 0
        for i, one in enumerate(selections):
            span = deviation[offset : offset + one.end - one.start]
            # as in repair_selecting: non-candidates (+inf) all, then the most deviating
            chosen = torch.topk(span, one.kept_rows, sorted=False).indices.sort().values
            rows.append(chosen + offset)
            first, last = kept_offset, kept_offset + one.kept_rows
            segments.append((first, last, page_indptr[i], page_indptr[i + 1], one.end))
            offset += one.end - one.start
            kept_offset += one.kept_rows
        kept = torch.cat(rows)
        qkv, residual, positions, slots = qkv[kept], residual[kept], positions[kept], slots[kept]
        self.aside.tokens += kept_offset
        self.aside.forwards += 1
        hidden = self.model.forward_kept(
            qkv,
            residual,
            positions,
            self.kv_caches,
            layer,
            self.scattered,
            self.scattered.batch_metadata(positions, slots, tables, segments),
        )
        self._place_below(selections, layer, slots)
        # each sequence's rows ascend by position: its last is its end - 1
        wanted = [i for i, one in enumerate(selections) if one.logits]
        out: list[torch.Tensor | None] = [None] * len(selections)
        if wanted:
            last = torch.cat([hidden[segments[i][1] - 1 : segments[i][1]] for i in wanted])
            logits = self.model.compute_logits(last)
            for row, i in enumerate(wanted):
                out[i] = logits[row : row + 1]
        return out

    def _place_below(self, selections: list[Selection], layer: int, kept: torch.Tensor) -> None:
        """Where a selection's placement asks for it (``PlaceSpans.below_selection``),
        its entries' KV in the layers below ``layer`` at the positions not recomputed:
        the placement over every position of those layers, then the recomputed rows'
        in-context KV (slots ``kept``, of every selection) put back."""
        places = [one.place for one in selections if one.place and one.place.below_selection]
        if not places:
            return
        pages, offsets = kept // self.page_size, kept % self.page_size
        low = self.kv_stack[:layer]
        computed = low[:, pages, :, offsets].clone()  # [rows, layers, 2, heads, dim]
        for place in places:
            place.apply(self, 0, layer)
        low[:, pages, :, offsets] = computed

    def _select_eagerly(self, selections: list[Selection], layer: int):
        """The selecting forward up to the top-k, without graphs: the layers before
        ``layer`` over every selection's positions (one ragged plan), each one's
        ``place(layer)``, then the deviation at ``layer``. Returns ``(qkv, residual,
        deviation, positions, slots, tables, page_indptr)``: rows in the selections'
        order, and their page tables joined (selection i's from ``page_indptr[i]``)."""
        device = self.device
        inputs = build_inputs(
            [ScheduledSeq(one.seq, one.start, one.end - one.start) for one in selections],
            self.page_size,
        )
        positions = inputs.positions.to(device, non_blocking=True)
        metadata = self.backend.plan_aside(inputs.layout)  # a step may be in flight
        hidden, residual = self.model.early_layers(
            inputs.input_ids.to(device, non_blocking=True),
            positions,
            self.kv_caches,
            self.backend,
            metadata,
            layer,
        )
        for one in selections:
            if one.place is not None:
                one.place.apply(self, layer)
        candidate = np.zeros(len(inputs.positions), dtype=bool)
        offset = 0
        for one in selections:
            candidate[offset + one.candidates - one.start] = True
            offset += one.end - one.start
        qkv, residual, deviation = self.model.selection_deviation(
            hidden,
            residual,
            positions,
            self.kv_caches[layer],
            metadata.kv_rows,
            layer,
            torch.from_numpy(candidate).to(device, non_blocking=True),
        )
        slots = inputs.layout.slot_mapping.to(device, non_blocking=True).long()
        tables = inputs.layout.kv_page_indices.to(device, non_blocking=True)
        page_indptr = inputs.layout.kv_page_indptr.tolist()  # one layout row a selection
        return qkv, residual, deviation, positions, slots, tables, page_indptr

    def _note_aside(self) -> None:
        """Start counting forwards queued aside, if none is counted since the engine
        last took them."""
        if self.aside is None:
            started = None
            if self.device.type == "cuda":
                started = torch.cuda.Event(enable_timing=True)
                started.record()
            self.aside = AsideWork(0, started, time.perf_counter())

    def take_aside(self) -> AsideWork | None:
        """What ``repair_selecting`` queued since the last call (None: nothing): work
        outside the steps, which the engine counts in the step it launches next."""
        taken, self.aside = self.aside, None
        return taken

    def apply(self, op) -> None:
        """Run a KV operation (``kv_ops``) on this runner's KV tensors, and on the other
        ranks' first."""
        self._mirror("apply", op)
        op.apply(self)

    def attach_host_copier(self, num_slots: int) -> PageCopier:
        """The copier between the KV tensors and ``num_slots`` host slots of the host KV
        tier (``host_tier``): on a tensor-parallel worker, each rank keeps its own KV
        heads' slots, and rank 0's copier has the others copy as it does."""
        self._mirror("attach_host_copier", num_slots)
        self.host_copier = PageCopier(self.kv_stack, num_slots)
        if self.followers is None:
            return self.host_copier
        return MirroredCopier(self.host_copier, self.followers)

    def use_admission_graphs(self, layer: int) -> None:
        """Run ``repair_selecting``'s forward through CUDA graphs (captured on first use)
        when it selects at ``layer``, where CUDA graphs are on: its selection pass with
        the FlashInfer backend (``graphs.selection``), its kept rows where the scattered
        kernel runs (``graphs.kept``: CUDA, fused ops)."""
        self._mirror("use_admission_graphs", layer)
        if self.graphs is None:
            return
        if self.backend.graph_hooks:
            from workers.engine.graphs.selection import SelectionGraphs  # CUDA only

            self.selection_graphs = SelectionGraphs(
                self.model,
                self.backend,
                self.kv_caches,
                layer,
                scratch_page=self.scratch_page,
                max_pages_per_seq=self.max_pages_per_seq,
            )
        if not self.scattered.use_kernel:
            return
        from workers.engine.graphs.kept import KeptRowsGraphs  # CUDA only

        self.kept_graphs = KeptRowsGraphs(
            self.model,
            self.kv_caches,
            self.scattered,
            layer,
            scratch_page=self.scratch_page,
            max_pages_per_seq=self.max_pages_per_seq,
        )
