"""Where a warm RAG request's time to first token goes (issue 14's warm TTFT): the
scenario of bench/chunk_reuse.py (system 1,024 + 4 documents x 1,024 cached, a new
64-token query), one request profiled after warm-up, timed as chunk_reuse times it
(``LLM.generate_tokens``, one output token).

    python bench/warm_profile.py [--model DIR] [--trace FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.approx_profile import profile_first_token  # noqa: E402
from bench.chunk_reuse import DOC, DOCS, QUERY, SYSTEM, ttft  # noqa: E402
from bench.common import bench_model  # noqa: E402
from workers import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--trace", help="write the profiler's Chrome trace here")
    args = ap.parse_args()
    rng = random.Random(0)
    draw = lambda n: rng.choices(range(10, 1000), k=n)  # noqa: E731
    system, docs = draw(SYSTEM), [t for _ in range(DOCS) for t in draw(DOC)]
    llm = LLM(bench_model(args.model), num_pages=16384)
    ttft(llm, system + docs + draw(QUERY))  # caches the system prompt and documents

    def first_token() -> float:
        seconds, cached = ttft(llm, system + docs + draw(QUERY))
        assert cached == SYSTEM + DOCS * DOC, f"expected the context cached, got {cached}"
        return seconds

    profile_first_token(first_token, args.trace)


if __name__ == "__main__":
    main()
