"""What approximate reuse costs over a stream against exact reuse serving the same
stream, on the doc-QA model, counted in prompt positions computed through every layer
(``Engine.tally``, entry fills included), with the answers of each (no time: on a GPU
the first requests of each admission shape capture CUDA graphs, so a short stream's wall
time says little):

- ``new``: documents never seen before. Each one's entry is taken from the KV its
  first request computes in context, so a first sight should cost what exact reuse
  pays (once, not twice);
- ``repeated``: the same document sets again, in new orders after new system prompts.
  Exact reuse matches nothing past the template; approximate reuse places every
  document.

Each engine serves its stream in rounds (a round's requests in one batch), both
engines in this process. ``tests/workers/test_first_sight.py`` asserts the position
ratios on the CPU with these streams.

    python bench/first_sight.py [--device cuda] [--examples 64] [--sets 16 --repeats 5]

The doc-QA documents have 14-17 tokens, so the engines keep entries from 8 tokens on
(``min_entry_tokens``; the default, 32, is for real documents); everything else is the
engine's and the request's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import device_line, print_table  # noqa: E402
from bench.reuse_quality import build_prompt  # noqa: E402
from modeltools.docqa_data import DocQAExample, answer_matches, generate  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.reuse_info import ReuseRequest  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.engine.workload_tally import WorkloadTally  # noqa: E402

DOCQA = Path(__file__).resolve().parents[1] / "modeltools" / "docqa_model"
ANSWER = SamplingParams(max_tokens=12, temperature=0)
MODES = ("exact", "approximate")


@dataclasses.dataclass
class Served:
    tally: WorkloadTally  # the stream's work
    right: int
    answers: int


def make_engine(device: str | None = "cpu", num_pages: int = 2048) -> Engine:
    config = EngineConfig(str(DOCQA), device=device, num_pages=num_pages, min_entry_tokens=8)
    return Engine(config)


def serve(engine: Engine, rounds: list[list[DocQAExample]], mode: str) -> Served:
    """Each round's requests in one batch, rounds in order."""
    before = engine.tally.copy()
    right, answers = 0, 0
    for number, examples in enumerate(rounds):
        texts = {}
        for index, example in enumerate(examples):
            prompt = build_prompt(engine.tokenizer, example)
            rid = f"{mode}-{number}-{index}"
            texts[rid] = (example, [])
            engine.add_request(
                rid, prompt.token_ids, ANSWER, placeable=prompt.doc_spans,
                reuse=ReuseRequest(mode),
            )  # fmt: skip
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id][1].extend(out.new_token_ids)
        for example, tokens in texts.values():
            text = engine.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            right += answer_matches(text, example.answer)
            answers += 1
    return Served(engine.tally.since(before), right, answers)


def reordered(example: DocQAExample, round_number: int) -> DocQAExample:
    """The same documents rotated and reversed, after a system prompt never seen."""
    docs = list(example.documents)
    shift = round_number % len(docs)
    docs = (docs[shift:] + docs[:shift])[:: -1 if round_number % 2 else 1]
    gold = tuple(
        docs.index(example.documents[g]) for g in example.gold
    )  # the gold documents follow their text
    system = f"{example.system} Desk {round_number + 1}."
    return dataclasses.replace(example, system=system, documents=tuple(docs), gold=gold)


def new_stream(examples: int, batch: int, seed: int = 11) -> list[list[DocQAExample]]:
    """``examples`` held-out questions over 8 documents each, all new, ``batch`` a round."""
    stream = generate(seed, examples, 8, "heldout", 1)
    return [stream[i : i + batch] for i in range(0, len(stream), batch)]


def repeated_stream(sets: int, repeats: int, seed: int = 12) -> list[list[DocQAExample]]:
    """``sets`` two-hop questions over 8 documents, asked again ``repeats`` times in
    new orders after new system prompts; a round asks every set once."""
    examples = generate(seed, sets, 8, "heldout", 2)
    return [[reordered(ex, r) for ex in examples] for r in range(1 + repeats)]


def compare(device: str | None, rounds: list[list[DocQAExample]]) -> dict[str, Served]:
    """Each mode's engine (fresh) serves ``rounds``."""
    return {mode: serve(make_engine(device), rounds, mode) for mode in MODES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default=None, help="default: cuda where there is one")
    ap.add_argument("--examples", type=int, default=64, help="the new-documents stream")
    ap.add_argument("--batch", type=int, default=8, help="requests a round, new documents")
    ap.add_argument("--sets", type=int, default=16, help="the repeated stream's document sets")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if torch.cuda.is_available() and args.device in (None, "cuda"):
        print(device_line())
    streams = {
        f"new documents ({args.examples} requests, {args.batch} a round)": new_stream(
            args.examples, args.batch
        ),
        f"repeated ({args.sets} sets x {1 + args.repeats} rounds)": repeated_stream(
            args.sets, args.repeats
        ),
    }
    rows = []
    for name, rounds in streams.items():
        served = compare(args.device, rounds)
        exact = served["exact"]
        for mode, run in served.items():
            tally = run.tally
            rows.append([
                name, mode, f"{tally.prompt_positions:,}",
                f"{tally.prompt_positions / exact.tally.prompt_positions:.3f}",
                f"{tally.entry_hits} / {tally.entry_misses}",
                f"{tally.entries_taken} / {tally.fills_queued}",
                f"{run.right} / {run.answers}",
            ])  # fmt: skip
    print_table(
        "prompt positions through every layer (fills included), approximate against exact",
        ["stream", "mode", "positions", "x exact", "entry hits / misses",
         "entries taken / fills", "answers right"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
