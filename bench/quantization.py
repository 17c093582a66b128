"""Weight quantization (int8, fp8) against the unquantized model, in one run (issue 17).

For each --dtypes and each --weights format (none, int8, fp8), with each --kv-cache-dtypes:
  accuracy    a stretch of English (this repo's README and architecture notes) scored position by
              position (teacher-forced, --positions tokens): top-1 next-token agreement with the
              unquantized bf16 model, and perplexity;
  memory      bytes of the layers' linear weights as kept, and of all weights;
  throughput  the offline workload of bench/offline_throughput.py (greedy, ignore_eos), output tok/s.

  .venv/bin/python bench/quantization.py --dtypes float32 bfloat16 --rounds 2
  .venv/bin/python bench/quantization.py --dtypes bfloat16 --weights none --kv-cache-dtypes auto fp8
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from offline_throughput import add_workload_args, make_workload, run_pdserve  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.model.model_config import ModelConfig  # noqa: E402
from engine.model_files import resolve_model_path  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402


def text_ids(tokenizer: Tokenizer, positions: int) -> torch.Tensor:
    text = "\n\n".join((ROOT / name).read_text() for name in ("README.md", "docs/architecture.md"))
    ids = tokenizer.encode(text)
    if len(ids) < positions + 1:
        raise SystemExit(f"only {len(ids)} tokens of text for --positions {positions}")
    return torch.tensor(ids[:positions + 1])


def score(model_dir: Path, dtype: str, quantization: str | None, ids: torch.Tensor) -> dict:
    """Logits of every position, perplexity, and the weights' bytes."""
    config = EngineConfig(dtype=dtype, device="cpu", quantization=quantization).resolved()
    start = time.perf_counter()
    runner = ModelRunner(config, model_dir, ModelConfig.from_dir(model_dir), len(ids) + 16)
    load_s = time.perf_counter() - start
    logits = runner.forward_prompt(ids[:-1], torch.arange(len(ids) - 1)).float()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:])
    model = runner.model
    linear_bytes = sum(lin.nbytes for layer in model.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                          layer.down))
    other = model.embed.nbytes + model.final_norm.nbytes + sum(layer.input_norm.nbytes + layer.post_norm.nbytes
                                                                for layer in model.layers)
    if model.lm_head.weight is not None and model.lm_head.weight.data_ptr() != model.embed.data_ptr():
        other += model.lm_head.nbytes
    return {"logits": logits, "perplexity": float(torch.exp(nll)), "linear_mib": linear_bytes / 2**20,
            "weights_mib": (linear_bytes + other) / 2**20, "load_s": load_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.set_defaults(num_requests=32, prompt_len=(32, 256), output_len=(32, 64))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--positions", type=int, default=2000, help="text positions scored for agreement")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8"],
                    help="KV caches of the throughput runs (each a row of its own)")
    ap.add_argument("--weights", nargs="+", default=["none", "int8", "fp8"], choices=["none", "int8", "fp8"])
    ap.add_argument("--rounds", type=int, default=2, help="throughput rounds, interleaved over the formats")
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "quantization.json"))
    args = ap.parse_args()
    model_dir = resolve_model_path(args.model)
    tokenizer = Tokenizer(model_dir)
    ids = text_ids(tokenizer, args.positions)
    reference = score(model_dir, "bfloat16", None, ids)["logits"].argmax(-1)
    work = make_workload(tokenizer, args.num_requests, args.seed, args.prompt_len, args.output_len)
    rows = []
    for dtype in args.dtypes:
        for weights in args.weights:
            quantization = None if weights == "none" else weights
            scored = score(model_dir, dtype, quantization, ids)
            agreement = float((scored.pop("logits").argmax(-1) == reference).float().mean())
            rows += [{"dtype": dtype, "weights": weights, "kv_cache_dtype": kv, "top1_agreement_vs_bf16": agreement,
                      **scored, "runs": []} for kv in args.kv_cache_dtypes]
    for _ in range(args.rounds):  # throughput A/B interleaved: every format sees the same machine
        for r in rows:
            args.kv_cache_dtype = r["kv_cache_dtype"]
            r["runs"].append(run_pdserve(model_dir, r["dtype"], work, args,
                                         quantization=None if r["weights"] == "none" else r["weights"]))
    for r in rows:
        best = min(r["runs"], key=lambda run: run["elapsed_s"])
        r["output_tok_s"] = best["output_tokens"] / best["elapsed_s"]
        r["rounds_output_tok_s"] = [run["output_tokens"] / run["elapsed_s"] for run in r["runs"]]
        print(f"{r['dtype']:<9} {r['weights']:<5} kv {r['kv_cache_dtype']:<5} "
              f"agree {r['top1_agreement_vs_bf16']:6.4f}  "
              f"ppl {r['perplexity']:7.3f}  linears {r['linear_mib']:6.1f} MiB  weights {r['weights_mib']:6.1f} MiB  "
              f"{r['output_tok_s']:7.1f} out tok/s (best of {args.rounds})", flush=True)
    cpu = torch.backends.cpu.get_cpu_capability()
    result = {"cpu_capability": cpu, "threads": torch.get_num_threads(), "positions": args.positions,
              "workload": {"requests": len(work), "prompt_len": args.prompt_len, "output_len": args.output_len},
              "rows": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"\nCPU capability {cpu}, {torch.get_num_threads()} threads; "
          f"agreement over {args.positions} positions vs unquantized bf16; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
