"""``build_inputs``' token ids: long prompt runs are read from the packed prompt, the
rest from the token list; either way a step's ids are its positions' tokens, in
batch order, with each sampling sequence's last row indexed."""

from __future__ import annotations

from array import array

import numpy as np

from chunkstore.hashing import Namespace
from workers.engine.model_runner import build_inputs
from workers.engine.request import Sequence
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import ScheduledSeq

PAGE = 16


def _sequence(name: str, prompt: list[int], outputs: list[int], packed: bool) -> Sequence:
    seq = Sequence(name, 0, prompt, SamplingParams(max_tokens=64), Namespace("m"))
    seq.token_ids = prompt + outputs
    seq.page_ids = array("i", range(1, 1 + -(-len(seq.token_ids) // PAGE)))
    if packed:
        seq.packed_tokens(len(prompt))  # packed ahead, as the engine's validation does
    return seq


def test_ids_are_the_positions_tokens_whichever_way_they_are_read():
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(0, 2**31, size=n).tolist()  # noqa: E731 (beyond 16 bits)
    long = _sequence("long", draw(700), draw(5), packed=True)
    unpacked = _sequence("unpacked", draw(300), [], packed=False)
    decoding = _sequence("decoding", draw(40), draw(9), packed=True)
    scattered = np.sort(rng.choice(600, size=90, replace=False)).astype(np.int64)
    few = np.array([3, 9, 10], dtype=np.int64)
    batch = [
        ScheduledSeq(decoding, 48, 1),  # a decode token: past the prompt
        ScheduledSeq(long, 5, 500),  # a long prompt run
        ScheduledSeq(long, 690, 15),  # a run across the prompt's end into outputs
        ScheduledSeq(unpacked, 0, 300),  # long, the prompt packed on first use
        ScheduledSeq(decoding, 47, 2),  # short, ends past the prompt
        ScheduledSeq(long, 650, 20, scattered=scattered),  # many scattered positions
        ScheduledSeq(unpacked, 200, 5, scattered=few),  # few scattered positions
    ]
    inputs = build_inputs(batch, PAGE)
    expected, last_rows = [], []
    for item in batch:
        computed = [] if item.scattered is None else item.scattered.tolist()
        computed += range(item.start, item.start + item.num_tokens)
        expected += [item.seq.token_ids[p] for p in computed]
        if item.samples:
            last_rows.append(len(expected) - 1)
    assert str(inputs.input_ids.dtype) == "torch.int64"
    assert inputs.input_ids.tolist() == expected
    assert inputs.logits_indices.tolist() == last_rows
    assert len(last_rows) == 4  # every item that reaches its sequence's last token


def test_scattered_positions_make_a_row_per_run_over_its_prefix():
    """Each maximal run of consecutive positions is a layout row whose KV is the
    sequence's pages up to the run's end (the plain causal kernel then attends by
    position); slots are each position's page and offset."""
    rng = np.random.default_rng(1)
    seq = _sequence("runs", rng.integers(0, 50_000, size=900).tolist(), [], packed=True)
    pages = np.asarray(seq.page_ids)
    for trial in range(20):
        size = int(rng.integers(1, 200))
        scattered = np.sort(rng.choice(800, size=size, replace=False)).astype(np.int64)
        start = 800 + int(rng.integers(0, 20))
        inputs = build_inputs([ScheduledSeq(seq, start, 900 - start, scattered=scattered)], PAGE)
        computed = np.concatenate((scattered, np.arange(start, 900)))
        runs = np.split(computed, np.flatnonzero(np.diff(computed) != 1) + 1)
        layout = inputs.layout
        assert layout.qo_indptr.tolist() == np.cumsum([0] + [len(r) for r in runs]).tolist()
        ends = [int(r[-1]) + 1 for r in runs]
        assert layout.kv_lens.tolist() == ends, trial
        counts = [-(-end // PAGE) for end in ends]
        assert layout.kv_page_indptr.tolist() == np.cumsum([0] + counts).tolist()
        assert layout.kv_page_indices.tolist() == [p for c in counts for p in pages[:c].tolist()]
        assert layout.kv_last_page_len.tolist() == [
            e - (c - 1) * PAGE for e, c in zip(ends, counts, strict=True)
        ]
        slots = pages[computed // PAGE] * PAGE + computed % PAGE
        assert layout.slot_mapping.tolist() == slots.tolist()
        assert inputs.positions.tolist() == computed.tolist()
