"""Where one offline run of the engine spends its time: torch profiler ops, grouped.

Runs bench/offline_throughput.py's workload through pdserve's engine under
torch.profiler and prints the op time per group (linears, RMSNorm, other
elementwise, attention, sampling) beside the wall time, so the share outside
ops (Python) shows too. PDSERVE_FUSED=0 profiles the unfused path.

  PYTHONPATH=. .venv/bin/python bench/profile_engine.py --dtype bfloat16 --num-requests 48 \
      --prompt-len 12 420 --output-len 32 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from offline_throughput import add_workload_args, make_workload  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_files import resolve_model_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

GROUPS = [  # (group, substrings of op names), first match wins
    ("linears", ("_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm")),
    ("fused elementwise (pdserve C++)", ("pdserve::", "fused_add_rms_norm", "silu_and_mul", "rope_")),
    ("rms_norm", ("rms_norm", "aten::pow", "aten::mean", "aten::rsqrt")),
    ("attention", ("paged_decode", "scaled_dot_product", "_flash_attention", "index_put", "index_select")),
    ("sampling (argmax)", ("aten::argmax", "aten::max")),
    ("elementwise", ("aten::mul", "aten::add", "aten::silu", "aten::copy_", "aten::neg", "aten::cat",
                     "aten::to", "aten::_to_copy", "aten::sub", "aten::index", "aten::embedding",
                     "aten::clone", "aten::fill_", "aten::zero_")),
]


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    work = make_workload(Tokenizer(model_dir), args.num_requests, args.seed, args.prompt_len, args.output_len)
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=args.dtype,
                                    scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens),
                                    cache=CacheConfig(kv_cache_memory_bytes=2 << 30)))
    engine.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=4))
    engine.kv.pool.reset_prefix_cache()
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    steps0 = engine.num_steps
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished():
            engine.step()
    wall = time.perf_counter() - start
    # Self time of leaf-level ops: nothing is counted twice.
    per_group: dict[str, float] = defaultdict(float)
    per_op: dict[str, tuple[float, int]] = {}
    total = 0.0
    for evt in prof.key_averages():
        self_s = evt.self_cpu_time_total / 1e6
        if self_s <= 0:
            continue
        total += self_s
        per_group[group_of(evt.key)] += self_s
        per_op[evt.key] = (self_s, evt.count)
    print(f"\n{engine.num_steps - steps0} steps, wall {wall:.2f} s (profiled), op self time {total:.2f} s, "
          f"dtype {args.dtype}, fused={os.environ.get('PDSERVE_FUSED', '1')}, threads {torch.get_num_threads()}")
    print(f"{'group':<34} {'s':>7} {'share':>7}")
    for group, s in sorted(per_group.items(), key=lambda kv: -kv[1]):
        print(f"{group:<34} {s:>7.3f} {s / total:>7.1%}")
    print(f"{'outside ops (wall - op time)':<34} {max(0.0, wall - total):>7.3f}")
    print(f"\n{'op':<48} {'s':>7} {'calls':>7}")
    for name, (s, n) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{name[:48]:<48} {s:>7.3f} {n:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
