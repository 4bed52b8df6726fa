"""``bench/tensor_parallel.py`` on the CPU (gloo ranks, dummy weights of the tiny
preset): it builds each size's engine, decodes, and reports ratios against one rank;
a size that does not divide the model is reported as refused, with the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modeltools.make_model import make_model
from tests.cluster.conftest import REPO

pytestmark = pytest.mark.integration


def test_the_bench_compares_rank_counts(tmp_path):
    model = make_model(tmp_path / "tiny", preset="tiny", weights=False)
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "tensor_parallel.py"),
            "--model",
            str(model),
            "--device",
            "cpu",
            "--sizes",
            "1",
            "2",
            "3",
            "--batch",
            "4",
            "--context",
            "24",
            "--steps",
            "2",
            "--pages",
            "64",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = done.stdout[done.stdout.index("decode, context 24") :]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.count("|") > 3}
    assert "1.000x" in rows["1"] and "x" in rows["2"].split("|")[3]
    assert "refused" in rows["3"] and "does not divide" in rows["3"]
