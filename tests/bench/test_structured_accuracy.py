"""bench/structured_accuracy.py counts an output as schema-valid only when it is a
complete JSON object with exactly a string ``answer``."""

from __future__ import annotations

from bench.structured_accuracy import schema_answer


def test_only_a_complete_object_with_a_string_answer_counts():
    assert schema_answer('{"answer": " Oslo"}') == " Oslo"
    assert schema_answer('{"answer": " Oslo", "why": "x"}') is None  # not the schema's
    assert schema_answer('{"answer": " Oslo') is None  # stopped at the token limit
    assert schema_answer('{"answer": 34}') is None
    assert schema_answer('[" Oslo"]') is None
