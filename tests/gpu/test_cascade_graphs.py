"""Cascade decode steps replayed from CUDA graphs give the logits of the eager cascade
step and of a flat decode step, for batches that fill a captured size and batches that
are padded, with two and three levels and rows that share nothing (flat rows)."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from tests.gpu.test_engine_gpu import _record
from workers import LLM, SamplingParams
from workers.engine.model_runner import build_inputs
from workers.engine.request import Sequence
from workers.engine.scheduler import ScheduledSeq

PAGE = 16


def _batch(groups: list[tuple[int, int, int]], loners: int, rng: random.Random):
    """Decode rows: for each (rows, shared pages, subgroups), ``rows`` requests that
    share ``shared`` pages, then (with subgroups > 1) one of ``subgroups`` further
    4-page runs; then ``loners`` requests that share nothing; each row has 1-4 own
    pages with a partial last page."""
    items, next_page = [], 0

    def pages(n: int) -> list[int]:
        nonlocal next_page
        next_page += n
        return list(range(next_page - n, next_page))

    lists = []
    for rows, shared, subgroups in groups:
        prefix = pages(shared)
        further = [pages(4) for _ in range(subgroups)] if subgroups > 1 else [[]]
        lists += [
            prefix + further[i % len(further)] + pages(rng.randint(1, 4)) for i in range(rows)
        ]
    lists += [pages(rng.randint(1, 6)) for _ in range(loners)]
    rng.shuffle(lists)
    for i, page_list in enumerate(lists):
        kv_len = (len(page_list) - 1) * PAGE + rng.randint(1, PAGE)
        seq = Sequence(
            f"r{i}", i, [rng.randrange(10, 1000) for _ in range(kv_len)], SamplingParams(), None
        )
        seq.page_ids = array("i", page_list)
        seq.num_computed = kv_len - 1
        items.append(ScheduledSeq(seq, kv_len - 1, 1))
    return items


@pytest.fixture(scope="module")
def runner(qwen3_06b):
    llm = LLM(qwen3_06b, page_size=PAGE, num_pages=4096, enable_reuse=False, max_num_seqs=64)
    runner = llm.engine.runner
    torch.manual_seed(0)
    for cache in runner.kv_caches:
        cache.normal_(std=0.5)
    runner.backend.min_saved_tokens = 0  # cascade on every shared step
    return runner


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize(
    "name, groups, loners, levels",
    [
        ("16 rows, one group, 2 levels (a captured size)", [(16, 40, 1)], 0, 2),
        ("37 rows, 3 levels and loners (padded to 64)", [(20, 30, 3), (12, 50, 1)], 5, 3),
        ("9 rows, 2 levels and a loner (padded to 16)", [(8, 64, 1)], 1, 2),
    ],
)
def test_cascade_graph_matches_eager_cascade_and_flat(runner, name, groups, loners, levels):
    items = _batch(groups, loners, random.Random(len(name)))
    layout = build_inputs(items, PAGE).layout
    backend, graphs = runner.backend, runner.graphs
    plan = backend.cascade_plan(layout)
    assert plan is not None and len(plan.levels) == levels
    assert graphs.graph_for(layout) == "cascade"
    replayed = runner.run(items)
    assert backend.last_plan_kind == "cascade"
    runner.graphs = None
    try:
        eager = runner.run(items)
        assert backend.last_plan_kind == "cascade"
        backend.enable_cascade = False
        flat = runner.run(items)
        assert backend.last_plan_kind == "decode"
    finally:
        runner.graphs, backend.enable_cascade = graphs, True
    errors = {
        "graph_vs_eager_cascade": _rel(replayed, eager),
        "graph_vs_flat": _rel(replayed, flat),
        "eager_cascade_vs_flat": _rel(eager, flat),
        "argmax_equal_graph_flat": (replayed.argmax(-1) == flat.argmax(-1)).float().mean().item(),
    }
    _record("cascade_graph", {"case": name, **errors})
    # Padding rows, row order or a level's entries laid out wrong would put whole rows
    # off by O(1); a correct graph is as close to flat decode as the eager cascade is.
    assert errors["graph_vs_flat"] <= max(1e-2, 2 * errors["eager_cascade_vs_flat"]), errors
    assert errors["graph_vs_eager_cascade"] <= max(1e-2, 2 * errors["eager_cascade_vs_flat"]), (
        errors
    )
