"""The reuse seam: attention by position over KV that is already filled, and pages
that know whether their KV is exact."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch

from chunkstore.events import EventKind
from chunkstore.hashing import Namespace, pack_tokens
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.kv_pool import KVPool
from workers.engine.request import Sequence
from workers.engine.reuse import ExactPrefixReuse, publish_exact_pages
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq

PAGE = 16


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def engine(request, model_factory):
    """Qwen3, and Llama 3 (whose tiny preset has llama3 RoPE scaling)."""
    model = model_factory(request.param)
    return Engine(EngineConfig(str(model), page_size=PAGE, num_pages=64, device="cpu"))


def _sequence(engine: Engine, tokens: list[int], name: str) -> Sequence:
    seq = Sequence(name, 0, tokens, SamplingParams(max_tokens=1), engine.namespace())
    seq.page_ids = array("i", engine.pool.allocate(-(-len(tokens) // PAGE)))
    return seq


def _kv_rows(engine: Engine, seq: Sequence, n: int) -> list[torch.Tensor]:
    """Every layer's K/V of positions [0, n): [n, 2, kv_heads, head_dim] each."""
    pages = torch.tensor(seq.page_ids, dtype=torch.long).repeat_interleave(PAGE)[:n]
    offsets = torch.arange(n) % PAGE
    return [cache[pages, :, offsets].clone() for cache in engine.runner.kv_caches]


def _corrupt(engine: Engine, seq: Sequence, positions: np.ndarray) -> None:
    pages = torch.tensor(seq.page_ids, dtype=torch.long)[torch.from_numpy(positions) // PAGE]
    offsets = torch.from_numpy(positions) % PAGE
    for cache in engine.runner.kv_caches:
        cache[pages, :, offsets] = torch.randn_like(cache[pages, :, offsets]) * 5


@pytest.mark.parametrize("seed", [0, 1])
def test_recomputing_scattered_positions_reproduces_one_plain_pass(engine, seed):
    """Two sequences in one step: one recomputes an arbitrary subset of its tokens
    (scattered positions, then its last three) over its cached KV, whose rows at those
    positions were overwritten with noise; the other is a plain prefill. KV and
    logits equal those of one plain pass (float32, 1e-5)."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    tokens = rng.integers(10, vocab - 1, size=83).tolist()
    other = rng.integers(10, vocab - 1, size=21).tolist()
    seq = _sequence(engine, tokens, f"scattered-{seed}")
    plain_logits = engine.runner.run([ScheduledSeq(seq, 0, len(tokens))])
    plain_kv = _kv_rows(engine, seq, len(tokens))

    tail = len(tokens) - 3
    subset = np.sort(rng.choice(tail, size=29, replace=False)).astype(np.int64)
    subset = np.union1d(subset, [0, 16, 17, tail - 1]).astype(np.int64)  # page edges too
    _corrupt(engine, seq, np.concatenate((subset, np.arange(tail, len(tokens)))))
    neighbour = _sequence(engine, other, f"plain-{seed}")
    logits = engine.runner.run(
        [ScheduledSeq(neighbour, 0, len(other)), ScheduledSeq(seq, tail, 3, subset)]
    )
    neighbour_alone = _sequence(engine, other, f"alone-{seed}")
    alone_logits = engine.runner.run([ScheduledSeq(neighbour_alone, 0, len(other))])

    torch.testing.assert_close(logits[1], plain_logits[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[0], alone_logits[0], atol=1e-5, rtol=0)
    got_kv = _kv_rows(engine, seq, len(tokens))
    for layer, (got, want) in enumerate(zip(got_kv, plain_kv, strict=True)):
        assert (got - want).abs().max() <= 1e-5, f"layer {layer}"
    for s in (seq, neighbour, neighbour_alone):
        engine.pool.release(s.page_ids)


def test_scattered_queries_attend_by_position_not_as_a_tail(engine):
    """The same recompute with the scattered tokens' KV left corrupted elsewhere
    would differ: a query must not see positions after its own."""
    rng = np.random.default_rng(5)
    vocab = engine.model_config.vocab_size
    tokens = rng.integers(10, vocab - 1, size=40).tolist()
    seq = _sequence(engine, tokens, "by-position")
    engine.runner.run([ScheduledSeq(seq, 0, len(tokens))])
    plain_kv = _kv_rows(engine, seq, len(tokens))
    # Corrupt positions 30..39 and recompute only position 5 (plus the last token):
    # position 5 must not see the noise at 30..38, so its KV stays exact.
    _corrupt(engine, seq, np.arange(30, 39))
    engine.runner.run([ScheduledSeq(seq, 39, 1, np.array([5], dtype=np.int64))])
    got = _kv_rows(engine, seq, len(tokens))
    for layer in range(len(got)):
        assert (got[layer][5] - plain_kv[layer][5]).abs().max() <= 1e-5
    engine.pool.release(seq.page_ids)


def test_engine_finishes_pending_positions_before_the_tail():
    """A sequence admitted with pending positions computes them in order, within the
    token budget, and only then its contiguous tail."""
    from workers.engine.scheduler import Scheduler, SchedulerLimits

    pool = KVPool(16, PAGE)

    class Placed:
        mode = "exact"

        def admit(self, seq, budget, place=True):
            seq.page_ids = array("i", pool.allocate(3))
            seq.num_computed = 40
            seq.pending = np.arange(10, 30, dtype=np.int64)
            seq.exact_until = 10
            return True

        def publish(self, seq, start, end):
            pass

        def flush(self):
            pass

    scheduler = Scheduler(pool, Placed(), SchedulerLimits(4, 12))
    seq = Sequence("p", 0, list(range(50)), SamplingParams(max_tokens=1), Namespace("m", ""))
    scheduler.add(seq)
    first = scheduler.schedule()[0]
    assert first.scattered.tolist() == list(range(10, 22)) and first.num_tokens == 0
    assert not first.samples
    seq.pending, seq.num_computed = seq.pending[12:], first.end
    second = scheduler.schedule()[0]
    assert second.scattered.tolist() == list(range(22, 30))
    assert (second.start, second.num_tokens) == (40, 4)


def test_inexact_pages_are_never_keyed_matched_or_announced():
    pool = KVPool(8, PAGE)
    namespace = Namespace("m", "")
    tokens = list(range(100, 164))  # four full pages
    seq = Sequence("a", 0, tokens, SamplingParams(max_tokens=1), namespace)
    seq.page_ids = array("i", pool.allocate(4))
    seq.exact_until = 2 * PAGE + 3  # positions from 35 on were approximated
    publish_exact_pages(pool, seq, 0, len(tokens))
    stored = [e for e in pool.drain_events() if e.kind is EventKind.STORED]
    keys = seq.extend_page_keys(PAGE, len(tokens))
    assert [k for e in stored for k in e.keys] == keys[:2]
    assert [pool.is_exact(p) for p in seq.page_ids] == [True, True, False, False]
    with pytest.raises(ValueError, match="inexact"):
        pool.publish(seq.page_ids[2], keys[2], pack_tokens(tokens[32:48]), keys[1])
    assert pool.drain_events() == []

    # An exact request with the same tokens matches only the exact pages.
    later = Sequence("b", 1, tokens + [7], SamplingParams(max_tokens=1), namespace)
    assert ExactPrefixReuse(pool).admit(later)
    assert list(later.page_ids) == list(seq.page_ids[:2])
    assert later.reuse.reused_tokens == 2 * PAGE and later.reuse.mode == "exact"

    # Freed, an inexact page comes back exact (its KV will be computed afresh).
    pool.release(seq.page_ids)
    fresh = pool.allocate(8 - 2)
    assert fresh is not None and all(pool.is_exact(p) for p in fresh)


def test_exact_admission_matches_by_chain_without_hashing_and_keys_agree():
    """A sequence readmitted after preemption (outputs after its prompt) matches the
    pages an earlier sequence published over prompt and outputs alike; the keys it
    takes from the matched pages are those hashing its tokens gives, so the pages it
    publishes next chain on from them."""
    pool = KVPool(16, PAGE)
    namespace = Namespace("m", "")
    tokens = list(range(100, 180))  # five full pages
    first = Sequence("a", 0, tokens, SamplingParams(max_tokens=1), namespace)
    first.page_ids = array("i", pool.allocate(5))
    publish_exact_pages(pool, first, 0, len(tokens))
    pool.release(first.page_ids)

    # prompt of two and a half pages, then outputs up to 70 tokens: 4 full pages usable
    later = Sequence("b", 1, tokens[:40], SamplingParams(max_tokens=64), namespace)
    later.token_ids = tokens[:70]
    assert later.packed_tokens(70) == pack_tokens(tokens[:70])
    assert ExactPrefixReuse(pool).admit(later)
    assert list(later.page_ids) == list(first.page_ids[:4]) and later.num_computed == 64
    hashed = Sequence("c", 2, tokens[:70], SamplingParams(max_tokens=1), namespace)
    assert later.page_keys == hashed.extend_page_keys(PAGE, 64)[:4]

    # its fifth page, once computed, is published under the key hashing gives
    later.token_ids = tokens + [1]
    later.page_ids.extend(pool.allocate(1))
    pool.evict(first.page_ids[4:5])
    publish_exact_pages(pool, later, 64, 80)
    keys = Sequence("d", 3, tokens, SamplingParams(max_tokens=1), namespace).extend_page_keys(
        PAGE, 80
    )
    assert pool.keys_of(later.page_ids[4:5]) == keys[4:5]
    assert pool.match_chain(keys[3], pack_tokens(tokens[64:80]), 1) == list(later.page_ids[4:5])
