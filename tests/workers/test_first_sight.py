"""What approximate reuse costs over a stream, on the shipped doc-QA model (CPU), counted
in prompt positions computed through every layer (``Engine.tally``, entry fills
included), against exact reuse serving the same stream:

- documents never seen before: each one's entry is taken from the KV its first request
  computes in context, so a first sight costs what exact reuse pays (once, not twice);
- the same document sets again, in new orders after new system prompts: exact reuse
  matches nothing past the template, approximate reuse places every document;

and the answers are as right as exact reuse's.

The streams and engines are ``bench/first_sight.py``'s (which prints the figures, on
any device).
"""

from __future__ import annotations

import pytest

from bench.first_sight import compare, new_stream, repeated_stream


@pytest.fixture(scope="module")
def new_documents():
    return compare("cpu", new_stream(12, 4))


@pytest.fixture(scope="module")
def repeated_documents():
    return compare("cpu", repeated_stream(6, 5))


def test_a_first_sight_costs_what_exact_reuse_pays(new_documents):
    exact, approx = new_documents["exact"], new_documents["approximate"]
    tally = approx.tally
    # every document missed (bar one found in an exact prefix) and kept, none filled
    assert tally.entry_hits == 0 and tally.entry_misses >= 12 * 8 - 2
    assert tally.entries_taken == tally.entry_misses and tally.fills_queued == 0
    ratio = tally.prompt_positions / exact.tally.prompt_positions
    assert ratio <= 1.1, f"approximate computed {ratio:.2f}x exact's positions"
    assert approx.right >= exact.right >= exact.answers - 1  # the model answers these


def test_repeated_documents_in_new_orders_cost_half_or_less(repeated_documents):
    exact, approx = repeated_documents["exact"], repeated_documents["approximate"]
    tally = approx.tally
    assert tally.entries_taken == 6 * 8  # the first round's, once
    assert tally.entry_hits == 5 * 6 * 8
    ratio = tally.prompt_positions / exact.tally.prompt_positions
    assert ratio <= 0.5, f"approximate computed {ratio:.2f}x exact's positions"
    assert approx.right >= exact.right >= exact.answers - 2
