"""bench/host_phases: wall time per named host function, patches undone after."""

from __future__ import annotations

import sys
import time
import types

import pytest

from bench.host_phases import HostPhases


class Worker:
    def work(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


class Child(Worker):
    pass


def helper(n: int) -> int:
    return n + 1


@pytest.fixture
def module():
    """This test module's own classes and function, as a module HostPhases can import."""
    name = "host_phases_target"
    mod = types.ModuleType(name)
    mod.Worker, mod.Child, mod.helper = Worker, Child, helper
    sys.modules[name] = mod
    yield mod
    del sys.modules[name]


def test_times_methods_and_functions_and_restores_them(module):
    original_work, original_helper = Worker.__dict__["work"], module.helper
    targets = ["host_phases_target:Worker.work", "host_phases_target:helper", "absent.mod:f"]
    with HostPhases(targets) as phases:
        assert Worker().work(0.02) == "done" and module.helper(1) == 2
        Worker().work(0.0)
    assert Worker.__dict__["work"] is original_work and module.helper is original_helper
    assert phases.calls == {"host_phases_target:Worker.work": 2, "host_phases_target:helper": 1}
    assert phases.seconds["host_phases_target:Worker.work"] >= 0.02
    report = phases.report(calls=2)
    assert "Worker.work" in report and "host_phases_target:helper" in report
    assert "absent" not in report  # a module that does not import is left out


def test_an_inherited_method_is_refused_and_nothing_stays_patched(module):
    original_helper = module.helper
    with pytest.raises(ValueError, match="defines work"):
        with HostPhases(["host_phases_target:helper", "host_phases_target:Child.work"]):
            pass
    assert module.helper is original_helper
