"""Runs ``triton_interpreted.py`` (the Triton kernels against their torch paths, on the
CPU) in a process of its own: Triton reads ``TRITON_INTERPRET`` when a kernel is
defined, so it must be set before any kernel module is imported. Triton comes with the
dev extra on Linux x86-64 (the platforms it ships wheels for)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton has no wheel for this platform")

CHECKS = Path(__file__).with_name("triton_interpreted.py")
ROOT = Path(__file__).resolve().parents[2]


def test_the_triton_kernels_match_their_torch_paths_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CHECKS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
