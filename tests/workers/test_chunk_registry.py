"""Registered chunks: generation from ids is exact, pinned pages survive pressure
until their TTL ends or they are unregistered, and bad input pins nothing."""

from __future__ import annotations

import random

import pytest

from chunkstore.chunking import chunk_conversation, longest_token_chars
from chunkstore.events import EventKind
from chunkstore.hashing import page_keys
from workers import LLM, SamplingParams
from workers.engine.chunk_registry import UnknownChunkError

PAGE = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SYSTEM = "You are a terse assistant who answers from the documents. " * 3
DOC = "Document: the quick brown fox jumps over the lazy dog near the river bank. " * 4
QUERY = "What jumps over the dog?"
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": DOC},
    {"role": "user", "content": QUERY},
]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_llm(tiny_qwen3):
    """A small pool: 40 pages of 16, at most 256 tokens per request (24 pinnable pages)."""

    def make(**kw) -> LLM:
        options = {"page_size": PAGE, "num_pages": 40, "max_model_len": 256, **kw}
        return LLM(tiny_qwen3, **options)

    return make


def _register_all(llm: LLM) -> tuple[str, str, str]:
    system = llm.register_chunk(SYSTEM, role="system")
    doc = llm.register_chunk(DOC, after=[system])
    query = llm.register_chunk(QUERY, role="query", after=[system, doc])
    return system, doc, query


def _info(llm: LLM, chunk_id: str):
    return next(c for c in llm.list_chunks() if c.chunk_id == chunk_id)


def _removed_keys(llm: LLM) -> set[bytes]:
    events = llm.engine.pool.drain_events()
    return {k for e in events if e.kind is EventKind.REMOVED for k in e.keys}


def _flood(llm: LLM, seed: int = 0) -> None:
    """Unrelated requests needing far more pages than the pool has."""
    rng = random.Random(seed)
    prompts = [rng.choices(range(10, 500), k=200) for _ in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))


def _unregister_all_and_check_no_leaks(llm: LLM) -> None:
    for info in llm.list_chunks():
        llm.unregister_chunk(info.chunk_id)
    pool = llm.engine.pool
    assert llm.list_chunks() == [] and pool.num_pinned == 0
    assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages))
    assert pool.num_available == pool.num_pages


def test_generation_from_chunks_equals_inline_chat(make_llm):
    llm, plain = make_llm(), make_llm(enable_reuse=False)
    system, doc, query = _register_all(llm)
    out = llm.generate_from_chunks([system, doc, query], GREEDY)
    inline = plain.chat(MESSAGES, GREEDY)[0]
    assert out.token_ids == inline.token_ids and out.text == inline.text
    assert out.prompt_token_ids == inline.prompt_token_ids
    pinned = _info(llm, query).pinned_tokens
    assert pinned == len(_prefix_keys(llm, MESSAGES)) * PAGE
    assert out.num_cached_tokens >= pinned > _info(llm, doc).pinned_tokens > 0
    for chunk_id in (system, doc, query):
        info = _info(llm, chunk_id)
        assert info.hits == 1 and 0 < info.tokens_saved <= info.num_tokens
    # another order is still exact; only the system prompt's pages match there
    swapped = llm.generate_from_chunks([system, query, doc], GREEDY)
    swapped_inline = plain.chat([MESSAGES[0], MESSAGES[2], MESSAGES[1]], GREEDY)[0]
    assert swapped.token_ids == swapped_inline.token_ids
    assert _info(llm, system).pinned_tokens <= swapped.num_cached_tokens
    assert swapped.num_cached_tokens < _info(llm, doc).pinned_tokens
    assert _info(llm, system).hits == 2 and _info(llm, doc).hits == 1
    _unregister_all_and_check_no_leaks(llm)


def test_identical_content_is_deduplicated_and_refreshes_ttl(make_llm):
    clock = Clock()
    llm = make_llm(clock=clock)
    first = llm.register_chunk(DOC, ttl_s=10)
    pinned = llm.engine.pool.num_pinned
    assert pinned == _info(llm, first).pinned_tokens // PAGE > 0
    clock.now = 5
    assert llm.register_chunk(DOC, ttl_s=10) == first
    assert llm.engine.pool.num_pinned == pinned
    assert max(llm.engine.pool.pin_count(p) for p in range(40)) == 1  # pinned once
    assert _info(llm, first).expires_at == 15
    # role and context are part of the identity
    assert llm.register_chunk(DOC, role="query") != first
    system = llm.register_chunk(SYSTEM, role="system")
    assert llm.register_chunk(DOC, after=[system]) != first
    assert len(llm.list_chunks()) == 4
    _unregister_all_and_check_no_leaks(llm)


def test_pinned_chunk_survives_a_flood_that_evicts_an_unpinned_prefix(make_llm):
    pinned_llm, unpinned_llm = make_llm(), make_llm()
    system, doc, query = _register_all(pinned_llm)
    unpinned_llm.chat(MESSAGES, GREEDY)  # the identical prefix, cached but unpinned
    for llm in (pinned_llm, unpinned_llm):
        _flood(llm)
        assert _removed_keys(llm), "the flood evicted nothing"
    out = pinned_llm.generate_from_chunks([system, doc, query], GREEDY)
    assert out.num_cached_tokens >= _info(pinned_llm, query).pinned_tokens > 0
    assert unpinned_llm.chat(MESSAGES, GREEDY)[0].num_cached_tokens == 0
    assert out.token_ids == unpinned_llm.chat(MESSAGES, GREEDY)[0].token_ids
    _unregister_all_and_check_no_leaks(pinned_llm)


def test_ttl_expiry_unpins_and_evicts(make_llm):
    clock = Clock()
    llm = make_llm(clock=clock)
    doc = llm.register_chunk(DOC, ttl_s=5)
    keep = llm.register_chunk(SYSTEM, role="system")
    doc_keys = _prefix_keys(llm, [{"role": "user", "content": DOC}])
    llm.engine.pool.drain_events()
    clock.now = 4.9
    assert len(llm.list_chunks()) == 2
    clock.now = 5
    assert [c.chunk_id for c in llm.list_chunks()] == [keep]
    assert llm.engine.pool.num_pinned == _info(llm, keep).pinned_tokens // PAGE
    assert doc_keys and _removed_keys(llm) >= doc_keys
    assert not doc_keys & set(llm.engine.pool.cached_keys())
    with pytest.raises(UnknownChunkError, match="TTL"):
        llm.generate_from_chunks([doc])
    _unregister_all_and_check_no_leaks(llm)


def test_unregister_evicts_pages_no_one_else_holds(make_llm):
    llm = make_llm()
    system, doc, query = _register_all(llm)
    system_keys = _prefix_keys(llm, MESSAGES[:1])
    query_keys = _prefix_keys(llm, MESSAGES) - system_keys
    llm.engine.pool.drain_events()
    llm.unregister_chunk(doc)
    assert _removed_keys(llm) == set()  # the query chunk's prefix still pins doc's pages
    llm.unregister_chunk(query)
    removed = _removed_keys(llm)
    assert query_keys and removed == query_keys
    assert system_keys <= set(llm.engine.pool.cached_keys())  # pinned by the system chunk
    with pytest.raises(UnknownChunkError):
        llm.unregister_chunk(doc)
    _unregister_all_and_check_no_leaks(llm)


def test_pin_over_the_limit_is_refused_and_pins_nothing(make_llm):
    llm = make_llm(max_model_len=512)  # 40 - 512 / 16 = 8 pinnable pages
    with pytest.raises(ValueError, match="at most 128 tokens"):
        llm.register_chunk(DOC * 2)
    assert llm.list_chunks() == [] and llm.engine.pool.num_pinned == 0
    system = llm.register_chunk(SYSTEM, role="system")
    assert 0 < _info(llm, system).pinned_tokens <= 128
    _unregister_all_and_check_no_leaks(llm)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"content": DOC, "role": "assistant"}, "role must be one of"),
        ({"content": DOC, "ttl_s": 0}, "ttl_s must be a positive"),
        ({"content": DOC, "ttl_s": -3}, "ttl_s must be a positive"),
        ({"content": "  "}, "content is empty"),
        ({"content": []}, "non-empty"),
        ({"content": DOC, "after": ["nope"]}, "unknown chunk id 'nope'"),
    ],
)
def test_bad_registrations_pin_nothing(make_llm, kwargs, match):
    llm = make_llm()
    with pytest.raises(ValueError, match=match):
        llm.register_chunk(**kwargs)
    assert llm.list_chunks() == [] and llm.engine.pool.num_pinned == 0


def test_content_the_context_could_not_hold_is_refused_before_it_is_rendered(make_llm):
    """More messages than the context has tokens, or more characters than its tokens
    could spell: refused by counting alone (a chunk of 3,000 messages once took 24 s
    to render on the worker, delaying every other tenant's request)."""
    llm = make_llm()  # a context of 256 tokens
    spelled = 256 * longest_token_chars(llm.tokenizer)
    cases = [
        ([{"role": "user", "content": ""}] * 257, "the chunk has 257 messages"),
        ("x" * (spelled + 1), f"the chunk has {spelled + 1} characters"),
    ]
    for content, says in cases:
        with pytest.raises(ValueError, match=says):
            llm.register_chunk(content)
    assert llm.list_chunks() == [] and llm.engine.pool.num_pinned == 0


def test_unknown_ids_are_refused(make_llm):
    llm = make_llm()
    with pytest.raises(UnknownChunkError, match="unknown chunk id 'missing'"):
        llm.generate_from_chunks(["missing"])
    with pytest.raises(UnknownChunkError):
        llm.unregister_chunk("missing")
    with pytest.raises(ValueError, match="non-empty list"):
        llm.generate_from_chunks([])


def _prefix_keys(llm: LLM, messages: list[dict]) -> set[bytes]:
    """Page keys of a chunk prefix: the full pages a chunk with these messages pins."""
    chunks = chunk_conversation(llm.tokenizer, messages, add_generation_prompt=False)
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    return set(page_keys(tokens, PAGE, llm.engine.namespace()))


def _tenant_registry(llm: LLM, salt: str):
    """A registry of another tenant on the same engine (as a worker keeps one each)."""
    from workers.engine.chunk_registry import ChunkRegistry

    engine = llm.engine

    def compute(tokens: list[int]) -> None:
        rid = f"pin-{salt}-{len(tokens)}-{tokens[:4]}"
        engine.add_request(rid, tokens, SamplingParams(max_tokens=1), tenant_salt=salt)
        while engine.has_unfinished():
            engine.step()

    return ChunkRegistry(engine, compute, tenant_salt=salt, step_until=llm._step_until)


def test_pin_quota_holds_per_tenant_and_refusals_speak_only_of_the_callers_pins(make_llm):
    llm = make_llm(pin_quota_tokens=96)
    a, b = _tenant_registry(llm, "tenant-a"), _tenant_registry(llm, "tenant-b")
    texts = [f"Document {i}: the archive of station {i} holds tide tables. " * 2 for i in range(4)]
    a.register(texts[0])
    a.register(texts[1])
    pinned = a.pinned_tokens()
    assert 0 < pinned <= 96
    with pytest.raises(
        ValueError, match=f"your chunks pin {pinned} of your quota of 96"
    ) as refused:
        a.register(texts[2])
    assert a.pinned_tokens() == pinned  # nothing pinned by the refusal
    b.register(texts[2])  # another tenant's quota is its own
    assert b.pinned_tokens() > 0 and str(b.pinned_tokens() + pinned) not in str(refused.value)

    # The worker's room (24 pages here): once tenant B holds most of it, tenant A's
    # refusal names A's own pins, never the worker's total.
    roomy = make_llm()
    a, b = _tenant_registry(roomy, "tenant-a"), _tenant_registry(roomy, "tenant-b")
    long_text = "Tide tables for every station of the northern coast, by the hour. " * 9
    b.register(long_text)
    b.register(long_text.replace("northern", "southern"))
    with pytest.raises(ValueError, match="your chunks pin 0 tokens") as full:
        a.register(long_text)
    message = str(full.value)
    assert "no room" in message and "pinned already" not in message
    assert str(roomy.engine.pool.num_pinned * PAGE) not in message.split("may be pinned")[-1]
