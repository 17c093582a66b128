"""Metric exposition without a cluster: the worker collector and the /metrics endpoint."""
from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest

from common.metrics_http import MetricsServer
from worker_runtime.metrics import WorkerMetrics

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


class FakeLoop:
    stats = {"num_running": 3, "num_waiting": 2, "num_requests": 6, "kv_blocks_total": 200, "kv_blocks_used": 50,
             "num_pulls": 1, "prompt_tokens_total": 1000, "generation_tokens_total": 77,
             "prefix_cache_queries": 800, "prefix_cache_hits": 320, "num_preemptions": 4, "kv_bytes_moved": 12345,
             "transfers_failed": 2, "num_kv_recomputed": 1, "requests_total": 9,
             "spec_decode_num_draft_tokens": 40, "spec_decode_num_accepted_tokens": 31}
    observe_transfer_s = None


def sample(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_worker_metrics_read_the_stats_snapshot_with_vllm_names():
    loop = FakeLoop()
    metrics = WorkerMetrics(loop, "decode", "10.0.0.1:5000")
    loop.observe_transfer_s(0.004)  # the loop's hook now feeds the histogram
    text = generate_latest(metrics.registry).decode()
    assert sample(text, "pdserve:num_requests_running") == 3
    assert sample(text, "pdserve:num_requests_waiting") == 2
    assert sample(text, "pdserve:kv_cache_usage_perc") == 0.25
    assert sample(text, "pdserve:prefix_cache_queries_total") == 800
    assert sample(text, "pdserve:prefix_cache_hits_total") == 320
    assert sample(text, "pdserve:num_preemptions_total") == 4
    assert sample(text, "pdserve:prompt_tokens_total") == 1000
    assert sample(text, "pdserve:generation_tokens_total") == 77
    assert sample(text, "pdserve:kv_transfer_bytes_total") == 12345
    assert sample(text, "pdserve:kv_transfer_failures_total") == 2
    assert sample(text, "pdserve:kv_recomputed_total") == 1
    assert sample(text, "pdserve:kv_transfers_in_flight") == 1
    assert sample(text, "pdserve:spec_decode_num_draft_tokens_total") == 40
    assert sample(text, "pdserve:spec_decode_num_accepted_tokens_total") == 31
    assert sample(text, "pdserve:kv_transfer_time_seconds_count") == 1
    assert 'role="decode",worker="10.0.0.1:5000"' in text
    loop.stats = {**loop.stats, "prefix_cache_hits": 400}  # read at scrape time, not copied at start
    assert sample(generate_latest(metrics.registry).decode(), "pdserve:prefix_cache_hits_total") == 400


def test_metrics_endpoint_keeps_colons_when_prometheus_asks_for_openmetrics():
    metrics = WorkerMetrics(FakeLoop(), "prefill", "w:1")
    port = metrics.serve("127.0.0.1", 0)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    finally:
        metrics.close()
    assert sample(text, "pdserve:num_requests_running") == 3
    assert "pdserve_" not in text


def test_metrics_server_404s_other_paths():
    from prometheus_client import CollectorRegistry
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    try:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/nope", timeout=10)
            raise AssertionError("expected 404")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
    finally:
        server.close()


def test_worker_exports_the_kv_transfer_backend_and_why():
    info = {"backend": "tcp-staged", "reason": "nixl unavailable: nixl does not import; CUDA KV moves through "
                                              "pinned host staging buffers"}
    text = generate_latest(WorkerMetrics(FakeLoop(), "prefill", "w:1", info).registry).decode()
    line = next(line for line in text.splitlines() if line.startswith("pdserve:kv_transfer_backend_info{"))
    assert 'backend="tcp-staged"' in line and 'reason="nixl unavailable: nixl does not import;' in line
    assert 'role="prefill",worker="w:1"' in line and line.endswith(" 1.0")
    without = generate_latest(WorkerMetrics(FakeLoop(), "decode", "w:2").registry).decode()
    assert "kv_transfer_backend_info" not in without
