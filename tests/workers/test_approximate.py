"""Approximate reuse in the engine: position-free entries taken or filled on a miss, placed
wherever their chunk appears, repaired; exact where the limiting case promises it,
tainted and labelled everywhere else."""

from __future__ import annotations

import json
import shutil
from array import array

import numpy as np
import pytest
import torch

from chunkstore.chunking import chunk_conversation, placeable_spans
from chunkstore.events import EventKind
from chunkstore.hashing import position_free_key
from workers import LLM
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, resolve_deviation_layer
from workers.engine.request import Sequence
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq

PAGE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
DOCS = (37, 48, 33)  # document lengths: all at least min_entry_tokens
APPROX = ReuseRequest("approximate", first_tokens=4, deviation_ratio=0.0)


def _engine(model, **overrides) -> Engine:
    config = dict(page_size=PAGE, num_pages=160, device="cpu", min_entry_tokens=32)
    return Engine(EngineConfig(str(model), **{**config, **overrides}))


def _run(engine: Engine, prompt, spans=(), reuse=None):
    rid = f"r{np.random.randint(1 << 40)}"
    engine.add_request(rid, prompt, GREEDY, placeable=tuple(spans), reuse=reuse)
    tokens, logprobs, info = [], [], None
    while engine.has_unfinished():  # also runs queued entry fills to completion
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            logprobs.append([lp for _, lp in out.logprobs])
            info = out.reuse
    return tokens, np.array(logprobs), info


def _layout(system, docs, question):
    """Prompt tokens and the documents' spans."""
    prompt, spans = list(system), []
    for doc in docs:
        spans.append((len(prompt), len(prompt) + len(doc)))
        prompt += doc
    return prompt + list(question), spans


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, model_factory):
    return model_factory(request.param)


@pytest.fixture(scope="module")
def parts(model):
    vocab = _engine(model).model_config.vocab_size
    rng = np.random.default_rng(7)
    draw = lambda n: rng.integers(10, vocab - 1, size=n).tolist()  # noqa: E731
    return {
        "systems": [draw(23), draw(41)],
        "docs": [draw(n) for n in DOCS],
        "question": draw(9),
    }


def _warm(engine, parts):
    """A first request misses every entry; its chunks become entries."""
    prompt, spans = _layout(parts["systems"][0], parts["docs"], parts["question"])
    _, _, info = _run(engine, prompt, spans, APPROX)
    assert (info.mode, info.reused_tokens, info.recomputed_tokens) == ("approximate", 0, 0)
    for doc in parts["docs"]:
        assert engine.pool.entry(position_free_key(engine.namespace(), doc)) is not None


def test_recomputing_every_placed_token_equals_plain_generation(model, parts):
    """The limiting case (first_tokens >= every chunk) is token-exact: placement,
    attention by position and repair are wired right. Also via deviation_ratio 1."""
    engine, plain = _engine(model), _engine(model, enable_reuse=False)
    _warm(engine, parts)
    repairs = (ReuseRequest("approximate", 10_000), ReuseRequest("approximate", 0, 1.0))
    system_pages = len(parts["systems"][1]) // PAGE * PAGE
    # the second request matches the first one's (exact) system prompt pages
    for order, repair, matched in zip(
        [(2, 0, 1), (1, 2, 0)], repairs, [0, system_pages], strict=True
    ):
        # another order after another system prompt: nothing matches exactly (a fully
        # repaired request's pages are exact, so each repair gets its own order)
        docs = [parts["docs"][i] for i in order]
        prompt, spans = _layout(parts["systems"][1], docs, parts["question"])
        want, want_lp, info = _run(plain, prompt)
        assert info.mode == "off"
        got, got_lp, info = _run(engine, prompt, spans, repair)
        assert got == want
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
        placed = sum(DOCS)
        assert (info.mode, info.reused_tokens, info.recomputed_tokens) == (
            "approximate",
            matched + placed,
            placed,
        )
        # nothing placed is left: every full page is exact, published for exact requests
        _, _, info = _run(engine, prompt, spans, ReuseRequest("exact"))
        assert info.reused_tokens == (len(prompt) - 1) // PAGE * PAGE


def test_a_taken_entry_is_its_chunk_as_computed_in_context(model, parts):
    """A first sight's entries are the KV its request computed, moved to position 0:
    placed back where they were computed (same offsets, same chunks before them),
    with nothing recomputed, the request equals plain generation (CPU float32). The
    copy is the entry's own pages: the first request's pages are free afterwards."""
    engine, plain = _engine(model), _engine(model, enable_reuse=False)
    prompt, spans = _layout(parts["systems"][0], parts["docs"], parts["question"])
    want, want_lp, _ = _run(plain, prompt)
    _warm(engine, parts)
    assert engine.tally.entries_taken == len(DOCS) and engine.tally.fills_queued == 0
    entry_pages = sum(-(-n // PAGE) for n in DOCS)
    engine.pool.evict(range(engine.pool.num_pages))  # the exact pages: placement only
    assert engine.pool.occupancy() == (0, len(DOCS), entry_pages)
    nothing = ReuseRequest("approximate", first_tokens=0, deviation_ratio=0.0)
    got, got_lp, info = _run(engine, prompt, spans, nothing)
    assert (info.reused_tokens, info.recomputed_tokens) == (sum(DOCS), 0)
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)


def test_an_entry_is_its_chunk_computed_after_the_entry_context(model, parts):
    """Entries are computed after the engine's entry context (a system turn and the
    opening of a user turn), then moved to start at position 0. Placed right after
    that same context, with nothing recomputed, the chunk's KV is exactly what a plain
    pass computes there: the request equals plain generation (CPU float32). (Only the
    first chunk after the context: a second one would not have seen the first.)"""
    engine, plain = _engine(model), _engine(model, enable_reuse=False)
    context = list(engine.entry_context)
    assert 0 < len(context) < 64  # the default system turn, e.g. 19 tokens on Qwen3
    for doc in parts["docs"]:
        engine.fill_entry(doc)
    while engine.has_unfinished():
        engine.step()
    for doc in parts["docs"]:
        entry = engine.pool.entry(position_free_key(engine.namespace(), doc))
        assert entry is not None and entry.num_tokens == len(doc)
        assert len(entry.pages) == -(-len(doc) // PAGE)  # the context's pages went back
    assert engine.pool.num_available == 160  # nothing leaked
    for doc in parts["docs"]:
        prompt, spans = _layout(context, [doc], parts["question"])
        want, want_lp, _ = _run(plain, prompt)
        nothing = ReuseRequest("approximate", first_tokens=0, deviation_ratio=0.0)
        got, got_lp, info = _run(engine, prompt, spans, nothing)
        # reused: the chunk, plus the context's full pages matched exactly once cached
        assert info.recomputed_tokens == 0
        assert info.reused_tokens - len(doc) in (0, len(context) // PAGE * PAGE)
        assert got == want
        np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)


def test_entries_without_a_context_start_at_position_0(model, parts):
    """``entry_system_prompt=None``: entries are computed alone (the older form),
    which placed after a system turn is no longer exact."""
    engine = _engine(model, entry_system_prompt=None)
    plain = _engine(model, enable_reuse=False)
    assert engine.entry_context == ()
    doc = parts["docs"][0]
    engine.fill_entry(doc)
    while engine.has_unfinished():
        engine.step()
    system = list(_engine(model).entry_context)
    prompt, spans = _layout(system, [doc], parts["question"])
    _, want_lp, _ = _run(plain, prompt)
    _, got_lp, info = _run(engine, prompt, spans, ReuseRequest("approximate", 0, 0.0))
    assert info.reused_tokens == len(doc)
    assert np.abs(got_lp - want_lp).max() > 1e-3


def test_placed_chunks_are_labelled_tainted_and_never_served_to_exact_requests(model, parts):
    engine, plain = _engine(model), _engine(model, enable_reuse=False)
    _warm(engine, parts)
    engine.pool.drain_events()
    docs = [parts["docs"][i] for i in (1, 2, 0)]
    prompt, spans = _layout(parts["systems"][1], docs, parts["question"])
    _, approx_lp, info = _run(engine, prompt, spans, APPROX)
    assert info.mode == "approximate"
    assert info.reused_tokens == sum(DOCS)
    assert info.recomputed_tokens == 4 * len(DOCS)
    stored = [k for e in engine.pool.drain_events() if e.kind is EventKind.STORED for k in e.keys]
    exact_pages = spans[0][0] + 4  # positions before the first placed, unrepaired token
    assert len(stored) == exact_pages // PAGE

    # The same prompt asked exactly: plain generation's output, no placed KV.
    want, want_lp, _ = _run(plain, prompt)
    got, got_lp, info = _run(engine, prompt, spans, ReuseRequest("exact"))
    assert got == want and info.mode == "exact" and info.recomputed_tokens == 0
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
    assert info.reused_tokens == exact_pages // PAGE * PAGE
    assert not np.allclose(approx_lp[0], want_lp[0], atol=1e-4)  # approximation is real


def test_deviation_ratio_recomputes_the_most_deviating_share(model, parts):
    engine = _engine(model)
    _warm(engine, parts)
    prompt, spans = _layout(parts["systems"][1], parts["docs"], parts["question"])
    _, _, info = _run(engine, prompt, spans, ReuseRequest("approximate", 2, 0.25))
    placed = sum(DOCS)
    assert info.recomputed_tokens == 2 * len(DOCS) + round(0.25 * placed)


def test_selection_finds_the_deviating_tokens_on_the_device(model, parts):
    """``repair_selecting`` over a prompt whose KV is right except at some positions
    (noise at every layer), told that every position is placed and to keep as many as
    are noisy: it picks exactly those at the selection layer (their K/V deviate most)
    and restores the KV of one plain pass."""
    engine = _engine(model, enable_reuse=False)
    runner, page = engine.runner, PAGE
    tokens = [t for doc in parts["docs"] for t in doc]
    seq = Sequence("selecting", 0, tokens, GREEDY, engine.namespace())
    seq.page_ids = array("i", engine.pool.allocate(-(-len(tokens) // page)))
    runner.run([ScheduledSeq(seq, 0, len(tokens))])
    pages = torch.tensor(seq.page_ids, dtype=torch.long)[torch.arange(len(tokens)) // page]
    offsets = torch.arange(len(tokens)) % page
    plain = [cache[pages, :, offsets].clone() for cache in runner.kv_caches]
    noisy = torch.from_numpy(np.random.default_rng(2).choice(len(tokens), 13, replace=False))
    for cache in runner.kv_caches:
        cache[pages[noisy], :, offsets[noisy]] = 5 * torch.randn(cache[:13, :, 0].shape)
    candidates = np.arange(len(tokens))
    runner.repair_selecting(seq, 0, len(tokens), candidates, len(noisy), engine.deviation_layer)
    for layer, cache in enumerate(runner.kv_caches):
        torch.testing.assert_close(cache[pages, :, offsets], plain[layer], atol=1e-5, rtol=1e-5)
    assert runner.take_aside().tokens == len(noisy) and runner.take_aside() is None


def _steps_until_first_token(engine, rid, prompt, spans, reuse):
    """(model runs the admitting step made, its outputs)."""
    runs, run = [], engine.runner.run
    engine.runner.run = lambda batch, *carried: runs.append(batch) or run(batch, *carried)
    try:
        engine.add_request(rid, prompt, GREEDY, placeable=tuple(spans), reuse=reuse)
        return runs, engine.step()
    finally:
        engine.runner.run = run


def test_admission_forward_computes_the_question_and_yields_the_first_token(model, parts):
    """With a deviation ratio, admission's one forward runs through the question too:
    the step that admits the request samples its first token with no model step of
    its own. A tail over a step's token budget is computed in steps instead; both
    answer alike, and alike beside a sequence that is decoding."""
    repair = ReuseRequest("approximate", 0, 0.25)
    prompt, spans = _layout(parts["systems"][1], parts["docs"], parts["question"])
    answers = {}
    for budget in (8192, len(parts["question"]) - 1):
        engine = _engine(model, max_num_batched_tokens=budget)
        _warm(engine, parts)
        runs, outs = _steps_until_first_token(engine, "q", prompt, spans, repair)
        if budget == 8192:
            assert not runs and [o.request_id for o in outs] == ["q"]
            assert engine.last_resolved_steps[0][0] == "admission forward"
            assert engine._sequences["q"].approx.ready_logits is None  # taken by the step
        else:  # the forward leaves no room for the question: it comes in later steps
            assert not outs
        tokens, logprobs = [], []
        while engine.has_unfinished():
            outs += engine.step()
        for out in outs:
            tokens += out.new_token_ids
            logprobs.append([lp for _, lp in out.logprobs])
        answers[budget] = tokens, np.array(logprobs)
    (want, want_lp), (got, got_lp) = answers.values()
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
    # admitted beside a decoding sequence and before a prefilling one: one step samples
    # all three, each from its own logits
    engine = _engine(model)
    _warm(engine, parts)
    other, third = parts["systems"][0] + parts["question"], parts["systems"][1][:20]
    engine.add_request("other", other, GREEDY)
    first = engine.step()
    engine.add_request("q", prompt, GREEDY, placeable=tuple(spans), reuse=repair)
    engine.add_request("third", third, GREEDY)
    runs, run = [], engine.runner.run
    engine.runner.run = lambda batch, *c: runs.append(batch) or run(batch, *c)
    outs = engine.step()
    engine.runner.run = run
    assert [[item.seq.request_id for item in batch] for batch in runs] == [["other", "third"]]
    assert sorted(o.request_id for o in outs) == ["other", "q", "third"]
    tokens = {"other": list(first[0].new_token_ids), "q": [], "third": []}
    while engine.has_unfinished():
        outs += engine.step()
    for out in outs:
        tokens[out.request_id] += out.new_token_ids
    assert tokens["q"] == want
    for rid, alone in (("other", other), ("third", third)):
        assert tokens[rid] == _run(_engine(model), alone)[0]


def test_admission_forwards_count_in_the_step_budget(model, parts):
    """What an admission forward computes past the selection layer (its kept rows and
    the question) counts in the admitting step's token budget: a burst of approximate
    requests is admitted a budget's worth per step, and a forward whose tail does not
    fit what is left leaves the tail to the next steps."""
    repair = ReuseRequest("approximate", 0, 0.25)
    rng = np.random.default_rng(11)
    # system prompts of one length, none a prefix of another: every forward alike
    prompts = [
        _layout(rng.integers(10, 500, size=41).tolist(), parts["docs"], parts["question"])
        for _ in range(5)
    ]
    engine = _engine(model)
    _warm(engine, parts)
    prompt, spans = prompts[4]
    engine.add_request("one", prompt, GREEDY, placeable=tuple(spans), reuse=repair)
    assert [o.request_id for o in engine.step()] == ["one"]
    rows = engine.last_step_prompt_tokens  # one forward's rows, question included
    assert rows > len(parts["question"])
    for budget, first_tokens in ((2 * rows, ["q0", "q1"]), (2 * rows - 1, ["q0"])):
        engine = _engine(model, max_num_batched_tokens=budget)
        _warm(engine, parts)
        for i, (prompt, spans) in enumerate(prompts[:4]):
            engine.add_request(f"q{i}", prompt, GREEDY, placeable=tuple(spans), reuse=repair)
        assert sorted(o.request_id for o in engine.step()) == first_tokens
        # with one token too few, q1's forward stops before the question and the step
        # takes all but its last token; nothing after q1 is admitted in this step
        assert [seq.request_id for seq in engine.scheduler.waiting] == ["q2", "q3"]
        assert engine.last_step_prompt_tokens == budget


def test_admissions_of_one_step_select_in_one_forward_and_answer_as_alone(model, parts):
    """Approximate requests admitted in one step run their selection forwards as one
    (``ChunkReuse.flush``, ``ModelRunner.repair_selecting_batch``): each sequence keeps
    its own most deviating rows and attends over its own KV, so every answer, and its
    log-probabilities, are what the request gets admitted alone."""
    repair = ReuseRequest("approximate", 0, 0.25)
    rng = np.random.default_rng(5)
    docs = parts["docs"]
    prompts = [
        _layout(rng.integers(10, 500, size=20 + 7 * i).tolist(), docs[i % 3 :] + docs[: i % 3],
                parts["question"])
        for i in range(4)
    ]  # fmt: skip
    alone = []
    for prompt, spans in prompts:
        engine = _engine(model)
        _warm(engine, parts)
        alone.append(_run(engine, prompt, spans, repair)[:2])
    engine = _engine(model)
    _warm(engine, parts)
    sizes, batch = [], engine.runner.repair_selecting_batch
    engine.runner.repair_selecting_batch = lambda s, layer: sizes.append(len(s)) or batch(s, layer)
    for i, (prompt, spans) in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, GREEDY, placeable=tuple(spans), reuse=repair)
    tokens = {f"q{i}": [] for i in range(4)}
    logprobs = {f"q{i}": [] for i in range(4)}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id].append([lp for _, lp in out.logprobs])
    assert sizes == [4]
    for i, (want, want_lp) in enumerate(alone):
        assert tokens[f"q{i}"] == want
        np.testing.assert_allclose(np.array(logprobs[f"q{i}"]), want_lp, atol=1e-4)


def test_deviation_layer_defaults_to_layer_3_within_the_model():
    assert resolve_deviation_layer(None, 28) == 3
    assert resolve_deviation_layer(None, 2) == 1  # a shallower model: its last layer
    assert resolve_deviation_layer(5, 8) == 5
    with pytest.raises(ValueError, match=r"deviation_layer 8 is not a layer .*1 to 7"):
        resolve_deviation_layer(8, 8)
    with pytest.raises(ValueError, match="deviation_layer must be >= 1"):
        EngineConfig("unused", deviation_layer=0)


def _kv(engine, seq, layer, positions) -> np.ndarray:
    """The K and V rows a sequence's pages hold at ``positions`` of ``layer``."""
    pages = np.asarray(seq.page_ids)[positions // PAGE]
    return engine.runner.kv_caches[layer][pages, :, positions % PAGE].numpy()


def _filled_layout(engines: list[Engine], seed: int):
    """Documents of ``DOCS`` lengths filled as entries in each of ``engines``, and a
    prompt placing them after a fresh system prompt: ``(prompt, spans, docs,
    question, draw)``, ``draw(n)`` giving n more random tokens."""
    vocab = engines[0].model_config.vocab_size
    rng = np.random.default_rng(seed)
    draw = lambda n: rng.integers(10, vocab - 1, size=n).tolist()  # noqa: E731
    docs, question = [draw(n) for n in DOCS], draw(9)
    for engine in engines:
        for doc in docs:
            engine.fill_entry(doc)
        while engine.has_unfinished():
            engine.step()
    prompt, spans = _layout(draw(29), docs, question)
    return prompt, spans, docs, question, draw


def test_selecting_at_a_deeper_layer_keeps_in_context_kv_below_it(model_factory):
    """With ``deviation_layer`` L, the layers below L of every placed token hold the KV
    this context gives (what plain prefill computes there); layer L and above of the
    tokens not selected hold the placed KV. And the limiting case (ratio 1) is still
    plain generation."""
    model = model_factory("qwen3", num_hidden_layers=4)
    engine = _engine(model, deviation_layer=2)
    plain = _engine(model, enable_reuse=False)
    assert engine.reuse.deviation_layer == 2
    prompt, spans, docs, question, draw = _filled_layout([engine], seed=3)
    two_steps = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request(
        "approx",
        prompt,
        two_steps,
        placeable=tuple(spans),
        reuse=ReuseRequest("approximate", 0, 0.1),
    )
    plain.add_request("plain", prompt, two_steps)
    # admitted and prefilled, not yet finished: the pages are still the sequence's
    approx_seq, plain_seq = engine._sequences["approx"], plain._sequences["plain"]
    engine.step(), plain.step()
    assert approx_seq.num_output_tokens == plain_seq.num_output_tokens == 1
    placed = np.concatenate([np.arange(s, e) for s, e in spans])
    in_context = {}
    for layer in range(4):
        ours, theirs = _kv(engine, approx_seq, layer, placed), _kv(plain, plain_seq, layer, placed)
        in_context[layer] = np.abs(ours - theirs).reshape(len(placed), -1).max(1) < 1e-4
    # below the selection layer every placed token; at it, the selected ones (their
    # input is in context; above it, what they attend to is partly placed)
    assert in_context[0].all() and in_context[1].all()
    assert in_context[2].sum() == round(0.1 * len(placed))
    assert not in_context[3][~in_context[2]].any()  # the others: placed KV
    while engine.has_unfinished() or plain.has_unfinished():
        engine.step(), plain.step()
    # the limiting case: every placed token recomputed gives plain generation
    order = [docs[i] for i in (2, 0, 1)]
    prompt, spans = _layout(draw(31), order, question)
    want, want_lp, _ = _run(plain, prompt)
    got, got_lp, info = _run(engine, prompt, spans, ReuseRequest("approximate", 0, 1.0))
    assert got == want and info.recomputed_tokens == sum(DOCS)
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)


def test_low_layers_from_entries_keep_in_context_kv_only_where_recomputed(model_factory):
    """With ``placed_low_layers`` ``entries``, a placed token the selection does not
    recompute holds its entry's KV in every layer, below the selection layer too (as
    placement alone gives); a recomputed one holds this context's KV below it (as plain
    prefill gives)."""
    model = model_factory("qwen3", num_hidden_layers=4)
    entries = _engine(model, deviation_layer=2, placed_low_layers="entries")
    placed_only = _engine(model, deviation_layer=2)
    plain = _engine(model, enable_reuse=False)
    prompt, spans, _, _, _ = _filled_layout([entries, placed_only], seed=5)
    two_steps = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    runs = {
        "entries": (entries, ReuseRequest("approximate", 0, 0.1)),
        "placed": (placed_only, ReuseRequest("approximate", 0, 0.0)),
        "plain": (plain, None),
    }
    seqs = {}
    for name, (engine, reuse) in runs.items():
        if reuse is None:
            engine.add_request(name, prompt, two_steps)
        else:
            engine.add_request(name, prompt, two_steps, placeable=tuple(spans), reuse=reuse)
        seqs[name] = engine._sequences[name]
        engine.step()  # admitted and prefilled: the pages are still the sequence's
        assert seqs[name].num_output_tokens == 1
    placed = np.concatenate([np.arange(s, e) for s, e in spans])

    def same(name, other, layer):
        ours = _kv(runs[name][0], seqs[name], layer, placed)
        theirs = _kv(runs[other][0], seqs[other], layer, placed)
        return np.abs(ours - theirs).reshape(len(placed), -1).max(1) < 1e-4

    recomputed = same("entries", "plain", 2)  # selected at layer 2: its input in context
    assert recomputed.sum() == round(0.1 * len(placed))
    for layer in range(4):
        assert same("entries", "placed", layer)[~recomputed].all()
    for layer in range(2):
        assert same("entries", "plain", layer)[recomputed].all()
    # layer 0's KV is the token's at its position, whatever precedes it; layer 1's is not
    assert not same("entries", "plain", 1)[~recomputed].any()


def test_short_chunks_are_computed_not_kept(model, parts):
    engine = _engine(model, min_entry_tokens=40)  # only the 48-token document qualifies
    prompt, spans = _layout(parts["systems"][0], parts["docs"], parts["question"])
    _run(engine, prompt, spans, APPROX)
    kept = [
        engine.pool.entry(position_free_key(engine.namespace(), d)) is not None
        for d in parts["docs"]
    ]
    assert kept == [False, True, False]
    stored = [e for e in engine.pool.drain_events() if e.kind is EventKind.ENTRY_STORED]
    assert len(stored) == 1


def test_entries_are_evicted_as_units_when_pages_run_out(model, parts):
    engine = _engine(model, num_pages=40)
    _warm(engine, parts)
    entries = [engine.pool.entry(position_free_key(engine.namespace(), d)) for d in parts["docs"]]
    held = sum(len(e.pages) for e in entries)
    assert engine.pool.num_available == 40  # every entry page is evictable
    pages = engine.pool.allocate(40 - held + 1)  # one page more than the free ones
    assert pages is not None
    removed = [e for e in engine.pool.drain_events() if e.kind is EventKind.ENTRY_REMOVED]
    assert len(removed) == 1 and removed[0].keys == (entries[0].key,)  # least recent
    engine.pool.release(pages)


def test_a_model_whose_rope_cannot_be_moved_is_refused(model, parts, tmp_path):
    copy = tmp_path / "partial"
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["partial_rotary_factor"] = 0.5
    (copy / "config.json").write_text(json.dumps(config))
    engine = _engine(copy)
    prompt, spans = _layout(parts["systems"][0], parts["docs"], parts["question"])
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        engine.add_request("x", prompt, GREEDY, placeable=tuple(spans), reuse=APPROX)
    assert not engine.has_unfinished()


def test_registered_approximate_chunk_pins_one_copy_for_every_system_prompt(model):
    """One pinned position-free copy of a document serves requests after different
    system prompts; it counts once toward the pin limit and survives pressure."""
    llm = LLM(model, page_size=PAGE, num_pages=96, device="cpu", max_model_len=512)
    doc = "The billing group sits in Oslo and the Team plan is run by it. " * 3
    chunk_id = llm.register_chunk(doc, mode="approximate")
    assert llm.register_chunk(doc, mode="approximate") == chunk_id  # deduplicated
    engine = llm.engine
    tokens = engine.tokenizer.encode(doc, add_special_tokens=False)
    entry = engine.pool.entry(position_free_key(engine.namespace(), tokens))
    assert entry is not None and entry.pins == 1
    assert engine.pool.num_pinned == len(entry.pages)
    [info] = llm.list_chunks()
    assert (info.mode, info.num_tokens, info.pinned_tokens) == (
        "approximate",
        len(tokens),
        len(entry.pages) * PAGE,
    )
    for system in ("You are terse.", "You are a careful analyst of documents."):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": [{"type": "text", "text": t} for t in (doc, "Where?")]},
        ]
        chunks = chunk_conversation(engine.tokenizer, messages)
        prompt = [t for c in chunks for t in c.token_ids]
        _, _, reuse = _run(engine, prompt, placeable_spans(chunks), APPROX)
        assert reuse.mode == "approximate" and reuse.reused_tokens >= len(tokens)
    assert engine.pool.num_pinned == len(entry.pages)  # still one copy
    # pinned: never evicted, even when every other page is taken
    pages = engine.pool.allocate(engine.pool.num_available)
    assert engine.pool.entry(entry.key) is entry
    engine.pool.release(pages)
    llm.unregister_chunk(chunk_id)
    assert engine.pool.entry(entry.key) is None and engine.pool.num_pinned == 0
    with pytest.raises(ValueError, match="after"):
        llm.register_chunk(doc, mode="approximate", after=[chunk_id])
    with pytest.raises(ValueError, match="mode must be one of"):
        llm.register_chunk(doc, mode="fuzzy")


def test_entry_fill_input_is_checked(model):
    engine = _engine(model, max_model_len=128)
    with pytest.raises(ValueError, match="at least one token"):
        engine.fill_entry([])
    room = 127 - len(engine.entry_context)
    with pytest.raises(ValueError, match=f"at most {room} tokens"):
        engine.fill_entry([11] * (room + 1))
    engine.fill_entry([11] * room)  # the longest that fits is computed and kept
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.entry(position_free_key(engine.namespace(), [11] * room)) is not None


def test_the_workload_tally_counts_hits_misses_fills_and_positions(model, parts):
    """``Engine.tally``: a first sight misses every document and takes each one's
    entry from its in-context KV (each position computed once), or, without
    ``entries_from_context``, fills each (computed twice: in context, then after the
    entry context); the same documents in another order after another system prompt
    hit every entry, and a repair with a deviation ratio runs the candidates it does
    not keep through the selection layers only; a pool too small for every entry
    evicts some."""
    prompt, spans = _layout(parts["systems"][0], parts["docs"], parts["question"])
    filling = _engine(model, entries_from_context=False)
    _run(filling, prompt, spans, APPROX)
    filled = filling.tally
    assert (filled.entry_misses, filled.entries_taken) == (len(DOCS), 0)
    assert filled.fills_queued == filled.fills_stored == len(DOCS)
    context = len(filling.entry_context)
    assert filled.prompt_positions == len(prompt) + sum(context + n for n in DOCS)

    engine = _engine(model)
    before = engine.tally.copy()
    _run(engine, prompt, spans, APPROX)
    first = engine.tally.since(before)
    assert (first.entry_hits, first.entry_misses) == (0, len(DOCS))
    assert first.entries_taken == len(DOCS) and first.fills_queued == 0
    assert first.prompt_positions == len(prompt)  # what exact reuse computes
    assert first.selection_only_positions == 0 and first.admission_forwards == 0

    repair = ReuseRequest("approximate", first_tokens=4, deviation_ratio=0.25)
    order = list(reversed(parts["docs"]))
    prompt, spans = _layout(parts["systems"][1], order, parts["question"])
    before = engine.tally.copy()
    _run(engine, prompt, spans, repair)
    second = engine.tally.since(before)
    assert (second.entry_hits, second.entry_misses, second.fills_queued) == (len(DOCS), 0, 0)
    candidates = sum(n - 4 for n in DOCS)
    kept = round(0.25 * sum(DOCS))
    assert second.selection_only_positions == candidates - kept
    assert second.admission_forwards == second.steps_with_admissions == 1
    # every position of the prompt but the candidates left behind: through every layer
    assert second.prompt_positions == len(prompt) - (candidates - kept)
    assert second.steps >= 1 and second.entry_evictions == 0

    small = _engine(model, num_pages=30)  # a request and two requests' entries
    rng = np.random.default_rng(3)
    vocab = small.model_config.vocab_size
    for _ in range(3):  # new documents each time: their entries push older ones out
        docs = [rng.integers(10, vocab - 1, size=n).tolist() for n in DOCS]
        _run(small, *_layout(parts["systems"][0], docs, parts["question"]), APPROX)
    stored = small.tally.entries_taken + small.tally.fills_stored
    assert stored == 3 * len(DOCS)
    assert 0 < small.tally.entry_evictions < stored


def test_a_placement_without_room_while_nothing_runs_computes_in_context(model, parts):
    """A pool with room for the request or for its documents' entries, not both: with
    nothing else running no page would ever be freed for the placement, so the request
    is admitted computing its documents in context, as plain generation does (it once
    waited for ever)."""
    engine = _engine(model, num_pages=12)
    _warm(engine, parts)  # three entries held
    # the first sight's pages left no room to copy every entry: those were filled
    assert engine.tally.fills_stored > 0
    assert engine.tally.entries_taken + engine.tally.fills_stored == len(DOCS)
    prompt, spans = _layout(parts["systems"][1], list(reversed(parts["docs"])), parts["question"])
    assert -(-len(prompt) // PAGE) + sum(-(-n // PAGE) for n in DOCS) > 12
    tokens, _, info = _run(engine, prompt, spans, APPROX)
    assert (info.reused_tokens, info.recomputed_tokens) == (0, 0)  # nothing placed
    plain, _, _ = _run(_engine(model, enable_reuse=False), prompt)
    assert tokens == plain


def test_entries_that_proved_their_worth_outlive_a_burst_of_new_documents(model, parts):
    """Proven entries (placed at least once) keep up to ``entry_reserve`` of the pool
    while requests wait for running ones: a burst of requests over new documents, too
    many to run at once, leaves them in place, and the documents hit afterwards. With
    no reserve the burst evicts them. The burst's answers are the same either way."""
    rng = np.random.default_rng(5)
    vocab = _engine(model).model_config.vocab_size
    burst = [
        _layout(parts["systems"][0], [rng.integers(10, vocab - 1, n).tolist() for n in DOCS],
                parts["question"])
        for _ in range(8)
    ]  # fmt: skip
    results = {}
    for reserve in (0.5, 0.0):
        engine = _engine(model, num_pages=48, entry_reserve=reserve)
        _warm(engine, parts)
        reordered = _layout(parts["systems"][1], parts["docs"][::-1], parts["question"])
        _, _, info = _run(engine, *reordered, APPROX)  # places all three: proven
        assert info.reused_tokens >= sum(DOCS)
        for index, (prompt, spans) in enumerate(burst):
            engine.add_request(f"b{index}", prompt, GREEDY, placeable=tuple(spans), reuse=APPROX)
        answers = {f"b{i}": [] for i in range(len(burst))}
        while engine.has_unfinished():
            for out in engine.step():
                answers[out.request_id] += out.new_token_ids
        before = engine.tally.copy()
        _run(engine, *_layout(parts["systems"][0][:7], parts["docs"], parts["question"]), APPROX)
        results[reserve] = (answers, engine.tally.since(before).entry_hits)
    assert results[0.5][0] == results[0.0][0]
    assert results[0.5][1] == len(DOCS)  # every proven document still held
    assert results[0.0][1] < len(DOCS)  # the burst evicted some
