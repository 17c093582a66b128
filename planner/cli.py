"""`pdserve planner`: its own process (e.g. a Deployment scaling the chart's pools through the Kubernetes API),
its flags (PlannerConfig's, as `pdserve serve --planner` takes them, plus the routers and Kubernetes objects)."""
from __future__ import annotations

import argparse
import threading

from common.config_flags import ConfigFlags, comma_list
from planner.config import PlannerConfig

PLANNER_FLAGS = ConfigFlags(PlannerConfig, "planner")
"""The planner's own flags (`pdserve serve --planner` gets them from ClusterConfig.planner)."""


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """`pdserve planner`: the PlannerConfig flags, the routers to read and the Kubernetes objects to scale."""
    PLANNER_FLAGS.add_to(p)
    p.add_argument("--router-metrics", required=True,
                   help="comma-separated URLs of the routers' /metrics; a host name resolving to several "
                        "addresses (a headless Service) is read at each")
    p.add_argument("--backend", choices=["kubernetes"], default="kubernetes")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: the in-cluster service "
                   "account)")
    p.add_argument("--namespace", default="default")
    p.add_argument("--prefill-deployment", default=None, help="scale these Deployments (the chart's "
                   "deployments mode)")
    p.add_argument("--decode-deployment", default=None)
    p.add_argument("--raycluster", default=None, help="scale this RayCluster's worker groups instead")
    p.add_argument("--prefill-group", default="prefill")
    p.add_argument("--decode-group", default="decode")
    p.add_argument("--metrics-port", type=int, default=None, help="serve the planner's metrics here")
    p.add_argument("--host", default="0.0.0.0", help="address of the metrics server")


def prepare(args: argparse.Namespace):
    """Validate `pdserve planner`'s flags; return the command to run."""
    from planner.kubernetes_scaler import KubernetesScaler, KubernetesTargetConfig

    config = PLANNER_FLAGS.build(args)
    target = KubernetesTargetConfig(namespace=args.namespace, prefill_deployment=args.prefill_deployment,
                                    decode_deployment=args.decode_deployment, raycluster=args.raycluster,
                                    prefill_group=args.prefill_group, decode_group=args.decode_group)
    urls = comma_list(args.router_metrics)
    if not urls:
        raise ValueError("--router-metrics needs at least one URL")
    return lambda: run_planner(config, KubernetesScaler.from_config(target, args.kubeconfig), urls,
                               args.host, args.metrics_port)


def run_planner(config: PlannerConfig, scaler, urls: list[str], host: str, metrics_port: int | None) -> int:
    """Plan until SIGTERM/SIGINT."""
    import signal

    from prometheus_client import CollectorRegistry

    from common.metrics_http import MetricsServer
    from planner.loop import PlannerLoop
    from planner.planner_metrics import PlannerMetrics
    from planner.router_scrape import read_routers
    from planner.serve_planner import print_decision

    registry = CollectorRegistry()
    server = MetricsServer(registry, host, metrics_port) if metrics_port is not None else None
    loop = PlannerLoop(config, lambda: read_routers(urls), scaler, PlannerMetrics(registry),
                       on_decision=print_decision)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"ready: pdserve planner reading {', '.join(urls)} every {config.interval_s:g} s"
          f"{f', metrics at http://{host}:{metrics_port}/metrics' if metrics_port is not None else ''}", flush=True)
    try:
        loop.run(stop)
    finally:
        if server is not None:
            server.close()
    return 0
