"""Naive placement (a measurement mode on the reuse seam): chunks computed alone
from position 0, copied to their offsets with keys rotated. Checked against plain
generation where it must be exact, and for taint where it cannot be."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkstore.events import EventKind
from workers.engine.approximate.naive import NaivePlacement
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import Sequence
from workers.engine.reuse import ExactPrefixReuse
from workers.engine.sampling_params import SamplingParams

PAGE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)


def _engine(model, **placement) -> Engine:
    config = EngineConfig(str(model), page_size=PAGE, num_pages=96, device="cpu")
    return Engine(config, reuse_factory=lambda e: NaivePlacement(e, **placement))


def _plain(model) -> Engine:
    return Engine(EngineConfig(str(model), page_size=PAGE, num_pages=96, device="cpu"))


def _run(engine: Engine, prompt: list[int], spans=()):
    rid = f"r{len(engine._sequences)}-{np.random.randint(1 << 30)}"
    engine.add_request(rid, prompt, GREEDY, placeable=tuple(spans))
    tokens, logprobs, reuse = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs.append(out.logprobs)
            reuse = out.reuse
    return tokens, logprobs, reuse


def _prompt(seed: int, vocab: int):
    """system (21) + three documents (37, 16, 29 tokens) + question (9)."""
    rng = np.random.default_rng(seed)
    sizes = [21, 37, 16, 29, 9]
    parts = [rng.integers(10, vocab - 1, size=n).tolist() for n in sizes]
    prompt = [t for p in parts for t in p]
    bounds = np.cumsum([0, *sizes])
    spans = [(int(bounds[i]), int(bounds[i + 1])) for i in (1, 2, 3)]
    return prompt, spans


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, model_factory):
    return model_factory(request.param)


def test_recomputing_every_placed_token_equals_plain_generation(model):
    """The limiting case: placement, scattered-position attention and repair wired
    right give plain generation's tokens and logprobs."""
    reference = _plain(model)
    full = _engine(model, recompute_first=10_000)
    for seed in (0, 1):
        prompt, spans = _prompt(seed, reference.model_config.vocab_size)
        want, want_lp, _ = _run(reference, prompt)
        got, got_lp, reuse = _run(full, prompt, spans)
        assert got == want
        for a, b in zip(got_lp, want_lp, strict=True):
            np.testing.assert_allclose([x[1] for x in a], [x[1] for x in b], atol=1e-4)
        placed = sum(e - s for s, e in spans)
        assert (reuse.mode, reuse.reused_tokens, reuse.recomputed_tokens) == (
            "naive_placement",
            placed,
            placed,
        )


def test_a_chunk_placed_at_the_start_is_exact_and_later_ones_are_not(model):
    """Alone at position 0 is what plain generation computes for a leading chunk;
    a chunk placed after others lacks their context, so its layers >= 1 differ."""
    naive, reference = _engine(model), _plain(model)
    prompt, spans = _prompt(3, reference.model_config.vocab_size)
    doc_start = spans[0][0]
    leading = prompt[doc_start:]  # the first document opens the prompt
    shifted = [(s - doc_start, e - doc_start) for s, e in spans[:1]]
    want, want_lp, _ = _run(reference, leading)
    got, got_lp, reuse = _run(naive, leading, shifted)
    assert got == want and reuse.reused_tokens == spans[0][1] - doc_start
    np.testing.assert_allclose([x[1] for x in got_lp[0]], [x[1] for x in want_lp[0]], atol=1e-4)

    _, full_lp, _ = _run(reference, prompt)
    _, naive_lp, reuse = _run(naive, prompt, spans)
    assert reuse.recomputed_tokens == 0
    first_full = torch.tensor([x[1] for x in full_lp[0]])
    first_naive = torch.tensor([x[1] for x in naive_lp[0]])
    assert not torch.allclose(first_full, first_naive, atol=1e-4)


def test_placed_pages_are_inexact_and_never_announced(model):
    naive = _engine(model)
    prompt, spans = _prompt(4, naive.model_config.vocab_size)
    naive.pool.drain_events()
    _run(naive, prompt, spans)
    stored = {k for e in naive.pool.drain_events() if e.kind is EventKind.STORED for k in e.keys}
    # A fresh exact-mode sequence over the same tokens matches only the exact pages.
    seq = Sequence("probe", 99, prompt + [5], GREEDY, naive.namespace())
    keys = seq.extend_page_keys(PAGE, len(prompt))
    first_placed = spans[0][0]
    exact_keys = set(keys[: first_placed // PAGE])
    assert stored == exact_keys  # only pages wholly before the first placed token
    assert ExactPrefixReuse(naive.pool).admit(seq)
    assert seq.num_computed == first_placed // PAGE * PAGE
    naive.pool.release(seq.page_ids)
