"""Structured output: decoding constrained to a JSON grammar (OpenAI's
``response_format``), by xgrammar.

Why a library: a grammar engine must turn a schema into a pushdown automaton over the
tokenizer's vocabulary and give, at every step, the set of tokens that keep the output
a valid prefix; xgrammar does that in C++ with per-grammar caches and mask kernels for
CPU and CUDA, and is what vLLM and SGLang use.

How: ``ResponseFormat`` travels in ``SamplingParams``. The engine keeps one
``Grammars`` (compiled grammars cached per format) and gives each constrained
sequence a matcher. Before sampling, each constrained row's allowed tokens are written
into a bitmask on the host and applied to its logits on the device (disallowed tokens
get -inf, so every sampler, greedy or not, draws an allowed one); after, the matcher
accepts the token, and a matcher that reached the grammar's end finishes the
sequence ("stop").

Invariants:
- The prompt and its KV are untouched: only logits are masked, so structured output
  composes with both reuse modes.
- JSON is compact (``{"a": 1, "b": 2}``: one space after each separator, none
  elsewhere): a grammar that allowed any whitespace would let a weak model pad forever.
- A sequence ends ("stop") with the JSON's last token, whether or not the model would
  have ended its text there.
- A format is checked without a tokenizer (``check_response_format``), so a router
  refuses a schema the library cannot compile before any worker sees it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

GRAMMAR_CACHE = 256  # compiled grammars kept per engine (a new schema compiles in ms)
ANY_OBJECT = '{"type": "object"}'  # json_object's schema


@dataclass(frozen=True)
class ResponseFormat:
    """``json_object``: any JSON object; ``json_schema``: JSON valid under ``schema``
    (the schema's JSON text)."""

    type: Literal["json_object", "json_schema"]
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.type not in ("json_object", "json_schema"):
            raise ValueError(
                f"response format must be json_object or json_schema, got {self.type!r}"
            )
        if (self.type == "json_schema") != (self.schema is not None):
            raise ValueError("a json_schema format needs its schema, a json_object none")


def check_response_format(fmt: ResponseFormat) -> None:
    """ValueError saying why, if xgrammar cannot build ``fmt``'s grammar."""
    import xgrammar as xgr

    if fmt.schema is None:
        return
    try:
        json.loads(fmt.schema)
        xgr.Grammar.from_json_schema(fmt.schema, any_whitespace=False)
    except (ValueError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
        # xgrammar prefixes its C++ source position: keep the reason after it
        raise ValueError(f"the JSON schema cannot be used: {reason.split(': ', 1)[-1]}") from None


class Grammars:
    """Grammars for one tokenizer and vocabulary, compiled on first use of a format
    and cached (``GRAMMAR_CACHE``); a matcher per constrained sequence."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler = None
        self._batch = None  # xgrammar's BatchGrammarMatcher: fills rows on its threads
        self._compiled: OrderedDict[ResponseFormat, Any] = OrderedDict()

    def matcher(self, fmt: ResponseFormat) -> Any:
        """A fresh matcher at the start of ``fmt``'s grammar."""
        import xgrammar as xgr

        # ends at the JSON's last token: no end-of-text token needed after it
        return xgr.GrammarMatcher(self._compile(fmt), terminate_without_stop_token=True)

    def constrain(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]):
        """``logits`` with each of ``rows`` masked to the tokens its matcher allows next
        (a new tensor; the same one without rows). Steps with no constrained row never
        import xgrammar."""
        if not rows:
            return logits
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(logits), self._vocab_size)
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:  # the rows' fills in parallel (half the host's cores)
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, list(rows))
        masked = logits.clone()  # the runner's logits may be an inference tensor
        xgr.apply_token_bitmask_inplace(
            masked, bitmask.to(masked.device, non_blocking=True), indices=list(rows)
        )
        return masked

    def _compile(self, fmt: ResponseFormat) -> Any:
        compiled = self._compiled.get(fmt)
        if compiled is not None:
            self._compiled.move_to_end(fmt)
            return compiled
        schema = ANY_OBJECT if fmt.schema is None else fmt.schema
        compiled = self._compiler_once().compile_json_schema(schema, any_whitespace=False)
        self._compiled[fmt] = compiled
        if len(self._compiled) > GRAMMAR_CACHE:
            self._compiled.popitem(last=False)
        return compiled

    def _compiler_once(self) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler
