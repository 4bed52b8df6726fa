"""Per-request generation settings."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.structured import ResponseFormat


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. ``seed`` makes sampling reproducible per request.

    ``logprobs`` > 0 returns, per generated token, its log-probability and the top
    ``logprobs`` alternatives (from the distribution before temperature).

    Generation stops at the first of: ``max_tokens`` new tokens, an EOS token (unless
    ``ignore_eos``), a token in ``stop_token_ids``, a string in ``stop`` (the text is
    cut before it), or the model's context length. ``min_tokens`` (vLLM's meaning): the
    first ``min_tokens`` tokens are never an EOS or stop token (their logits are
    masked), and no stop string ends the output before it has that many tokens.
    ``response_format``: every output token keeps the text a prefix of JSON of that
    format, and the output ends ("stop") once the JSON is complete
    (``workers.engine.structured``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int = 0  # return this many top log-probabilities per generated token
    response_format: ResponseFormat | None = None  # output constrained to it (JSON)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
