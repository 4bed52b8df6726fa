"""Overlapped steps (``EngineConfig.overlap_scheduling``): step N+1 is queued before
step N's tokens are read back. Every request's output must be the same token for
token as without overlap, whatever happens around it: stops found one step late,
preemption, chunked prefill, exact and approximate reuse, seeded sampling, aborts."""

from __future__ import annotations

import numpy as np
import pytest

from workers.engine.config import EngineConfig
from workers.engine.engine import PLACEHOLDER, Engine
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams

PAGE = 16


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request, model_factory):
    return model_factory(request.param)


def _engine(model, overlap: bool, **overrides) -> Engine:
    config = dict(page_size=PAGE, num_pages=160, device="cpu", min_entry_tokens=16)
    config.update(overrides)
    return Engine(EngineConfig(str(model), overlap_scheduling=overlap, **config))


def _drive(engine: Engine, requests, abort_after: dict[str, int] | None = None):
    """Add ``requests`` ((id, prompt, params, kwargs)) and step to the end; returns
    per request its tokens, text, finish reason and logprobs. ``abort_after``: abort
    a request once that many ``step()`` calls have run."""
    for rid, prompt, params, kwargs in requests:
        engine.add_request(rid, prompt, params, **kwargs)
    got = {rid: {"tokens": [], "text": "", "reason": None, "logprobs": []} for rid, *_ in requests}
    calls = 0
    while engine.has_unfinished():
        for out in engine.step():
            seen = got[out.request_id]
            assert seen["reason"] is None, "nothing comes after a finished output"
            seen["tokens"] += out.new_token_ids
            seen["text"] += out.new_text
            seen["reason"] = out.finish_reason
            if out.logprobs is not None:
                seen["logprobs"].append(out.logprobs)
        calls += 1
        for rid, after in (abort_after or {}).items():
            if calls == after:
                engine.abort(rid)
    for seq in engine._sequences.values():
        assert PLACEHOLDER not in seq.token_ids
    return got


def _prompts(engine: Engine, seed: int, lengths):
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 1, size=n).tolist() for n in lengths]


def _compare(model, make_requests, abort_after=None, **overrides):
    plain = _drive(_engine(model, False, **overrides), make_requests(), abort_after)
    overlapped_engine = _engine(model, True, **overrides)
    assert overlapped_engine.overlap
    overlapped = _drive(overlapped_engine, make_requests(), abort_after)
    for rid, want in plain.items():
        if rid in (abort_after or {}):  # aborted a step apart: outputs one token apart
            continue
        got = overlapped[rid]
        assert got["tokens"] == want["tokens"], rid
        assert got["text"] == want["text"] and got["reason"] == want["reason"], rid
        for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
            assert [t for t, _ in a] == [t for t, _ in b]
            np.testing.assert_allclose([lp for _, lp in a], [lp for _, lp in b], atol=1e-5)
    assert overlapped_engine.pool.num_available == overlapped_engine.pool.num_pages
    return plain


def test_overlap_is_off_on_the_cpu_by_default(model):
    engine = Engine(EngineConfig(str(model), device="cpu", num_pages=32))
    assert not engine.overlap


def test_greedy_and_seeded_outputs_are_token_identical(model):
    """Lengths that end on different steps, a stop token and a stop string found a
    step late, logprobs, seeded sampling, and shared prefixes (exact reuse)."""
    probe = _engine(model, False)
    prompts = _prompts(probe, 1, [23, 40, 17, 64, 33])
    shared = prompts[3][:48]
    # a token the first request emits at its fourth step: a stop found mid-stream
    first = _drive(probe, [("p", prompts[0], SamplingParams(max_tokens=8, temperature=0), {})])
    stop_token = first["p"]["tokens"][3]

    def requests():
        greedy = dict(temperature=0, ignore_eos=True)
        return [
            (
                "stop-token",
                prompts[0],
                SamplingParams(max_tokens=8, stop_token_ids=[stop_token], temperature=0),
                {},
            ),
            ("long", prompts[1], SamplingParams(max_tokens=21, **greedy), {}),
            ("one", prompts[2], SamplingParams(max_tokens=1, **greedy), {}),
            ("logprobs", prompts[3], SamplingParams(max_tokens=7, logprobs=3, **greedy), {}),
            ("shared", shared + prompts[4], SamplingParams(max_tokens=9, **greedy), {}),
            (
                "seeded",
                prompts[4],
                SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True),
                {},
            ),
            (
                "stop-text",
                prompts[1],
                SamplingParams(max_tokens=12, stop=[" "], temperature=0, ignore_eos=True),
                {},
            ),
        ]

    plain = _compare(model, requests)
    assert len(plain["stop-token"]["tokens"]) == 4 and plain["stop-token"]["reason"] == "stop"
    assert len(plain["long"]["tokens"]) == 21 and len(plain["one"]["tokens"]) == 1


def test_identical_under_preemption_and_chunked_prefill(model):
    """A pool too small for every request at once preempts (sequences whose token is
    still in flight among them); a small token budget splits prompts over steps."""
    probe = _engine(model, False)
    prompts = _prompts(probe, 2, [70, 45, 90, 30, 52, 66])

    def requests():
        return [
            (f"r{i}", p, SamplingParams(max_tokens=20 + 8 * i, temperature=0, ignore_eos=True), {})
            for i, p in enumerate(prompts)
        ]

    overrides = dict(num_pages=20, max_num_batched_tokens=64)
    _compare(model, requests, **overrides)
    engine = _engine(model, True, **overrides)
    _drive(engine, requests())
    assert engine.scheduler.num_preemptions > 0  # the case this test is for happened


def test_identical_with_approximate_reuse_and_entry_fills(model):
    """Approximate requests whose chunks miss (entries filled after them) and then hit
    (placed and repaired), beside plain ones."""
    probe = _engine(model, False)
    system, *docs = _prompts(probe, 3, [21, 37, 48, 33])
    question = _prompts(probe, 4, [9])[0]

    def layout(order):
        prompt, spans = list(system), []
        for i in order:
            spans.append((len(prompt), len(prompt) + len(docs[i])))
            prompt += docs[i]
        return prompt + question, tuple(spans)

    def requests():
        out = []
        for n, order in enumerate([(0, 1, 2), (2, 0, 1), (1, 2, 0)]):
            prompt, spans = layout(order)
            reuse = ReuseRequest("approximate", first_tokens=2, deviation_ratio=0.2)
            kwargs = dict(placeable=spans, reuse=reuse)
            out.append(
                (
                    f"a{n}",
                    prompt,
                    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                    kwargs,
                )
            )
        return out

    def staged(engine):
        first, later = requests()[:1], requests()[1:]
        got = _drive(engine, first)  # misses: entries filled after it
        return got | _drive(engine, later)  # placed

    plain, overlapped = staged(_engine(model, False)), staged(_engine(model, True))
    for rid in plain:
        assert overlapped[rid]["tokens"] == plain[rid]["tokens"], rid


def test_an_abort_while_a_token_is_in_flight_loses_nothing_else(model):
    probe = _engine(model, False)
    prompts = _prompts(probe, 5, [30, 41, 26])

    def requests():
        return [
            (f"r{i}", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), {})
            for i, p in enumerate(prompts)
        ]

    plain = _compare(model, requests, abort_after={"r1": 4})
    assert plain["r1"]["reason"] is None and 0 < len(plain["r1"]["tokens"]) < 10
    assert plain["r0"]["reason"] == plain["r2"]["reason"] == "length"


def test_the_first_token_is_not_held_back_later_ones_come_a_call_late(model):
    """A step that yields a request's first token is read back at once (time to first
    token unchanged); from then on each token comes one ``step()`` call later."""
    probe = _engine(model, False)
    (prompt,) = _prompts(probe, 6, [40])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    per_call = {}
    for overlap in (False, True):
        engine = _engine(model, overlap)
        engine.add_request("r", prompt, params)
        counts = []
        while engine.has_unfinished():
            counts.append(sum(len(out.new_token_ids) for out in engine.step()))
        per_call[overlap] = counts
    assert per_call[False] == [1, 1, 1, 1]
    assert per_call[True] == [1, 0, 1, 1, 1]


def test_prompt_tokens_read_back_follow_those_launched(model):
    """``last_read_back_prompt_tokens`` (what a call's wall time waited for, the engine
    loop's prefill-rate sample) equals ``last_step_prompt_tokens`` without overlap and
    lags it by a call with overlap, summing to the same."""
    probe = _engine(model, False)
    (prompt,) = _prompts(probe, 8, [50])
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for overlap in (False, True):
        engine = _engine(model, overlap, max_num_batched_tokens=16)  # 4 prompt chunks
        engine.add_request("r", prompt, params)
        launched, read_back = [], []
        while engine.has_unfinished():
            engine.step()
            launched.append(engine.last_step_prompt_tokens)
            read_back.append(engine.last_read_back_prompt_tokens)
        assert sum(launched) == sum(read_back) == 50
        if overlap:  # chunks without a token are held; the last chunk's token is not
            assert launched[:4] == [16, 16, 16, 2] and read_back[:4] == [0, 16, 16, 18]
        else:
            assert read_back == launched


@pytest.mark.parametrize("overlap", [False, True])
def test_every_launched_step_is_read_back_once_with_its_time(model, overlap):
    """``Engine.last_resolved_steps``: each step launched is reported once, by the
    call that reads it back (with overlap often the next one, the last by the call
    that drains the engine), with its kind and a positive time."""
    engine = _engine(model, overlap)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(engine, 3, (40, 70, 25))):
        engine.add_request(f"r{i}", prompt, params)
    launched, resolved, late = 0, [], 0
    while engine.has_unfinished():
        engine.step()
        launched += engine.last_step_seqs > 0
        resolved += engine.last_resolved_steps
        late += engine.last_step_seqs == 0 and bool(engine.last_resolved_steps)
    assert len(resolved) == launched
    assert {kind for kind, _ in resolved} == {"torch eager"}
    assert all(seconds > 0 for _, seconds in resolved)
    assert late == (1 if overlap else 0)  # overlapped: the last step read back by the drain
