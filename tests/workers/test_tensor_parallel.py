"""Tensor parallelism on the CPU: a worker split over two ranks (gloo, float32) computes
what one rank computes: the same logits up to float32 summation order, the same greedy
tokens, the same reuse (exact prefix hits; approximate entries taken, filled, placed
and repaired, whose selection sums each rank's deviation) and the same host-tier round
trips. The sharded layers, the vocabulary split (with a padded last shard) and rank 0
sending every operation to the other rank are all on the path."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.chunkstore.testkit import wait_until
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.models.config import ModelConfig
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.engine.tp.shard import Shard, check_divisible

PAGE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
DOCS = (37, 48, 33)

# per family: the model's overrides and the engine's, chosen so that between them every
# path rank 0 sends runs: overlapped steps (tokens carried on the device), entries taken
# from context and entries filled, immediate and deferred placement, the host tier
VARIANTS = {
    "qwen3": ({}, dict(overlap_scheduling=True, num_pages=160)),
    "llama": (
        # an odd vocabulary: the last rank's rows are padded
        dict(vocab_size=1027, tie_word_embeddings=True),
        dict(entries_from_context=False, num_pages=40, host_kv_gib=0.002),
    ),
}


def _engine(model, world: int, **overrides) -> Engine:
    config = dict(page_size=PAGE, device="cpu", min_entry_tokens=32, tensor_parallel_size=world)
    return Engine(EngineConfig(str(model), **{**config, **overrides}))


def _requests(vocab: int):
    """Groups of (prompt, spans, reuse), in order: concurrent first sights, an exact
    prefix hit, an approximate first sight, then its documents in other orders after
    another system prompt, repaired by selection and placed as they are; then the
    first sights again."""
    rng = np.random.default_rng(3)
    draw = lambda n: rng.integers(10, vocab - 1, size=n).tolist()  # noqa: E731
    systems, docs, question = [draw(23), draw(41)], [draw(n) for n in DOCS], draw(9)

    def layout(system, order):
        prompt, spans = list(system), []
        for i in order:
            spans.append((len(prompt), len(prompt) + DOCS[i]))
            prompt += docs[i]
        return prompt + question, tuple(spans)

    plain = [draw(70), draw(55), draw(90)]
    yield [(p, (), None) for p in plain]
    yield [(plain[0][:64] + draw(12), (), ReuseRequest("exact"))]
    approx = [
        ReuseRequest("approximate", first_tokens=4, deviation_ratio=0.2),
        ReuseRequest("approximate", first_tokens=4, deviation_ratio=0.2),
        ReuseRequest("approximate", first_tokens=4, deviation_ratio=0.0),
    ]
    for (system, order), reuse in zip(
        [(systems[0], (0, 1, 2)), (systems[1], (2, 0, 1)), (systems[1], (1, 2, 0))],
        approx,
        strict=True,
    ):
        prompt, spans = layout(system, order)
        yield [(prompt, spans, reuse)]
    # the first ones again: cached on the device, or (a small pool) in the host tier
    yield [(p, (), ReuseRequest("exact")) for p in plain]


def _serve(engine: Engine) -> tuple[list, list[torch.Tensor]]:
    """Each group of requests at once, to completion: per request its tokens and reuse
    (mode, reused, recomputed); and every step's logits."""
    logits: list[torch.Tensor] = []
    engine.on_logits = lambda seqs, rows: logits.append(rows.clone())
    results, number = [], 0
    for group in _requests(engine.model_config.vocab_size):
        tokens, infos = {}, {}
        for prompt, spans, reuse in group:
            rid = f"r{number}"
            number += 1
            named = {"placeable": spans} | ({"reuse": reuse} if reuse else {})
            engine.add_request(rid, prompt, GREEDY, **named)
            tokens[rid] = []
        while engine.has_unfinished():  # entry fills run to completion too
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                reuse = out.reuse
                infos[out.request_id] = (reuse.mode, reuse.reused_tokens, reuse.recomputed_tokens)
        results += [(tokens[rid], infos[rid]) for rid in tokens]
    return results, logits


@pytest.mark.integration  # ranks are processes
@pytest.mark.parametrize("family", sorted(VARIANTS))
def test_two_ranks_compute_what_one_computes(family, model_factory):
    model_overrides, engine_overrides = VARIANTS[family]
    model = model_factory(family, **model_overrides)
    one = _engine(model, 1, **engine_overrides)
    want, want_logits = _serve(one)
    two = _engine(model, 2, **engine_overrides)
    try:
        got, got_logits = _serve(two)
        tally = two.tally.copy()
        host = two.pool.host
        host_counts = None if host is None else host.stats()
    finally:
        two.close()
    assert got == want
    # the paths this variant is for ran
    modes = [info[0] for _, info in want]
    assert modes.count("approximate") == 3 and want[3][1][1] > 0  # the exact hit
    placed = [info for _, info in want if info[0] == "approximate" and info[1]]
    assert len(placed) == 2 and all(info[2] > 0 for info in placed)
    if engine_overrides.get("entries_from_context") is False:
        assert tally.fills_stored > 0
    else:
        assert tally.entries_taken > 0
    if host_counts is not None:
        assert host_counts.pages_loaded > 0
        # the same pages moved, and their bytes counted over both ranks' heads
        alone = one.pool.host.stats()
        assert (host_counts.pages_written, host_counts.pages_loaded) == (
            alone.pages_written,
            alone.pages_loaded,
        )
        assert host_counts.bytes_written == alone.bytes_written > 0
    assert len(got_logits) == len(want_logits)
    for a, b in zip(want_logits, got_logits, strict=True):
        assert a.shape == b.shape
        # float32 sums in another order: 1e-5 of the logits' scale
        scale = max(1.0, a.abs().max().item())
        assert (a - b).abs().max().item() <= 1e-5 * scale


def test_a_step_message_reaches_the_other_ranks_as_sent():
    """``wire_dumps`` sends CPU tensors as numpy arrays: values, dtypes and shapes
    arrive as sent, views and non-contiguous tensors included; bfloat16 and device
    tensors keep torch's own pickling."""
    import pickle

    from workers.engine.tp.group import wire_dumps

    base = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    sent = {
        "ids": torch.tensor([5, 7, 9], dtype=torch.int64),
        "table": torch.arange(10, dtype=torch.int32),
        "mask": torch.tensor([True, False, True]),
        "scores": torch.randn(3, 5),
        "view": base[1:3, 2:5],  # a view: only its values travel
        "transposed": base.t(),
        "scalar": torch.tensor(3.5),
        "bf16": torch.randn(4, dtype=torch.bfloat16),
        "array": np.arange(4),
    }
    got = pickle.loads(wire_dumps(("run_inputs", (sent, None))))
    assert got[0] == "run_inputs" and got[1][1] is None
    for key, value in sent.items():
        back = got[1][0][key]
        if isinstance(value, np.ndarray):
            assert np.array_equal(back, value)
            continue
        assert back.dtype == value.dtype and back.shape == value.shape, key
        assert torch.equal(back, value), key
    assert len(wire_dumps(sent["view"])) < len(pickle.dumps(sent["view"]))


def test_sizes_that_do_not_divide_the_model_are_refused(tiny_qwen3):
    config = ModelConfig.from_dir(tiny_qwen3)  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide .*4 attention"):
        _engine(tiny_qwen3, 3)
    check_divisible(config, 4)  # 4 ranks: one head each, the 2 KV heads replicated
    shard = Shard(3, 4)
    assert shard.kv_replicas(config) == 2 and shard.kv_head_rows(config) == (1, 2)
    assert shard.local_config(config).num_kv_heads == 1


@pytest.mark.integration
def test_attention_biases_load_whole_and_sharded(model_factory, tmp_path):
    """A checkpoint with q/k/v/o biases (``attention_bias``; make-model writes none):
    one rank's logits match transformers', and two ranks' (q/k/v biases split by head,
    o's on rank 0 alone) match one rank's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path = tmp_path / "biased"
    shutil.copytree(model_factory("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    for i in range(config["num_hidden_layers"]):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            rows = tensors[f"model.layers.{i}.self_attn.{name}.weight"].shape[0]
            bias = torch.randn(rows, generator=generator) * 0.5
            tensors[f"model.layers.{i}.self_attn.{name}.bias"] = bias
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompt = list(range(10, 60))
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        want = reference(torch.tensor([prompt])).logits[0, -1]
    logits = {}
    for world in (1, 2):
        engine = _engine(path, world, num_pages=64)
        seen = []
        engine.on_logits = lambda seqs, rows, seen=seen: seen.append(rows.clone())
        try:
            engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
            while engine.has_unfinished():
                engine.step()
        finally:
            engine.close()
        logits[world] = seen[0][0]
    scale = want.abs().max().item()
    assert (logits[1] - want).abs().max().item() <= 1e-4 * scale
    assert (logits[2] - logits[1]).abs().max().item() <= 1e-5 * scale


@pytest.mark.integration
def test_a_rank_that_fails_to_start_fails_the_engine_with_its_reason(tiny_qwen3):
    """Rank 0 waits for the other ranks to load and build; an engine that cannot start
    raises what went wrong (not a secondary error from closing) and leaves no rank."""
    with pytest.raises(ValueError, match="not enough memory for the KV cache"):
        _engine(tiny_qwen3, 2, cpu_kv_cache_bytes=1)


def _rank_that_aborts_with_rank_0(conn, rank: int, folder) -> None:
    """A rank other than 0 as closing sees it: on its pipe's EOF it aborts its end of
    the group, which (as NCCL's abort does within a node) returns once rank 0 aborts
    too; exit code 0 if it did, 3 if it waited in vain. (Files say who aborts: a rank
    terminated while it waits leaves nothing half-held.)"""
    try:
        conn.recv_bytes()
    except EOFError:
        pass
    (folder / f"aborting{rank}").touch()
    raise SystemExit(0 if wait_until((folder / "aborting0").exists, 30) else 3)


@pytest.mark.integration  # ranks are processes
def test_closing_aborts_rank_0_while_the_other_ranks_abort(tmp_path):
    """NCCL's abort waits for every rank of a node, so ``Followers.close`` must run rank
    0's abort after the others start theirs (their pipes closed) and before it waits
    for them to exit: otherwise each waits for the other until the others are
    terminated, and rank 0's abort then waits for ranks that are gone."""
    import multiprocessing

    from workers.engine.tp.group import Followers

    context = multiprocessing.get_context("spawn")
    conns, processes = [], []
    for rank in (1, 2):
        mine, theirs = context.Pipe()
        process = context.Process(
            target=_rank_that_aborts_with_rank_0, args=(theirs, rank, tmp_path)
        )
        process.start()
        theirs.close()
        conns.append(mine)
        processes.append(process)
    met = []

    def rank_0_abort() -> None:  # returns once every other rank aborts as well
        (tmp_path / "aborting0").touch()
        met.append(all(wait_until((tmp_path / f"aborting{rank}").exists, 60) for rank in (1, 2)))

    Followers(conns, processes, store=None).close(while_they_stop=rank_0_abort)
    assert met == [True]
    assert [p.exitcode for p in processes] == [0, 0]


class _NcclGroupAsClosingSeesIt:
    """Only what ``Shard.close`` uses of an NCCL group: its name, and an abort that
    returns once ``others_aborted`` is set (the other ranks of the node)."""

    def __init__(self) -> None:
        self.others_aborted = threading.Event()

    def name(self) -> str:
        return "nccl"

    def abort(self) -> None:
        self.others_aborted.wait()


def test_an_abort_no_other_rank_meets_is_left_behind_and_closing_ends(monkeypatch, caplog):
    import workers.engine.tp.shard as shard_module

    monkeypatch.setattr(shard_module, "ABORT_WAIT_S", 0.2)
    met, alone = _NcclGroupAsClosingSeesIt(), _NcclGroupAsClosingSeesIt()
    met.others_aborted.set()
    try:
        assert Shard(0, 2, met).close() is True
        assert "left behind" not in caplog.text
        assert Shard(0, 2, alone).close() is False
        assert "rank 0's NCCL group has not aborted" in caplog.text
    finally:
        alone.others_aborted.set()  # the thread left behind ends
