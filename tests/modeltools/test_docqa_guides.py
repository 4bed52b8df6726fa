"""Attention guides of doc-QA training: the positions they name and their loss."""

from __future__ import annotations

import math
import random

import pytest
import torch

from modeltools import docqa_data
from modeltools.docqa_guides import (
    ANSWER,
    BIND,
    BRIDGE,
    SUBJECT,
    GuideFinder,
    guide_heads,
    guide_loss,
    guide_tensor,
)
from modeltools.docqa_train import _batch_ids, build_docqa_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_docqa_tokenizer()


def _document_spans(tokenizer, ex, seq):
    """(start, end) token span of each document in the prompt, in order."""
    spans, start = [], 0
    header = tokenizer.encode("<|im_start|>system\n" + ex.system + "<|im_end|>\n<|im_start|>user\n")
    start = len(header)
    for doc in ex.documents:
        n = len(tokenizer.encode(doc))
        spans.append((start, start + n))
        start += n
    return spans


def test_guides_name_subjects_links_and_answers(tokenizer):
    finder = GuideFinder(tokenizer)
    rng = random.Random("guides")
    examples = [
        docqa_data.generate_example(rng, rng.randint(2, 16), "train", questions=4, reverse=True)
        for _ in range(60)
    ]
    seen = set()
    for ex, segments in zip(examples, _batch_ids(tokenizer, examples), strict=True):
        seq = [t for ids, _ in segments for t in ids]
        spans = _document_spans(tokenizer, ex, seq)
        guides = finder.guides(segments)

        def word(p, seq=seq):
            return tokenizer.decode([seq[p]])

        def doc_of(p, spans=spans):
            return next(i for i, (a, b) in enumerate(spans) if a <= p < b)

        assert all(target < source for _, source, target in guides)
        binds = [(s, t) for r, s, t in guides if r == BIND]
        assert len(binds) == 2 * len(ex.documents)  # every document states two values
        for source, target in binds:
            doc = ex.documents[doc_of(source)]
            assert doc_of(target) == doc_of(source)
            subject = doc.split(": ", 1)[1].split(" ")[0 if doc.startswith("Staff") else 1]
            assert word(target) == " " + subject and word(source).strip() in doc
        # the first question: its subject, the link (two hops) and the answer
        first = len(segments[0][0]) - 1
        by_role = {r: t for r, s, t in guides if s == first}
        assert word(by_role[SUBJECT]) == " " + ex.combo[1]
        assert word(by_role[ANSWER]) == " " + ex.answer
        assert doc_of(by_role[ANSWER]) == ex.gold[-1]
        if ex.hops == 2:
            assert word(by_role[BRIDGE]) == " " + ex.combo[2]
            assert doc_of(by_role[BRIDGE]) == ex.gold[0]
        else:
            assert BRIDGE not in by_role
        seen |= set(by_role)
    assert seen == {SUBJECT, BRIDGE, ANSWER}


def test_guides_need_the_documents_token_as_the_answer(tokenizer):
    """Without the leading space the answer is another token: no answer guide."""
    finder = GuideFinder(tokenizer)
    ex = docqa_data.generate(3, 1, 4, hops=1)[0]
    with_space = finder.guides(_batch_ids(tokenizer, [ex], answer_space=True)[0])
    without = finder.guides(_batch_ids(tokenizer, [ex], answer_space=False)[0])
    assert ANSWER in {r for r, _, _ in with_space}
    assert ANSWER not in {r for r, _, _ in without}


def test_guide_loss_is_the_mean_log_attention_on_targets():
    heads = guide_heads(4)
    batch, n_heads, length = 2, 2, 5
    uniform = [torch.full((batch, n_heads, length, length), 1 / length) for _ in range(4)]
    guides = guide_tensor([[(BIND, 3, 1), (ANSWER, 4, 2)], [(SUBJECT, 4, 0)]])
    assert guides.tolist() == [[0, BIND, 3, 1], [0, ANSWER, 4, 2], [1, SUBJECT, 4, 0]]
    assert guide_loss(uniform, guides, heads).item() == pytest.approx(math.log(length))
    sharp = [a.clone() for a in uniform]
    for row, role, source, target in guides.tolist():
        layer, head = heads[role]
        sharp[layer][row, head, source] = 0.0
        sharp[layer][row, head, source, target] = 1.0
    assert guide_loss(sharp, guides, heads).item() == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="at least 4 layers"):
        guide_heads(3)
