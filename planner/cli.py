"""Flags of `pdserve planner` (its own process, e.g. a Deployment scaling the chart's pools through
the Kubernetes API) and of `pdserve serve --planner` (the same planner over serve's Ray actors)."""
from __future__ import annotations

import argparse
import threading

from planner.config import PlannerConfig


def add_planner_args(p: argparse.ArgumentParser, in_serve: bool) -> None:
    d = PlannerConfig()
    if in_serve:
        p.add_argument("--planner", action="store_true",
                       help="resize the prefill and decode pools from live TTFT/ITL (starting from --prefill and "
                            "--decode), draining workers before removing them")
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_s * 1e3, help="TTFT p90 SLO the prefill pool "
                   "is sized for")
    p.add_argument("--slo-itl-ms", type=float, default=d.slo_itl_s * 1e3, help="ITL p90 SLO the decode pool is "
                   "sized for")
    p.add_argument("--interval-s", type=float, default=d.interval_s, help="how often the planner decides")
    p.add_argument("--window-s", type=float, default=d.window_s, help="percentiles and rates over this much "
                   "of the recent past")
    for role in ("prefill", "decode"):
        p.add_argument(f"--min-{role}", type=int, default=getattr(d, f"min_{role}"))
        p.add_argument(f"--max-{role}", type=int, default=getattr(d, f"max_{role}"))
    p.add_argument("--scale-up-cooldown-s", type=float, default=d.scale_up_cooldown_s)
    p.add_argument("--scale-down-cooldown-s", type=float, default=d.scale_down_cooldown_s)
    p.add_argument("--scale-down-window-s", type=float, default=d.scale_down_window_s,
                   help="remove a worker only after this long of load the others could carry")
    if not in_serve:
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


def planner_config_from_args(args: argparse.Namespace) -> PlannerConfig:
    return PlannerConfig(
        slo_ttft_s=args.slo_ttft_ms / 1e3, slo_itl_s=args.slo_itl_ms / 1e3, interval_s=args.interval_s,
        window_s=args.window_s, min_prefill=args.min_prefill, max_prefill=args.max_prefill,
        min_decode=args.min_decode, max_decode=args.max_decode, scale_up_cooldown_s=args.scale_up_cooldown_s,
        scale_down_cooldown_s=args.scale_down_cooldown_s, scale_down_window_s=args.scale_down_window_s)


def prepare(args: argparse.Namespace):
    """Validate `pdserve planner`'s flags; return the command to run."""
    from planner.kubernetes_scaler import KubernetesScaler, KubernetesTargetConfig

    config = planner_config_from_args(args)
    target = KubernetesTargetConfig(namespace=args.namespace, prefill_deployment=args.prefill_deployment,
                                    decode_deployment=args.decode_deployment, raycluster=args.raycluster,
                                    prefill_group=args.prefill_group, decode_group=args.decode_group)
    urls = [u.strip() for u in args.router_metrics.split(",") if u.strip()]
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
