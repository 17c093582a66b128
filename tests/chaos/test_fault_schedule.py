"""`pdserve chaos` without processes: its config's validation and the seeded fault schedule."""
from __future__ import annotations

import pytest

from loadtest.chaos.config import ChaosConfig
from loadtest.chaos.processes import _without
from loadtest.chaos.report import table, verdict
from loadtest.chaos.schedule import fault_plan
from loadtest.config import LoadTestConfig

LOAD = LoadTestConfig(url="127.0.0.1:1")


def test_the_plan_is_seeded_spaced_and_stops_only_decode_workers():
    config = ChaosConfig(LOAD, num_prefill=2, num_decode=3, duration_s=300, fault_every_s=30, first_fault_s=10,
                         seed=5)
    plan = fault_plan(config)
    assert plan == fault_plan(config)  # replayable
    assert [f.at_s for f in plan] == [10 + 30 * i for i in range(10)]
    assert {f.kind for f in plan} == {"kill", "stop", "drain"}
    assert all(f.role == "decode" for f in plan if f.kind == "stop")
    assert all(0 <= f.index < config.pool_size(f.role) for f in plan)
    assert plan != fault_plan(ChaosConfig(LOAD, num_prefill=2, num_decode=3, seed=6))


def test_faults_on_prefill_only_never_stop():
    plan = fault_plan(ChaosConfig(LOAD, roles=("prefill",), faults=("stop", "kill"), duration_s=600))
    assert plan and all(f.role == "prefill" and f.kind == "kill" for f in plan)


@pytest.mark.parametrize("kwargs,message", [
    ({"num_decode": 1}, "decode workers need at least 2"),
    ({"num_prefill": 1}, "prefill workers need at least 2"),
    ({"faults": ("explode",)}, "--faults"),
    ({"faults": ()}, "--faults"),
    ({"roles": ("router",)}, "--roles"),
    ({"faults": ("stop",), "roles": ("prefill",)}, "decode workers only"),
    ({"duration_s": 0}, "--duration-s"),
    ({"stop_s": -1}, "--stop-s"),
    ({"max_migrations": -1}, "--max-migrations"),
])
def test_config_refuses_what_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ChaosConfig(LOAD, **kwargs)


def test_defaults_and_the_stop_length():
    config = ChaosConfig(LOAD, stream_timeout_s=5)
    assert config.stop_s == 9  # past the stream timeout, so the router moves the stopped worker's streams
    assert ChaosConfig(LOAD, num_prefill=0, roles=("decode",)).pool_size("prefill") == 0


def test_restart_keeps_the_port():
    assert _without(["decode-worker", "--port", "0", "--dtype", "float32"], "--port") == ["decode-worker", "--dtype",
                                                                                        "float32"]
    assert _without(["--port=5", "x"], "--port") == ["x"]


def test_the_verdict_needs_no_failure_no_leak_and_every_worker_back():
    report = {"num_prefill": 2, "num_decode": 2, "duration_s": 60, "request_rate": 1.0,
              "requests": {"sent": 10, "completed": 10, "failed": 0, "failures_by_status": {}},
              "migrations": {"worker_lost": 2.0}, "leaks": {},
              "faults": [{"kind": "kill", "worker": "decode[0] a", "started_s": 1.0, "back_s": 9.0, "error": ""}],
              "latency_ms": {"ttft_p50": 1.0, "ttft_p99": 2.0, "itl_p50": 1.0, "itl_p99": 2.0}}
    assert verdict(report) and "PASS" in table(report) and "worker_lost 2" in table(report)
    for broken in ({"requests": {**report["requests"], "failed": 1, "failures_by_status": {"UNAVAILABLE": 1}}},
                   {"leaks": {"a": [1, 0, 0]}},
                   {"faults": [{**report["faults"][0], "back_s": None}]}):
        assert not verdict({**report, **broken}) and "FAIL" in table({**report, **broken})
