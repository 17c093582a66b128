"""The load tester end to end against a fake Generation server with known delays (no model)."""
from __future__ import annotations

import json

import pytest

from loadtest.config import DatasetConfig, LoadTestConfig
from loadtest.fake_server import FakeServerThread
from loadtest.runner import run
from pdserve.cli import main as pdserve_main

TTFT_S, ITL_S = 0.05, 0.01


@pytest.fixture
def fake():
    server = FakeServerThread(TTFT_S, ITL_S)
    yield server
    server.stop()


def test_measured_timings_match_the_injected_delays(fake):
    dataset = DatasetConfig(name="random", random_input_len=16, random_output_len=8)
    config = LoadTestConfig(url=fake.address, dataset=dataset, num_prompts=60, request_rate=40.0, num_warmups=2,
                            progress=False)
    result = run(config)
    s = result.summary
    assert s["completed"] == 60 and s["failed"] == 0
    assert fake.servicer.num_requests == 62  # warm-ups are sent but not counted
    assert s["total_output_tokens"] == 60 * 8 and s["total_input_tokens"] == 60 * 16
    # Generous bands (a noisy shared 2-core VM).
    # Never below the injected delay; the upper bounds catch unit or reference-point mistakes.
    assert 50 <= s["median_ttft_ms"] < 150
    assert 10 <= s["median_itl_ms"] < 40
    assert 10 <= s["median_tpot_ms"] < 40
    assert 120 <= s["median_e2el_ms"] < 400  # 50 + 7 * 10
    assert all(len(r.itls) == 7 for r in result.records)
    assert 1.0 < s["duration"] < 6.0  # 60 arrivals at 40/s take ~1.5 s


def test_max_concurrency_and_time_bound_are_respected(fake):
    dataset = DatasetConfig(name="random", random_input_len=4, random_output_len=4)
    run(LoadTestConfig(url=fake.address, dataset=dataset, num_prompts=20, max_concurrency=3, progress=False))
    assert fake.servicer.max_in_flight == 3
    s = run(LoadTestConfig(url=fake.address, dataset=dataset, num_prompts=1000, request_rate=20.0, duration_s=0.5,
                           progress=False)).summary
    assert 3 <= s["completed"] <= 20  # ~10 arrivals in 0.5 s, not 1000


def test_cli_writes_json_jsonl_plots_and_counts_failures_by_status(tmp_path, capsys):
    server = FakeServerThread(0.02, 0.005, fail_every=4)
    try:
        out, detail = tmp_path / "result.json", tmp_path / "requests.jsonl"
        code = pdserve_main(["loadtest", "--url", server.address, "--dataset", "random", "--num-prompts", "20",
                             "--request-rate", "inf", "--random-input-len", "8", "--random-output-len", "4",
                             "--goodput", "ttft:1000", "tpot:1000", "--output", str(out),
                             "--save-requests", str(detail), "--plot-dir", str(tmp_path / "plots"),
                             "--no-progress"])
    finally:
        server.stop()
    assert code == 0
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "failed: RESOURCE_EXHAUSTED" in table
    assert "SLO attainment (%):" in table and "P99 ITL (ms):" in table
    data = json.loads(out.read_text())
    assert data["completed"] == 15 and data["failed"] == 5
    assert data["failures_by_status"] == {"RESOURCE_EXHAUSTED": 5}
    assert data["request_rate"] == "inf" and data["num_prompts"] == 20
    assert data["slo_attainment"] == 0.75 and data["good_requests"] == 15
    assert data["request_goodput"] == pytest.approx(15 / data["duration"])
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_itl_ms", "p99_tpot_ms"):
        assert key in data
    lines = [json.loads(line) for line in detail.read_text().splitlines()]
    assert len(lines) == 20 and sum(line["status"] == "OK" for line in lines) == 15
    assert all(len(line["itls_ms"]) == 3 for line in lines if line["status"] == "OK")
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 1000


def test_sweep_reports_attainment_per_rate_and_the_goodput_rate(tmp_path):
    server = FakeServerThread(0.02, 0.005)
    try:
        out = tmp_path / "sweep.json"
        code = pdserve_main(["loadtest", "--url", server.address, "--num-prompts", "10", "--random-input-len", "8",
                             "--random-output-len", "4", "--sweep", "20,10", "--goodput", "ttft:2000",
                             "--output", str(out), "--plot-dir", str(tmp_path), "--no-progress"])
    finally:
        server.stop()
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["request_rate"] for r in data["runs"]] == [10.0, 20.0]
    assert all(r["slo_attainment"] == 1.0 for r in data["runs"])
    assert data["goodput_request_rate"] == 20.0
    assert (tmp_path / "attainment_vs_rate.png").exists()


def test_sweep_without_slos_is_refused():
    assert pdserve_main(["loadtest", "--url", "h:1", "--sweep", "1,2"]) == 2
