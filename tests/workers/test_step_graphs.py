"""The model runner's seam with CUDA graphs and its attention backend's fused ops: the
runner captures step graphs over a backend with graph hooks (none without), the
backend says whether the model runs fused elementwise kernels, and the runner replays
whatever fits, never asking which backend it has. On the CPU, with a backend that wraps
the torch reference and a capture function that stands in for ``graphs.step``'s."""

from __future__ import annotations

from array import array

import torch

from chunkstore.hashing import Namespace
from workers.engine.attention.base import AttentionShape
from workers.engine.attention.torch_backend import TorchAttentionBackend
from workers.engine.model_runner import ModelRunner
from workers.engine.models.config import ModelConfig
from workers.engine.models.loader import load_model
from workers.engine.request import Sequence
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq

PAGE = 16


class ReplayOneTokenSteps:
    """Stands in for captured graphs: 'replays' steps of one new token per row (with
    logits no model gives), leaves the rest to the eager path."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.asked: list[int] = []

    def replay(self, input_ids, positions, layout, rows):
        self.asked.append(layout.num_tokens)
        if not layout.is_decode:
            return None
        return torch.full((len(rows), self.vocab), 7.0)


class CapturingBackend(TorchAttentionBackend):
    name = "not-one-the-runner-knows"
    fused_ops = False
    graph_hooks = True

    def __init__(self, shape: AttentionShape, vocab: int) -> None:
        super().__init__(shape)
        self.graphs = ReplayOneTokenSteps(vocab)
        self.captured_with: dict | None = None


def capture(model, backend, kv_caches, scratch_page, max_batch_size, max_pages_per_seq):
    """Stands in for ``graphs.step.capture_step_graphs``: records what it was given."""
    backend.captured_with = {
        "layers": len(kv_caches),
        "scratch_page": scratch_page,
        "max_batch_size": max_batch_size,
        "max_pages_per_seq": max_pages_per_seq,
    }
    return backend.graphs


def _runner(model_dir, backend_for, enable_cuda_graphs: bool):
    config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, config, torch.float32, torch.device("cpu"))
    shape = AttentionShape(
        config.num_heads, config.num_kv_heads, config.head_dim, PAGE, torch.float32,
        torch.device("cpu"),
    )  # fmt: skip
    backend = backend_for(shape, config.vocab_size)
    runner = ModelRunner(
        model, backend, 64, PAGE, 320, 4, enable_cuda_graphs, capture_graphs=capture
    )
    return runner, backend, config


def _steps(runner, tokens):
    """Logits of a 20-token prefill, then of one decode step."""
    seq = Sequence("s", 0, tokens, SamplingParams(), Namespace("graphs"))
    seq.page_ids = array("i", range(2))
    prefill = runner.run([ScheduledSeq(seq, 0, 20)])
    decode = runner.run([ScheduledSeq(seq, 20, 1)])
    return prefill, decode


def test_the_runner_replays_the_graphs_its_backend_captured(tiny_qwen3):
    runner, backend, config = _runner(tiny_qwen3, CapturingBackend, enable_cuda_graphs=True)
    assert runner.graphs is backend.graphs
    assert backend.captured_with == {
        "layers": config.num_layers,
        "scratch_page": 64,  # the page after the pool's
        "max_batch_size": 4,
        "max_pages_per_seq": 20,
    }
    tokens = list(range(5, 26))
    prefill, decode = _steps(runner, tokens)
    assert backend.graphs.asked == [20, 1]
    assert torch.equal(decode, torch.full_like(decode, 7.0))  # what the graph gave
    eager, _ = _steps(_runner(tiny_qwen3, CapturingBackend, False)[0], tokens)
    assert torch.equal(prefill, eager)  # the graph declined: the eager path ran


def test_graphs_off_or_absent_means_every_step_runs_eagerly(tiny_qwen3):
    runner, backend, _ = _runner(tiny_qwen3, CapturingBackend, enable_cuda_graphs=False)
    assert runner.graphs is None and backend.captured_with is None
    plain, _, _ = _runner(tiny_qwen3, lambda s, v: TorchAttentionBackend(s), True)
    assert plain.graphs is None  # the reference backend has none


def test_elementwise_ops_follow_the_backend(tiny_qwen3):
    class Fused(CapturingBackend):
        fused_ops = True

    for backend_for, fused in ((CapturingBackend, False), (Fused, True)):
        runner, _, _ = _runner(tiny_qwen3, backend_for, enable_cuda_graphs=False)
        flags = {m.fused_ops for m in runner.model.modules() if hasattr(m, "fused_ops")}
        assert flags == {fused}


def test_a_step_loads_into_a_graphs_buffers_with_padding_on_the_scratch_page():
    """The one way every CUDA-graph kind loads a step (graphs.inputs.load_step): real
    tokens first; padding computes token 0 at position 0 and writes the scratch page."""
    from types import SimpleNamespace

    from workers.engine.attention.base import kv_write_rows
    from workers.engine.graphs.inputs import load_step

    size, scratch = 8, 99
    graph = SimpleNamespace(
        input_ids=torch.full((size,), 7, dtype=torch.long),  # stale values of a last step
        positions=torch.full((size,), 7, dtype=torch.long),
        kv_rows=torch.full((2 * size,), -1, dtype=torch.long),
    )
    slots = torch.tensor([3 * PAGE + 1, 5 * PAGE, 5 * PAGE + 1], dtype=torch.int32)
    load_step(graph, torch.tensor([11, 12, 13]), torch.tensor([40, 80, 81]), slots, scratch, PAGE)
    assert graph.input_ids.tolist() == [11, 12, 13] + [0] * 5
    assert graph.positions.tolist() == [40, 80, 81] + [0] * 5
    padded = torch.cat((slots, torch.full((5,), scratch * PAGE, dtype=torch.int32)))
    assert torch.equal(graph.kv_rows, kv_write_rows(padded, PAGE))
    keys, values = graph.kv_rows[:size], graph.kv_rows[size:]
    assert (keys[3:] == scratch * 2 * PAGE).all() and (values[3:] == keys[3:] + PAGE).all()
    # a full graph: nothing padded
    load_step(graph, torch.arange(size), torch.arange(size), torch.arange(size).int(), 0, PAGE)
    assert graph.input_ids.tolist() == list(range(size))


def test_a_selection_forward_stages_its_inputs_for_two_copies():
    """graphs.inputs.stage_selection: a selection graph's inputs for one row of
    consecutive positions, packed where input_layout puts them, equal to what
    build_inputs gives that row (real tokens first; padding is token 0 at position 0
    on the scratch page, never a candidate), and its plan inputs where PLAN_FIELDS and
    PLAN_PAGES put them: the whole bucket as one row (its padding queries last, their
    keys past the sequence's pages on the scratch page), so the plan depends on the
    bucket and the row's start alone; stale values of a bigger earlier forward are
    overwritten."""
    import numpy as np

    from workers.engine.graphs.inputs import (
        PLAN_FIELDS,
        PLAN_PAGES,
        input_layout,
        padded_row_pages,
        stage_selection,
    )
    from workers.engine.model_runner import _run_ids, build_inputs

    seq = Sequence("staged", 0, list(range(100, 150)), SamplingParams(), Namespace("m"))
    seq.page_ids = array("i", [7, 3, 9, 4])  # 50 tokens over 4 pages
    start, n, tokens, scratch = 20, 30, 64, 99
    candidate = np.zeros(n, dtype=bool)
    candidate[[0, 5, 29]] = True
    staged = np.full(4 * tokens, -7, dtype=np.int64)  # an earlier forward's values
    plan = np.full(PLAN_PAGES + 7, -7, dtype=np.int32)
    table = np.frombuffer(seq.page_ids, dtype=np.int32)
    ids = _run_ids(seq, start, start + n)
    pages = stage_selection(staged, plan, tokens, ids, start, table, candidate, scratch, PAGE)
    at = input_layout(tokens)
    pad = tokens - n
    reference = build_inputs([ScheduledSeq(seq, start, n)], PAGE)
    assert staged[at["input_ids"]].tolist() == reference.input_ids.tolist() + [0] * pad
    assert staged[at["input_ids"]][:n].tolist() == list(range(120, 150))
    assert staged[at["positions"]].tolist() == reference.positions.tolist() + [0] * pad
    assert np.flatnonzero(staged[at["candidate"]]).tolist() == [0, 5, 29]
    assert reference.layout.slot_mapping[0] == 3 * PAGE + 4  # position 20: page 1 (id 3)
    padded = reference.layout.slot_mapping.tolist() + [scratch * PAGE] * pad
    assert staged[at["slots"]].tolist() == padded
    # the planned row: 64 queries over 20 + 64 = 84 keys on 6 pages, the last holding 4
    fields = {name: plan[where].tolist() for name, where in PLAN_FIELDS.items()}
    assert fields == {
        "qo_indptr": [0, tokens],
        "kv_page_indptr": [0, 6],
        "kv_last_page_len": [84 - 5 * PAGE],
        "kv_len": [start + tokens],
    }
    assert padded_row_pages(start, tokens, PAGE) == 6
    # the real tokens' KV spans the sequence's 4 pages, the padding's the scratch page
    assert pages == 4 and plan[PLAN_PAGES : PLAN_PAGES + 6].tolist() == [7, 3, 9, 4, 99, 99]
    assert plan[PLAN_PAGES + 6] == -7  # nothing written past the row
    # the same bucket from the same start plans the same row, whatever n is
    again = np.full_like(plan, -7)
    stage_selection(staged, again, tokens, ids[:12], start, table, candidate[:12], scratch, PAGE)
    assert again[:PLAN_PAGES].tolist() == plan[:PLAN_PAGES].tolist()
    # a bucket's capture layout is its row from position 0: the plan a graph holds after
    # capture is the one stage_selection asks for at start 0 (SelectionGraphs skips it)
    from workers.engine.graphs.inputs import capture_layout

    for bucket in (64, 512, 520):
        captured = capture_layout(bucket, 1, scratch, PAGE)
        staged_plan = np.full(PLAN_PAGES + bucket // PAGE + 1, -7, dtype=np.int32)
        short = min(n, bucket)
        inputs = np.zeros(4 * bucket, dtype=np.int64)
        stage_selection(
            inputs, staged_plan, bucket, ids[:short], 0, table, candidate[:short], scratch, PAGE
        )
        assert {name: staged_plan[where].tolist() for name, where in PLAN_FIELDS.items()} == {
            "qo_indptr": captured.qo_indptr.tolist(),
            "kv_page_indptr": captured.kv_page_indptr.tolist(),
            "kv_last_page_len": captured.kv_last_page_len.tolist(),
            "kv_len": captured.kv_lens.tolist(),
        }
    # a run past the prompt (a resumed sequence's generated tokens) reads the token list
    seq.token_ids.extend([7, 8])
    assert _run_ids(seq, 45, 52).tolist() == [145, 146, 147, 148, 149, 7, 8]
