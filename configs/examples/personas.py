"""Several personas (different system prompts) answer questions about one shared
document set, from ONE pinned position-free copy of each document; prints each
answer and how its prompt was served.

    python configs/examples/personas.py [MODEL_DIR] [--device cpu]

The documents are registered once with ``mode="approximate"``: each is computed
after the engine's entry context (a neutral system turn) and pinned. Every persona's
request then places those copies after its own system prompt (approximate reuse),
recomputing the system prompt, the question and the most deviating tenth of the
placed tokens (the default repair). In exact mode each persona would need a copy of
its own: a document's exact KV depends on everything before it. The default model
is the doc-QA model shipped in modeltools/docqa_model.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from workers import LLM, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "modeltools" / "docqa_model"
PERSONAS = {
    "concise": "You answer questions from the documents in the conversation. "
    "Reply with the answer only.",
    "directory": "You are the staff directory assistant. Use only the notes provided and "
    "answer with one name, team, city or number.",
    "reader": "Read the records below and answer the question with a single word.",
}
DOCUMENTS = (
    "Staff note: Mira lives in Oslo and is 34 years old.\n",
    "Team note: the Falcon team is based in Lima and is led by Omar.\n",
    "Staff note: Omar works in the Cedar team and lives in Cairo.\n",
    "Team note: the Cedar team is led by Lena and is based in Dublin.\n",
)
QUESTIONS = {  # question -> the answer the documents give
    "How old is Mira?": "34",
    "Who leads the Falcon team?": "Omar",
    "Which team does Omar work in?": "Cedar",
    "Where is the team of Omar based?": "Dublin",  # two hops: Omar -> Cedar -> Dublin
}


def run(llm: LLM, say: Callable[[str], None] = print) -> list[dict]:
    """Register the documents once, ask every persona every question; one record each."""
    chunk_ids = [llm.register_chunk(doc, mode="approximate") for doc in DOCUMENTS]
    params = SamplingParams(max_tokens=8, temperature=0)
    records = []
    for persona, system in PERSONAS.items():
        for question, expected in QUESTIONS.items():
            parts = [{"type": "text", "text": t} for t in (*DOCUMENTS, f"Question: {question}")]
            messages = [{"role": "system", "content": system}, {"role": "user", "content": parts}]
            out = llm.chat(messages, params, reuse="approximate")[0]
            record = {
                "persona": persona,
                "question": question,
                "answer": out.text.strip(),
                "expected": expected,
                "reuse": out.reuse,
                "prompt_tokens": len(out.prompt_token_ids),
            }
            records.append(record)
            say(
                f"[{persona}] {question} -> {record['answer']!r} (documents say {expected!r}); "
                f"reuse {out.reuse.mode}: reused {out.reuse.reused_tokens}, recomputed "
                f"{out.reuse.recomputed_tokens} of {record['prompt_tokens']} prompt tokens"
            )
    pinned = {info.chunk_id: info.pinned_tokens for info in llm.list_chunks()}
    say(
        f"{len(chunk_ids)} documents, one pinned copy each: {sum(pinned.values())} pinned "
        f"tokens in all, for {len(PERSONAS)} personas"
    )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", default=str(MODEL))
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    run(LLM(args.model_dir, device=args.device))


if __name__ == "__main__":
    main()
