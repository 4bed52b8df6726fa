"""The layouts of ``bench/scattered_attention.py`` (the GPU timing itself runs there)."""

from __future__ import annotations

import numpy as np
import torch

from bench.scattered_attention import PAGE, position_mask, rows_layout, runs_of


def test_runs_and_row_layouts_cover_each_query_causally():
    positions = np.array([3, 4, 5, 9, 20, 21, 40])
    assert runs_of(positions) == [(3, 5), (9, 9), (20, 21), (40, 40)]
    kv_lens, q_lens = [6, 10, 22, 41], [3, 1, 2, 1]
    layout = rows_layout(kv_lens, q_lens)
    assert layout["qo_indptr"].tolist() == [0, 3, 4, 6, 7]
    pages = [-(-n // PAGE) for n in kv_lens]
    assert layout["kv_indptr"].tolist() == [0, *np.cumsum(pages).tolist()]
    assert layout["kv_indices"].tolist() == [i for p in pages for i in range(p)]
    last = layout["last_page_len"].tolist()
    assert [(p - 1) * PAGE + n for p, n in zip(pages, last, strict=True)] == kv_lens
    # two rows of a custom mask: each query sees the KV up to its own position
    mask = position_mask(torch.from_numpy(positions), [(0, 4, 10), (4, 3, 41)])
    first, second = mask[:40].view(4, 10), mask[40:].view(3, 41)
    assert first.sum(1).tolist() == [4, 5, 6, 10]
    assert second.sum(1).tolist() == [21, 22, 41]
