"""The router's lookup keys are exactly keys the engine publishes (no Ray)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

from chunkstore.chunking import chunk_conversation, placeable_spans
from chunkstore.events import EventKind
from chunkstore.hashing import Namespace
from cluster.assembly import namespace_model
from cluster.config import parse_config
from cluster.routing.prompts import (
    EncodeCache,
    PromptLanes,
    direct_encoder,
    prepare_chat,
    prepare_text,
)
from workers.engine.checkpoint import load_tokenizer
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.reuse_info import ReuseRequest
from workers.engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[3]

SYSTEM = "You answer from the documents. " * 8
DOC = "Document: the harbor opens at six and closes at nine. " * 6


def messages(question: str) -> list[dict]:
    parts = [{"type": "text", "text": DOC}, {"type": "text", "text": question}]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def test_router_keys_are_engine_keys(tiny_qwen3):
    cfg = parse_config({"model": {"name": "tiny", "path": str(tiny_qwen3)}})
    engine = Engine(EngineConfig(model_dir=str(tiny_qwen3), model_id="tiny", page_size=16))
    assert namespace_model(cfg, tiny_qwen3) == engine.namespace_model
    namespace = Namespace(engine.namespace_model, "tenant-1")
    prompt = prepare_chat(engine.tokenizer, messages("Q?"), namespace, 16)
    engine.add_request("r", list(prompt.token_ids), SamplingParams(max_tokens=1), "tenant-1")
    while engine.has_unfinished():
        engine.step()
    stored = {k for e in engine.pool.drain_events() if e.kind is EventKind.STORED for k in e.keys}
    assert prompt.lookup_keys and set(prompt.lookup_keys) <= stored
    chunks = chunk_conversation(engine.tokenizer, messages("Q?"))
    ends, total = [], 0
    for chunk in chunks:
        total += len(chunk.token_ids)
        ends.append(total // 16 * 16)
    assert list(prompt.token_ends) == sorted(set(e for e in ends if e))
    other_tenant = prepare_chat(engine.tokenizer, messages("Q?"), Namespace(namespace.model_id), 16)
    assert not set(other_tenant.lookup_keys) & stored


def test_router_entry_keys_are_engine_entry_keys(tiny_qwen3):
    """An approximate request's prompt carries its placeable spans and their entry keys,
    exactly the keys of the entries the engine fills (and publishes) for them."""
    engine = Engine(EngineConfig(model_dir=str(tiny_qwen3), model_id="tiny", page_size=16))
    namespace = Namespace(engine.namespace_model, "tenant-1")
    two_docs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": DOC},
        {"role": "user", "content": "Second document: " + DOC},
        {"role": "user", "content": "Q?"},
    ]
    exact = prepare_chat(engine.tokenizer, two_docs, namespace, 16)
    assert (exact.placeable, exact.entry_keys) == ((), ())
    prompt = prepare_chat(engine.tokenizer, two_docs, namespace, 16, approximate=True)
    assert prompt.placeable == placeable_spans(chunk_conversation(engine.tokenizer, two_docs))
    assert len(prompt.entry_keys) == len(prompt.placeable) == 2
    assert prompt.lookup_keys == exact.lookup_keys and prompt.token_ids == exact.token_ids
    engine.add_request(
        "r",
        list(prompt.token_ids),
        SamplingParams(max_tokens=1),
        "tenant-1",
        placeable=prompt.placeable,
        reuse=ReuseRequest("approximate"),
    )
    while engine.has_unfinished():  # the request, then its documents' entry fills
        engine.step()
    events = engine.pool.drain_events()
    filled = [k for e in events if e.kind is EventKind.ENTRY_STORED for k in e.keys]
    assert sorted(filled) == sorted(prompt.entry_keys)


def test_encode_cache_gives_the_tokenizer_tokens_and_stays_within_its_bound(tiny_qwen3):
    tokenizer = load_tokenizer(tiny_qwen3)
    cache = EncodeCache(tokenizer, max_chars=3 * len(DOC), min_chars=64)
    namespace = Namespace("tiny@x", "")
    for question in ("Q: one?", "Q: two?", "Q: one?"):
        cached = prepare_chat(cache, messages(question), namespace, 16)
        assert cached == prepare_chat(tokenizer, messages(question), namespace, 16)
    # the system prompt and document are kept from the first request on; questions never
    assert cache.hits == 4
    docs = [f"Document {i}: " + DOC for i in range(5)]
    for doc in docs:
        assert cache.encode(doc, add_special_tokens=False) == tokenizer.encode(
            doc, add_special_tokens=False
        )
    assert cache.encode(docs[-1], add_special_tokens=False) == tokenizer.encode(
        docs[-1], add_special_tokens=False
    )
    assert cache.hits == 5
    before = cache.hits
    cache.encode(docs[0], add_special_tokens=False)  # dropped: the bound holds 2 of these
    assert cache.hits == before
    returned = cache.encode(docs[0], add_special_tokens=False)
    returned.append(-1)  # callers own what they get
    assert cache.encode(docs[0], add_special_tokens=False)[-1] != -1


def test_caches_sharing_a_store_find_each_others_texts(tiny_qwen3):
    tokenizer = load_tokenizer(tiny_qwen3)
    first = EncodeCache(tokenizer, max_chars=10 * len(DOC), min_chars=64)
    second = first.sharing(copy.deepcopy(tokenizer))
    expected = tokenizer.encode(DOC, add_special_tokens=False)
    assert first.encode(DOC, add_special_tokens=False) == expected
    assert second.encode(DOC, add_special_tokens=False) == expected
    assert (first.hits, second.hits) == (1, 1)  # one store, one count


def test_prompt_lanes_prepare_small_and_large_prompts_alike(tiny_qwen3):
    tokenizer = load_tokenizer(tiny_qwen3)
    lanes = PromptLanes(tokenizer, cache_chars=2**20, large_chars=len(DOC))
    namespace = Namespace("tiny@x", "")
    assert (lanes.lane(len(DOC)), lanes.lane(len(DOC) + 1)) == (lanes.SMALL, lanes.LARGE)

    async def both() -> list:
        return await asyncio.gather(
            lanes.run(lanes.SMALL, lambda t: prepare_text(t, DOC, namespace, 16)),
            lanes.run(lanes.LARGE, lambda t: prepare_text(t, DOC + DOC, namespace, 16)),
        )

    small, large = asyncio.run(both())
    assert small == prepare_text(tokenizer, DOC, namespace, 16)
    assert large == prepare_text(tokenizer, DOC + DOC, namespace, 16)


def test_direct_encoder_gives_the_tokenizers_ids(tiny_qwen3, tiny_llama):
    """The Rust tokenizer called directly, where the probes find it equal: the same ids
    as the tokenizer's ``encode`` over the shipped corpus, with and without special
    tokens; a tokenizer without one is called as it is."""
    corpus = (REPO / "modeltools/data/corpus.txt").read_text().splitlines()[:200]
    for model in (tiny_qwen3, tiny_llama):
        tokenizer = load_tokenizer(model)
        encode = direct_encoder(tokenizer)
        assert encode.__name__ == "direct"
        for text in corpus + ["".join(corpus[:20]), " <|im_start|> x", ""]:
            for special in (True, False):
                assert encode(text, special) == tokenizer.encode(text, add_special_tokens=special)

    class Plain:  # no backend_tokenizer: its own encode
        def encode(self, text, add_special_tokens=True):
            return [len(text), int(add_special_tokens)]

    assert direct_encoder(Plain())("abc", False) == [3, 0]
