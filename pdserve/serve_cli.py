"""The flags of `pdserve serve` that are its own (pools, Ray, internal TLS) and the ClusterConfig made
from them; the router, worker and planner flags it shares with their commands live with those."""
from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: decode workers prefill)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                       help=f"ranks of each {role} worker (default: --tensor-parallel-size); prefill and "
                            "decode may differ, their KV moves between any two sizes")
    p.add_argument("--follow-ray-nodes", action="store_true",
                   help="with --ray-address: run a worker per unit of pdserve_<role> each node declares, "
                        "as nodes join and leave (a RayCluster resized by `pdserve planner`)")
    p.add_argument("--internal-tls", action="store_true",
                   help="mutual TLS on router -> worker gRPC and the KV links, with a throwaway CA made at "
                        "start (needs the openssl command; one host only)")
    for part, what in (("cert", "PEM certificate the router and every worker present (serverAuth and clientAuth)"),
                       ("key", "PEM private key of --internal-tls-cert"),
                       ("ca", "PEM CA the peers' certificates chain to")):
        p.add_argument(f"--internal-tls-{part}", dest=f"worker_tls_{part}", default=None,
                       help=f"{what}: mutual TLS on router -> worker gRPC and the KV links with these files, "
                            "at the same path on every node (with --ray-address; e.g. the chart's Secret)")
    p.add_argument("--internal-tls-server-name", dest="worker_tls_server_name", default=None,
                   help="name the certificate carries, checked instead of the worker addresses dialed")


def cluster_config_from_args(args: argparse.Namespace, router, worker, planner):  # -> ClusterConfig
    """ClusterConfig of `serve` from its flags and the router, worker and planner configs made from theirs."""
    from pdserve.cluster import ClusterConfig
    return ClusterConfig(router=router, worker=worker, num_prefill=args.prefill, num_decode=args.decode,
                         ray_address=args.ray_address, log_level=args.log_level.upper(),
                         internal_tls=args.internal_tls,
                         prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
                         decode_tensor_parallel_size=args.decode_tensor_parallel_size,
                         follow_ray_nodes=args.follow_ray_nodes, planner=planner)
