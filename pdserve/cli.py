"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pdserve.command_flags import (
    ENGINE_FLAGS,
    ROUTER_FLAGS,
    SERVE_FLAGS,
    WORKER_FLAGS,
    cluster_config_from_args,
    engine_config_from_args,
    router_config_from_args,
    worker_config_from_args,
)
from planner.cli import add_planner_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    ENGINE_FLAGS.add_to(p)


def _quantize(args: argparse.Namespace) -> int:
    from engine.model.fp8_checkpoint import save_fp8_checkpoint
    from engine.model_files import resolve_model_path
    out = save_fp8_checkpoint(resolve_model_path(args.model), Path(args.output))
    print(f"wrote {args.quantization} checkpoint to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for a JSONL file of requests")
    gen.add_argument("--offline", action="store_true", help="run the engine in this process")
    gen.add_argument("--url", help="host:port of a running pdserve router (instead of --offline)")
    gen.add_argument("--stream", action="store_true",
                     help="with --url: print every chunk as a JSON line on stdout as it arrives")
    gen.add_argument("--timeout", type=float, default=None, help="with --url: per-request deadline, seconds")
    gen.add_argument("--api-key-file", default=None,
                     help="with --url: file whose first line is the API key (else $PDSERVE_API_KEY)")
    gen.add_argument("--tls-ca", default=None,
                     help="with --url: PEM CA certificate; the router is then reached over TLS and verified")
    gen.add_argument("--input", required=True)
    gen.add_argument("--output", required=True)
    add_engine_args(gen)

    SERVE_FLAGS.add_to(sub.add_parser("serve", usage="%(prog)s [options]", help="run a local cluster: Ray-placed "
                                      "prefill and decode workers plus a router"))
    ROUTER_FLAGS.add_to(sub.add_parser("router", help="run the router alone (workers started elsewhere)"))

    from loadtest.cli import add_arguments as add_loadtest_args
    add_loadtest_args(sub.add_parser("loadtest", help="measure TTFT/ITL/TPOT/E2E latency and goodput of a running "
                                                      "cluster at a request rate"))

    from loadtest.chaos.cli import add_arguments as add_chaos_args
    add_chaos_args(sub.add_parser("chaos", help="start a local cluster, run a load test while killing, stopping and "
                                                "draining workers on a schedule; report completed/migrated/failed "
                                                "requests and leaks (exit 1 unless none failed and nothing leaked)"))

    add_planner_args(sub.add_parser("planner", help="size the prefill and decode pools from the routers' live "
                                                    "TTFT/ITL through the Kubernetes API (the chart's planner)"))

    quantize = sub.add_parser("quantize", help="write a checkpoint's layer weights in fp8 (the format vLLM's fp8 "
                                                "method loads; pdserve loads it with no flag)")
    quantize.add_argument("--model", default="default", help="unquantized checkpoint directory, or 'default'")
    quantize.add_argument("--quantization", default="fp8", choices=["fp8"])
    quantize.add_argument("--output", required=True, help="directory to write the quantized checkpoint to")

    for role in ("prefill", "decode"):
        WORKER_FLAGS.add_to(sub.add_parser(f"{role}-worker", help=f"run one {role} worker (its own gRPC server)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        job = _prepare(args)
    except ValueError as exc:  # a config dataclass refused a flag
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return job()


def _prepare(args: argparse.Namespace):
    """Validate the flags into config objects; return the command to run."""
    if args.command == "generate":
        if args.url:
            from common.client import run_generate_url
            return lambda: run_generate_url(args)
        if not args.offline:
            raise ValueError("give --url HOST:PORT (a running cluster) or --offline")
        config = engine_config_from_args(args)
        from pdserve.offline import run_offline
        return lambda: run_offline(args, config)
    if args.command == "loadtest":
        from loadtest.cli import prepare
        return prepare(args)
    if args.command == "chaos":
        from loadtest.chaos.cli import prepare as prepare_chaos
        return prepare_chaos(args)
    if args.command == "planner":
        from planner.cli import prepare as prepare_planner
        return prepare_planner(args)
    if args.command == "quantize":
        return lambda: _quantize(args)
    if args.command in ("prefill-worker", "decode-worker"):
        from pdserve.worker_roles import run_worker
        config = worker_config_from_args(args, args.command.split("-")[0])
        return lambda: run_worker(config)
    if args.command == "router":
        from router.server import run_router
        config = router_config_from_args(args)
        return lambda: run_router(config)
    from pdserve.cluster import run_serve
    config = cluster_config_from_args(args)
    return lambda: run_serve(config)

if __name__ == "__main__":
    sys.exit(main())
