"""``chunkserve chat --model DIR`` driven through a pseudo-terminal: every reply is
followed by the reuse line naming the mode (/reuse switches it), and later turns
reuse the registered chunks' KV."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pexpect

DOCQA = Path(__file__).resolve().parents[3] / "modeltools" / "docqa_model"
PROMPT = "you> "
REUSE = re.compile(rb"reuse (\w+): reused (\d+) / computed (\d+) prompt tokens, TTFT (\d+) ms")
SYSTEM = "You are a precise assistant for the Harbor Analytics handbook; answer briefly."
DOC = "Handbook: Starter costs 29 dollars a month for five seats; backups run every six hours."


def test_chat_shows_reuse_after_each_turn(tiny_qwen3, tmp_path):
    doc = tmp_path / "handbook.txt"
    doc.write_text(DOC)
    child = pexpect.spawn(
        sys.executable,
        ["-m", "cluster.ops.cli", "chat", "--model", str(tiny_qwen3), "--device", "cpu"]
        + ["--max-tokens", "6"],
        timeout=120,
    )
    try:
        child.expect_exact(PROMPT)
        child.sendline(f"/system {SYSTEM}")
        child.expect_exact("system prompt set")
        child.sendline("/register")
        child.expect(r"registered system prompt as [0-9a-f]{64}")
        child.sendline(f"/register-file {doc}")
        child.expect(r"registered .*handbook.txt as [0-9a-f]{64}")

        reused = []
        for question in ("How much is Starter?", "And how often do backups run?"):
            child.expect_exact(PROMPT)
            child.sendline(question)
            child.expect(REUSE)
            assert child.match.group(1) == b"exact"
            reused.append(int(child.match.group(2)))
        assert reused[0] > 0  # the registered chunks
        assert reused[1] > reused[0]  # ... and the first turn

        child.sendline("/reuse sloppy")
        child.expect_exact("error: reuse mode must be one of exact, approximate")
        child.sendline("/reuse approximate")
        child.expect_exact("reuse mode: approximate")
        child.expect_exact(PROMPT)
        child.sendline("Is there a free plan?")
        child.expect(REUSE)
        assert child.match.group(1) == b"approximate"

        child.sendline("/chunks")
        child.expect(r"system +\d+ tokens, \d+ pinned")
        child.expect(r"context +\d+ tokens, \d+ pinned")
        child.sendline("/nonsense")
        child.expect_exact("commands:")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_chat_with_the_shipped_model_answers_follow_up_turns():
    """The README's conversation: ``--system`` starts the chat with a system prompt, the
    document comes in the first turn, the questions after it are typed as in a chat
    (no "Question: "), and each later turn reuses the conversation before it."""
    system = (
        "You answer questions from the documents in the conversation. Reply with the answer only."
    )
    child = pexpect.spawn(
        sys.executable,
        ["-m", "cluster.ops.cli", "chat", "--model", str(DOCQA), "--device", "cpu"]
        + ["--max-tokens", "8", "--system", system],
        timeout=120,
    )
    turns = [
        ("Staff note: Petra lives in Tallinn and is 29 years old. Team note: the Falcon team "
         "is based in Oslo and is led by Petra. Who leads the Falcon team?", "Petra"),
        ("How old is Petra?", "29"),
        ("Where does the leader of the Falcon team live?", "Tallinn"),
    ]  # fmt: skip
    try:
        reused = []
        for question, answer in turns:
            child.expect_exact(PROMPT)
            child.sendline(question)
            child.expect(rb"assistant> ([^\r\n]*)\r?\n")  # pexpect matches with DOTALL
            assert child.match.group(1).decode().strip() == answer
            child.expect(REUSE)
            reused.append(int(child.match.group(2)))
        assert reused[0] == 0 and 0 < reused[1] < reused[2]  # earlier turns' KV
        child.sendline("/register")  # there is a system prompt to register: --system's
        child.expect(r"registered system prompt as [0-9a-f]{64}")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
