"""The engine on a qwen3-0.6b-shaped random checkpoint, bf16, FlashInfer: reuse and
cascade agree with plain runs and with transformers within bf16 noise."""

from __future__ import annotations

import json
import os
import random
from array import array

import pytest
import torch

from workers import LLM, SamplingParams

# Noise between two bf16 computation paths (logit std of their difference), measured by
# the first test; a greedy divergence is a near-tie when the top-2 gap lies within
# 4 standard deviations of the gap noise (sqrt(2) x that).
NOISE = {"logit_std": 0.1}
# Over 32 greedy steps small bf16 differences compound through the generated tokens'
# KV; a divergence counts as a near-tie when the two leading tokens swap places and
# were within this many nats (the logits' standard deviation is about 6).
NEAR_TIE = 0.5
TOP = 5  # logprobs asked for: where a divergent pick may rank in the other run


def _record(name: str, value) -> None:
    out = os.environ.get("CHUNKSERVE_RESULTS_DIR")
    if out:
        with open(os.path.join(out, "gpu_tests.jsonl"), "a") as f:
            f.write(json.dumps({"test": name, **value}) + "\n")


def _prompts(n: int, system_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = rng.choices(range(10, 1000), k=system_len)
    return [system + rng.choices(range(10, 1000), k=rng.randint(8, 64)) for _ in range(n)]


@pytest.fixture(scope="module")
def engines(qwen3_06b):
    reuse = LLM(qwen3_06b, page_size=16, num_pages=8192)
    plain = LLM(qwen3_06b, page_size=16, num_pages=8192, enable_reuse=False, enable_cascade=False)
    return reuse, plain


def _near_tie_threshold() -> float:
    return 4 * 2**0.5 * NOISE["logit_std"]


def _last_logits(llm: LLM, prompt: list[int], chunks: tuple[int, ...] = ()) -> torch.Tensor:
    """Full-vocabulary logits at the prompt's last position, through our model runner;
    ``chunks`` splits the prefill (later chunks read earlier ones from the paged cache,
    the path a cache hit takes)."""
    from tests.workers.reference import prefill_hidden

    hidden = prefill_hidden(llm, prompt, list(chunks) + [len(prompt) - sum(chunks)])
    with torch.inference_mode():
        return llm.engine.runner.model.compute_logits(hidden[-1:])[0].float()


def _rel_full(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_first_token_logits_reuse_and_transformers(engines, qwen3_06b):
    """A cached prefix (prefill in two chunks, the second reading the first from the
    paged cache) agrees with one-shot prefill within bf16 noise, and our bf16 logits
    are no further from a float32 oracle (transformers, float32) than transformers'
    own bf16 run."""
    from bench.common import load_transformers_model

    reuse, plain = engines
    prompts = _prompts(4, 700, seed=1)
    worst = {"cached_vs_oneshot": 0.0, "ours_bf16_vs_fp32": 0.0, "transformers_bf16_vs_fp32": 0.0}
    references = []
    for dtype in (torch.float32, torch.bfloat16):
        model = load_transformers_model(qwen3_06b, dtype)
        with torch.no_grad():
            references.append(
                [model(torch.tensor([p], device="cuda")).logits[0, -1].float() for p in prompts]
            )
        del model
    diffs = []
    for prompt, fp32, hf_bf16 in zip(prompts, *references, strict=True):
        oneshot = _last_logits(plain, prompt)
        cached = _last_logits(plain, prompt, chunks=(len(prompt) // 16 * 16 - 16,))
        diffs.append(cached - oneshot)
        worst["cached_vs_oneshot"] = max(worst["cached_vs_oneshot"], _rel_full(cached, oneshot))
        worst["ours_bf16_vs_fp32"] = max(worst["ours_bf16_vs_fp32"], _rel_full(oneshot, fp32))
        worst["transformers_bf16_vs_fp32"] = max(
            worst["transformers_bf16_vs_fp32"], _rel_full(hf_bf16, fp32)
        )
        # the engine's own cache-hit path reports the reuse
        reuse.generate([prompt], SamplingParams(max_tokens=1))
        again = reuse.generate([prompt], SamplingParams(max_tokens=1))[0]
        assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    NOISE["logit_std"] = torch.cat(diffs).std().item()
    worst["logit_noise_std"] = NOISE["logit_std"]
    _record("first_token_logits_rel_error", worst)
    assert worst["cached_vs_oneshot"] <= 2 * worst["ours_bf16_vs_fp32"]
    assert worst["ours_bf16_vs_fp32"] <= max(2e-2, 1.5 * worst["transformers_bf16_vs_fp32"])


def test_greedy_agreement_reuse_cascade_vs_plain(engines):
    reuse, plain = engines
    prompts = _prompts(64, 1024, seed=2)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=TOP)
    reuse.generate([prompts[0]], params)  # cache the shared system prompt
    runner = reuse.engine.runner
    backend = runner.backend
    backend.min_saved_tokens = 0  # exercise the cascade path on every shared decode step
    kinds = []
    original_run = runner.run

    def spy(batch, carried=None):
        logits = original_run(batch, carried)
        kinds.append(backend.last_plan_kind)  # eager or graph
        return logits

    runner.run = spy
    try:
        got = reuse.generate(prompts, params)
    finally:
        runner.run = original_run
    want = plain.generate(prompts, params)
    same = sum(a.token_ids == b.token_ids for a, b in zip(got, want, strict=True))
    divergences = [
        _divergence(a, b) for a, b in zip(got, want, strict=True) if a.token_ids != b.token_ids
    ]
    gaps = [lp[1][1] - lp[2][1] for out in want for lp in out.logprobs]
    result = {
        "prompts": len(prompts),
        "identical": same,
        "agreement_rate": same / len(prompts),
        "cascade_steps": kinds.count("cascade"),
        "near_tie_nats": NEAR_TIE,
        "share_of_all_positions_below_near_tie": sum(g < NEAR_TIE for g in gaps) / len(gaps),
        "divergences": divergences,
    }
    _record("greedy_agreement", result)
    assert kinds.count("cascade") > 0, "the shared 1K prefix should have used cascade decode"
    # At every divergence the reuse run picked a token the plain run ranked within
    # NEAR_TIE of its own pick.
    assert all(d["near_tie"] for d in divergences), divergences


def _divergence(a, b) -> dict:
    """First differing step of two greedy runs: how run ``b`` ranked the token run
    ``a`` picked there. A near tie: ``b`` had it among its top TOP, within NEAR_TIE
    nats of its own pick (with random weights the top few often lie that close, so
    a run may pick b's third)."""
    step = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y)
    top_b = b.logprobs[step][1:]  # (token, logprob), best first
    ranks = [t for t, _ in top_b]
    picked = a.token_ids[step]
    gap = top_b[0][1] - top_b[ranks.index(picked)][1] if picked in ranks else None
    return {
        "step": step,
        "top2_gap": top_b[0][1] - top_b[1][1],
        "picked_rank": ranks.index(picked) + 1 if picked in ranks else None,
        "picked_gap": gap,
        "near_tie": gap is not None and gap < NEAR_TIE,
    }


def test_cuda_graph_decode_matches_eager(qwen3_06b, engines):
    _, plain = engines
    eager = LLM(
        qwen3_06b,
        page_size=16,
        num_pages=4096,
        enable_reuse=False,
        enable_cascade=False,
        enable_cuda_graphs=False,
    )
    assert plain.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    prompts = _prompts(16, 200, seed=3)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=TOP)
    a = plain.generate(prompts, params)
    b = eager.generate(prompts, params)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True))
    gaps = []
    for x, y in zip(a, b, strict=True):
        if x.token_ids != y.token_ids:
            step = next(
                i for i, (p, q) in enumerate(zip(x.token_ids, y.token_ids, strict=False)) if p != q
            )
            gaps.append(y.logprobs[step][1][1] - y.logprobs[step][2][1])
    _record("cuda_graph_vs_eager", {"prompts": 16, "identical": same, "gaps": gaps})
    assert all(g < _near_tie_threshold() for g in gaps)


def test_prefill_graphs_match_eager(qwen3_06b, engines):
    """Prefills of up to 1,024 new tokens replay a CUDA graph: single prompts, a cache
    hit's short tail over a long cached prefix (a split-KV graph), and several prompts
    in one step."""
    reuse, plain = engines
    eager = LLM(
        qwen3_06b,
        page_size=16,
        num_pages=4096,
        enable_cascade=False,
        enable_cuda_graphs=False,
    )
    runner = reuse.engine.runner
    replays, graphs = [], runner.graphs.prefill
    original = graphs.run
    graphs.run = lambda *a: (
        replays.append((a[2].batch_size, graphs._bucket(a[2])[2])) or original(*a)
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=TOP)
    rng = random.Random(4)
    context = rng.choices(range(10, 1000), k=3000)
    prompts = [rng.choices(range(10, 1000), k=n) for n in (17, 64, 100, 250, 700)]
    prompts += [context + rng.choices(range(10, 1000), k=40) for _ in range(3)]
    batch = [rng.choices(range(10, 1000), k=n) for n in (30, 90, 200)]
    mismatches = []
    try:
        for prompt in prompts:
            a = reuse.generate([prompt], params)[0]
            b = eager.generate([prompt], params)[0]
            if a.token_ids != b.token_ids:
                mismatches.append(_divergence(a, b))
        for a, b in zip(reuse.generate(batch, params), eager.generate(batch, params), strict=True):
            if a.token_ids != b.token_ids:
                mismatches.append(_divergence(a, b))
    finally:
        graphs.run = original
    _record("prefill_graph_vs_eager", {"prompts": len(prompts) + 3, "mismatches": mismatches})
    rows = [r for r, _ in replays]
    assert rows.count(1) >= len(prompts) - 1  # the first context request prefills 3K eagerly
    assert 3 in rows  # the batch's prompts in one step, one row each
    assert (1, "split-kv") in replays  # a cached context's tail: the split-KV graph
    assert all(d["near_tie"] for d in mismatches), mismatches


def test_cache_hit_joining_decoding_requests_takes_small_query_tiles(engines):
    """A loaded worker's mixed step: a cache hit's short tail beside 20 decoding
    requests over long contexts replays a small-tile (FA2) prefill graph, and every
    request's greedy tokens match a plain engine's (up to near ties)."""
    from types import SimpleNamespace

    reuse, plain = engines
    engine = reuse.engine
    graphs = engine.runner.graphs.prefill
    replays, original = [], graphs.run
    graphs.run = lambda *a: (
        replays.append((a[2].batch_size, graphs._bucket(a[2])[2])) or original(*a)
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=TOP)
    rng = random.Random(11)
    decoding = [rng.choices(range(10, 1000), k=1100) for _ in range(20)]
    hit = decoding[0] + rng.choices(range(10, 1000), k=48)  # decoding[0] is cached
    tokens: dict[str, list[int]] = {}
    try:
        for i, prompt in enumerate(decoding):
            engine.add_request(f"mixed-d{i}", prompt, params)
        for _ in range(4):
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.add_request("mixed-hit", hit, params)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    finally:
        graphs.run = original
    assert any(rows >= 21 and kernel == "small-tiles" for rows, kernel in replays), replays
    # FA2 fixed each small-tile graph's query tile at capture: its smallest, and its split
    # scratch (plan info: padded tile slots first, the tile fourth) fits the budget
    from workers.engine.attention.base import SMALL_QUERY_TILE
    from workers.engine.attention.flashinfer_backend import WORKSPACE_BYTES

    shape = graphs.backend.shape
    small = [key for key in graphs.graphs if key[2] == "small-tiles"]
    assert small
    for key in small:
        info = graphs.graphs[key].wrapper._plan_info
        assert info[3] == SMALL_QUERY_TILE, (key, info[:4])
        scratch = info[0] * shape.num_heads * SMALL_QUERY_TILE * (shape.head_dim + 1) * 4
        assert scratch <= WORKSPACE_BYTES // 2, (key, scratch)
    expected = plain.generate([*decoding, hit], params)
    mismatches = []
    names = [*(f"mixed-d{i}" for i in range(20)), "mixed-hit"]
    for rid, ref in zip(names, expected, strict=True):
        assert len(tokens[rid]) == len(ref.token_ids) == 12, (rid, tokens[rid])
        if tuple(tokens[rid]) != tuple(ref.token_ids):
            mismatches.append(_divergence(SimpleNamespace(token_ids=tokens[rid]), ref))
    _record("mixed_step_small_tiles", {"requests": 21, "mismatches": mismatches})
    assert all(d["near_tie"] for d in mismatches), mismatches


def _sequence_with_pages(engine, name: str, tokens: list[int]):
    """A sequence holding pages for ``tokens`` (not yet computed); its KV rows (page,
    offset) per position; and a function stacking every layer's K/V at them."""
    from workers.engine.request import Sequence
    from workers.engine.sampling_params import SamplingParams

    page = engine.pool.page_size
    seq = Sequence(name, 0, tokens, SamplingParams(max_tokens=1), engine.namespace())
    seq.page_ids = array("i", engine.pool.allocate(-(-len(tokens) // page)))
    table = torch.tensor(list(seq.page_ids), device="cuda").repeat_interleave(page)
    rows = (table[: len(tokens)], torch.arange(len(tokens), device="cuda") % page)

    def kv() -> torch.Tensor:
        return torch.stack([c[rows[0], :, rows[1]].float() for c in engine.runner.kv_caches])

    return seq, rows, kv


def test_scattered_recompute_over_cached_kv_matches_one_pass(engines):
    """Recomputing a random subset of positions (one causal row per run) over KV whose
    rows there were overwritten with noise restores the KV and last logits of one
    plain pass, within bf16 noise."""
    import numpy as np

    from workers.engine.scheduler import ScheduledSeq

    engine = engines[0].engine
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 50_000, size=700).tolist()
    seq, rows, kv = _sequence_with_pages(engine, "gpu-scattered", tokens)

    plain_logits = engine.runner.run([ScheduledSeq(seq, 0, len(tokens))])[0].float()
    plain_kv = kv()
    tail = len(tokens) - 4
    subset = np.sort(rng.choice(tail, size=120, replace=False)).astype(np.int64)
    noisy = torch.from_numpy(np.concatenate((subset, np.arange(tail, len(tokens))))).cuda()
    runner, graphs = engine.runner, engine.runner.graphs.prefill
    results = {}
    for path in ("graph", "eager"):  # 124 tokens in 111 rows: a graph fits
        for cache in runner.kv_caches:
            cache[rows[0][noisy], :, rows[1][noisy]] = 5 * torch.randn_like(
                cache[rows[0][noisy], :, rows[1][noisy]]
            )
        step = ScheduledSeq(seq, tail, 4, subset)
        replays = []
        original, fits = graphs.run, graphs.can_run
        if path == "eager":
            graphs.can_run = lambda layout: False

        def counted(*args, replays=replays, original=original):
            replays.append(args[2].batch_size)
            return original(*args)

        graphs.run = counted
        try:
            logits = runner.run([step])[0].float()
        finally:
            graphs.run, graphs.can_run = original, fits
        assert bool(replays) == (path == "graph") and all(r > 32 for r in replays)
        kv_rel = ((kv() - plain_kv).norm() / plain_kv.norm()).item()
        results[path] = {"kv_rel": kv_rel, "logit_rel": _rel_full(logits, plain_logits)}
    engine.pool.release(seq.page_ids)
    _record("scattered_recompute", results)
    for r in results.values():
        assert r["kv_rel"] <= 2e-2 and r["logit_rel"] <= 2e-2, results


def test_selecting_forward_finds_and_restores_deviating_kv(engines):
    """``repair_selecting`` over a prompt whose KV is right except at 120 positions
    (noise at every layer), told that every position before the question is placed
    and to keep 120: the device picks exactly the noisy ones at the selection layer,
    and the one forward (its selection pass and its kept rows through the scattered-
    query kernel in CUDA graphs, and eagerly) restores the KV and the last logits of
    one plain pass, within bf16 noise; also when the forward itself computes the last
    position and returns its logits."""
    import numpy as np

    from workers.engine.scheduler import ScheduledSeq

    engine = engines[0].engine
    rng = np.random.default_rng(1)
    tokens = rng.integers(10, 50_000, size=2000).tolist()
    seq, rows, kv = _sequence_with_pages(engine, "gpu-selecting", tokens)

    runner = engine.runner
    plain_logits = runner.run([ScheduledSeq(seq, 0, len(tokens))])[0].float()
    plain_kv = kv()
    tail, last = len(tokens) - 40, len(tokens) - 1
    noisy = torch.from_numpy(np.sort(rng.choice(tail, size=120, replace=False))).cuda()
    graphs, selection = runner.kept_graphs, runner.selection_graphs
    assert graphs is not None and graphs.layer == engine.deviation_layer
    assert selection is not None and selection.layer == engine.deviation_layer
    results = {}
    served = []  # per call of the selection graphs: whether a graph ran it
    start_selection = selection.start

    def counted(*args):
        out = start_selection(*args)
        served.append(out is not None)
        return out

    selection.start = counted  # delegates: harmless to later tests if this one fails
    # 39 + 120 rows over 1,999 keys (40 + 120 over 2,000 when the forward gives the
    # logits, as an approximate admission's does): a graph fits
    for path in ("graph", "eager", "graph, last row"):
        for cache in runner.kv_caches:
            cache[rows[0][noisy], :, rows[1][noisy]] = 5 * torch.randn_like(
                cache[rows[0][noisy], :, rows[1][noisy]]
            )
        if path == "eager":
            runner.kept_graphs = runner.selection_graphs = None
        layer = engine.deviation_layer
        try:
            if path == "graph, last row":
                logits = runner.repair_selecting(
                    seq, 0, last + 1, np.arange(tail), 120, layer, logits=True
                )[0].float()
            else:
                assert runner.repair_selecting(seq, 0, last, np.arange(tail), 120, layer) is None
        finally:
            runner.kept_graphs, runner.selection_graphs = graphs, selection
        if path != "graph, last row":
            logits = runner.run([ScheduledSeq(seq, last, 1)])[0].float()
        kv_rel = ((kv() - plain_kv).norm() / plain_kv.norm()).item()
        results[path] = {"kv_rel": kv_rel, "logit_rel": _rel_full(logits, plain_logits)}
    del selection.start
    assert served == [True, True]  # both graph paths ran the selection in a graph
    assert selection.plannable  # re-planned by FlashInfer's compiled planner alone
    assert (256, 4096) in graphs.graphs and 2048 in selection.graphs
    assert runner.take_aside().tokens == 2 * (39 + 120) + 40 + 120
    engine.pool.release(seq.page_ids)
    _record("selecting_forward", results)
    for r in results.values():
        assert r["kv_rel"] <= 2e-2 and r["logit_rel"] <= 2e-2, results


def test_selecting_forwards_queued_back_to_back(engines):
    """Two selecting forwards queued one after the other, both through the same
    selection graph (one token bucket) but over KV of different lengths, the second
    after 48 positions of held KV (a matched prefix: its row starts elsewhere, so the
    graph is planned again), nothing waited for in between: each restores its own
    sequence's noisy KV and gives its own last logits (a plan of the second
    overwriting the first's before its replay read it would make the first attend over
    the wrong keys)."""
    import numpy as np

    from workers.engine.scheduler import ScheduledSeq

    engine = engines[0].engine
    runner = engine.runner
    rng = np.random.default_rng(2)
    layer = engine.deviation_layer
    cases = []
    for name, length, start in (("gpu-queued-a", 2000, 0), ("gpu-queued-b", 1700, 48)):
        tokens = rng.integers(10, 50_000, size=length).tolist()
        seq, rows, kv = _sequence_with_pages(engine, name, tokens)
        plain_logits = runner.run([ScheduledSeq(seq, 0, length)])[0].float()
        tail = length - 40
        noisy = rng.choice(np.arange(start, tail), size=120, replace=False)
        noisy = torch.from_numpy(np.sort(noisy)).cuda()
        for cache in runner.kv_caches:
            cache[rows[0][noisy], :, rows[1][noisy]] = 5 * torch.randn_like(
                cache[rows[0][noisy], :, rows[1][noisy]]
            )
        cases.append((seq, kv, plain_logits, start, tail))
    torch.cuda.synchronize()
    selection = runner.selection_graphs
    logits = [  # queued back to back: nothing here waits for the device
        runner.repair_selecting(
            seq, start, len(seq.token_ids), np.arange(start, tail), 120, layer, True
        )
        for seq, _, _, start, tail in cases
    ]
    assert selection.graphs[2048].planned_start == 48  # planned again for the second
    repaired = [kv() for _, kv, _, _, _ in cases]
    results = {}
    for (seq, kv, plain_logits, *_), got, kv_after in zip(cases, logits, repaired, strict=True):
        # the reference KV: a plain pass over the same tokens into the same pages
        runner.run([ScheduledSeq(seq, 0, len(seq.token_ids))])
        plain_kv = kv()
        kv_rel = ((kv_after - plain_kv).norm() / plain_kv.norm()).item()
        results[seq.request_id] = {
            "kv_rel": kv_rel,
            "logit_rel": _rel_full(got[0].float(), plain_logits),
        }
        engine.pool.release(seq.page_ids)
    runner.take_aside()
    _record("selecting_queued", results)
    for r in results.values():
        assert r["kv_rel"] <= 2e-2 and r["logit_rel"] <= 2e-2, results


def test_overlapped_steps_match_plain_steps(qwen3_06b, engines):
    """Overlapped steps (on by default with CUDA) against plain ones: the same greedy
    tokens, up to near ties. Every request ends on the same step, so both runs
    compute the same batches."""
    _, overlapped = engines
    assert overlapped.engine.overlap
    plain = LLM(
        qwen3_06b,
        page_size=16,
        num_pages=4096,
        enable_reuse=False,
        enable_cascade=False,
        overlap_scheduling=False,
    )
    prompts = _prompts(24, 300, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=TOP)
    got, want = overlapped.generate(prompts, params), plain.generate(prompts, params)
    divergences = [
        _divergence(a, b) for a, b in zip(got, want, strict=True) if a.token_ids != b.token_ids
    ]
    _record("overlap_vs_plain", {"prompts": len(prompts), "divergences": divergences})
    assert all(len(a.token_ids) == 40 for a in got)
    assert all(d["near_tie"] for d in divergences), divergences
