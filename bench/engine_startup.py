"""How long a worker takes to start: imports, engine construction (weights, KV pool,
CUDA-graph capture, kernel JIT on a fresh machine), and its first request.

    python bench/engine_startup.py --model DIR [--pages 24576]

Run several at once (one per GPU, ``CUDA_VISIBLE_DEVICES``) to see whether workers
starting together slow each other down.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

started = time.perf_counter()
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--pages", type=int, default=24576)
    args = ap.parse_args()
    imported = time.perf_counter()
    engine = Engine(
        EngineConfig(model_dir=args.model, num_pages=args.pages, max_num_batched_tokens=8192),
        stream_text=True,
    )
    built = time.perf_counter()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("probe", list(range(100, 3000)), params)
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(
        f"{torch.cuda.get_device_name()}: imports {imported - started:.1f} s, engine "
        f"{built - imported:.1f} s, first request (2,900 tokens) {done - built:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
