"""bench/reuse_quality.py end to end on the shipped doc-QA model (CPU): exact reuse
equals full prefill token for token, and the JSON rows have the promised fields."""

from __future__ import annotations

import json

import pytest

from bench import reuse_quality


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "rows.json"
    argv = ["--examples", "4", "--docs", "4", "--hops", "1", "2", "--device", "cpu"]
    argv += ["--repairs", "k=0", "k=2,r=0.2", "k=10000"]
    assert reuse_quality.main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """Entries filled alone from position 0 (no entry context)."""
    out = tmp_path_factory.mktemp("quality") / "alone.json"
    argv = ["--examples", "4", "--docs", "4", "--hops", "1", "--device", "cpu"]
    argv += ["--repairs", "k=0", "--entry-system-prompt", "none", "--deviation-layer", "5"]
    argv += ["--entries", "filled"]
    assert reuse_quality.main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_exact_reuse_equals_full_prefill_on_docqa_prompts(result):
    assert result["exact_token_mismatches"] == 0
    rows = {(r["mode"], r["hops"]): r for r in result["rows"]}
    for hops in (1, 2):
        full, exact = rows[("full", hops)], rows[("exact", hops)]
        assert exact["accuracy"] == full["accuracy"]
        assert full["kl"] == 0 and exact["kl"] < 1e-9
        assert full["recomputed_share"] == 1.0
        assert exact["recomputed_share"] < 0.2  # a warm cache serves nearly every token


def test_approximate_limits_naive_placement_and_full_prefill(result, alone):
    """Entries computed alone and placed with nothing recomputed are naive placement;
    entries taken from a first sight in another context are far closer to full
    prefill; recomputing every placed token is full prefill."""
    solo = {(r["mode"], r.get("first_tokens")): r for r in alone["rows"]}
    assert alone["meta"]["entry_system_prompt"] is None
    assert (alone["meta"]["entries"], result["meta"]["entries"]) == ("filled", "context")
    assert alone["selection_layer"] == [5, 8] and result["selection_layer"] == [3, 8]
    assert abs(solo[("approximate", 0)]["kl"] - solo[("naive", None)]["kl"]) < 1e-6
    assert solo[("approximate", 0)]["placed_recomputed_share"] == 0
    rows = {
        (r["mode"], r.get("first_tokens"), r.get("deviation_ratio"), r["hops"]): r
        for r in result["rows"]
    }
    for hops in (1, 2):
        naive, full = rows[("naive", None, None, hops)], rows[("full", None, None, hops)]
        nothing = rows[("approximate", 0, 0.0, hops)]
        everything = rows[("approximate", 10000, 0.0, hops)]
        some = rows[("approximate", 2, 0.2, hops)]
        assert nothing["kl"] < naive["kl"] / 10 and naive["kl"] > 1
        assert nothing["placed_recomputed_share"] == 0
        assert everything["kl"] < 1e-9 and everything["accuracy"] == full["accuracy"]
        assert everything["placed_recomputed_share"] == 1
        assert 0.2 < some["placed_recomputed_share"] < 0.5


def test_rows_cover_every_mode_with_the_promised_fields(result):
    assert {(r["mode"], r["hops"], r["docs"]) for r in result["rows"]} == {
        (m, h, 4) for m in ("full", "exact", "naive", "approximate") for h in (1, 2)
    }
    for row in result["rows"]:
        assert {"mode", "hops", "docs", "accuracy", "kl", "recomputed_share"} <= set(row)
        assert 0 <= row["accuracy"] <= 1 and row["kl"] >= 0
    naive = [r for r in result["rows"] if r["mode"] == "naive"]
    # documents are placed, not computed: only system prompt, question and the
    # generation prompt are
    assert all(r["recomputed_share"] < 0.6 for r in naive)
    # 12 prompts per row over the shipped model, which answers all held-out questions
    # (a random-weight model answers none)
    full = [r for r in result["rows"] if r["mode"] == "full"]
    assert all(r["accuracy"] >= 0.9 for r in full), full
