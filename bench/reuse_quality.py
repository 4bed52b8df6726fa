"""Reuse quality on held-out doc-QA examples: how close each reuse mode's answers
stay to full prefill, with the gold documents' positions swept.

    python bench/reuse_quality.py --model modeltools/docqa_model --examples 100 \
        --seed 0 --docs 4 8 16 --hops 1 2 --json /tmp/reuse_quality.json

Modes (one engine each, same device and dtype):
- ``full``: reuse off; every prompt token computed (the reference).
- ``exact``: exact prefix reuse on a warm engine (every prompt ran once before), so
  nearly every prompt token comes from the cache. Must equal full prefill token for
  token on the CPU; mismatches are counted and reported.
- ``naive``: naive placement (``workers.engine.approximate.naive``): each document's KV
  computed alone at position 0, rotated to its place, nothing recomputed.
- ``approximate``, one row per repair setting (``--repairs``, e.g. ``k=4`` or
  ``k=2,r=0.1``): every document's position-free entry is held, placed, and repaired.
  Entries (``--entries``) are ``context`` (the default, what the engine does): taken
  from a first sight of each prompt's documents in the reverse order after another
  system prompt, as computed there; or ``filled``: computed before the batch after the
  entry context ``--entry-system-prompt``. Below the deviation layer, the placed tokens
  not recomputed keep the KV the selecting forward computed there (``--low-layers
  context``, the default) or take the entries' own (``entries``). Repair:
  the first k tokens of each document and the share r
  of placed tokens deviating most at the engine's deviation layer (``--deviation-layer``;
  layer 3 by default) are recomputed. Cached system-prompt
  pages are dropped before each setting, so settings do not feed each other.

Per row (mode, hops, docs): exact-match accuracy of the greedy answer, mean KL
divergence KL(full || mode) of the first answer token's distribution, the share of
prompt tokens whose KV the request computed (``recomputed_share``; 1.0 for full
prefill) and, for placing modes, the share of placed tokens recomputed
(``placed_recomputed_share``). Every example is asked once per swept position of its
first gold document (the link document of a two-hop question): first, middle and
last by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import parse_repair  # noqa: E402
from chunkstore.chunking import chunk_conversation  # noqa: E402
from chunkstore.hashing import position_free_key  # noqa: E402
from modeltools.docqa_data import (  # noqa: E402
    SYSTEM_PROMPTS,
    DocQAExample,
    answer_matches,
    generate,
)
from workers.engine.approximate.naive import NaivePlacement  # noqa: E402
from workers.engine.config import DEFAULT_ENTRY_SYSTEM_PROMPT, EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.reuse_info import ReuseRequest  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "modeltools" / "docqa_model"
MODES = ("full", "exact", "naive")
# first tokens alone (EPIC-style), then the curve of accuracy against recompute share
DEFAULT_REPAIRS = ("k=0", "k=1", "k=4", "k=0,r=0.02", "k=0,r=0.05", "k=0,r=0.1")
POSITIONS = {"first": lambda k: 0, "middle": lambda k: k // 2, "last": lambda k: k - 1}
ANSWER = SamplingParams(max_tokens=16, temperature=0)


@dataclasses.dataclass(frozen=True)
class Prompt:
    example: DocQAExample
    token_ids: list[int]
    doc_spans: tuple[tuple[int, int], ...]


@dataclasses.dataclass
class Outcome:
    text: str
    first_logits: torch.Tensor  # float64 log-probabilities of the first answer token
    computed_share: float
    token_ids: list[int]
    placed: int  # prompt tokens taken from position-free entries (placing modes)
    recomputed: int  # of those, recomputed in context


def swept(example: DocQAExample, position: int) -> DocQAExample:
    """``example`` with its first gold document moved to ``position`` (swapped)."""
    docs = list(example.documents)
    gold = example.gold[0]
    docs[gold], docs[position] = docs[position], docs[gold]
    remap = {gold: position, position: gold}
    return dataclasses.replace(
        example, documents=tuple(docs), gold=tuple(remap.get(g, g) for g in example.gold)
    )


def build_prompt(tokenizer, example: DocQAExample) -> Prompt:
    """Canonical chunk tokenization: system, the user header, one chunk per
    document, the question, the generation prompt."""
    chunks = chunk_conversation(tokenizer, example.messages)
    if len(chunks) != example.num_docs + 4:
        raise ValueError(f"unexpected chunking: {len(chunks)} chunks for {example.num_docs} docs")
    spans, offset = [], 0
    for index, chunk in enumerate(chunks):
        if 2 <= index < 2 + example.num_docs:
            spans.append((offset, offset + len(chunk.token_ids)))
        offset += len(chunk.token_ids)
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    return Prompt(example, tokens, tuple(spans))


def make_engine(
    model: str,
    mode: str,
    device: str | None,
    num_pages: int,
    entry_system_prompt: str | None = DEFAULT_ENTRY_SYSTEM_PROMPT,
    dtype: str | None = None,
    deviation_layer: int | None = None,
    entries_from_context: bool = True,
    placed_low_layers: str = "context",
) -> Engine:
    config = EngineConfig(
        model,
        device=device,
        dtype=dtype,
        deviation_layer=deviation_layer,
        num_pages=num_pages,
        enable_reuse=mode != "full",
        page_size=16,
        entry_system_prompt=entry_system_prompt,
        entries_from_context=entries_from_context,
        placed_low_layers=placed_low_layers,
        min_entry_tokens=1,  # doc-QA documents have 14-17 tokens: every one is kept
    )
    if mode == "naive":
        return Engine(config, reuse_factory=NaivePlacement)
    return Engine(config)


def run_prompts(
    engine: Engine, prompts: list[Prompt], place: bool, reuse: ReuseRequest | None = None
) -> list[Outcome]:
    """Greedy answers of ``prompts`` in one batch, with each one's first-token
    distribution (recorded from the logits the engine samples from: ``Engine.on_logits``)."""
    first: dict[str, torch.Tensor] = {}

    def recording(seqs, logits):
        for row, seq in zip(logits, seqs, strict=True):
            if seq.num_output_tokens == 0:
                first[seq.request_id] = torch.log_softmax(row.double().cpu(), -1)

    engine.on_logits = recording
    try:
        ids = [f"q{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            spans = prompt.doc_spans if place else ()
            engine.add_request(rid, prompt.token_ids, ANSWER, placeable=spans, reuse=reuse)
        tokens = {rid: [] for rid in ids}
        texts = dict.fromkeys(ids, "")
        served = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                served[out.request_id] = out.reuse
        for rid in ids:
            texts[rid] = engine.tokenizer.decode(tokens[rid], skip_special_tokens=True)
    finally:
        engine.on_logits = None
    outcomes = []
    for rid, prompt in zip(ids, prompts, strict=True):
        info = served[rid]
        computed = len(prompt.token_ids) - info.reused_tokens + info.recomputed_tokens
        placed = sum(e - s for s, e in prompt.doc_spans) if place else 0
        outcomes.append(
            Outcome(
                texts[rid].strip(),
                first[rid],
                computed / len(prompt.token_ids),
                tokens[rid],
                placed,
                info.recomputed_tokens,
            )
        )
    return outcomes


def fill_entries(engine: Engine, prompts: list[Prompt]) -> None:
    """Make every document of ``prompts`` a held position-free entry."""
    for prompt in prompts:
        for start, end in prompt.doc_spans:
            engine.fill_entry(prompt.token_ids[start:end])
    while engine.has_unfinished():
        engine.step()


def first_sight(engine: Engine, prompts: list[Prompt], tokenizer) -> None:
    """Make every document of ``prompts`` a held position-free entry the way a first
    sight does: each prompt's documents asked about in the reverse order after another
    system prompt, with approximate reuse, so that each missed document's entry is the
    KV computed there (``EngineConfig.entries_from_context``)."""
    seen = []
    for prompt in prompts:
        ex = prompt.example
        other = SYSTEM_PROMPTS[(SYSTEM_PROMPTS.index(ex.system) + 1) % len(SYSTEM_PROMPTS)]
        reordered = dataclasses.replace(ex, system=other, documents=ex.documents[::-1])
        seen.append(build_prompt(tokenizer, reordered))
    run_prompts(engine, seen, place=True, reuse=ReuseRequest("approximate"))
    missing = [
        (p, s, e)
        for p in prompts
        for s, e in p.doc_spans
        if engine.pool.entry(position_free_key(engine.namespace(), p.token_ids[s:e])) is None
    ]
    if missing:
        raise RuntimeError(f"{len(missing)} documents have no entry after their first sight")


def drop_cached_pages(engine: Engine) -> None:
    """Evict every cached page nothing holds (entries stay)."""
    engine.pool.evict(range(engine.pool.num_pages))


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of two log-probability vectors, in nats. KL is never
    negative; a sum of float terms for two equal distributions can come out a few
    ulps below zero, which is reported as 0."""
    return max(0.0, float((reference.exp() * (reference - other)).sum()))


def evaluate(
    model: str,
    examples: int,
    seed: int,
    docs: list[int],
    hops: list[int],
    positions: list[str],
    device: str | None = None,
    batch: int = 32,
    repairs: tuple[str, ...] = DEFAULT_REPAIRS,
    progress: Callable[[str], None] = print,
    entry_system_prompt: str | None = DEFAULT_ENTRY_SYSTEM_PROMPT,
    dtype: str | None = None,
    deviation_layer: int | None = None,
    entries: str = "context",
    low_layers: str = "context",
) -> dict:
    """Every (mode, hops, docs) row, plus exact-vs-full token mismatches."""
    if entries not in ("context", "filled"):
        raise ValueError(f"entries must be 'context' or 'filled', got {entries!r}")
    settings = {text: parse_repair(text) for text in repairs}
    rows, mismatches = [], 0
    for k in docs:
        # room for one batch twice over (exact mode keeps a warm copy) plus entries
        num_pages = 3 * batch * (k * 64 + 256) // 16
        engines = {mode: make_engine(model, mode, device, num_pages, dtype=dtype) for mode in MODES}
        engines["approximate"] = make_engine(
            model, "exact", device, num_pages, entry_system_prompt, dtype, deviation_layer,
            entries_from_context=entries == "context", placed_low_layers=low_layers,
        )  # fmt: skip
        selection = (
            engines["approximate"].deviation_layer,
            engines["full"].model_config.num_layers,
        )
        tokenizer = engines["full"].tokenizer
        for h in hops:
            base = generate(seed, examples, k, "heldout", h)
            prompts = [
                build_prompt(tokenizer, swept(ex, POSITIONS[p](k)))
                for ex in base
                for p in positions
            ]
            results: dict[str, list[Outcome]] = {m: [] for m in (*MODES, *settings)}
            for start in range(0, len(prompts), batch):
                part = prompts[start : start + batch]
                results["full"] += run_prompts(engines["full"], part, place=False)
                run_prompts(engines["exact"], part, place=False)  # warm the cache
                results["exact"] += run_prompts(engines["exact"], part, place=False)
                results["naive"] += run_prompts(engines["naive"], part, place=True)
                engines["naive"].reuse.clear()
                approx = engines["approximate"]
                approx.pool.clear()  # entries of earlier batches: room for this one's
                if entries == "context":
                    first_sight(approx, part, tokenizer)
                else:
                    fill_entries(approx, part)
                for text, repair in settings.items():
                    drop_cached_pages(approx)
                    results[text] += run_prompts(approx, part, place=True, reuse=repair)
                progress(f"docs {k} hops {h}: {min(start + batch, len(prompts))}/{len(prompts)}")
            mismatches += sum(
                a.token_ids != b.token_ids
                for a, b in zip(results["full"], results["exact"], strict=True)
            )
            for name, outs in results.items():
                repair = settings.get(name)
                rows.append(
                    _row(name if repair is None else "approximate", h, k, outs, prompts, results)
                    | (
                        {}
                        if repair is None
                        else {
                            "first_tokens": repair.first_tokens,
                            "deviation_ratio": repair.deviation_ratio,
                        }
                    )
                )
    return {"rows": rows, "exact_token_mismatches": mismatches, "selection_layer": selection}


def _row(mode, hops, docs, outs, prompts, results) -> dict:
    correct = sum(
        answer_matches(o.text, p.example.answer) for o, p in zip(outs, prompts, strict=True)
    )
    placed = sum(o.placed for o in outs)
    row = {
        "mode": mode,
        "hops": hops,
        "docs": docs,
        "accuracy": correct / len(outs),
        "kl": sum(
            kl(f.first_logits, o.first_logits) for f, o in zip(results["full"], outs, strict=True)
        )
        / len(outs),
        "recomputed_share": sum(o.computed_share for o in outs) / len(outs),
        "prompts": len(outs),
    }
    if placed:
        row["placed_recomputed_share"] = sum(o.recomputed for o in outs) / placed
    return row


def format_table(rows: list[dict]) -> str:
    lines = [
        "| mode | repair | hops | docs | prompts | accuracy | KL vs full | computed share "
        "| placed recomputed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        repair = f"k={r['first_tokens']},r={r['deviation_ratio']:g}" if "first_tokens" in r else ""
        placed = r.get("placed_recomputed_share")
        lines.append(
            f"| {r['mode']} | {repair} | {r['hops']} | {r['docs']} | {r['prompts']} | "
            f"{r['accuracy']:.1%} | {r['kl']:.4f} | {r['recomputed_share']:.3f} | "
            f"{'' if placed is None else f'{placed:.3f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory")
    parser.add_argument("--examples", type=int, default=100, help="held-out examples per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--docs", type=int, nargs="+", default=[8], help="documents per prompt")
    parser.add_argument("--hops", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument(
        "--positions",
        nargs="+",
        default=list(POSITIONS),
        choices=list(POSITIONS),
        help="where the first gold document is moved",
    )
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on cuda)")
    parser.add_argument(
        "--deviation-layer",
        type=int,
        help="approximate rows: the layer whose K/V deviation selects the tokens to "
        "recompute (default: the engine's, layer 3 or the model's last)",
    )
    parser.add_argument("--batch", type=int, default=32, help="prompts per engine batch")
    parser.add_argument(
        "--repairs",
        nargs="*",
        default=list(DEFAULT_REPAIRS),
        help="approximate repair settings, one row each: k=FIRST_TOKENS[,r=DEVIATION_RATIO]",
    )
    parser.add_argument(
        "--entry-system-prompt",
        default=DEFAULT_ENTRY_SYSTEM_PROMPT,
        help="approximate rows: the system prompt entries are computed after "
        f"(default {DEFAULT_ENTRY_SYSTEM_PROMPT!r}; 'none': each chunk alone from position 0)",
    )
    parser.add_argument(
        "--entries",
        choices=("context", "filled"),
        default="context",
        help="approximate rows: entries taken from a first sight in another context "
        "(what the engine does by default), or filled after the entry context",
    )
    parser.add_argument(
        "--low-layers",
        choices=("context", "entries"),
        default="context",
        help="approximate rows: the KV of placed tokens not recomputed below the deviation "
        "layer, as the selecting forward computed it in this prompt (the default) or the "
        "entries' own (EngineConfig.placed_low_layers)",
    )
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.entry_system_prompt == "none":
        args.entry_system_prompt = None
    if args.examples < 1:
        parser.error("--examples must be >= 1")
    try:
        [parse_repair(text) for text in args.repairs]
    except ValueError as error:
        parser.error(str(error))
    if not Path(args.model, "config.json").is_file():
        parser.error(f"{args.model} is not a checkpoint directory (no config.json)")
    started = time.perf_counter()
    result = evaluate(
        args.model,
        args.examples,
        args.seed,
        args.docs,
        args.hops,
        args.positions,
        args.device,
        args.batch,
        tuple(args.repairs),
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        entry_system_prompt=args.entry_system_prompt,
        dtype=args.dtype,
        deviation_layer=args.deviation_layer,
        entries=args.entries,
        low_layers=args.low_layers,
    )
    result["meta"] = {
        "model": str(args.model),
        "examples": args.examples,
        "seed": args.seed,
        "positions": args.positions,
        "entry_system_prompt": args.entry_system_prompt,
        "entries": args.entries,
        "low_layers": args.low_layers,
        "device": args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        "dtype": args.dtype,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(format_table(result["rows"]))
    print(f"exact reuse vs full prefill: {result['exact_token_mismatches']} token mismatches")
    layer, layers = result["selection_layer"]
    print(
        f"deviating tokens selected at layer {layer} of {layers}: layers 0-{layer - 1} of "
        "every position up to the last placed chunk run in context (not counted as recomputed)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if math.isfinite(sum(r["kl"] for r in result["rows"])) else 1


if __name__ == "__main__":
    raise SystemExit(main())
