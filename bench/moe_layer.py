"""One MoE layer three ways on this CPU: pdserve's grouped path, a dense all-experts loop, transformers' block.

  grouped       engine.model.moe.moe_forward: pairs sorted by expert, one GEMM pair per active expert
  dense         every expert over every token, outputs weighted by a [T, E] routing matrix (zeros for
                the experts a token did not pick): what "never a dense loop" rules out
  hf_eager      transformers' Qwen3MoeSparseMoeBlock, the same weights, its eager experts (a loop over
                the experts hit, index_add_ per expert)
  hf_grouped_mm the same block with `_experts_implementation="grouped_mm"` (torch's grouped_mm)

Qwen3-MoE-ish shape (hidden 1024, 32 experts, top-4, intermediate 256), T tokens per call, float32
and bfloat16; the four outputs are checked equal before timing. Milliseconds per call (median of
the repetitions), a table and JSON; the CPU flags that pick the GEMM kernels are printed with them.

  PYTHONPATH=. .venv/bin/python bench/moe_layer.py [--tokens 1 4 16 64 256 512] [--threads 1] [--output ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402

from bench.cpu_peer_side_by_side import cpu_description  # noqa: E402
from engine.model.moe import MoeOutput, MoeSpec, MoeWeights, moe_forward, route, swiglu  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 1024, 32, 4, 256


def dense_forward(hidden: torch.Tensor, weights: MoeWeights, spec: MoeSpec) -> MoeOutput:
    """Every expert on every token; the routing zeroes what was not chosen."""
    topk_weights, ids = route(hidden, weights, spec)
    dense = torch.zeros(hidden.shape[0], spec.num_experts).scatter_(1, ids, topk_weights).to(hidden.dtype)
    out = torch.zeros_like(hidden)
    for e in range(spec.num_experts):
        y = torch.nn.functional.linear(swiglu(torch.nn.functional.linear(hidden, weights.w13[e]), spec), weights.w2[e])
        out += y * dense[:, e:e + 1]
    return MoeOutput(out, torch.bincount(ids.flatten(), minlength=spec.num_experts))


def timed(fn, reps: int) -> float:
    """Median milliseconds of `reps` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def build(dtype: torch.dtype) -> tuple[dict[str, torch.nn.Module], MoeWeights, MoeSpec]:
    """transformers' block per experts implementation, random weights shared, and the same tensors as
    MoeWeights (transformers keeps them in memory in this stacked layout)."""
    blocks = {}
    for impl in ("eager", "grouped_mm"):
        config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                             num_experts_per_tok=TOP_K, norm_topk_prob=True)
        config._experts_implementation = impl
        torch.manual_seed(0)
        blocks[f"hf_{impl}"] = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in blocks["hf_eager"].parameters():
            p.normal_(0.0, 0.02)
    blocks["hf_grouped_mm"].load_state_dict(blocks["hf_eager"].state_dict())
    blocks = {name: block.to(dtype) for name, block in blocks.items()}
    block = blocks["hf_eager"]
    weights = MoeWeights(block.gate.weight.data, block.experts.gate_up_proj.data, block.experts.down_proj.data)
    return blocks, weights, MoeSpec(EXPERTS, TOP_K, renormalize=True)


def measure(dtype: torch.dtype, tokens: list[int]) -> list[dict]:
    blocks, weights, spec = build(dtype)
    rows = []
    for t in tokens:
        hidden = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(t)).to(dtype)
        with torch.no_grad():
            runs = {"grouped": lambda h=hidden: moe_forward(h, weights, spec).hidden,
                    "dense": lambda h=hidden: dense_forward(h, weights, spec).hidden,
                    **{name: lambda h=hidden, b=block: b(h.unsqueeze(0)).squeeze(0) for name, block in blocks.items()}}
            outs = {name: fn() for name, fn in runs.items()}
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            for name in list(runs)[1:]:
                torch.testing.assert_close(outs[name].float(), outs["grouped"].float(), rtol=tol, atol=tol)
            reps = max(5, min(50, 2000 // t))
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": t,
                   "active_experts": int((moe_forward(hidden, weights, spec).expert_counts > 0).sum())}
            row |= {f"{name}_ms": timed(fn, reps) for name, fn in runs.items()}
        rows.append(row)
        print(f"{row['dtype']:<9} T={t:<4} active {row['active_experts']:>2}/{EXPERTS}  "
              + "  ".join(f"{name} {row[name + '_ms']:8.3f} ms" for name in runs), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 512])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "moe_layer.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = cpu_description() | {"torch_threads": torch.get_num_threads()}
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, {cpu['torch_threads']} torch threads, "
          f"flags: {' '.join(cpu['isa'])}")
    rows = [r for name in args.dtypes for r in measure(getattr(torch, name), args.tokens)]
    paths = [k.removesuffix("_ms") for k in rows[0] if k.endswith("_ms")]
    print("\n| dtype | tokens | active experts | " + " | ".join(f"{p} ms" for p in paths)
          + " | " + " | ".join(f"{p} / grouped" for p in paths[1:]) + " |")
    print("|---|---:|---:|" + "---:|" * (2 * len(paths) - 1))
    for r in rows:
        print(f"| {r['dtype']} | {r['tokens']} | {r['active_experts']} | "
              + " | ".join(f"{r[p + '_ms']:.3f}" for p in paths) + " | "
              + " | ".join(f"{r[p + '_ms'] / r['grouped_ms']:.2f}x" for p in paths[1:]) + " |")
    shape = {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "intermediate": INTER}
    Path(args.output).write_text(json.dumps({"cpu": cpu, "shape": shape, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
