"""Structured output on the doc-QA model: held-out questions asked with a JSON schema
(``{"answer": string}``, nothing else), against the same questions asked without one.
Per run: how many outputs are complete JSON that the schema accepts, how many of those
hold the right answer, and how many stopped at the token limit instead.

    python bench/structured_accuracy.py [--model modeltools/docqa_model] [--questions 50]
        [--max-tokens 24] [--device cpu]

Half the questions are single-hop, half two-hop, over 8 documents (``docqa_data``'s
held-out split). The grammar keeps every output a prefix of valid JSON; whether it
ends (closes the string and the object) is the model's doing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table  # noqa: E402
from bench.reuse_quality import build_prompt  # noqa: E402
from modeltools.docqa_data import DocQAExample, answer_matches, generate  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.engine.structured import ResponseFormat  # noqa: E402

DOCQA = Path(__file__).resolve().parents[1] / "modeltools" / "docqa_model"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def ask(engine: Engine, examples: list[DocQAExample], params: SamplingParams) -> list[tuple]:
    """Each example's (output text, finish reason), all in one batch."""
    texts: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for i, example in enumerate(examples):
        prompt = build_prompt(engine.tokenizer, example)
        engine.add_request(str(i), prompt.token_ids, params)
        texts[str(i)] = []
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [
        (engine.tokenizer.decode(texts[str(i)], skip_special_tokens=True), reasons[str(i)])
        for i in range(len(examples))
    ]


def schema_answer(text: str) -> str | None:
    """The answer of a complete JSON object the schema accepts, else None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or set(value) != {"answer"}:
        return None
    return value["answer"] if isinstance(value["answer"], str) else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DOCQA))
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    half = args.questions // 2
    examples = generate(args.seed, half, 8, "heldout", 1) + generate(
        args.seed + 1, args.questions - half, 8, "heldout", 2
    )
    engine = Engine(EngineConfig(args.model, device=args.device))
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    runs = {
        "json_schema": SamplingParams(
            max_tokens=args.max_tokens, temperature=0, response_format=fmt
        ),
        "none": SamplingParams(max_tokens=args.max_tokens, temperature=0),
    }
    rows = []
    for name, params in runs.items():
        outputs = ask(engine, examples, params)
        right = at_limit = valid = 0
        for (text, reason), example in zip(outputs, examples, strict=True):
            at_limit += reason == "length"
            answer = schema_answer(text) if name == "json_schema" else text
            valid += answer is not None and name == "json_schema"
            right += answer is not None and answer_matches(answer, example.answer)
        rows.append([
            name, f"{valid} / {len(examples)}" if name == "json_schema" else "",
            f"{right} / {len(examples)}", f"{at_limit}", repr(outputs[0][0][:60]),
        ])  # fmt: skip
    print_table(
        f"doc-QA, {len(examples)} held-out questions over 8 documents, "
        f"{args.max_tokens} tokens at most",
        ["response_format", "schema-valid JSON", "right", "stopped at the limit", "first output"],
        rows,
    )


if __name__ == "__main__":
    main()
