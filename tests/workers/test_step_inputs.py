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
