"""The embedded directory's memory under endless churn: its change log (what routers'
copies follow) holds at most ``DEFAULT_MAX_LOG`` changes plus keys, so its memory
levels off once the log is full. One worker keeps 2,048 pages, storing 4 new page keys
and dropping its 4 oldest per publish, as a CPU worker serving new questions does.

    python bench/directory_log.py [--publishes 120000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunkstore.embedded_directory import DEFAULT_MAX_LOG, EmbeddedChunkDirectory  # noqa: E402
from chunkstore.events import CacheEvent, EventKind  # noqa: E402

HELD_PAGES = 2048
KEYS_PER_PUBLISH = 4


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--publishes", type=int, default=120_000)
    args = ap.parse_args()
    directory = EmbeddedChunkDirectory(lease_ttl_s=1e9)
    held: list[bytes] = []
    tracemalloc.start()
    base = rss_mb()
    print(f"max_log {DEFAULT_MAX_LOG}; keys logged, log weight, traced MB, RSS growth MB")
    for seq in range(args.publishes):
        keys = tuple(os.urandom(32) for _ in range(KEYS_PER_PUBLISH))
        held.extend(keys)
        events = [CacheEvent(EventKind.STORED, keys)]
        if len(held) > HELD_PAGES:
            events.append(CacheEvent(EventKind.REMOVED, tuple(held[:KEYS_PER_PUBLISH])))
            del held[:KEYS_PER_PUBLISH]
        directory.publish("w0", 1, seq, events)
        if seq % (args.publishes // 6) == 0 or seq == args.publishes - 1:
            traced = tracemalloc.get_traced_memory()[0] / 2**20
            logged = (seq + 1) * 2 * KEYS_PER_PUBLISH
            print(f"{logged:>9} {directory.log_weight:>8} {traced:8.1f} {rss_mb() - base:8.1f}")


if __name__ == "__main__":
    main()
