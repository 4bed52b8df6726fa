"""The offline API's reuse switch: ``LLM.chat(..., reuse=...)`` places documents'
position-free KV when asked for approximate reuse, and never otherwise."""

from __future__ import annotations

import pytest

from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams
from workers.llm import LLM, reuse_request

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
SYSTEMS = (
    "You are a careful assistant for the Harbor Analytics documentation. " * 2,
    "Answer briefly and cite the document you used for every claim you make. " * 2,
)
DOCS = (  # each well above min_entry_tokens (32) as a chat message
    "Document A: Starter costs 29 dollars a month for five seats and one workspace. " * 2,
    "Document B: Backups run every six hours and are kept for thirty days in two regions. " * 2,
    "Document C: Reports export to CSV, Excel and PDF; the API allows 600 requests. " * 2,
)


def conversation(system: str, docs: tuple[str, ...], question: str) -> list[dict]:
    """Documents as messages of their own: the same tokens wherever they appear."""
    documents = [{"role": "user", "content": d} for d in docs]
    return [
        {"role": "system", "content": system},
        *documents,
        {"role": "user", "content": question},
    ]


@pytest.fixture(scope="module")
def llms(tiny_qwen3):
    config = dict(page_size=16, num_pages=256, device="cpu")
    return LLM(tiny_qwen3, **config), LLM(tiny_qwen3, enable_reuse=False, **config)


def test_approximate_chat_places_documents_after_another_system_prompt(llms):
    llm, plain = llms
    first = llm.chat(conversation(SYSTEMS[0], DOCS, "Q: price?"), GREEDY, reuse="approximate")[0]
    assert (first.reuse.mode, first.reuse.reused_tokens, first.reuse.recomputed_tokens) == (
        "approximate",
        0,
        0,
    )
    # the documents in another order, after another system prompt: nothing matches exactly
    reordered = conversation(SYSTEMS[1], DOCS[::-1], "Q: backups?")
    repair = {"mode": "approximate", "first_tokens": 4, "deviation_ratio": 0}
    second = llm.chat(reordered, GREEDY, reuse=repair)[0]
    assert second.reuse.mode == "approximate"
    assert second.reuse.reused_tokens > 0
    assert second.reuse.recomputed_tokens == 4 * len(DOCS)
    assert second.num_cached_tokens == second.reuse.reused_tokens

    # the same prompt asked exactly (the default): plain generation's output, no placed KV
    exact = llm.chat(reordered, GREEDY)[0]
    want = plain.chat(reordered, GREEDY)[0]
    assert exact.reuse.mode == "exact" and exact.reuse.recomputed_tokens == 0
    assert exact.token_ids == want.token_ids
    assert want.reuse.mode == "off"


def test_reuse_argument_forms(llms):
    llm, _ = llms
    as_request = ReuseRequest("approximate", first_tokens=2, deviation_ratio=0.25)
    assert reuse_request(as_request) is as_request
    assert reuse_request(None) == reuse_request("exact") == ReuseRequest()
    assert reuse_request({"mode": "approximate", "deviation_ratio": 0}) == ReuseRequest(
        "approximate", deviation_ratio=0.0
    )
    # a plain prompt is one chunk: nothing placeable, served (and labelled) as asked
    out = llm.generate("The harbor at dawn", GREEDY, reuse=as_request)[0]
    assert out.reuse.mode == "approximate" and out.reuse.recomputed_tokens == 0


@pytest.mark.parametrize(
    ("reuse", "message"),
    [
        ("fast", "choose one of"),
        ({"mode": "approximate", "first_tokens": -1}, "first_tokens"),
        ({"mode": "approximate", "deviation_ratio": 2}, r"deviation_ratio must be in \[0, 1\]"),
        ({"first_tokens": 4}, "'mode'"),
        (3, "reuse must be one of"),
    ],
)
def test_bad_reuse_arguments_raise_value_error(llms, reuse, message):
    llm, _ = llms
    with pytest.raises(ValueError, match=message):
        llm.chat(conversation(SYSTEMS[0], DOCS[:1], "Q?"), GREEDY, reuse=reuse)
    assert not llm.engine.has_unfinished()


def test_bools_are_not_token_ids(llms):
    """A bool is an int to Python (the engine would take True as token 1): refused."""
    llm, _ = llms
    with pytest.raises(ValueError, match="prompt 1: .* bool at position 2"):
        llm.generate_tokens([[5, 6, 7], [5, 6, True, 7]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate_tokens([[5, 6, 7]], GREEDY)[0].token_ids) == 4
