"""Bad input raises ValueError with an actionable message and harms no other request."""

from __future__ import annotations

import json
import shutil

import pytest

from workers import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, max_model_len=128)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt,message",
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([1, 2, 10**6], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        (list(range(10, 140)), "at most 127 prompt tokens"),
    ],
)
def test_bad_prompts_leave_other_requests_unharmed(llm, prompt, message):
    good = [5, 6, 7, 8, 9]
    expected = llm.generate([good], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], GREEDY)
    assert not llm.engine.has_unfinished()  # the good request was withdrawn, not stuck
    assert llm.generate([good], GREEDY)[0].token_ids == expected


def test_generation_stops_at_context_length(llm):
    out = llm.generate([list(range(10, 120))], SamplingParams(max_tokens=50, temperature=0))[0]
    assert out.finish_reason in ("length", "stop")
    assert len(out.prompt_token_ids) + len(out.token_ids) <= 128


def test_params_count_mismatch(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY, GREEDY])


def test_context_longer_than_the_model_supports(tiny_qwen3):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 4096"):
        LLM(tiny_qwen3, max_model_len=8192)


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(tmp_path)


@pytest.mark.parametrize(
    "damage,message",
    [
        ("bad_json", "not valid JSON"),
        ("no_weights", "no model.safetensors"),
        ("wrong_arch", "unsupported model"),
        ("missing_field", "lacks required field 'hidden_size'"),
        ("shape_mismatch", "does not match"),
        ("corrupt_weights", "cannot read"),
    ],
)
def test_malformed_checkpoint(tiny_qwen3, tmp_path, damage, message):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3, broken)
    config = json.loads((broken / "config.json").read_text())
    if damage == "bad_json":
        (broken / "config.json").write_text("{not json")
    elif damage == "no_weights":
        for f in broken.glob("*.safetensors*"):
            f.unlink()
    elif damage == "wrong_arch":
        config["architectures"], config["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    elif damage == "missing_field":
        del config["hidden_size"]
    elif damage == "shape_mismatch":
        config["intermediate_size"] = 96
    elif damage == "corrupt_weights":
        weights = next(broken.glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:100])
    if damage in ("wrong_arch", "missing_field", "shape_mismatch"):
        (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(broken)
