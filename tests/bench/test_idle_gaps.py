"""Device idle time charged to host events (bench/idle_gaps.py), on intervals whose
answers are worked out by hand; and the profiler glue on a CPU profile."""

from __future__ import annotations

import pytest
import torch

from bench.idle_gaps import NO_HOST_EVENT, charge, idle_gaps, idle_report, merge, our_frame


def test_busy_intervals_merge_and_leave_the_gaps_between():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    busy = [(2, 4), (3, 5), (8, 9), (20, 30)]
    assert idle_gaps(busy, 0, 10) == [(0, 2), (5, 8), (9, 10)]
    assert idle_gaps([], 0, 10) == [(0, 10)]
    assert idle_gaps([(0, 10)], 2, 8) == []


def test_each_gap_is_charged_to_the_innermost_host_event():
    gaps = [(0, 10), (20, 30)]
    host = [
        (0, 30, "step"),  # the outer call, running throughout
        (2, 6, "sync"),  # nested in it: charged where it runs
        (4, 5, "inner"),  # nested in sync
        (25, 40, "plan"),
    ]
    totals = charge(gaps, host)
    # step: 0-2, 6-10 and 20-25; sync: 2-4 and 5-6; plan (started after step): 25-30
    assert totals == pytest.approx({"step": 2 + 4 + 5, "sync": 3, "inner": 1, "plan": 5})
    assert sum(totals.values()) == pytest.approx(20)  # all of the gaps, once
    assert charge([(0, 4)], [(1, 2, "a")]) == pytest.approx({NO_HOST_EVENT: 3, "a": 1})
    assert charge([], host) == {}


def test_frames_of_our_code_label_events():
    stack = [
        "/usr/lib/python3.11/threading.py(1): run",
        "/work/main/workers/engine/model_runner.py(210): kv_deviation",
        "bench/approx_profile.py(60): first_token",
    ]
    assert our_frame(stack) == "workers/engine/model_runner.py(210): kv_deviation"
    assert our_frame(stack[2:]) == "bench/approx_profile.py(60): first_token"
    assert our_frame(["/x/myworkers/y.py(1): f"]) == ""  # a folder that only ends alike


def test_a_cpu_profile_has_nothing_to_charge():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).sum()
    assert idle_report(prof).startswith("no device events")


def test_labels_drop_object_addresses_and_name_our_frame():
    from types import SimpleNamespace

    from bench.idle_gaps import _label

    method = "<built-in method sum of Tensor object at 0x7f1b864ed6d0>"
    assert _label(SimpleNamespace(name=method, stack=[])) == "<built-in method sum>"
    sync = SimpleNamespace(
        name="cudaStreamSynchronize",
        stack=["/work/main/workers/engine/model_runner.py(210): kv_deviation"],
    )
    assert (
        _label(sync) == "cudaStreamSynchronize @ workers/engine/model_runner.py(210): kv_deviation"
    )
