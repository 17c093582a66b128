"""`pdserve chaos` flags: the cluster, the fault schedule, and the load (the `pdserve loadtest` flags
minus --url)."""
from __future__ import annotations

import argparse
import math
import shlex

from loadtest.chaos.config import FAULTS, ROLES, ChaosConfig

DEFAULT_WORKER_ARGS = "--dtype float32 --kv-cache-memory-gib 0.5 --num-threads 1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadtest.cli import add_arguments as add_load_arguments
    add_load_arguments(p, own_cluster=True)
    p.set_defaults(request_rate=2.0, duration_s=300.0, random_input_len=128, random_output_len=32,
                   random_range_ratio=0.5, num_prompts=0, no_progress=True)
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--roles", default=",".join(ROLES), help="pools faults may hit (each needs >= 2 workers)")
    p.add_argument("--fault-every-s", type=float, default=30.0, help="seconds between fault starts")
    p.add_argument("--first-fault-s", type=float, default=10.0)
    p.add_argument("--restart-delay-s", type=float, default=2.0, help="a killed/drained worker restarts after")
    p.add_argument("--stop-s", type=float, default=None, help="how long a SIGSTOP lasts (default: timeout + 4 s)")
    p.add_argument("--stream-timeout-s", type=float, default=8.0, help="the router's --stream-timeout-s")
    p.add_argument("--drain-timeout-s", type=float, default=2.0, help="the workers' --drain-timeout-s")
    p.add_argument("--max-migrations", type=int, default=3)
    p.add_argument("--worker-args", default=DEFAULT_WORKER_ARGS,
                   help="extra flags for every worker, one string (e.g. \"--model DIR --dtype bfloat16\")")
    p.add_argument("--router-args", default="", help="extra flags for the router, one string")
    p.add_argument("--log-dir", default=None, help="write each process's output to DIR/<name>.log")


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    from loadtest.cli import config_from_args as load_config_from_args
    if math.isinf(args.request_rate):
        raise ValueError("--request-rate: chaos needs a finite rate")
    if not args.num_prompts:  # enough for the whole duration at the rate, with Poisson's spread
        args.num_prompts = math.ceil(args.request_rate * args.duration_s * 1.3) + 20
    load = load_config_from_args(args, url="127.0.0.1:0")
    return ChaosConfig(load=load, num_prefill=args.prefill, num_decode=args.decode, duration_s=args.duration_s,
                       fault_every_s=args.fault_every_s, first_fault_s=args.first_fault_s,
                       faults=_names(args.faults), roles=_names(args.roles), restart_delay_s=args.restart_delay_s,
                       stream_timeout_s=args.stream_timeout_s, stop_s=args.stop_s,
                       drain_timeout_s=args.drain_timeout_s, max_migrations=args.max_migrations, seed=args.seed,
                       worker_args=shlex.split(args.worker_args), router_args=shlex.split(args.router_args),
                       output=args.output, log_dir=args.log_dir)


def prepare(args: argparse.Namespace):
    config = config_from_args(args)
    from loadtest.chaos.runner import run_chaos
    return lambda: run_chaos(config)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())
