"""Offline throughput of the peer, vLLM's CPU engine, on offline_throughput.py's workload.

Same requests as bench/offline_throughput.py (its `make_workload`, same args and seed,
so the token ids are identical): greedy, ignore_eos, max_tokens = each request's
output length, all submitted in one `llm.generate` call, prefix cache reset after a
small warm-up. Runs in its own venv (see /work/shared/peer-vllm-cpu.md; that venv also
needs `pip install xxhash` to import pdserve's modules):

  cd /work/main && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    VLLM_CACHE_ROOT=/tmp/vllm-peer/cache TORCHINDUCTOR_CACHE_DIR=/tmp/vllm-peer/inductor \
    /tmp/vllm-peer/bin/python bench/vllm_peer_offline.py --dtype bfloat16 \
    --wait-for offline_throughput.py pytest

--wait-for: before starting the engine and again before the timed run, wait (up to
40 min) until no other process's command line contains any of these strings, so the
peer never shares the two cores with another benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
             "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}.items():
    os.environ.setdefault(k, v)


def busy(patterns) -> list[str]:
    """Command lines of other processes (not this script) that contain a pattern."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # process gone
            continue
        if "vllm_peer_offline" not in cmd and any(pat in cmd for pat in patterns):
            found.append(f"{p.name}: {cmd[:100]}")
    return found


def wait_idle(patterns, timeout_s=2400, poll_s=20) -> float:
    start = time.monotonic()
    while patterns and (others := busy(patterns)):
        if time.monotonic() - start > timeout_s:
            sys.exit(f"still busy after {timeout_s} s: {others}")
        print(f"waiting for: {others}", flush=True)
        time.sleep(poll_s)
    return time.monotonic() - start


def main() -> int:
    from offline_throughput import add_workload_args, make_workload

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--wait-for", nargs="*", default=[])
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    from engine.model_files import resolve_model_path
    from engine.tokenizer import Tokenizer

    model_dir = resolve_model_path(args.model)
    work = make_workload(Tokenizer(model_dir), args.num_requests, args.seed, args.prompt_len, args.output_len)
    prompt_tokens = sum(len(p) for p, _ in work)

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    wait_idle(args.wait_for)
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=args.dtype, max_model_len=args.max_model_len)
    engine_start_s = time.perf_counter() - t0
    llm.generate([TokensPrompt(prompt_token_ids=work[0][0])], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)  # warm-up

    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    waited_s = wait_idle(args.wait_for)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    overlapped = busy(args.wait_for) if args.wait_for else []

    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    r = {"elapsed_s": elapsed, "output_tokens": produced, "output_tok_s": produced / elapsed,
         "total_tok_s": (produced + prompt_tokens) / elapsed, "engine_start_s": engine_start_s,
         "waited_before_timed_run_s": waited_s, "busy_after_timed_run": overlapped}
    print(f"\nworkload: {len(work)} requests, {prompt_tokens} prompt tokens, "
          f"{sum(o for _, o in work)} output tokens, dtype {args.dtype}, vllm {vllm.__version__}, "
          f"engine start {engine_start_s:.1f} s")
    print(f"{'system':<10} {'time s':>8} {'out tok/s':>10} {'total tok/s':>12} {'out tokens':>11}")
    print(f"{'vllm-cpu':<10} {elapsed:>8.1f} {r['output_tok_s']:>10.1f} {r['total_tok_s']:>12.1f} {produced:>11}")
    if overlapped:
        print(f"WARNING: another benchmark was running at the end of the timed run: {overlapped}")
    out = {"config": vars(args) | {"prompt_tokens": prompt_tokens, "model_dir": str(model_dir),
                                   "vllm": vllm.__version__, "torch": torch.__version__,
                                   "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]},
           "results": {"vllm-cpu": r}}
    path = Path(args.output or HERE / "results" / f"vllm_peer_{args.dtype}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
