"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pdserve.serve_cli import add_serve_args, cluster_config_from_args
from planner.cli import add_planner_args, planner_config_from_args
from router.openai.http_limits import add_http_limit_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is present), cpu or cuda[:N]")
    p.add_argument("--quantization", default=None, choices=["int8", "fp8"],
                   help="quantize the layers' linear weights at load: int8 (weight-only) or fp8 (e4m3); "
                        "a checkpoint already in fp8 needs no flag")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes (GPUs on CUDA) that split each layer's heads and MLP; must divide the "
                        "model's attention and KV head counts")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="Mixture-of-Experts models with --tensor-parallel-size > 1: each rank holds whole experts "
                        "(E / ranks of them) instead of a slice of every expert; attention stays split by heads")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash"],
                   help="auto: triton on CUDA, torch on CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of device memory for weights, activations and the KV cache")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no graphs for decode batches")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None,
                   help="KV cache size (default: 2 on CPU; on CUDA what --gpu-memory-utilization leaves)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8: float8_e4m3 K/V with per-layer scales (half the bytes)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-offload-cpu-gib", type=float, default=0.0,
                   help="KV tier 2: host memory (pinned on CUDA) keeping prefix blocks the pool evicts (0: off)")
    p.add_argument("--kv-offload-dir", default=None,
                   help="KV tier 3: directory of a local-disk arena below the host tier, found again on restart")
    p.add_argument("--kv-offload-disk-gib", type=float, default=0.0, help="size of the disk tier's arena")
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="speculative decoding (exact): ngram (prompt lookup) or draft (--speculative-model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="tokens proposed per sequence and step (K); a verifying step computes K + 1")
    p.add_argument("--speculative-model", default=None,
                   help="draft checkpoint directory (same tokenizer as --model) for --speculative-method draft")
    p.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix looked up")
    p.add_argument("--ngram-max", type=int, default=4, help="ngram: longest suffix looked up (tried first)")


def engine_config_from_args(args: argparse.Namespace):
    """Map the engine flags onto EngineConfig (which validates them)."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.kv_offload.config import OffloadConfig
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        attention_backend=args.attention_backend, cuda_graphs=not args.enforce_eager,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs),
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                          kv_cache_memory_bytes=None if args.kv_cache_memory_gib is None
                          else int(args.kv_cache_memory_gib * 2**30),
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_dtype=args.kv_cache_dtype,
                          offload=OffloadConfig(cpu_bytes=int(args.kv_offload_cpu_gib * 2**30),
                                                disk_dir=args.kv_offload_dir,
                                                disk_bytes=int(args.kv_offload_disk_gib * 2**30))),
        speculative=SpeculativeConfig(method=args.speculative_method,
                                      num_speculative_tokens=args.num_speculative_tokens,
                                      model=args.speculative_model, ngram_min=args.ngram_min,
                                      ngram_max=args.ngram_max))


def add_worker_args(p: argparse.ArgumentParser, standalone: bool) -> None:
    add_engine_args(p)
    if standalone:
        p.add_argument("--host", default="127.0.0.1", help="interface the worker's gRPC server binds to")
        p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
        p.add_argument("--advertise-host", default=None, help="host the router and peers should dial")
        p.add_argument("--auth-name", dest="auth_names", action="append", default=[], metavar="HOST",
                       help="another host routers may dial this worker by (e.g. a Service DNS name): cluster "
                            "tokens addressed to HOST:PORT are accepted too (repeatable)")
    p.add_argument("--kv-transfer-backend", default="auto", choices=["auto", "nixl", "tcp"])
    p.add_argument("--kv-transfer-host", default=None,
                   help="interface of the KV transfer listener (default: the gRPC host)")
    p.add_argument("--kv-transfer-port", type=int, default=0)
    p.add_argument("--lease-s", type=float, default=30.0, help="prefill: how long KV waits for decode to pull it")
    p.add_argument("--pull-timeout-s", type=float, default=20.0, help="decode: deadline of one KV pull")
    p.add_argument("--max-num-requests", type=int, default=1024,
                   help="requests a worker holds at once; more get RESOURCE_EXHAUSTED")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    if standalone:
        p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
        add_registry_args(p)
        add_cluster_secret_arg(p)
        p.add_argument("--tls-cert", default=None, help="PEM certificate of this worker's gRPC port (mTLS; with "
                                                        "--tls-key and --tls-ca: callers must present a cert from it)")
        p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
        p.add_argument("--tls-ca", default=None, help="PEM CA that callers' (the routers') certificates chain to")
        p.add_argument("--no-kv-tls", dest="kv_tls", action="store_false",
                       help="with --tls-*: keep the KV transfer links plaintext (HMAC-authenticated only); by "
                            "default they speak mutual TLS with the same certificate")


def add_cluster_secret_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-secret-file", default=None,
                   help="file holding the secret shared by the router and workers: authenticates worker gRPC, "
                        "KV transfers and KV handles (or env PDSERVE_CLUSTER_SECRET_FILE / PDSERVE_CLUSTER_SECRET; "
                        "none: internal links unauthenticated). `serve` generates one when none is given")


def add_registry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None,
                   help="share the worker registry and KV events through this Redis (redis://host:port/db)")
    p.add_argument("--registry-ttl-s", type=float, default=3.0,
                   help="lifetime of a worker's registration in Redis (renewed every third of it)")
    p.add_argument("--redis-password-file", default=None,
                   help="file holding the Redis password (else $REDIS_PASSWORD; keep it out of --redis-url, "
                        "which any local user can read in the process list)")


def worker_config_from_args(args: argparse.Namespace, role: str, standalone: bool = True):
    """WorkerConfig from the worker flags; `serve` (not standalone) picks hosts and ports itself."""
    from common.cluster_auth import ClusterAuthConfig
    from common.cluster_auth.tls import InternalTLSConfig
    from kv_transfer import KVTransferConfig
    from worker_runtime.config import WorkerConfig
    host = args.host if standalone else "127.0.0.1"
    advertise = args.advertise_host if standalone else None
    kv = KVTransferConfig(backend=args.kv_transfer_backend, host=args.kv_transfer_host or host,
                          port=args.kv_transfer_port, advertise_host=advertise)
    return WorkerConfig(role=role, engine=engine_config_from_args(args), host=host,
                        port=args.port if standalone else 0, advertise_host=advertise,
                        auth_names=tuple(args.auth_names) if standalone else (), kv_transfer=kv,
                        lease_s=args.lease_s, pull_timeout_s=args.pull_timeout_s,
                        max_num_requests=args.max_num_requests, num_threads=args.num_threads,
                        drain_timeout_s=args.drain_timeout_s, redis_url=args.redis_url,
                        registry_ttl_s=args.registry_ttl_s, metrics_port=args.metrics_port if standalone else None,
                        redis_password_file=args.redis_password_file,
                        auth=ClusterAuthConfig(args.cluster_secret_file),
                        tls=InternalTLSConfig(args.tls_cert, args.tls_key, args.tls_ca) if standalone
                        else InternalTLSConfig(args.worker_tls_cert, args.worker_tls_key, args.worker_tls_ca),
                        kv_tls=getattr(args, "kv_tls", True))


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface the gRPC server binds to")
    p.add_argument("--port", type=int, default=50051, help="gRPC port of the Generation service")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    p.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API here (/v1/completions, /v1/chat/completions, ...)")
    p.add_argument("--routing-policy", default="prefix", choices=["prefix", "least_loaded", "round_robin", "random"],
                   help="prefix: least predicted TTFT from cached blocks (KV events) and load, caches "
                        "partitioned by rendezvous hash; see router/routing_policy.py")
    p.add_argument("--overlap-weight", type=float, default=1.0,
                   help="prefix policy: cost of an uncached prompt block relative to a block of queued work")
    p.add_argument("--prefill-request-weight", type=float, default=8.0,
                   help="prefill choice: fixed cost of one request, in blocks of prompt")
    p.add_argument("--kv-weight", type=float, default=4.0,
                   help="decode choice: cost of a full KV pool, in running requests")
    p.add_argument("--pollution-weight", type=float, default=1.0,
                   help="prefix policy: cost of evicting a cached block relative to computing one")
    p.add_argument("--tie-ratio", type=float, default=0.2,
                   help="prefix policy: costs within this fraction of the best are near-ties "
                        "(holder, then rendezvous-hash home)")
    p.add_argument("--decode-hold-weight", type=float, default=2.0,
                   help="prefix policy, decode choice: cost of not holding the prompt, in running requests")
    p.add_argument("--kv-tier-weights", type=tier_weights, default={}, metavar="MEDIUM=W,...",
                   help="prefix policy: worth of a prompt block a worker holds in host memory (cpu) or on local "
                        "disk (disk), relative to one on its device (1.0); default cpu=0.8,disk=0.5")
    p.add_argument("--skip-prefill-tokens", type=int, default=32,
                   help="the decode worker prefills itself when fewer prompt tokens than this are uncached there")
    p.add_argument("--no-link-aware-prefill", action="store_true",
                   help="always prefill remotely, even into a decode worker whose observed KV link moves a "
                        "token's KV slower than the prefill pool computes one")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="requests that may wait when every worker is saturated; more get RESOURCE_EXHAUSTED")
    p.add_argument("--queue-timeout-s", type=float, default=30.0)
    p.add_argument("--retry-after-s", type=float, default=1.0, help="retry advice sent with RESOURCE_EXHAUSTED")
    p.add_argument("--health-interval-s", type=float, default=1.0)
    p.add_argument("--router-drain-timeout-s", type=float, default=30.0)
    p.add_argument("--max-migrations", type=int, default=3,
                   help="how often one sample may move to another decode worker when its decode stream breaks "
                        "(worker died, connection cut, drained, silent past --stream-timeout-s); 0: never")
    p.add_argument("--stream-timeout-s", type=float, default=30.0,
                   help="a decode stream silent this long counts as broken (migrated, or UNAVAILABLE); 0: no limit")
    p.add_argument("--max-n", type=int, default=16, help="most parallel samples (n) one request may ask for")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt text tokenized (default: max model len x 16 characters)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest gRPC request message / HTTP request body the router reads")
    p.add_argument("--api-key-file", default=None,
                   help="file of TENANT:KEY lines; then Generate, Abort and /v1 need 'authorization: Bearer KEY' "
                        "(keys may also come from $PDSERVE_API_KEYS, comma-separated; never on the command line)")
    p.add_argument("--tls-cert-file", default=None, help="PEM certificate: the gRPC and HTTP fronts speak TLS only")
    p.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    p.add_argument("--route-metadata", action="store_true",
                   help="name the workers of each sample in Generate's trailing metadata (debugging)")
    add_http_limit_args(p)
    add_registry_args(p)
    add_cluster_secret_arg(p)


def tier_weights(text: str) -> dict[str, float]:
    """`cpu=0.8,disk=0.5` -> {"cpu": 0.8, "disk": 0.5} (media and ranges are checked by RoutingWeights)."""
    weights = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        medium, sep, value = item.partition("=")
        try:
            if not sep or not medium.strip():
                raise ValueError
            weights[medium.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected MEDIUM=WEIGHT[,...] (e.g. cpu=0.8,disk=0.5), "
                                             f"got {item!r}") from None
    return weights


def router_config_from_args(args: argparse.Namespace, prefill: list[str], decode: list[str]):
    from common.cluster_auth import ClusterAuthConfig
    from common.cluster_auth.tls import InternalTLSConfig
    from router.config import RouterConfig
    from router.front_security import FrontSecurityConfig
    from router.openai.http_limits import http_limits_from_args
    from router.routing_policy import RoutingWeights
    return RouterConfig(model=args.model, host=args.host, port=args.port, prefill_workers=prefill,
                        decode_workers=decode, routing_policy=args.routing_policy,
                        routing_weights=RoutingWeights(args.overlap_weight, args.kv_weight,
                                                       args.prefill_request_weight,
                                                       pollution_weight=args.pollution_weight,
                                                       tie_ratio=args.tie_ratio,
                                                       hold_weight=args.decode_hold_weight,
                                                       kv_tier_weights=args.kv_tier_weights),
                        skip_prefill_tokens=args.skip_prefill_tokens, redis_url=args.redis_url,
                        link_aware_prefill=not args.no_link_aware_prefill,
                        registry_ttl_s=args.registry_ttl_s, max_queue_len=args.max_queue_len,
                        queue_timeout_s=args.queue_timeout_s, retry_after_s=args.retry_after_s,
                        max_model_len=args.max_model_len, health_interval_s=args.health_interval_s,
                        lease_s=args.lease_s,
                        metrics_port=args.metrics_port, http_port=args.http_port,
                        drain_timeout_s=args.router_drain_timeout_s, max_n=args.max_n,
                        max_migrations=args.max_migrations, stream_timeout_s=args.stream_timeout_s,
                        max_prompt_chars=args.max_prompt_chars, max_request_bytes=args.max_request_bytes,
                        http_limits=http_limits_from_args(args),
                        security=FrontSecurityConfig(api_key_file=args.api_key_file,
                                                     tls_cert_file=args.tls_cert_file,
                                                     tls_key_file=args.tls_key_file),
                        route_metadata=args.route_metadata, redis_password_file=args.redis_password_file,
                        cluster_auth=ClusterAuthConfig(args.cluster_secret_file),
                        worker_tls=InternalTLSConfig(getattr(args, "worker_tls_cert", None),
                                                     getattr(args, "worker_tls_key", None),
                                                     getattr(args, "worker_tls_ca", None),
                                                     getattr(args, "worker_tls_server_name", None)))


def _quantize(args: argparse.Namespace) -> int:
    from engine.model.fp8_checkpoint import save_fp8_checkpoint
    from engine.model_files import resolve_model_path
    out = save_fp8_checkpoint(resolve_model_path(args.model), Path(args.output))
    print(f"wrote {args.quantization} checkpoint to {out}")
    return 0


def _addresses(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()]


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

    serve = sub.add_parser("serve", help="run a local cluster: Ray-placed prefill and decode workers plus a router")
    add_serve_args(serve)
    add_router_args(serve)
    add_worker_args(serve, standalone=False)
    add_planner_args(serve, in_serve=True)

    router = sub.add_parser("router", help="run the router alone (workers started elsewhere)")
    router.add_argument("--prefill-workers", default="", help="comma-separated host:port of prefill workers")
    router.add_argument("--decode-workers", default="",
                        help="comma-separated host:port of decode workers (or let them register in --redis-url)")
    router.add_argument("--lease-s", type=float, default=30.0)
    router.add_argument("--worker-tls-cert", default=None,
                        help="PEM client certificate the router presents to workers (mTLS to workers started "
                             "with --tls-cert/--tls-key/--tls-ca)")
    router.add_argument("--worker-tls-key", default=None, help="PEM private key of --worker-tls-cert")
    router.add_argument("--worker-tls-ca", default=None, help="PEM CA the workers' certificates chain to")
    router.add_argument("--worker-tls-server-name", default=None,
                        help="name the workers' certificates carry, checked instead of the address dialed "
                             "(e.g. one certificate for the pool, the chart's <release>-internal)")
    add_router_args(router)
    router.add_argument("--model", default="default", help="checkpoint directory (tokenizer), or 'default'")
    router.add_argument("--max-model-len", type=int, default=None)

    from loadtest.cli import add_arguments as add_loadtest_args
    add_loadtest_args(sub.add_parser("loadtest", help="measure TTFT/ITL/TPOT/E2E latency and goodput of a running "
                                                      "cluster at a request rate"))

    from loadtest.chaos.cli import add_arguments as add_chaos_args
    add_chaos_args(sub.add_parser("chaos", help="start a local cluster, run a load test while killing, stopping and "
                                                "draining workers on a schedule; report completed/migrated/failed "
                                                "requests and leaks (exit 1 unless none failed and nothing leaked)"))

    add_planner_args(sub.add_parser("planner", help="size the prefill and decode pools from the routers' live "
                                                    "TTFT/ITL through the Kubernetes API (the chart's planner)"),
                     in_serve=False)

    quantize = sub.add_parser("quantize", help="write a checkpoint's layer weights in fp8 (the format vLLM's fp8 "
                                                "method loads; pdserve loads it with no flag)")
    quantize.add_argument("--model", default="default", help="unquantized checkpoint directory, or 'default'")
    quantize.add_argument("--quantization", default="fp8", choices=["fp8"])
    quantize.add_argument("--output", required=True, help="directory to write the quantized checkpoint to")

    for role in ("prefill", "decode"):
        worker = sub.add_parser(f"{role}-worker", help=f"run one {role} worker (its own gRPC server)")
        add_worker_args(worker, standalone=True)
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
        config = router_config_from_args(args, _addresses(args.prefill_workers), _addresses(args.decode_workers))
        return lambda: run_router(config)
    from pdserve.cluster import run_serve
    config = cluster_config_from_args(args, router_config_from_args(args, [], []),
                                      worker_config_from_args(args, "decode", standalone=False),
                                      planner_config_from_args(args) if args.planner else None)
    return lambda: run_serve(config)

if __name__ == "__main__":
    sys.exit(main())
