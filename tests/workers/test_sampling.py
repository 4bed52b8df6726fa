from __future__ import annotations

import pytest
import torch

from workers import LLM, SamplingParams
from workers.engine.sampler import sample_on_device

PROMPT = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([PROMPT], p)[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.2, seed=7, ignore_eos=True)
    batched = llm.generate([[20, 21, 22], PROMPT, [30, 31]], [others, p, others])[1].token_ids
    assert alone == batched
    other_seed = llm.generate([PROMPT], SamplingParams(max_tokens=20, seed=43, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    top_k = llm.generate([PROMPT], SamplingParams(max_tokens=10, top_k=1, seed=1, ignore_eos=True))
    top_p = llm.generate(
        [PROMPT], SamplingParams(max_tokens=10, top_p=1e-6, seed=1, ignore_eos=True)
    )
    assert greedy[0].token_ids == top_k[0].token_ids == top_p[0].token_ids


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    seen_k = {
        sample_on_device(logits, [SamplingParams(top_k=2)], [gen]).tolist()[0] for _ in range(200)
    }
    assert seen_k == {0, 1}
    # probs ~ [.64, .24, .09, .03, .01]: top_p 0.8 keeps the first two only
    seen_p = {
        sample_on_device(logits, [SamplingParams(top_p=0.8)], [gen]).tolist()[0] for _ in range(200)
    }
    assert seen_p == {0, 1}
    assert sample_on_device(logits, [SamplingParams(temperature=0)], [None]).tolist() == [0]


def test_max_tokens_and_stop_token_ids(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(base.token_ids) == 12 and base.finish_reason == "length"
    stop_at = base.token_ids[5]
    first = base.token_ids.index(stop_at)
    out = llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,), ignore_eos=True),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]


def test_min_tokens_masks_stop_tokens_and_stop_strings_until_reached(llm):
    """vLLM's min_tokens: the first tokens are never a stop (or EOS) token, and a stop
    string made before them ends nothing."""
    base = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_at = base.token_ids[0]  # greedy's first token: stopping at it ends at once
    stopped = llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,))
    )[0]
    assert list(stopped.token_ids) == [stop_at] and stopped.finish_reason == "stop"
    held = llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,), min_tokens=5),
    )[0]
    assert len(held.token_ids) >= 5 and stop_at not in held.token_ids[:5]
    eos = llm.engine._eos_token_ids  # never among the first min_tokens, even if greedy
    forced = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, min_tokens=12))[0]
    assert len(forced.token_ids) == 12 and not eos & set(forced.token_ids)
    # a stop string in the first tokens' text ends nothing; a later one still stops
    stop = base.text[:2]
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, stop=(stop,), ignore_eos=True)
    )[0]
    assert out.text == "" and out.finish_reason == "stop"
    out = llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=12, temperature=0, stop=(stop,), ignore_eos=True, min_tokens=6),
    )[0]
    assert len(out.token_ids) >= 6
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_stop_strings_cut_text(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(base.text) > 6
    stop = base.text[4:6]
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=16, temperature=0, stop=(stop,), ignore_eos=True)
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[: base.text.find(stop)]


def test_eos_stops_unless_ignored(llm, model_factory):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    eos = base.token_ids[3]
    # same weights (same seed), but the config names a token we know comes up as EOS
    eos_llm = LLM(model_factory("qwen3", tied=False, eos_token_id=eos))
    ignored = eos_llm.generate(
        [PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )[0]
    assert ignored.token_ids == base.token_ids
    out = eos_llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: base.token_ids.index(eos) + 1]


def test_logprobs_match_reference_distribution(llm, hf_reference, tiny_qwen3):
    import torch

    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids) == 3
    ref = hf_reference(tiny_qwen3)
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + list(out.token_ids)])).logits[0].float()
    for step, entry in enumerate(out.logprobs):
        expected = torch.log_softmax(logits[len(PROMPT) - 1 + step], dim=-1)
        (chosen, chosen_lp), *top = entry
        assert chosen == out.token_ids[step] == top[0][0]  # greedy picks the top token
        assert abs(chosen_lp - expected[chosen].item()) < 1e-4
        assert [t for t, _ in top] == expected.topk(3).indices.tolist()
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
