"""`pdserve serve --planner` under a load that steps 0.5 -> 3 -> 0.5 req/s, from 1 prefill + 1 decode:
the planner adds workers while requests wait and TTFT misses its SLO, drains and removes them after,
and no request fails or leaks.

The workers take one request each (`--max-num-requests 1`), so at 3 req/s requests wait at the router
for a worker with room on any CPU (16 tokens decoded at one thread take well over 1/3 s: each step
reads the model's 0.5 GB of float32 weights), which is what the planner sees (requests waiting, the
pools saturated, TTFT p90 above its 1.5 s SLO). The router's queue is long and patient enough that
the backlog waits instead of being refused.
"""
from __future__ import annotations

import re
import time
import urllib.request

import pytest

from loadtest.chaos.processes import ManagedProcess
from loadtest.config import DatasetConfig, LoadTestConfig
from loadtest.runner import run
from planner.router_metrics import parse_router_metrics
from tests.cluster.harness import WORKER_FLAGS, free_port, metric_value

PLANNER_FLAGS = ["--planner", "--max-prefill", "2", "--max-decode", "2", "--slo-ttft-ms", "1500",
                 "--slo-itl-ms", "1000", "--interval-s", "2", "--window-s", "6", "--scale-up-cooldown-s", "4",
                 "--scale-down-cooldown-s", "20", "--scale-down-window-s", "8"]
SCHEDULE = ((0.5, 4.0), (3.0, 12.0), (0.5, 8.0))  # 12 s at 3 req/s: a backlog in 4-5 s (one worker < 2 req/s)


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
@pytest.mark.timeout(1200)  # on a busy machine the backlog drains slowly (one CPU burner beside `make test`: 426 s)
def test_planner_adds_workers_under_load_and_drains_them_after(tmp_path, smollm2_dir):
    metrics_port = free_port()
    log = tmp_path / "serve.log"
    proc = ManagedProcess("serve", ["serve", "--prefill", "1", "--decode", "1", "--port", "0", "--metrics-port",
                                    str(metrics_port), "--max-num-requests", "1", "--drain-timeout-s", "60",
                                    "--queue-timeout-s", "900", "--max-queue-len", "1000",
                                    *WORKER_FLAGS, *PLANNER_FLAGS], log_path=str(log)).start(600)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        result = run(LoadTestConfig(url=proc.address, dataset=DatasetConfig("random", random_input_len=64,
                                                                            random_output_len=16),
                                    rate_schedule=SCHEDULE, progress=False, request_timeout_s=900))
        assert result.summary["failed"] == 0, result.summary["failures_by_status"]
        assert result.summary["completed"] == len(result.records) > 0
        # back to one worker per pool once the load has passed, every request done, nothing held
        deadline = time.monotonic() + 180
        while not _back_to_one_each(url) or "drained and removed" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        text = log.read_text()
        ups = re.findall(r"planner: (prefill|decode) 1 -> 2 \((\w+)", text)
        assert ups, text[-4000:]
        assert {reason for _, reason in ups} <= {"ttft_above_slo", "queue_backlog", "load_above_capacity"}
        assert re.search(r"planner: (prefill|decode) 2 -> 1 \(load_below_capacity", text)
        assert re.search(r"planner: \w+ worker \S+ added", text), text[-4000:]
        assert metric_value(url, "pdserve:planner_decisions_total", role=ups[0][0], direction="up",
                            reason=ups[0][1]) >= 1
    finally:
        proc.stop()


def _back_to_one_each(url: str) -> bool:
    """One worker per pool in rotation, the planner wanting no more, and the contract's leak check:
    no request and no KV block held by any worker."""
    snap = parse_router_metrics([urllib.request.urlopen(url, timeout=10).read().decode()], time=0)
    for role in ("prefill", "decode"):
        workers = snap.pool(role)
        if sum(w.healthy for w in workers) != 1 or any(w.num_requests or w.kv_blocks_used for w in workers):
            return False
        if metric_value(url, "pdserve:planner_desired_workers", role=role) != 1:
            return False
    return True
