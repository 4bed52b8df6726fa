"""A sequence's output text: made from its ids incrementally, without re-decoding the
whole output and without emitting half a multi-byte character; returned to the caller
in pieces, less what a stop string could still cut."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OutputText:
    """Invariants: ``emitted <= len(text)``; ids before ``read_offset`` are in
    ``text``; ``prefix_offset <= read_offset`` starts the window decoded again."""

    prefix_offset: int  # the prompt's length at first: output ids only
    read_offset: int
    text: str = ""
    emitted: int = 0  # prefix of ``text`` already returned to the caller
    # where a stop string may end from: text made before ``min_tokens`` ends nothing
    stop_search_from: int = 0

    @classmethod
    def after(cls, prompt_len: int) -> OutputText:
        return cls(prompt_len, prompt_len)

    def add_step(self, tokenizer, ids: list[int], final: bool = False) -> None:
        """Append the text of ``ids`` (the sequence's tokens) since the last call.

        Decodes a short window (``prefix_offset`` .. end) and compares it with the same
        window without the unread tokens, so byte-level merges across the boundary are
        handled; text ending in U+FFFD is held back until its character is complete, or
        until the ``final`` call, which adds whatever is left."""
        window = ids[self.prefix_offset : self.read_offset]
        prefix = tokenizer.decode(window, skip_special_tokens=True)
        full = tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            self.text += full[len(prefix) :]

    def cut_at_stop_string(self, stops: tuple[str, ...] | list[str]) -> bool:
        """Cut ``text`` before the first of ``stops`` in it that ends past
        ``stop_search_from``; True if one was found."""
        start = self.stop_search_from
        positions = [p for s in stops if (p := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
        if not positions:
            return False
        self.text = self.text[: min(positions)]
        return True

    def take_new(self, holdback: int) -> str:
        """The text not returned yet, less its last ``holdback`` characters (what a stop
        string still being made could cut)."""
        new = self.text[self.emitted : max(self.emitted, len(self.text) - holdback)]
        self.emitted += len(new)
        return new
