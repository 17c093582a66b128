"""A real `pdserve planner` for the monitoring tests: it reads a local router's metrics and "scales" the
chart's two Deployments through the fake Kubernetes API of tests/planner/k8s_fake.py (a thread of the
test process), serving its own metrics for Prometheus to scrape."""
from __future__ import annotations

from pathlib import Path

from tests.cluster.harness import Proc, start
from tests.planner.k8s_fake import NS, FakeKube, deployment, write_kubeconfig

SLO_TTFT_MS = 30000.0
SLO_ITL_MS = 5000.0
"""Far above what the test's load reaches: the planner has no reason to resize anything."""
DEPLOYMENTS = {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}


def fake_kube_with_pools() -> FakeKube:
    """The fake API server holding the chart's prefill and decode Deployments, 1 replica each, 1 ready."""
    kube = FakeKube().start()
    for role, name in DEPLOYMENTS.items():
        labels = {"app.kubernetes.io/instance": "pdserve", "app.kubernetes.io/component": role}
        kube.deployments[name] = deployment(name, 1, 1, labels)
    return kube


def start_planner(kube: FakeKube, workdir: Path, router_metrics_port: int, metrics_port: int) -> Proc:
    """`pdserve planner` (its kubeconfig in `workdir`) deciding every second; each pool's bounds are 1..1
    (the fake never readies a new replica, and desired == actual keeps every planner series of the
    dashboards and alerts defined)."""
    kubeconfig = write_kubeconfig(workdir / "kubeconfig", kube.url)
    return start("planner", [
        "planner", "--backend", "kubernetes", "--kubeconfig", str(kubeconfig), "--namespace", NS,
        "--prefill-deployment", DEPLOYMENTS["prefill"], "--decode-deployment", DEPLOYMENTS["decode"],
        "--router-metrics", f"http://127.0.0.1:{router_metrics_port}/metrics", "--interval-s", "1",
        "--window-s", "2", "--slo-ttft-ms", f"{SLO_TTFT_MS:g}", "--slo-itl-ms", f"{SLO_ITL_MS:g}",
        "--max-prefill", "1", "--max-decode", "1", "--metrics-port", str(metrics_port), "--host", "127.0.0.1"],
        timeout=120)
