"""A real Prometheus scrapes a local cluster (router + prefill + decode, each with --metrics-port and both
KV cache tiers on) during a short load test: every PromQL expression of the shipped dashboards and alert
rules parses and returns data (every metric they name is exported), the rule files load, and the router's
TTFT p50 from its histogram agrees with the load tester's client-side p50.

Tolerance of the TTFT agreement: histogram_quantile interpolates linearly inside one bucket, so its
resolution is the width of the bucket holding the value; the client also pays the gRPC hop the router
does not see. |server p50 - client p50| <= width of that bucket + 25 ms.
"""
from __future__ import annotations

import bisect
import time

import grpc
import pytest

from common.protocol import generate_pb2
from loadtest.chaos.processes import stop_all
from loadtest.config import DatasetConfig, LoadTestConfig
from loadtest.runner import run
from router.metrics import LATENCY_BUCKETS
from tests.cluster.harness import free_port, generation_stub, start_router, start_workers
from tests.monitoring.planner_process import SLO_ITL_MS, SLO_TTFT_MS, fake_kube_with_pools, start_planner
from tests.monitoring.prometheus import Prometheus, dashboard_expressions, metric_names, rule_expressions

TTFT_EXTRA_MS = 25.0
NUM_PROMPTS = 20
MOE_ONLY = {"pdserve:moe_expert_tokens_total", "pdserve:moe_layer_imbalance"}
"""Series only Mixture-of-Experts models export (this cluster runs a dense model): their panels
must parse here; tests/monitoring/test_moe_metrics.py and the MoE cluster tests check their values."""


def kv_tier_flags(directory) -> list[str]:
    """Both KV tiers (host memory and a disk arena), so the dashboard's tier panels have series."""
    return ["--kv-offload-cpu-gib", "0.0625", "--kv-offload-dir", str(directory), "--kv-offload-disk-gib", "0.125"]


@pytest.fixture(scope="module")
def cluster(tiny_qwen2_dir, tmp_path_factory):
    """The router's address and the scrape targets by job: the workers (the tiny random model: the series,
    not the tokens, are the point), the router, and a `pdserve planner` reading the router's metrics and
    sizing the pools through a fake Kubernetes API."""
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port(), "planner": free_port()}
    procs = []
    kube = fake_kube_with_pools()
    try:
        tiers = {role: kv_tier_flags(tmp_path_factory.mktemp(f"kv-{role}")) for role in ("prefill", "decode")}
        procs += start_workers([[role, "--metrics-port", str(ports[role]), *tiers[role]] for role in tiers],
                               "--model", str(tiny_qwen2_dir))
        procs.append(start_router(procs[:1], procs[1:], "--metrics-port", str(ports["router"])))
        procs.append(start_planner(kube, tmp_path_factory.mktemp("planner"), ports["router"], ports["planner"]))
        yield procs[2].address, {job: [f"127.0.0.1:{p}"] for job, p in ports.items()}
    finally:
        stop_all(procs)
        kube.stop()


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), cluster[1], free_port())
    try:
        server.wait_for_scrape(list(cluster[1]))
        yield server
    finally:
        server.stop()


def test_dashboards_and_alerts_query_a_live_cluster(cluster, prometheus):
    address, _ = cluster
    # 1. A short load test with shared prefixes (so prefix caches hit and KV moves; the 48-token
    #    suffixes exceed the router's skip-prefill threshold, so every request goes through prefill).
    dataset = DatasetConfig(name="prefix", prefix_num_prefixes=2, prefix_len=64, suffix_len=48,
                            prefix_output_len=12)
    result = run(LoadTestConfig(url=address, dataset=dataset, num_prompts=NUM_PROMPTS, request_rate=5.0, seed=1,
                                progress=False, request_timeout_s=120))
    summary = result.summary
    assert summary["completed"] == NUM_PROMPTS, summary.get("failures_by_status")
    prometheus.wait_for_scrapes_after(time.time(), list(cluster[1]))  # the last request's samples are in
    at = time.time()

    # 2. Server-side TTFT p50 (the router's histogram) against the client-side p50.
    count = prometheus.query("sum(pdserve:time_to_first_token_seconds_count)", at)["data"]["result"]
    assert float(count[0]["value"][1]) == NUM_PROMPTS  # only the load test's requests went through this router
    res = prometheus.query("histogram_quantile(0.5, sum by (le) (pdserve:time_to_first_token_seconds_bucket))", at)
    server_ms = float(res["data"]["result"][0]["value"][1]) * 1000
    client_ms = summary["median_ttft_ms"]
    i = bisect.bisect_left(LATENCY_BUCKETS, client_ms / 1000)
    width_ms = 1000 * (LATENCY_BUCKETS[min(i, len(LATENCY_BUCKETS) - 1)] - (LATENCY_BUCKETS[i - 1] if i else 0))
    print(f"\nTTFT p50: client {client_ms:.1f} ms, router histogram {server_ms:.1f} ms, "
          f"tolerance {width_ms + TTFT_EXTRA_MS:.0f} ms")
    assert abs(server_ms - client_ms) <= width_ms + TTFT_EXTRA_MS

    # 3. A failed request (so the per-code failure series exists), then a few more scrapes.
    with pytest.raises(grpc.RpcError) as failed:
        list(generation_stub(address).Generate(generate_pb2.GenerateRequest(request_id="bad"), timeout=30))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    prometheus.wait_for_scrapes_after(time.time(), list(cluster[1]))

    # 4. Every expression parses, every metric it names is exported, and it returns data.
    exported = set(prometheus.api("label/__name__/values")["data"])
    problems = []
    for where, expr in dashboard_expressions() + rule_expressions():
        body = prometheus.query(expr)
        if body.get("status") != "success":
            problems.append(f"{where}: {body.get('errorType')}: {body.get('error')}\n    {expr}")
        elif metric_names(expr) and metric_names(expr) <= MOE_ONLY:
            continue
        elif metric_names(expr) - exported:
            problems.append(f"{where}: no target exports {sorted(metric_names(expr) - exported)}")
        elif not body["data"]["result"]:
            problems.append(f"{where}: no data\n    {expr}")
    assert not problems, "\n".join(problems)
    assert len(dashboard_expressions()) >= 30 and len(rule_expressions()) >= 10

    # 5. Prometheus loaded every rule file and evaluates every rule without error.
    groups = prometheus.api("rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == len(rule_expressions())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_worker_metrics_count_the_load(cluster, prometheus):
    """The worker series carry real figures: tokens, prefix hits, KV bytes, transfer times."""
    def value(expr: str) -> float:
        result = prometheus.query(expr)["data"]["result"]
        assert result, expr
        return float(result[0]["value"][1])

    assert value('sum(pdserve:prompt_tokens_total{role="prefill"})') >= NUM_PROMPTS * 112
    assert value('sum(pdserve:generation_tokens_total{role="decode"})') >= NUM_PROMPTS * 11
    # Hits are whole 16-token blocks; how many prompts hit depends on timing (prompts that arrive while
    # the first one with their prefix is still prefilling miss), but repeats after it hit all 64 tokens.
    hits = value('sum(pdserve:prefix_cache_hits_total{role="prefill"})')
    assert hits >= 64 and hits % 16 == 0
    assert hits < value('sum(pdserve:prefix_cache_queries_total{role="prefill"})')
    assert value('sum(pdserve:kv_transfer_bytes_total{role="decode"})') > 0
    assert value('sum(pdserve:kv_transfer_time_seconds_count{role="decode"})') >= NUM_PROMPTS - 2
    assert value('sum(pdserve:num_requests_running)') == 0
    assert value('sum(pdserve:request_time_per_output_token_seconds_count)') == NUM_PROMPTS
    # Both KV tiers are on (kv_tier_flags): each worker reports each medium's capacity.
    for medium, gib in (("cpu", 0.0625), ("disk", 0.125)):
        for role in ("prefill", "decode"):
            capacity = value(f'sum(pdserve:kv_tier_capacity_bytes{{role="{role}",medium="{medium}"}})')
            assert 0 < capacity <= gib * 2**30, (role, medium, capacity)
    assert value('sum(pdserve:kv_tier_used_bytes)') >= 0


def test_the_planner_series_say_what_the_cluster_and_its_flags_say(cluster, prometheus):
    """Prometheus scraped the planner: the ready workers the fake API reports and the SLOs it was given."""
    def values(expr: str) -> dict[str, float]:
        result = prometheus.query(expr)["data"]["result"]
        assert result, expr
        return {r["metric"].get("role", ""): float(r["value"][1]) for r in result}

    assert values('pdserve:planner_actual_workers{role="decode"}') == {"decode": 1.0}
    assert values("pdserve:planner_desired_workers") == {"prefill": 1.0, "decode": 1.0}
    assert values("pdserve:planner_slo_seconds") == {"prefill": SLO_TTFT_MS / 1e3, "decode": SLO_ITL_MS / 1e3}
    assert values('sum by (role) (pdserve:planner_worker_seconds_total)')["decode"] > 0
    assert sum(values("sum by (role) (pdserve:planner_decisions_total)").values()) == 0
