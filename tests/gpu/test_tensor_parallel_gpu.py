"""Tensor parallelism on GPUs (NCCL, bf16, FlashInfer, CUDA graphs): two ranks answer
the doc-QA questions as one does; a model larger than one GPU is refused on one GPU,
saying so, and serves on two. The multi-GPU tests skip on a host with one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.reuse_quality import build_prompt
from modeltools.docqa_data import answer_matches, generate
from modeltools.make_model import make_model
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampling_params import SamplingParams

DOCQA = Path(__file__).resolve().parents[2] / "modeltools" / "docqa_model"
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory) -> Path:
    """Llama 3 70B's config and tokenizer, no weights (load_format dummy)."""
    out = tmp_path_factory.mktemp("llama3-70b")
    return make_model(out, preset="llama3-70b", family="llama", weights=False)


def _answers(engine: Engine, examples) -> list[str]:
    params = SamplingParams(max_tokens=12, temperature=0)
    tokens = {}
    for i, example in enumerate(examples):
        engine.add_request(str(i), build_prompt(engine.tokenizer, example).token_ids, params)
        tokens[str(i)] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [engine.tokenizer.decode(tokens[str(i)], skip_special_tokens=True) for i in tokens]


def test_a_model_larger_than_one_gpu_is_refused_on_one(llama_70b):
    config = EngineConfig(str(llama_70b), device="cuda", load_format="dummy", num_pages=64)
    with pytest.raises(ValueError, match="does not fit: its weights take 13[0-9].[0-9] GiB"):
        Engine(config)


@TWO_GPUS
def test_two_ranks_answer_the_docqa_questions_as_one():
    examples = generate(5, 20, 8, "heldout", 1) + generate(6, 20, 8, "heldout", 2)
    answers = []
    for world in (1, 2):
        # pages given: the first engine's memory is still held when the second sizes its pool
        engine = Engine(
            EngineConfig(str(DOCQA), device="cuda", tensor_parallel_size=world, num_pages=4096)
        )
        try:
            answers.append(_answers(engine, examples))
        finally:
            engine.close()
    assert answers[0] == answers[1]
    right = sum(answer_matches(a, ex.answer) for a, ex in zip(answers[1], examples, strict=True))
    assert right >= 36  # the shipped model's accuracy, on two ranks


@TWO_GPUS
def test_a_model_larger_than_one_gpu_serves_on_two(llama_70b):
    engine = Engine(
        EngineConfig(
            str(llama_70b), device="cuda", load_format="dummy", tensor_parallel_size=2,
            max_model_len=4096, max_num_seqs=8, num_pages=2048,
        )
    )  # fmt: skip
    try:
        engine.add_request("r", list(range(100, 612)), SamplingParams(max_tokens=8))
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        assert len(tokens) == 8
    finally:
        engine.close()


@TWO_GPUS
def test_two_ranks_load_prefixes_from_host_memory_as_one():
    """Host hits on two ranks: each rank loads its KV heads' pages unfenced and waits
    for them only once rank 0 lands the load (``tp.group.FollowingCopier``), several
    loads in flight while other requests step. The answers are one rank's, right."""
    from tests.workers.test_host_tier import _push_out

    examples = generate(7, 12, 8, "heldout", 1)
    answers, loaded = [], []
    for world in (1, 2):
        engine = Engine(
            EngineConfig(
                str(DOCQA), device="cuda", tensor_parallel_size=world, num_pages=4096,
                host_kv_gib=1.0,
            )
        )  # fmt: skip
        try:
            _answers(engine, examples)
            _push_out(engine)  # every cached page to host memory
            answers.append(_answers(engine, examples))
            loaded.append(engine.pool.host.stats().pages_loaded)
        finally:
            engine.close()
    assert answers[0] == answers[1]
    assert loaded[0] == loaded[1] > 0
    right = sum(answer_matches(a, ex.answer) for a, ex in zip(answers[1], examples, strict=True))
    assert right >= 9
