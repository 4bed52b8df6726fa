from __future__ import annotations

import subprocess
import sys

import pytest

from chunkstore.hashing import Namespace, chunk_keys, page_keys

NS = Namespace("model-a", "tenant-1")


def test_keys_chain_over_full_pages_only():
    tokens = list(range(37))
    keys = page_keys(tokens, 16, NS)
    assert len(keys) == 2 and all(len(k) == 32 for k in keys)
    assert page_keys(tokens[:32], 16, NS) == keys
    # changing an early token changes every later key (the chain)
    changed = page_keys([99] + tokens[1:], 16, NS)
    assert changed[0] != keys[0] and changed[1] != keys[1]
    # same page tokens after a different prefix -> different key
    assert page_keys(tokens[16:32], 16, NS)[0] != keys[1]


def test_namespace_separates_models_and_tenants():
    tokens = list(range(32))
    assert page_keys(tokens, 16, Namespace("model-a", "t1")) != page_keys(
        tokens, 16, Namespace("model-a", "t2")
    )
    assert page_keys(tokens, 16, Namespace("model-a")) != page_keys(tokens, 16, Namespace("b"))
    # no ambiguity from concatenating the parts
    assert Namespace("ab", "c").digest != Namespace("a", "bc").digest


def test_deterministic_across_processes():
    code = (
        "from chunkstore.hashing import Namespace, page_keys;"
        "print(page_keys(list(range(40)), 8, Namespace('m', 's'))[-1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PYTHONPATH": "."},
        ).stdout
        for seed in (1, 2)
    }
    assert len(outs) == 1
    assert outs.pop().strip() == page_keys(list(range(40)), 8, Namespace("m", "s"))[-1].hex()


def test_chunk_keys_are_page_keys_at_chunk_ends():
    tokens = list(range(50))
    keys = page_keys(tokens, 8, NS)
    assert chunk_keys([5, 10, 20, 15], keys, 8) == [None, keys[0], keys[3], keys[5]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        page_keys([1], 0, NS)
    with pytest.raises(ValueError, match="token ids"):
        page_keys([-1, 2], 2, NS)
