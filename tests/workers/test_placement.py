"""Placement primitives (docs/design.md, "Approximate reuse", items 1-2): a chunk computed
alone at position 0, keys rotated by p, equals the chunk computed alone at p.

The reference is transformers on the same checkpoint (float32, CPU); our side is the
engine's model writing the chunk's KV into its paged cache.

Tolerances: computing the chunk at p evaluates cos((p + x) f) while placement
composes cos(p f) with cos(x f); each rounds the float32 angle product, so the two
differ by about (p + x) * 2**-24 radians at worst. Allowed: 1e-5 plus that angle
error (doubled) times the largest key magnitude.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest
import torch

from chunkstore.hashing import Namespace
from workers import LLM, SamplingParams
from workers.engine.approximate.placement import place_chunk, rope_supports_placement, rotate_keys
from workers.engine.model_runner import build_inputs
from workers.engine.models.config import ModelConfig
from workers.engine.request import Sequence
from workers.engine.scheduler import ScheduledSeq

DOC_LEN = 37
PAGE_SIZE = 16
POSITIONS = (1, 16, 200, 1000)  # 1 and 200 are not page-aligned
BASE_TOL = 1e-5


def tolerance(p: int, scale: float) -> float:
    return BASE_TOL + 2 * 2**-24 * (p + DOC_LEN) * scale


@dataclass
class Doc:
    llm: LLM
    tokens: list[int]
    slots: torch.Tensor  # where the engine wrote the chunk computed alone at 0
    ours: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [n, H, D]


def prefill_alone(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """Runs the chunk alone at positions 0..n-1 through the engine's model; returns
    the slots its KV went to (pages stay allocated)."""
    engine, runner = llm.engine, llm.engine.runner
    seq = Sequence("doc", 0, tokens, SamplingParams(), Namespace("placement"))
    seq.page_ids = engine.pool.allocate(-(-len(tokens) // PAGE_SIZE))
    inputs = build_inputs([ScheduledSeq(seq, 0, len(tokens))], PAGE_SIZE)
    with torch.inference_mode():
        runner.model(
            inputs.input_ids.to(runner.device),
            inputs.positions.to(runner.device),
            runner.kv_caches,
            runner.backend,
            runner.backend.plan(inputs.layout),
        )
    return inputs.layout.slot_mapping.long()


def read_slots(kv_caches, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    return [(kv[pages, 0, offsets].clone(), kv[pages, 1, offsets].clone()) for kv in kv_caches]


@torch.no_grad()
def hf_kv(model, tokens: list[int], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The chunk computed alone at positions start..start+n-1 by transformers: per
    layer (keys, values) [n, kv_heads, head_dim], keys rotated."""
    n = len(tokens)
    out = model(
        torch.tensor([tokens]), position_ids=torch.arange(start, start + n)[None], use_cache=True
    )
    return [
        (layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1))
        for layer in out.past_key_values.layers
    ]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def doc(request, model_factory) -> Doc:
    llm = LLM(model_factory(request.param), page_size=PAGE_SIZE, num_pages=16)
    config = llm.engine.model_config
    if request.param == "llama":  # the tiny preset's llama3 scaling matters at test lengths
        assert config.rope_scaling is not None
        assert config.rope_scaling.original_max_position_embeddings < max(POSITIONS)
    tokens = random.Random(5).choices(range(10, config.vocab_size), k=DOC_LEN)
    slots = prefill_alone(llm, tokens)
    return Doc(llm, tokens, slots, read_slots(llm.engine.runner.kv_caches, slots))


def test_rotated_chunk_equals_chunk_computed_at_p(doc, hf_reference, model_factory):
    family = doc.llm.engine.model_config.family
    ref = hf_reference(model_factory(family))
    rope = doc.llm.engine.runner.model.rope_cache
    at_zero = hf_kv(ref, doc.tokens, 0)
    for (k_ours, v_ours), (k0, v0) in zip(doc.ours, at_zero, strict=True):
        assert max_diff(k_ours, k0) <= BASE_TOL  # our model agrees with the reference at 0
        assert max_diff(v_ours, v0) <= BASE_TOL
    for p in POSITIONS:
        at_p = hf_kv(ref, doc.tokens, p)
        for layer, ((k_ours, _), (k0, v0), (kp, vp)) in enumerate(
            zip(doc.ours, at_zero, at_p, strict=True)
        ):
            tol = tolerance(p, kp.abs().max().item())
            ours = max_diff(rotate_keys(k_ours, p, rope), kp)
            pure = max_diff(rotate_keys(k0, p, rope), kp)
            # Position invariance of a chunk alone: values (and un-rotated keys) of every
            # layer, not only the first, are the same at 0 and at p.
            values = max_diff(v0, vp)
            for what, diff in (("ours", ours), ("pure", pure), ("values", values)):
                assert diff <= tol, f"layer {layer}, p={p}: {what} differs by {diff:.2e}"
            if layer == 0:
                assert values == 0.0  # layer 0 values depend on the token alone
            assert max_diff(rotate_keys(kp, -p, rope), k0) <= tol  # and back


def test_place_chunk_unaligned_across_pages(doc, hf_reference, model_factory):
    llm = doc.llm
    kv_caches = llm.engine.runner.kv_caches
    rope = llm.engine.runner.model.rope_cache
    p = 21  # mid-page: rows land in three pages
    pages = llm.engine.pool.allocate(4)
    table = torch.tensor(pages[::-1])  # a request's pages need not be in order
    positions = torch.arange(p, p + DOC_LEN)
    dst = table[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    for kv in kv_caches:
        kv.normal_()  # garbage everywhere except the entry's rows
    for kv, (k, v) in zip(kv_caches, doc.ours, strict=True):
        kv[doc.slots // PAGE_SIZE, 0, doc.slots % PAGE_SIZE] = k
        kv[doc.slots // PAGE_SIZE, 1, doc.slots % PAGE_SIZE] = v
    before = [kv.clone() for kv in kv_caches]

    place_chunk(kv_caches, doc.slots, dst, p, rope, PAGE_SIZE)

    ref = hf_reference(model_factory(llm.engine.model_config.family))
    placed = read_slots(kv_caches, dst)
    for (k, v), (kp, vp), (k_ours, v_ours) in zip(
        placed, hf_kv(ref, doc.tokens, p), doc.ours, strict=True
    ):
        assert max_diff(k, kp) <= tolerance(p, kp.abs().max().item())
        assert torch.equal(k, rotate_keys(k_ours, p, rope))
        assert torch.equal(v, v_ours)  # values copied bit for bit
        assert max_diff(v, vp) <= tolerance(p, vp.abs().max().item())
    untouched = torch.ones(before[0].shape[:3], dtype=torch.bool)
    untouched[dst // PAGE_SIZE, :, dst % PAGE_SIZE] = False
    for kv, old in zip(kv_caches, before, strict=True):
        assert torch.equal(kv[untouched], old[untouched])

    # Rows given directly (e.g. from host memory) place identically.
    rows = [torch.stack((k, v), dim=1) for k, v in doc.ours]
    again = [kv.clone() for kv in before]
    place_chunk(again, rows, dst, p, rope, PAGE_SIZE)
    for kv, ref_kv in zip(again, kv_caches, strict=True):
        assert torch.equal(kv, ref_kv)
    llm.engine.pool.release(pages)


def test_place_chunk_overlapping_and_per_row_delta():
    torch.manual_seed(0)
    rope = torch.randn(64, 8)  # any table: only consistency is checked here
    caches = [torch.randn(5, 2, 4, 2, 8) for _ in range(2)]
    src = torch.arange(3, 13)
    dst = src + 2  # shifts within the same pages: sources overlap destinations
    delta = torch.arange(10)  # one shift per row
    expected = [kv.clone() for kv in caches]
    keys = [kv[src // 4, 0, src % 4].clone() for kv in caches]
    values = [kv[src // 4, 1, src % 4].clone() for kv in caches]
    for kv, k, v in zip(expected, keys, values, strict=True):
        kv[dst // 4, 0, dst % 4] = rotate_keys(k, delta, rope)
        kv[dst // 4, 1, dst % 4] = v
    place_chunk(caches, src, dst, delta, rope, 4)
    for kv, exp in zip(caches, expected, strict=True):
        assert torch.equal(kv, exp)
    for i in range(10):  # per-row delta equals rotating each row by its own int
        assert torch.equal(rotate_keys(keys[0], delta, rope)[i], rotate_keys(keys[0], i, rope)[i])
    with pytest.raises(ValueError, match="row 64"):
        rotate_keys(keys[0], 64, rope)


def test_rope_supports_placement(model_factory):
    qwen3, llama = model_factory("qwen3"), model_factory("llama")
    assert rope_supports_placement(ModelConfig.from_dir(qwen3)) is None
    llama_config = ModelConfig.from_dir(llama)
    assert llama_config.rope_scaling is not None  # llama3 scaling: still pure rotations
    assert rope_supports_placement(llama_config) is None
    raw = json.loads((llama / "config.json").read_text())
    assert rope_supports_placement(raw) is None

    yarn = {**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert "rope_scaling.rope_type 'yarn'" in rope_supports_placement(yarn)
    dynamic = {**raw, "rope_scaling": None, "rope_parameters": {"rope_type": "dynamic"}}
    assert "rope_parameters.rope_type 'dynamic'" in rope_supports_placement(dynamic)
    partial = {**raw, "rope_scaling": None, "rope_parameters": {"rope_type": "default"}}
    partial["partial_rotary_factor"] = 0.5
    assert "partial_rotary_factor" in rope_supports_placement(partial)


def test_placing_into_the_stacked_cache_equals_placing_layer_by_layer():
    """All layers at once (the runner's kv_stack) writes what the per-layer path
    writes, per-row rotations included, and nothing else."""
    from workers.engine.approximate.placement import place_chunk
    from workers.engine.layers.rotary import cos_sin_cache

    torch.manual_seed(0)
    layers, pages, page_size, heads, dim = 3, 12, 16, 2, 8
    stack = torch.randn(layers, pages, 2, page_size, heads, dim)
    per_layer = [layer.clone() for layer in stack]
    table = cos_sin_cache(dim, 10000.0, None, 4096)
    src = torch.arange(5, 45)
    dst = torch.arange(70, 110)
    delta = torch.cat((torch.full((20,), 65), torch.full((20,), 300)))
    place_chunk(per_layer, src, dst, delta, table, page_size)
    place_chunk(stack, src, dst, delta, table, page_size)
    for layer in range(layers):
        assert torch.equal(stack[layer], per_layer[layer])


def test_placing_spans_from_a_layer_leaves_the_layers_below_it():
    """place_spans with first_layer (two spans with unaligned starts, across page
    boundaries): the layers from it on hold what a placement of every layer writes
    there, and the layers below it keep their old contents, bit for bit."""
    from workers.engine.approximate.placement import place_spans
    from workers.engine.layers.rotary import cos_sin_cache

    torch.manual_seed(0)
    layers, pages, page_size, heads, dim = 4, 24, 16, 2, 8
    stack = torch.randn(layers, pages, 2, page_size, heads, dim)
    table = cos_sin_cache(dim, 10000.0, None, 4096)
    sequence = list(range(12, 20))  # the sequence's pages; entries are pages 0-7
    spans = [(5, 30, [0, 1]), (30, 70, [2, 3, 4])]  # unaligned starts
    every, upper = stack.clone(), stack.clone()
    place_spans(every, table, sequence, spans, page_size)
    place_spans(upper, table, sequence, spans, page_size, first_layer=2)
    assert not torch.equal(every[:2], stack[:2])  # the full placement wrote there
    assert torch.equal(upper[:2], stack[:2])
    assert torch.equal(upper[2:], every[2:])
