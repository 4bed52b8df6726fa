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


def test_the_benches_targets_name_what_the_code_defines():
    """Every target of ENGINE_STEP and ADMISSION_TIMELINE names a class method or a
    module-level name (defined or imported) that its module's source has, read
    without importing it: the CUDA-only modules (selection graphs, FlashInfer) are
    left out by HostPhases on a machine without them, so a renamed method there
    would otherwise first show as a failed GPU run."""
    import ast
    import importlib.util

    from bench.host_phases import ADMISSION_TIMELINE, ENGINE_STEP

    missing = []
    for target in sorted(set(ENGINE_STEP + ADMISSION_TIMELINE)):
        module, _, path = target.partition(":")
        if not module.startswith("workers."):  # torch and flashinfer: not ours to check
            continue
        tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
        names: dict[str, set[str] | None] = {}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names[node.name] = {
                    n.name
                    for n in node.body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                }
            elif isinstance(node, ast.FunctionDef):
                names[node.name] = None
            elif isinstance(node, ast.ImportFrom):
                names.update({alias.asname or alias.name: None for alias in node.names})
        owner, _, attr = path.rpartition(".")
        if owner:
            if attr not in (names.get(owner) or ()):
                missing.append(target)
        elif path not in names:
            missing.append(target)
    assert not missing
