"""One decoder layer's elementwise half three ways: eager torch ops, pdserve's fused C++ kernels,
torch.compile (inductor's C++/OpenMP codegen, dynamic shapes) of the eager ops.

Per step size (tokens) and dtype: milliseconds per layer for residual add + RMSNorm (twice),
SiLU*up, RoPE on q/k and the K/V cache write, SmolLM2-135M's shapes; plus inductor's compile
time and how many graphs it compiled across the step sizes. This is the measurement behind
the choice of C++ kernels (docs/architecture.md).

  PYTHONPATH=. .venv/bin/python bench/fused_elementwise_micro.py [--no-compile]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.model.fused import load_fused_ops  # noqa: E402
from engine.model.llama import rms_norm  # noqa: E402
from engine.model.rotary import RotaryEmbedding  # noqa: E402

HIDDEN, INTER, HQ, HKV, D, BS = 576, 1536, 9, 3, 64, 16
EPS = 1e-5


def eager(x, o, d, gate_up, qkv, cos, sin, w1, w2, k_cache, v_cache, blocks, offsets):
    """The unfused ops of one layer (as LlamaModel.forward runs them)."""
    t = qkv.shape[0]
    qk = RotaryEmbedding.apply(qkv[:, :(HQ + HKV) * D].view(t, HQ + HKV, D), cos, sin)
    k_cache[blocks, offsets] = qk[:, HQ:]
    v_cache[blocks, offsets] = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    x = x + o
    h = rms_norm(x, w1, EPS)
    gate, up = gate_up.chunk(2, dim=-1)
    a = F.silu(gate) * up
    x = x + d
    return rms_norm(x, w2, EPS), h, a, qk


def timed(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def measure(t, dtype, ops, rotary, k_cache, v_cache, w1, w2, compiled) -> tuple[str, float]:
    """One step size: the result line, and the compiled function's first-call time (0 without)."""
    torch.manual_seed(t)
    x, o, d = (torch.randn(t, HIDDEN).to(dtype) for _ in range(3))
    gate_up = torch.randn(t, 2 * INTER).to(dtype)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D).to(dtype)
    positions = torch.randint(0, 8192, (t,))
    cos, sin = rotary.lookup(positions)
    slots = torch.randperm(k_cache.shape[0] * BS)[:t]
    blocks, offsets = slots // BS, slots % BS
    reps = max(3, 2000 // t)
    inputs = (x, o, d, gate_up, qkv, cos, sin, w1, w2, k_cache, v_cache, blocks, offsets)

    def run_fused():
        r, xx, dd = x.clone(), o.clone(), d.clone()  # the eager path allocates its outputs too
        ops.rope_(qkv, positions, rotary.cos, rotary.sin, HQ, HKV, k_cache, v_cache, blocks, offsets)
        ops.add_rms_norm_(xx, r, w1, EPS)
        ops.silu_and_mul(gate_up)
        ops.add_rms_norm_(dd, r, w2, EPS)

    line = (f"{str(dtype)[6:]:<9} T={t:<5} eager {timed(lambda: eager(*inputs), reps):8.3f} ms  "
            f"fused {timed(run_fused, reps):8.3f} ms")
    if compiled is None:
        return line, 0.0
    start = time.perf_counter()
    compiled(*inputs)
    first = time.perf_counter() - start
    return line + f"  compiled {timed(lambda: compiled(*inputs), reps):8.3f} ms (first call {first:.1f} s)", first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 2048])
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    for dtype in (torch.float32, torch.bfloat16):
        ops = load_fused_ops(torch.device("cpu"), dtype)
        assert ops is not None, "the fused kernels did not build"
        rotary = RotaryEmbedding(D, 8192, 100000.0, None, dtype, torch.device("cpu"))
        kv = torch.zeros(512, 2, BS, HKV, D, dtype=dtype)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        w1, w2 = torch.rand(HIDDEN).to(dtype), torch.rand(HIDDEN).to(dtype)
        compiled = None if args.no_compile else torch.compile(eager, dynamic=True)
        compile_s = 0.0
        for t in args.tokens:
            line, first = measure(t, dtype, ops, rotary, k_cache, v_cache, w1, w2, compiled)
            compile_s += first
            print(line, flush=True)
        if compiled is not None:
            from torch._dynamo.utils import counters
            print(f"{str(dtype)[6:]}: inductor compile time {compile_s:.1f} s, "
                  f"graphs compiled so far {counters['stats']['unique_graphs']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
