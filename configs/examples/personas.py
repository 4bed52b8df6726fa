"""Several personas (different system prompts) answer questions about one shared
document set, from registered chunks; prints the prompt tokens reused per answer.

    python configs/examples/personas.py MODEL_DIR [--device cpu]

Exact mode: a chunk's KV is reused only after exactly the tokens it was registered
after, so each persona registers the documents after its own system prompt (one
pinned copy per persona); every question, sent inline, then reuses persona +
documents: exact mode matches the registered chunks' tokens wherever they recur.
"""

from __future__ import annotations

import argparse

from workers import LLM, SamplingParams

PERSONAS = {
    "analyst": "You are a financial analyst. Answer from the documents, with numbers.",
    "support": "You are a friendly support agent. Answer from the documents, simply.",
    "auditor": "You are a strict auditor. Quote the documents and flag any risk.",
}
DOCUMENTS = (
    "Pricing: Starter costs 29 dollars a month for five seats and one workspace; "
    "Team costs 99 dollars for twenty seats. Annual plans get two months free.\n"
    "Backups: snapshots run every six hours and are kept for thirty days in two "
    "regions; restores take under an hour for workspaces below 50 GB."
)
QUESTIONS = ("How much do twenty seats cost?", "How long are backups kept?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    llm = LLM(args.model_dir, device=args.device)
    params = SamplingParams(max_tokens=12, temperature=0)
    for name, prompt in PERSONAS.items():
        system = llm.register_chunk(prompt, role="system")
        llm.register_chunk(DOCUMENTS, role="context", after=[system])  # pinned
        for question in QUESTIONS:  # sent inline: only the question is new
            messages = [
                {"role": "system", "content": prompt},
                {"role": "user", "content": DOCUMENTS},
                {"role": "user", "content": question},
            ]
            out = llm.chat(messages, params)[0]
            computed = len(out.prompt_token_ids) - out.num_cached_tokens
            print(
                f"[{name}] {question} reused {out.num_cached_tokens} / computed {computed} "
                f"prompt tokens -> {out.text!r}"
            )
    for info in llm.list_chunks():
        print(
            f"chunk {info.chunk_id[:12]} {info.role:<7} {info.num_tokens:>3} tokens, "
            f"{info.pinned_tokens:>3} pinned"
        )


if __name__ == "__main__":
    main()
