"""The `pdserve` command line."""
from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    p.add_argument("--no-prefix-caching", action="store_true")


def engine_config_from_args(args: argparse.Namespace):
    """Map the engine flags onto EngineConfig (which validates them)."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=int(args.kv_cache_memory_gib * 2**30),
                          enable_prefix_caching=not args.no_prefix_caching))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for a JSONL file of requests")
    gen.add_argument("--offline", action="store_true", help="run the engine in this process")
    gen.add_argument("--input", required=True)
    gen.add_argument("--output", required=True)
    add_engine_args(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        if not args.offline:
            print("error: only --offline generation is available in this version", file=sys.stderr)
            return 2
        try:
            config = engine_config_from_args(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        from pdserve.offline import run_offline
        return run_offline(args, config)
    return 2


if __name__ == "__main__":
    sys.exit(main())
