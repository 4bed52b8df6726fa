"""Attention guides for doc-QA training: which token a few chosen heads should read.

Trained only on answers, a small model learns within a few hundred steps to copy a value
stated with the asked relation (any city someone *lives in*), and then stalls: to pick
*whose* city, a value token must first carry its subject, and nothing rewards the head
that would put it there until a later head already uses it (see TRAINING.md). The
guides break that deadlock with an auxiliary loss on four heads, the cross-entropy of
their attention against one target position:

- ``BIND``: every value token of a document reads the document's subject
  (``Oslo`` in "Mira lives in Oslo" reads ``Mira``);
- ``SUBJECT``: the position that predicts an answer reads the question's subject;
- ``BRIDGE`` (two-hop only): that position reads the link value in the subject's
  document (``Falcon`` in "Mira works in the Falcon team");
- ``ANSWER``: that position reads the answer where its document states it.

The model stays a plain Qwen3 with ordinary causal attention; only training's loss
changes. Positions are found from token ids alone (every entity is one token of the
doc-QA tokenizer, a document starts with ``note:`` and its first entity is its
subject), so follow-up questions get guides too.

Invariant: every guide points backwards (target < source), so causal attention can
reach it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerFast

from modeltools import docqa_data

BIND, SUBJECT, BRIDGE, ANSWER = range(4)
ROLES = ("bind", "subject", "bridge", "answer")


def guide_heads(num_layers: int) -> dict[int, tuple[int, int]]:
    """(layer, head) each role supervises: binding and the question's subject early,
    the link one layer later, the answer after that (models of 4+ layers)."""
    if num_layers < 4:
        raise ValueError(f"attention guides need at least 4 layers, got {num_layers}")
    return {BIND: (1, 0), SUBJECT: (1, 1), BRIDGE: (2, 0), ANSWER: (3, 0)}


class GuideFinder:
    """Finds guide positions in token sequences of the doc-QA tokenizer."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast):
        entity_ids = {
            tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" " + w))[0]
            for w in docqa_data.entity_words()
        }
        self.entities = entity_ids
        self.note = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" note"))[0]
        self.colon = tokenizer.convert_tokens_to_ids(":")

    def documents(self, ids: Sequence[int]) -> list[list[int]]:
        """Entity positions of each document in ``ids``, the subject first."""
        starts = [
            p for p in range(len(ids) - 1) if ids[p] == self.note and ids[p + 1] == self.colon
        ]
        docs = []
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(ids)
            ents = [p for p in range(start, end) if ids[p] in self.entities]
            docs.append(ents[:3])
        return docs

    def guides(self, segments: Sequence[tuple[list[int], bool]]) -> list[tuple[int, int, int]]:
        """(role, source, target) positions in the concatenated sequence of
        ``segments`` ((token ids, is an answer) as ``docqa_train._batch_ids`` makes
        them). A question whose answer cannot be traced through the documents (a reverse
        question) gets only its ``SUBJECT`` guide."""
        seq = [t for ids, _ in segments for t in ids]
        prompt_len = len(segments[0][0])
        docs = self.documents(seq[:prompt_len])
        out: list[tuple[int, int, int]] = []
        for subject_pos, *values in docs:
            out += [(BIND, v, subject_pos) for v in values]
        by_subject = {seq[d[0]]: d for d in docs}
        offset = 0
        for ids, is_answer in segments:
            if is_answer:
                self._question_guides(seq, offset, ids[0], by_subject, out)
            offset += len(ids)
        return out

    def _question_guides(self, seq, answer_start, answer_id, by_subject, out) -> None:
        source = answer_start - 1  # the position whose next token is the answer
        asked = next((p for p in range(source, -1, -1) if seq[p] in self.entities), None)
        if asked is None:
            return
        out.append((SUBJECT, source, asked))
        doc = by_subject.get(seq[asked])
        if doc is None:
            return
        for v in doc[1:]:
            if seq[v] == answer_id:
                out.append((ANSWER, source, v))
                return
        for v in doc[1:]:
            linked = by_subject.get(seq[v])
            if linked is None:
                continue
            for w in linked[1:]:
                if seq[w] == answer_id:
                    out += [(BRIDGE, source, v), (ANSWER, source, w)]
                    return


def guide_tensor(rows: Sequence[Sequence[tuple[int, int, int]]]) -> torch.Tensor:
    """(N, 4) long tensor of (row, role, source, target)."""
    flat = [(r, *g) for r, gs in enumerate(rows) for g in gs]
    return torch.tensor(flat, dtype=torch.long).reshape(-1, 4)


def guide_loss(
    attentions: Sequence[torch.Tensor], guides: torch.Tensor, heads: dict[int, tuple[int, int]]
) -> torch.Tensor:
    """Mean over roles of the mean -log attention probability each guided head gives
    its target; ``attentions[layer]`` is (batch, heads, queries, keys)."""
    total = attentions[0].new_zeros((), dtype=torch.float32)
    roles = 0
    for role, (layer, head) in heads.items():
        g = guides[guides[:, 1] == role]
        if g.numel() == 0:
            continue
        probs = attentions[layer][g[:, 0], head, g[:, 2], g[:, 3]].float()
        total = total - probs.clamp_min(1e-6).log().mean()
        roles += 1
    return total / max(1, roles)
