"""`pdserve loadtest`: its flags, their mapping onto LoadTestConfig, and the command itself."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from loadtest.arrivals import parse_schedule
from loadtest.config import DatasetConfig, LoadTestConfig, parse_slos


def add_arguments(p: argparse.ArgumentParser, own_cluster: bool = False) -> None:
    """The load-test flags; `own_cluster` where the caller starts the router itself (`pdserve chaos`):
    no --url, TLS, API key, sweep or plots then."""
    if not own_cluster:
        p.add_argument("--url", required=True, help="host:port of the router")
    p.add_argument("--dataset", default="random", help="random | prefix | sharegpt:FILE | mooncake:FILE (a trace)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (a trace: its first N)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (inf: all at once); not for a trace, which has its own send times")
    p.add_argument("--rate-schedule", default=None, metavar="R:S,R:S,...",
                   help="a rate that steps: R requests/s for S seconds, phase after phase (instead of "
                        "--request-rate and --num-prompts); the JSON gets a summary per phase")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--duration-s", type=float, default=None, help="no new request after this many seconds")
    p.add_argument("--request-timeout-s", type=float, default=None)
    p.add_argument("--goodput", nargs="+", metavar="METRIC:MS",
                   help="SLOs, e.g. --goodput ttft:200 tpot:50 (metrics: ttft, tpot, e2el)")
    if not own_cluster:
        p.add_argument("--sweep", default=None, metavar="R1,R2,...",
                       help="run once per request rate; report the highest with >= 90%% SLO attainment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="default", help="tokenizer for sharegpt texts")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-num-prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--prefix-output-len", type=int, default=32)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    _add_trace_arguments(p)
    p.add_argument("--output", default=None, help="JSON result file")
    p.add_argument("--no-progress", action="store_true")
    if own_cluster:
        return
    p.add_argument("--save-requests", default=None, metavar="FILE.jsonl", help="per-request detail")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.add_argument("--tls-ca", default=None, help="PEM CA certificate: reach the router over TLS and verify it")
    p.add_argument("--api-key-file", default=None, help="file whose first line is the API key (else $PDSERVE_API_KEY)")


def _add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-block-tokens", type=int, default=16, metavar="N",
                   help="mooncake: token ids per hash id (prompts are the trace's lengths times N/512)")
    p.add_argument("--trace-source-block-tokens", type=int, default=512,
                   help="mooncake: tokens per hash id in the trace")
    p.add_argument("--trace-output-scale", type=float, default=None,
                   help="mooncake: output length = the trace's times this (default: N/512, as the prompts)")
    p.add_argument("--trace-max-output-len", type=int, default=None, help="mooncake: cap on output lengths")
    p.add_argument("--trace-sessions", type=int, default=None, metavar="K",
                   help="mooncake: replay every turn of the first K sessions (instead of --num-prompts requests)")
    p.add_argument("--trace-min-turns", type=int, default=1, metavar="T",
                   help="mooncake, with --trace-sessions: only sessions of at least T requests (2: conversations)")
    p.add_argument("--trace-schedule", choices=("fixed", "order"), default=None,
                   help="mooncake: fixed = at the trace's timestamps; order = in trace order at --max-concurrency "
                        "(default: order with --max-concurrency, else fixed)")
    p.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="mooncake, fixed schedule: multiply the trace's timestamps (0.5: twice as fast)")


def config_from_args(args: argparse.Namespace, url: str | None = None) -> LoadTestConfig:
    dataset = DatasetConfig.from_spec(
        args.dataset, random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, prefix_num_prefixes=args.prefix_num_prefixes,
        prefix_len=args.prefix_len, suffix_len=args.suffix_len, prefix_output_len=args.prefix_output_len,
        sharegpt_output_len=args.sharegpt_output_len, model=args.model,
        trace_block_tokens=args.trace_block_tokens, trace_source_block_tokens=args.trace_source_block_tokens,
        trace_output_scale=args.trace_output_scale, trace_max_output_len=args.trace_max_output_len,
        trace_sessions=args.trace_sessions, trace_min_turns=args.trace_min_turns)
    return LoadTestConfig(url=url or args.url, dataset=dataset, num_prompts=args.num_prompts,
                          request_rate=args.request_rate, burstiness=args.burstiness,
                          rate_schedule=parse_schedule(args.rate_schedule) if args.rate_schedule else (),
                          max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
                          duration_s=args.duration_s, request_timeout_s=args.request_timeout_s,
                          slos=parse_slos(args.goodput), seed=args.seed, progress=not args.no_progress,
                          tls_ca_file=getattr(args, "tls_ca", None), api_key_file=getattr(args, "api_key_file", None),
                          trace_schedule=args.trace_schedule, trace_time_scale=args.trace_time_scale)


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: expected comma-separated rates, e.g. 1,2,4") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("--sweep: rates must be > 0")
    return rates


def run_command(args: argparse.Namespace, config: LoadTestConfig) -> int:
    """Run (or sweep), print the table(s), write the files asked for. Exit 1 if every request failed."""
    from loadtest import plots, report
    from loadtest.runner import run
    from loadtest.sweep import ATTAINMENT_TARGET, sweep

    plot_dir = Path(args.plot_dir) if args.plot_dir else None
    if plot_dir:
        plot_dir.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        results, best = sweep(config, parse_rates(args.sweep), lambda r: print(report.table(r.summary), flush=True))
        runs = [r.summary for r in results]
        print(report.sweep_table(runs, ATTAINMENT_TARGET, best))
        data = {"runs": runs, "slo_attainment_target": ATTAINMENT_TARGET, "goodput_request_rate": best}
        records = [(r.summary["request_rate"], r.records) for r in results]
        if plot_dir:
            plots.plot_attainment(runs, plot_dir / "attainment_vs_rate.png", ATTAINMENT_TARGET)
    else:
        result = run(config)
        print(report.table(result.summary))
        data, runs = result.summary, [result.summary]
        records = [(config.request_rate, result.records)]
    if plot_dir:
        plots.plot_cdfs([rec for _, rs in records for rec in rs], plot_dir / "latency_cdf.png", config.slos)
    if args.output:
        report.write_json(args.output, data)
    if args.save_requests:
        report.write_jsonl(args.save_requests, records)
    return 1 if all(r["completed"] == 0 for r in runs) else 0


def prepare(args: argparse.Namespace):
    """Validate the flags (ValueError names the bad one); return the command to run."""
    config = config_from_args(args)
    if args.sweep:
        if config.dataset.is_trace:
            raise ValueError("--sweep varies --request-rate, which a trace does not use (try --trace-time-scale)")
        parse_rates(args.sweep)
        if not config.slos:
            raise ValueError("--sweep needs SLOs: --goodput ttft:MS tpot:MS ...")
    return lambda: run_command(args, config)
