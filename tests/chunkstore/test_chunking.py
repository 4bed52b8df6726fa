from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from chunkstore.chunking import chunk_conversation, chunk_prompt


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tokenizer(request, model_factory):
    return AutoTokenizer.from_pretrained(model_factory(request.param))


def _flat(chunks):
    return [t for c in chunks for t in c.token_ids]


def test_one_chunk_per_message_plus_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hello there."},
    ]
    chunks = chunk_conversation(tokenizer, messages)
    assert [c.role for c in chunks] == ["system", "user", "generation"]
    text = tokenizer.decode(_flat(chunks))
    assert text == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_chunk_tokens_do_not_depend_on_what_follows(tokenizer):
    doc = {"role": "user", "content": "The river runs past the old mill."}
    a = chunk_conversation(tokenizer, [{"role": "system", "content": "S"}, doc])
    b = chunk_conversation(
        tokenizer, [{"role": "system", "content": "S"}, doc, {"role": "user", "content": "More"}]
    )
    assert a[1] == b[1]


def test_text_parts_give_one_chunk_each(tokenizer):
    parts = [{"type": "text", "text": t} for t in ("Doc one. ", "Doc two. ", "Question?")]
    messages = [{"role": "system", "content": "Sys"}, {"role": "user", "content": parts}]
    chunks = chunk_conversation(tokenizer, messages)
    # the message's header, then one chunk per part (the footer joins the last)
    assert [c.role for c in chunks] == ["system", "user", "user", "user", "user", "generation"]
    assert tokenizer.decode(list(chunks[1].token_ids)) == tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], tokenize=False
    ).split("<|im_end|>")[0].split("<|eot_id|>")[0].replace("<|begin_of_text|>", "")
    text = tokenizer.decode(_flat(chunks))
    assert text == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    # a part keeps its tokens when the parts around it change
    other = [parts[1], {"type": "text", "text": "Another question?"}]
    swapped = chunk_conversation(tokenizer, [messages[0], {"role": "user", "content": other}])
    middle = chunk_conversation(
        tokenizer, [messages[0], {"role": "user", "content": [parts[0], parts[1], parts[2]]}]
    )
    assert middle[3].token_ids == tuple(tokenizer.encode("Doc two. ", add_special_tokens=False))
    # first in the message or second, a part is the same chunk
    assert swapped[2].token_ids == middle[3].token_ids


@pytest.mark.parametrize(
    "messages,message",
    [
        ([], "non-empty list"),
        ([{"role": "user"}], "'role' and 'content'"),
        ([{"role": "", "content": "x"}], "role must be a non-empty string"),
        ([{"role": "user", "content": []}], "string or a non-empty list"),
        ([{"role": "user", "content": [{"type": "image"}]}], "'type': 'text'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
    ],
)
def test_bad_messages(tokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        chunk_conversation(tokenizer, messages)


def test_plain_prompt_is_one_chunk(tokenizer):
    (chunk,) = chunk_prompt(tokenizer, "hello world")
    assert tokenizer.decode(chunk.token_ids) == "hello world"
    with pytest.raises(ValueError, match="empty"):
        chunk_prompt(tokenizer, "")


def test_placeable_spans_skip_the_opening_chunk_the_question_and_the_generation_prompt():
    from chunkstore.chunking import Chunk, placeable_spans

    chunks = [
        Chunk("system", (1, 2, 3)),
        Chunk("user", (4, 5)),
        Chunk("user", (6, 7, 8, 9)),
        Chunk("user", (10,)),
        Chunk("generation", (11, 12)),
    ]
    assert placeable_spans(chunks) == ((3, 5), (5, 9))
    assert placeable_spans(chunks[:2]) == ()
    assert placeable_spans([Chunk("query", (1, 2))]) == ()


def test_continuing_the_final_assistant_message_ends_the_prompt_inside_it(tokenizer):
    prefill = "The answer is"
    messages = [
        {"role": "user", "content": "What is the answer?"},
        {"role": "assistant", "content": prefill},
    ]
    opened = _flat(chunk_conversation(tokenizer, messages, False, continue_final_message=True))
    closed = _flat(chunk_conversation(tokenizer, messages, add_generation_prompt=False))
    new_turn = _flat(chunk_conversation(tokenizer, messages))
    # continuing: the prompt ends with the prefill's own tokens, the end-of-turn gone
    assert tokenizer.decode(opened).endswith(prefill)
    assert closed[: len(opened)] == opened and len(closed) > len(opened)
    assert len(new_turn) > len(closed)  # closed, then a new assistant header
    with pytest.raises(ValueError, match="cannot both be true"):
        chunk_conversation(tokenizer, messages, True, continue_final_message=True)
    with pytest.raises(ValueError, match="the assistant's"):
        chunk_conversation(tokenizer, messages[:1], False, continue_final_message=True)


class CountingRenders:
    """The real tokenizer, counting the messages its chat template renders."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.messages_rendered = 0

    def apply_chat_template(self, conversation, **kwargs):
        self.messages_rendered += len(conversation)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def encode(self, text, add_special_tokens=True):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_chunking_renders_a_number_of_messages_linear_in_the_conversation(tokenizer):
    """Thousands of empty messages (a few KB of JSON) must not cost quadratic work:
    ten times the messages render about ten times as many, not a hundred."""
    rendered = {}
    for n in (200, 2000):
        counting = CountingRenders(tokenizer)
        roles = ("system", "user", "assistant")
        messages = [{"role": roles[min(k, 1 + k % 2)], "content": ""} for k in range(n)]
        chunks = chunk_conversation(counting, messages)
        assert tokenizer.decode(_flat(chunks)) == tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        rendered[n] = counting.messages_rendered
    assert rendered[2000] <= 12 * rendered[200], rendered


def test_more_distinct_roles_than_chunking_renders_make_one_exact_chunk(tokenizer):
    from chunkstore.chunking import MAX_ROLES

    messages = [{"role": f"role{k}", "content": f"text {k}"} for k in range(MAX_ROLES + 1)]
    chunks = chunk_conversation(tokenizer, messages)
    assert [c.role for c in chunks] == ["conversation"]
    assert tokenizer.decode(_flat(chunks)) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    fewer = chunk_conversation(tokenizer, messages[:MAX_ROLES])
    assert [c.role for c in fewer][:-1] == [m["role"] for m in messages[:MAX_ROLES]]
