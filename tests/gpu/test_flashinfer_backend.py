"""FlashInfer backend against the torch reference on random paged inputs (bf16)."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine.attention.base import AttentionShape, BatchLayout

PAGE = 16
HEADS, KV_HEADS, DIM = 16, 8, 128


def _shape():
    return AttentionShape(HEADS, KV_HEADS, DIM, PAGE, torch.bfloat16, torch.device("cuda"))


def _layout(page_lists, kv_lens, new_tokens):
    indptr, indices, last, qo, slots = [0], [], [], [0], []
    for pages, kv_len, n in zip(page_lists, kv_lens, new_tokens, strict=True):
        used = pages[: -(-kv_len // PAGE)]
        indices += used
        indptr.append(len(indices))
        last.append(kv_len - (len(used) - 1) * PAGE)
        qo.append(qo[-1] + n)
        slots += [used[p // PAGE] * PAGE + p % PAGE for p in range(kv_len - n, kv_len)]
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return BatchLayout(t(qo), t(indptr), t(indices), t(last), t(kv_lens), t(slots), PAGE)


def _run(backend, layout, q, k, v, cache):
    meta = backend.plan(layout)
    return backend.forward(q, k, v, cache, meta)


def _compare(layout, fi_backend):
    from workers.engine.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    num_pages = int(layout.kv_page_indices.max()) + 1
    cache = torch.randn(num_pages, 2, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    t = layout.num_tokens
    q = torch.randn(t, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    expected = _run(TorchAttentionBackend(_shape()), layout, q, k, v, cache.clone())
    got = _run(fi_backend, layout, q, k, v, cache.clone())
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    return rel


def _random_pages(rng, n_seqs, max_pages, shared=()):
    pool = list(range(len(shared), len(shared) + n_seqs * max_pages))
    rng.shuffle(pool)
    return [list(shared) + pool[i * max_pages : (i + 1) * max_pages] for i in range(n_seqs)]


def test_prefill_with_cached_prefix():
    from workers.engine.attention.flashinfer_backend import FlashInferBackend

    rng = random.Random(0)
    kv_lens, new = [100, 300, 17, 1000, 64], [10, 300, 1, 50, 64]
    layout = _layout(_random_pages(rng, 5, 70), kv_lens, new)
    backend = FlashInferBackend(_shape())
    assert _compare(layout, backend) <= 1e-2
    assert backend.last_plan_kind == "prefill"


def test_short_rows_over_a_long_kv_take_the_split_kv_kernel():
    """A question after long cached context, beside a short prompt: FA2 with the KV
    split over CTAs, agreeing with the torch reference."""
    from workers.engine.attention.flashinfer_backend import FlashInferBackend

    rng = random.Random(5)
    layout = _layout(_random_pages(rng, 2, 280), [256, 4384], [256, 32])
    backend = FlashInferBackend(_shape())
    assert _compare(layout, backend) <= 1e-2
    assert backend.last_plan_kind == "prefill-split"


def test_one_token_rows_beside_a_short_tail_take_small_query_tiles():
    """A loaded worker's mixed step (a cache hit's tail beside decoding requests): FA2,
    whose query tile follows the rows' average length, agreeing with the torch
    reference."""
    from workers.engine.attention.flashinfer_backend import FlashInferBackend

    rng = random.Random(6)
    kv_lens = [2608] + [rng.randint(1500, 2600) for _ in range(20)]
    layout = _layout(_random_pages(rng, 21, 170), kv_lens, [48] + [1] * 20)
    backend = FlashInferBackend(_shape())
    assert _compare(layout, backend) <= 1e-2
    assert backend.last_plan_kind == "prefill-small-tiles"


def test_decode():
    from workers.engine.attention.flashinfer_backend import FlashInferBackend

    rng = random.Random(1)
    kv_lens = [rng.randint(1, 900) for _ in range(32)]
    layout = _layout(_random_pages(rng, 32, 60), kv_lens, [1] * 32)
    backend = FlashInferBackend(_shape(), enable_cascade=False)
    assert _compare(layout, backend) <= 1e-2
    assert backend.last_plan_kind == "decode"


@pytest.mark.parametrize("levels", [2, 3])
def test_cascade_decode(levels):
    from workers.engine.attention.flashinfer_backend import FlashInferBackend

    rng = random.Random(2)
    system = list(range(10))  # 160 shared tokens
    docs = [list(range(10 + 8 * d, 18 + 8 * d)) for d in range(3)] if levels == 3 else [[]]
    page_lists, kv_lens = [], []
    next_page = 100
    for i in range(24):
        own = list(range(next_page, next_page + 5))
        next_page += 5
        page_lists.append(system + docs[i % len(docs)] + own)
        kv_lens.append((len(page_lists[-1]) - 5) * PAGE + rng.randint(1, 5 * PAGE))
    # plus loners that take the plain decode path in the same step
    for _ in range(4):
        page_lists.append(list(range(next_page, next_page + 3)))
        next_page += 3
        kv_lens.append(rng.randint(1, 3 * PAGE))
    layout = _layout(page_lists, kv_lens, [1] * len(page_lists))
    backend = FlashInferBackend(_shape(), min_saved_tokens=0)
    assert _compare(layout, backend) <= 1e-2
    assert backend.last_plan_kind == "cascade"


@pytest.mark.parametrize(
    ("run", "kind"),
    [(1, "prefill-small-tiles"), (12, "prefill")],  # FA2's small tiles; FA3 (longer runs)
)
def test_prefill_at_scattered_positions_runs_as_causal_rows(run, kind):
    """Queries at scattered positions over filled KV (repairs of placed chunks) beside
    a plain tail: the runner gives each run of positions its own causal row over the
    KV up to the run's end; FlashInfer agrees with the torch reference (by position),
    with runs of single positions (FA2's small query tiles) and of ``run`` positions
    (the default kernel)."""
    from array import array

    import numpy as np

    from workers.engine.attention.flashinfer_backend import FlashInferBackend
    from workers.engine.model_runner import build_inputs
    from workers.engine.request import Sequence
    from workers.engine.sampling_params import SamplingParams
    from workers.engine.scheduler import ScheduledSeq

    rng = random.Random(3)
    pages = _random_pages(rng, 3, 70)
    items = []
    for i, (kv_len, tail) in enumerate([(300, 10), (77, 17), (1000, 1)]):
        seq = Sequence(f"s{i}", i, [7] * kv_len, SamplingParams(max_tokens=1), None)
        seq.page_ids = array("i", pages[i])
        scattered = None
        if i != 1:  # the second sequence is a plain tail in the same step
            starts = sorted(rng.sample(range(0, kv_len - tail - run, run), 60 // run))
            chosen = [p for start in starts for p in range(start, start + run)]
            scattered = np.asarray(chosen, dtype=np.int64)
        items.append(ScheduledSeq(seq, kv_len - tail, tail, scattered))
    layout = build_inputs(items, PAGE).layout
    assert layout.batch_size > 3  # runs became rows
    backend = FlashInferBackend(_shape())
    assert _compare(layout, backend) <= 1e-2
    assert backend.last_plan_kind == kind
