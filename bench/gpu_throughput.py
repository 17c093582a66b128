"""GPU throughput: pdserve's engine against transformers and the hardware's roofline, in one run.

Needs no download: builds a random-weight Llama-shaped checkpoint (--size
135m | 1b | 8b; same shapes, so the same compute as the trained model) and
copies a tokenizer beside it (--tokenizer-dir, default the bundled SmolLM2's).
Workload (issue 14): --num-requests submitted together, prompts of random
tokens 128-1024, outputs 64-256, greedy, ignore_eos. Systems:
  pdserve-<backend>  the engine (continuous batching, paged KV, CUDA graphs), with the fused
                     Triton elementwise kernels off and on (+fused; --fused) and async
                     scheduling off and on (+async; --async-scheduling), split-KV decode
                     attention off and on (+splitkv; --split-kv);
  hf-static          transformers `generate` on left-padded batches of 64;
  hf-naive           transformers one request at a time (a --naive-requests subset).
Also one decode step at a fixed batch (--step-batch x --step-context): wall time
of engine.step() and GPU time of the model alone (the same step replayed
back to back), and the roofline both are measured against: prefill FLOPs at
--peak-tflops, decode bytes (weights + KV read) at --peak-tbps.

  python3 bench/gpu_throughput.py --size 1b --output $OUT/gpu_throughput.json
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.offline_throughput import run_hf_naive, run_hf_static  # noqa: E402
from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

SHAPES = {  # Llama-family shapes: SmolLM2-135M, Llama-3.2-1B-like (issue 14), Llama-3.1-8B
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, tie_word_embeddings=True),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, tie_word_embeddings=False),
}
VOCAB = 49152  # the bundled tokenizer's


def default_tokenizer_dir() -> Path:
    from engine.model_files import ensure_default_model
    return ensure_default_model()


def build_checkpoint(size: str, dest: Path, tokenizer_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    path = dest / f"random-llama-{size}"
    if (path / "config.json").exists():
        return path
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2, dtype="bfloat16", **SHAPES[size])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an 8B model in float32 alone would be 32 GB
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    del model
    torch.cuda.empty_cache()
    return path


def make_workload(n: int, seed: int, prompt_range, output_range) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
            for _ in range(n)]


def make_engine(model_dir: Path, backend: str, args, async_scheduling: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype="bfloat16", device="cuda", attention_backend=backend,
        cuda_graphs=not args.enforce_eager, async_scheduling=async_scheduling,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs),
        cache=CacheConfig(gpu_memory_utilization=args.gpu_memory_utilization)))


def run_pdserve(engine: LLMEngine, work) -> dict:
    engine.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    engine.kv.pool.reset_prefix_cache()
    torch.cuda.synchronize()
    steps0 = engine.num_steps
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    produced = 0
    split = {"graph": [0, 0.0], "eager": [0, 0.0]}  # steps, seconds by how the model ran
    while engine.has_unfinished():
        graphs_before, t0 = engine.runner.num_graph_steps, time.perf_counter()
        produced += sum(len(d.token_ids) for d in engine.step())
        kind = split["graph" if engine.runner.num_graph_steps > graphs_before else "eager"]
        kind[0] += 1
        kind[1] += time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": produced, "steps": engine.num_steps - steps0,
            "preemptions": engine.scheduler.num_preemptions, "kv_blocks": engine.num_kv_blocks_total,
            "graph_steps": split["graph"][0], "graph_steps_s": split["graph"][1],
            "eager_steps": split["eager"][0], "eager_steps_s": split["eager"][1]}


def decode_step_times(engine: LLMEngine, batch: int, context: int, repeats: int = 30, profile: bool = False) -> dict:
    """Wall time of engine.step() with `batch` sequences decoding at ~`context` tokens, and the GPU time
    of the model alone for the same step (replayed back to back, no host work in between)."""
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=2 * repeats + 20, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"step{i}", [rng.randrange(3, VOCAB) for _ in range(context - 1)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / repeats
    if profile:  # other steps than the timed ones: cProfile slows the host several times over
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(repeats):
            engine.step()
        profiler.disable()
        print(f"host profile of {repeats} decode steps at batch {batch}:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    engine.finish_launched_step()
    out = engine.scheduler.schedule()  # one more decode step's inputs, run on the model alone
    runner = engine.runner
    runner.execute(out, engine.kv)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        runner.execute(out, engine.kv)
    end.record()
    torch.cuda.synchronize()
    gpu = begin.elapsed_time(end) / 1e3 / repeats
    if profile:  # kernels of the same step run eagerly
        step = runner.varlen.build(out, engine.kv)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            runner.model.forward(step.input_ids, step.positions, runner.kv_cache, step.meta, step.logits_indices)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    for i in range(batch):
        engine.abort_request(f"step{i}")
    while engine.has_unfinished():
        engine.step()
    return {"batch": batch, "context": context, "step_wall_ms": wall * 1e3, "model_gpu_ms": gpu * 1e3,
            "gpu_busy_fraction": min(1.0, gpu / wall)}


def roofline(size: str, work, batch: int, context: int, peak_flops: float, peak_bw: float) -> dict:
    s = SHAPES[size]
    h, layers, heads, kv_heads, inter = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                                         s["num_key_value_heads"], s["intermediate_size"])
    d = h // heads
    layer_params = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter
    matmul_params = layers * layer_params + VOCAB * h  # LM head included
    weight_bytes = 2 * (layers * layer_params + VOCAB * h * (1 if s["tie_word_embeddings"] else 2))
    kv_per_token = 2 * layers * 2 * kv_heads * d  # K and V, bf16
    prefill_flops = sum(2 * matmul_params * len(p) + 2 * layers * heads * d * len(p) * len(p) for p, _ in work)
    t_prefill = prefill_flops / peak_flops
    t_decode = 0.0
    for step in range(1, max(o for _, o in work)):
        kv_bytes = sum((len(p) + step) * kv_per_token for p, o in work if o > step)
        t_decode += (weight_bytes + kv_bytes) / peak_bw
    out_tokens = sum(o for _, o in work)
    step_bytes = weight_bytes + batch * context * kv_per_token
    return {"prefill_tflop": prefill_flops / 1e12, "t_prefill_s": t_prefill, "t_decode_s": t_decode,
            "t_total_s": t_prefill + t_decode, "output_tok_s": out_tokens / (t_prefill + t_decode),
            "weight_gb": weight_bytes / 1e9, "decode_step_gb": step_bytes / 1e9,
            "decode_step_ms": step_bytes / peak_bw * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--workdir", default="/tmp/pdserve-gpu-bench")
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024))
    ap.add_argument("--output-len", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--backends", nargs="+", default=["triton"], choices=["triton", "torch", "flash"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--fused", nargs="+", default=["off", "on"], choices=["off", "on"],
                    help="the fused Triton elementwise kernels (PDSERVE_FUSED_CUDA) off and/or on, one engine each")
    ap.add_argument("--async-scheduling", nargs="+", default=["on"], choices=["off", "on"],
                    help="async scheduling off (step N collected before N+1 is launched) and/or on, one engine each")
    ap.add_argument("--split-kv", nargs="+", default=["off"], choices=["off", "on"],
                    help="split-KV decode attention (PDSERVE_SPLIT_KV) off and/or on; pair with a small --step-batch "
                         "and a long --step-context to see it")
    ap.add_argument("--static-requests", type=int, default=None,
                    help="run hf-static on the first N requests only (its rate is per output token)")
    ap.add_argument("--static-batch", type=int, default=64)
    ap.add_argument("--naive-requests", type=int, default=8)
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf-naive", "hf-static", "step"])
    ap.add_argument("--profile", action="store_true", help="print host (cProfile) and kernel profiles of a step")
    ap.add_argument("--step-batch", type=int, default=128)
    ap.add_argument("--step-context", type=int, default=512)
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 matmul, measured (H100 ~790)")
    ap.add_argument("--peak-tbps", type=float, default=3.0, help="HBM bandwidth, measured (H100 ~3.0)")
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "gpu_throughput.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_throughput.py needs a CUDA GPU", file=sys.stderr)
        return 2
    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else default_tokenizer_dir()
    model_dir = build_checkpoint(args.size, Path(args.workdir), tokenizer_dir)
    work = make_workload(args.num_requests, 0, args.prompt_len, args.output_len)
    roof = roofline(args.size, work, args.step_batch, args.step_context, args.peak_tflops * 1e12,
                    args.peak_tbps * 1e12)
    results, steps = {}, {}
    for backend, fused, asynchronous, split in itertools.product(args.backends, args.fused, args.async_scheduling,
                                                                 args.split_kv):
        os.environ["PDSERVE_FUSED_CUDA"] = "1" if fused == "on" else "0"
        os.environ["PDSERVE_SPLIT_KV"] = "1" if split == "on" else "0"
        name = (f"pdserve-{backend}" + ("+fused" if fused == "on" else "") + ("+async" if asynchronous == "on" else "")
                + ("+splitkv" if split == "on" else ""))
        engine = make_engine(model_dir, backend, args, asynchronous == "on")
        results[name] = run_pdserve(engine, work)
        if "step" not in args.skip:
            steps[name] = decode_step_times(engine, args.step_batch, args.step_context, profile=args.profile)
        engine.shutdown()
        del engine
        gc.collect()  # the engine's graphs and tensors freed now, not by a collection in the next engine's run
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if "hf-static" not in args.skip or "hf-naive" not in args.skip:
        from bench.offline_throughput import load_hf
        model = load_hf(model_dir, "bfloat16").to("cuda")
        if "hf-static" not in args.skip:
            results["hf-static"] = run_hf_static(model, work[:args.static_requests], args.static_batch)
        if "hf-naive" not in args.skip:
            results["hf-naive"] = run_hf_naive(model, work[:args.naive_requests])
    for r in results.values():
        r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
        r["fraction_of_roofline"] = r["output_tok_s"] / roof["output_tok_s"]
    static = results.get("hf-static", {}).get("output_tok_s")
    print(f"\n{torch.cuda.get_device_name()}, random Llama-{args.size} bf16: {len(work)} requests, "
          f"{sum(len(p) for p, _ in work)} prompt / {sum(o for _, o in work)} output tokens")
    print(f"roofline: {roof['prefill_tflop']:.0f} TFLOP prefill ({roof['t_prefill_s']:.2f} s at {args.peak_tflops:.0f} "
          f"TFLOP/s) + decode {roof['t_decode_s']:.2f} s at {args.peak_tbps} TB/s = {roof['output_tok_s']:,.0f} "
          "output tok/s")
    print(f"{'system':<36} {'time s':>8} {'out tok/s':>10} {'of roofline':>12} {'vs hf-static':>13}")
    for name, r in results.items():
        ratio = f"{r['output_tok_s'] / static:.1f}x" if static else "-"
        print(f"{name:<36} {r['elapsed_s']:>8.2f} {r['output_tok_s']:>10,.0f} {r['fraction_of_roofline']:>12.1%} "
              f"{ratio:>13}")
    for name, r in results.items():
        if "graph_steps" in r:
            print(f"{name}: {r['graph_steps']} decode steps from graphs in {r['graph_steps_s']:.2f} s, "
                  f"{r['eager_steps']} eager (prefill/mixed) steps in {r['eager_steps_s']:.2f} s")
    for name, s in steps.items():
        print(f"{name}: decode step at batch {s['batch']} x {s['context']}: {s['step_wall_ms']:.2f} ms wall, "
              f"{s['model_gpu_ms']:.2f} ms GPU ({s['gpu_busy_fraction']:.0%} busy); roofline "
              f"{roof['decode_step_ms']:.2f} ms ({roof['decode_step_ms'] / s['step_wall_ms']:.0%} of it)")
    out = {"config": vars(args), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "roofline": roof, "results": results, "decode_step": steps}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
