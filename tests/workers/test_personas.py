"""configs/examples/personas.py on the shipped doc-QA model (CPU): one pinned
position-free copy per document serves three system prompts, approximate answers
stay right."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from chunkstore.hashing import position_free_key
from workers import LLM

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "examples" / "personas.py"


def _example():
    spec = importlib.util.spec_from_file_location("personas_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_pinned_copy_serves_every_persona_and_answers_stay_right():
    personas = _example()
    llm = LLM(personas.MODEL, device="cpu")
    pool = llm.engine.pool
    lines: list[str] = []
    records = personas.run(llm, lines.append)

    assert len(records) == len(personas.PERSONAS) * len(personas.QUESTIONS)
    for record in records:
        assert record["answer"] == record["expected"], record
        assert record["reuse"].mode == "approximate"
        assert record["reuse"].reused_tokens > record["reuse"].recomputed_tokens > 0
    # one copy of each document, pinned once, whoever asked
    infos = llm.list_chunks()
    assert len(infos) == len(personas.DOCUMENTS)
    assert all(info.mode == "approximate" for info in infos)
    pinned_pages = sum(info.pinned_tokens for info in infos) // pool.page_size
    assert pool.num_pinned == pinned_pages
    for doc in personas.DOCUMENTS:
        tokens = llm.tokenizer.encode(doc, add_special_tokens=False)
        entry = pool.entry(position_free_key(llm.engine.namespace(), tokens))
        assert entry is not None and entry.pins == 1
    assert lines[-1].startswith(f"{len(personas.DOCUMENTS)} documents, one pinned copy each")
