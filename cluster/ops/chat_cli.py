"""``chunkserve chat``: an interactive chat that shows how much of each prompt was reused.

The conversation is: the system prompt (text, or its registered chunk), the
registered documents (chunks, in registration order), then the turns. After every
reply one line reports ``reuse MODE: reused R / computed C prompt tokens, TTFT T ms``.

Commands: ``/system TEXT``, ``/register`` (the current system prompt),
``/register-file PATH`` (a document, after the system prompt), ``/chunks``,
``/reuse [exact|approximate]`` (the reuse mode of the following turns; without an
argument, the current one), ``/quit``.
Invariant: a document is registered after the system prompt's chunk, so its KV is
computed in the context every later request has, and reused exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.ops.chat_backends import Backend, Message, Turn

HELP = (
    "commands: /system TEXT, /register, /register-file PATH, /chunks, "
    "/reuse [exact|approximate], /quit (anything else is a message)"
)
REUSE_MODES = ("exact", "approximate")


@dataclass
class Conversation:
    system: str = ""
    system_chunk: str | None = None  # the system prompt's chunk id, once registered
    documents: list[str] = field(default_factory=list)  # chunk ids, in order
    turns: list[Message] = field(default_factory=list)

    def messages(self) -> list[Message]:
        head: list[Message] = []
        if self.system_chunk is not None:
            head.append({"role": "system", "chunk_id": self.system_chunk})
        elif self.system:
            head.append({"role": "system", "content": self.system})
        head += [{"role": "user", "chunk_id": d} for d in self.documents]
        return head + self.turns


def reuse_line(turn: Turn) -> str:
    computed = turn.prompt_tokens - turn.cached_tokens
    return (
        f"reuse {turn.reuse_mode}: reused {turn.cached_tokens} / computed {computed} "
        f"prompt tokens, TTFT {turn.ttft_s * 1000:.0f} ms"
    )


class ChatSession:
    def __init__(self, backend: Backend, out: Callable[[str], None], reuse: str = "exact") -> None:
        _check_mode(reuse)
        self._backend = backend
        self._out = out  # prints a whole line
        self.conversation = Conversation()
        self.reuse = reuse  # the reuse mode each turn asks for

    def handle(self, line: str, write: Callable[[str], None]) -> bool:
        """Act on one input line; False once the user quits."""
        line = line.strip()
        if not line:
            return True
        if line.startswith("/"):
            return self._command(line)
        self.conversation.turns.append({"role": "user", "content": line})
        write("assistant> ")
        turn = self._backend.reply(self.conversation.messages(), write, self.reuse)
        write("\n")
        self.conversation.turns.append({"role": "assistant", "content": turn.text})
        self._out(reuse_line(turn))
        return True

    def _command(self, line: str) -> bool:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        try:
            if name == "/quit":
                return False
            if name == "/system":
                self.conversation.system, self.conversation.system_chunk = arg, None
                self.conversation.documents.clear()  # their KV assumed the old prompt
                self._out("system prompt set" if arg else "system prompt cleared")
            elif name == "/register":
                self._out(f"registered system prompt as {self._register_system()}")
            elif name == "/register-file":
                self._register_file(arg)
            elif name == "/chunks":
                self._list()
            elif name == "/reuse":
                if arg:
                    _check_mode(arg)
                    self.reuse = arg
                self._out(f"reuse mode: {self.reuse}")
            else:
                self._out(HELP)
        except (ValueError, OSError) as error:
            self._out(f"error: {error}")
        return True

    def _register_system(self) -> str:
        conv = self.conversation
        if not conv.system:
            raise ValueError("no system prompt: set one with /system TEXT")
        if conv.system_chunk is None:
            conv.system_chunk = self._backend.register(conv.system, "system", [])
        return conv.system_chunk

    def _register_file(self, path: str) -> None:
        if not path:
            raise ValueError("usage: /register-file PATH")
        text = Path(path).read_text()
        conv = self.conversation
        after = [self._register_system()] if conv.system else []
        chunk_id = self._backend.register(text, "context", [*after, *conv.documents])
        conv.documents.append(chunk_id)
        self._out(f"registered {path} as {chunk_id}")

    def _list(self) -> None:
        rows = self._backend.chunks()
        if not rows:
            self._out("no chunks registered")
        for row in rows:
            hits = "" if row.hits is None else f", {row.hits} hits"
            self._out(
                f"{row.chunk_id[:16]}  {row.role:<7} {row.tokens} tokens, "
                f"{row.pinned_tokens} pinned{hits}"
            )


def _check_mode(mode: str) -> None:
    if mode not in REUSE_MODES:
        raise ValueError(f"reuse mode must be one of {', '.join(REUSE_MODES)}, got {mode!r}")


def run_chat(backend: Backend, reuse: str = "exact", system: str = "") -> None:
    """Read lines until /quit or end of input; turns ask for ``reuse`` until /reuse,
    under the system prompt ``system`` until /system."""

    def write(text: str) -> None:
        print(text, end="", flush=True)

    session = ChatSession(backend, lambda line: print(line, flush=True), reuse)
    session.conversation.system = system
    print(HELP, flush=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return
        if not session.handle(line, write):
            return
