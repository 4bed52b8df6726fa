"""Incremental detokenization: turn newly generated ids into new text without
re-decoding the whole output, and without emitting half a multi-byte character."""

from __future__ import annotations

from workers.engine.request import Sequence


def detokenize_step(tokenizer, seq: Sequence, final: bool = False) -> str:
    """New text for ``seq`` since the last call; advances its offsets.

    Decodes a short window (``prefix_offset`` .. end) and compares it with the same
    window without the unread tokens, so byte-level merges across the boundary are
    handled; text ending in U+FFFD is held back until its character is complete, or
    until the ``final`` call, which returns whatever is left.
    """
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return full[len(prefix) :]
    return ""
