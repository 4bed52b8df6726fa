"""``bench/cluster_rag.py``'s own arguments, without a cluster: ``--set`` overrides
reach every run's cluster config and are refused where a flag of the bench's own sets
the key or the config's checks fail; ``--pairs`` names the (policy, reuse) runs instead
of every policy with every mode; ``open_rates`` gives each worker count its share of the
slowest closed-loop run; ``bench/http_rag.py`` takes its engine overrides to the router
path. (Runs through real clusters: tests/cluster.)"""

from __future__ import annotations

import sys

import pytest

from bench import cluster_rag
from bench.cluster_rag import RequestResult, RunResult
from modeltools.make_model import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", weights=False)


def parse(monkeypatch, *argv: str):
    monkeypatch.setattr(sys, "argv", ["cluster_rag.py", *argv])
    return cluster_rag.parse_args()


def test_overrides_reach_the_cluster_config(monkeypatch, model):
    args = parse(monkeypatch, "--model", str(model), "--gpus-per-worker", "0", "--pages", "300",
                 "--set", "engine.entry_reserve=0.25", "--set", "engine.batch_admissions=false")  # fmt: skip
    cfg = cluster_rag.cluster_config(args, 2, host_kv_gib=0.5)
    assert cfg.engine.entry_reserve == 0.25 and cfg.engine.batch_admissions is False
    # what the bench sets itself stays as its flags say
    assert cfg.engine.num_pages == 300 and cfg.engine.host_kv_gib == 0.5
    assert cfg.workers.count == 2 and cfg.engine.device == "cpu"
    plain = cluster_rag.cluster_config(parse(monkeypatch, "--model", str(model)), 2)
    assert plain.engine.entry_reserve is None  # the engine's default (resolved_entry_reserve)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("engine.num_pages=100", "--set engine.num_pages: use --pages"),
        ("engine.host_kv_gib=4", "use --host-kv-gib"),
        ("engine.entry_reserve=2", "engine.entry_reserve: Input should be less than or equal"),
        ("engine.no_such_setting=1", "engine.no_such_setting: Extra inputs are not permitted"),
        ("engine.entry_reserve", "--set expects dotted.key=value"),
    ],
)
def test_bad_overrides_are_refused_before_anything_starts(
    monkeypatch, model, capsys, override, said
):
    with pytest.raises(SystemExit) as refused:
        parse(monkeypatch, "--model", str(model), "--set", override)
    assert refused.value.code == 2
    assert said in capsys.readouterr().err


def test_pairs_name_the_runs(monkeypatch, model):
    args = parse(monkeypatch, "--model", str(model),
                 "--pairs", "round_robin:exact", "chunk_aware,recent_route_lease_s=0:approximate")  # fmt: skip
    assert args.pair_list == [
        ("round_robin", "exact"),
        ("chunk_aware,recent_route_lease_s=0", "approximate"),
    ]
    assert cluster_rag.policy_name("round_robin", "exact", args) == "round_robin, exact"
    every = parse(monkeypatch, "--model", str(model), "--reuse", "exact", "approximate")
    assert every.pair_list == [
        (policy, mode)
        for policy in ("chunk_aware", "round_robin")
        for mode in ("exact", "approximate")
    ]
    assert parse(monkeypatch, "--model", str(model)).pair_list == [
        ("chunk_aware", "exact"),
        ("round_robin", "exact"),
    ]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--pairs", "round_robin:exact", "--reuse", "exact"], "not with --policies or --reuse"),
        (["--pairs", "round_robin:approx"], "--pairs round_robin:approx: expected POLICY:REUSE"),
        (["--pairs", "round_robin"], "--pairs round_robin: expected POLICY:REUSE"),
    ],
)
def test_bad_pairs_are_refused(monkeypatch, model, capsys, argv, said):
    with pytest.raises(SystemExit):
        parse(monkeypatch, "--model", str(model), *argv)
    assert said in capsys.readouterr().err


def _run(workers: int, answered: int, seconds: float) -> RunResult:
    result = RequestResult("w", 0.1, 0.2, 10, 0, 2)
    return RunResult("", workers, "p", seconds, results=[result] * answered)


def test_open_rates_take_a_share_of_the_slowest_run_at_each_worker_count(capsys):
    closed = [_run(1, 20, 2.0), _run(1, 30, 2.0), _run(2, 40, 2.0), _run(2, 90, 3.0)]
    assert cluster_rag.open_rates(0.5, closed, [1, 2]) == {1: 5.0, 2: 10.0}
    assert cluster_rag.open_rates(0.0, closed, [1, 2]) == {}  # no share: no open loop
    silent = _run(2, 0, 2.0)  # a run that answered nothing leaves no rate, which is said
    assert cluster_rag.open_rates(0.5, [*closed, silent], [1, 2]) == {}
    assert "no open-loop runs" in capsys.readouterr().out


def test_the_http_bench_takes_its_engine_overrides_to_the_router_path():
    from bench.http_rag import engine_override

    assert engine_override("engine.entry_reserve=0")
    assert not engine_override("engine.num_pages=512")  # the router path's --pages sets it
    assert not engine_override("server.stream_interval_s=0")  # the HTTP app's alone
