"""Host time of ``model_runner.build_inputs`` (every step's inputs, and the selection
forward's at an approximate admission) for a few batch shapes; no model, no device.

    python bench/step_inputs.py

Compare trees by running it in each (e.g. one unpacked with ``git archive``) on the
same machine.
"""

from __future__ import annotations

import sys
import time
from array import array
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.model_runner import build_inputs  # noqa: E402
from workers.engine.request import Sequence  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402
from workers.engine.scheduler import ScheduledSeq  # noqa: E402

PAGE_SIZE = 16


def batches() -> dict[str, list[ScheduledSeq]]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 50_000, size=4384).tolist()
    long = Sequence("long", 0, tokens, SamplingParams(max_tokens=1), None)
    long.page_ids = array("i", range(1, 300))
    decoding = []
    for i in range(64):
        seq = Sequence(f"d{i}", 0, tokens[:100], SamplingParams(max_tokens=100), None)
        seq.token_ids = tokens[:150]
        seq.page_ids = array("i", range(400 + 10 * i, 410 + 10 * i))
        decoding.append(seq)
    decode = [ScheduledSeq(seq, 149, 1) for seq in decoding]
    scattered = np.sort(rng.choice(np.arange(300, 4000), 300, replace=False))
    return {
        "one 4,352-token prompt run": [ScheduledSeq(long, 32, 4352)],
        "64 decode tokens": decode,
        "64 decode tokens + a 2,000-token run": [*decode, ScheduledSeq(long, 32, 2000)],
        "300 scattered positions + a 32-token run": [
            ScheduledSeq(long, 4352, 32, scattered=scattered)
        ],
    }


def main() -> None:
    print("| batch | build_inputs, best of 3 x 200 calls |")
    print("|---|---|")
    for name, batch in batches().items():
        build_inputs(batch, PAGE_SIZE)  # warm-up
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(200):
                build_inputs(batch, PAGE_SIZE)
            best = min(best, (time.perf_counter() - start) / 200)
        print(f"| {name} | {best * 1e6:.0f} us |")


if __name__ == "__main__":
    main()
