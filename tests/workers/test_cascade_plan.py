"""The cascade grouping and cost model (pure Python; the GPU test checks the math)."""

from __future__ import annotations

import torch

from workers.engine.attention.base import BatchLayout
from workers.engine.attention.cascade_plan import pad_cascade, plan_cascade

PAGE = 16


def _decode_layout(page_lists: list[list[int]], last_lens: list[int]) -> BatchLayout:
    indptr = [0]
    for pages in page_lists:
        indptr.append(indptr[-1] + len(pages))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    kv_lens = [(len(p) - 1) * PAGE + n for p, n in zip(page_lists, last_lens, strict=True)]
    slots = [p[-1] * PAGE + n - 1 for p, n in zip(page_lists, last_lens, strict=True)]
    return BatchLayout(
        i32(list(range(len(page_lists) + 1))),
        i32(indptr),
        i32([x for p in page_lists for x in p]),
        i32(last_lens),
        i32(kv_lens),
        i32(slots),
        PAGE,
    )


def _pages_per_row(plan, rows):
    """Reassemble each cascaded row's page list from the levels."""
    out = {r: [] for r in rows}
    position = {r: i for i, r in enumerate(rows)}
    for level in plan.levels:
        qo = level.qo_indptr.tolist()
        indptr = level.kv_page_indptr.tolist()
        indices = level.kv_page_indices.tolist()
        for entry in range(len(qo) - 1):
            for pos in range(qo[entry], qo[entry + 1]):
                row = rows[pos]
                out[row] += indices[indptr[entry] : indptr[entry + 1]]
    assert set(position) == set(out)
    return out


def test_groups_shared_prefix_and_keeps_every_page():
    system = list(range(100, 110))
    docs_a, docs_b = list(range(200, 206)), list(range(300, 306))
    page_lists = []
    for i in range(8):
        docs = docs_a if i % 2 else docs_b
        page_lists.append(system + docs + [400 + 2 * i, 401 + 2 * i])
    page_lists.append([500, 501, 502])  # a loner
    layout = _decode_layout(page_lists, [3] * 9)
    plan = plan_cascade(layout, max_levels=3, min_saved_tokens=0)
    assert plan is not None and len(plan.levels) == 3
    rows = plan.rows.tolist()
    assert sorted(rows) == list(range(8)) and plan.flat_rows.tolist() == [8]
    reassembled = _pages_per_row(plan, rows)
    for r in rows:
        assert reassembled[r] == page_lists[r]
    # shared: system by 8 (7 saved) + each doc set by 4 (3 saved twice)
    assert plan.saved_tokens == (7 * 10 + 2 * 3 * 6) * PAGE
    # the last level holds only each row's own pages; last page length preserved
    assert plan.levels[-1].kv_last_page_len.tolist() == [3] * 8


def test_two_levels_when_nothing_more_is_shared():
    page_lists = [[1, 2, 3, 10 + i] for i in range(4)]
    plan = plan_cascade(_decode_layout(page_lists, [5] * 4), min_saved_tokens=0)
    assert plan is not None and len(plan.levels) == 2
    assert plan.levels[0].kv_page_indices.tolist() == [1, 2, 3]


def test_cost_model_declines_small_sharing_and_prefill():
    page_lists = [list(range(16)) + [100 + i] for i in range(8)]  # batch 8, prefix 256
    assert plan_cascade(_decode_layout(page_lists, [1] * 8)) is None
    big = [list(range(256)) + [1000 + i] for i in range(64)]  # batch 64, prefix 4K
    assert plan_cascade(_decode_layout(big, [1] * 64)) is not None
    no_sharing = [[i * 10, i * 10 + 1] for i in range(64)]
    assert plan_cascade(_decode_layout(no_sharing, [1] * 64), min_saved_tokens=0) is None


def _brute_force_saved(page_lists):
    """Reference: group rows by first page, share the common prefix of pages[:-1],
    then subgroups by the next page."""
    from collections import defaultdict

    def common(lists):
        n = 0
        while all(len(x) > n for x in lists) and len({x[n] for x in lists}) == 1:
            n += 1
        return n

    by_first = defaultdict(list)
    for r, p in enumerate(page_lists):
        if len(p) >= 2:
            by_first[p[0]].append(r)
    saved0 = saved1 = 0
    for rows in (g for g in by_first.values() if len(g) >= 2):
        n0 = common([page_lists[r][:-1] for r in rows])
        saved0 += (len(rows) - 1) * n0
        by_next = defaultdict(list)
        for r in rows:
            rest = page_lists[r][n0:-1]
            by_next[rest[0] if rest else ("alone", r)].append(r)
        for sub in by_next.values():
            if len(sub) >= 2:
                saved1 += (len(sub) - 1) * common([page_lists[r][n0:-1] for r in sub])
    return saved0, saved1


def _random_page_lists(rng, alone: float = 0.0) -> list[list[int]]:
    """2-12 rows, each one of 3 system prefixes and one of 3 document runs (shared page
    ids) then pages of its own; with probability ``alone`` a row has only its own."""
    prefixes = [[rng.randrange(1000) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    docs = [[rng.randrange(1000, 2000) for _ in range(rng.randint(0, 4))] for _ in range(3)]
    page_lists, next_page = [], 5000
    for _ in range(rng.randint(2, 12)):
        own = list(range(next_page, next_page + rng.randint(1, 4)))
        next_page += len(own)
        shared = alone == 0 or rng.random() >= alone  # draws only where rows may be alone
        page_lists.append((rng.choice(prefixes) + rng.choice(docs) if shared else []) + own)
    return page_lists


def test_randomized_against_brute_force():
    import random

    rng = random.Random(5)
    for _ in range(200):
        page_lists = _random_page_lists(rng)
        layout = _decode_layout(page_lists, [rng.randint(1, PAGE) for _ in page_lists])
        plan = plan_cascade(layout, max_levels=3, min_saved_tokens=0)
        saved0, saved1 = _brute_force_saved(page_lists)
        if saved0 + saved1 == 0:
            assert plan is None or plan.saved_tokens == 0
            continue
        assert plan is not None and plan.saved_tokens == (saved0 + saved1) * PAGE
        rows = plan.rows.tolist()
        reassembled = _pages_per_row(plan, rows)
        for r in rows:
            assert reassembled[r] == page_lists[r]
        assert sorted(rows + plan.flat_rows.tolist()) == list(range(len(page_lists)))
        assert len(plan.levels) == (3 if saved1 else 2)


def _padded_pages(padded, size):
    """Each padded row's pages (by its index in the padded batch) and, per level, the
    entry that holds it."""
    order = padded.order.tolist()
    out = {r: [] for r in order}
    for level in padded.levels:
        qo = level.qo_indptr.tolist()
        indptr = level.kv_page_indptr.tolist()
        indices = level.kv_page_indices.tolist()
        assert len(qo) == size + 1 and qo[0] == 0 and qo[-1] == size  # every row, once
        assert len(level.kv_last_page_len) == size
        for entry in range(size):
            for pos in range(qo[entry], qo[entry + 1]):
                out[order[pos]] += indices[indptr[entry] : indptr[entry + 1]]
    return out


def test_padded_cascade_keeps_every_row_and_fills_the_graph_size():
    import random

    rng = random.Random(7)
    scratch = 9999
    for _ in range(100):
        page_lists = _random_page_lists(rng, alone=0.2)
        last_lens = [rng.randint(1, PAGE) for _ in page_lists]
        layout = _decode_layout(page_lists, last_lens)
        plan = plan_cascade(layout, max_levels=3, min_saved_tokens=0)
        if plan is None:
            continue
        batch = len(page_lists)
        for size in (batch, batch + rng.randint(1, 20)):
            padded = pad_cascade(plan, layout, size, scratch)
            assert sorted(padded.order.tolist()) == list(range(size))
            assert len(padded.levels) == len(plan.levels)
            pages = _padded_pages(padded, size)
            for row in range(batch):  # shared levels, then its own pages: all, in order
                assert pages[row] == page_lists[row]
            for row in range(batch, size):
                assert pages[row] == [scratch]
            own = padded.levels[-1]
            position = {r: i for i, r in enumerate(padded.order.tolist())}
            for row in range(batch):
                assert own.kv_last_page_len[position[row]] == last_lens[row]
            # in a shared level, an entry with KV is full pages; the rows outside any
            # group share one entry with no KV
            for level in padded.levels[:-1]:
                counts = level.kv_page_indptr.diff()
                assert ((counts == 0) == (level.kv_last_page_len == 0)).all()
    try:
        pad_cascade(plan, layout, batch - 1, scratch)
    except ValueError as e:
        assert "cannot hold" in str(e)
    else:
        raise AssertionError("a size below the batch must be refused")
