"""Offline throughput: pdserve's engine vs transformers, naive and statically batched.

A fixed workload of SmolLM2 requests (varied prompt and output lengths, greedy,
ignore_eos so every system produces exactly the same number of tokens) runs
through, in one process and one run:
  hf-naive   transformers `generate`, one request at a time;
  hf-static  transformers `generate` on left-padded batches of --static-batch
             requests, each batch running to its longest output;
  pdserve    all requests submitted to the engine together (continuous
             batching, paged KV, chunked prefill).
It also reports KV memory utilisation (tokens stored / KV slots allocated) for
pdserve's paged cache against contiguous per-request allocation.

  .venv/bin/python bench/offline_throughput.py --dtype bfloat16

--variants runs pdserve several times under different engine switches, A/B
interleaved over --rounds (same process, same workload), e.g. the fused CPU
elementwise kernels against the unfused torch ops (issue 22):

  .venv/bin/python bench/offline_throughput.py --skip hf-naive hf-static \
      --variants fused unfused baseline --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_files import resolve_model_path  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

CORPUS = (
    "Large language models generate text one token at a time. Serving them efficiently means keeping "
    "the processor busy: batching many requests together, reusing the attention keys and values of "
    "tokens already seen, and never wasting memory on space a request will not use. Paged attention "
    "stores those keys and values in fixed-size blocks, like pages of virtual memory, so sequences of "
    "any length share one pool. Continuous batching lets a finished request leave and a new one join "
    "at every step instead of waiting for the slowest member of a batch. "
)


def make_workload(tokenizer: Tokenizer, n: int, seed: int, prompt_range, output_range):
    rng = random.Random(seed)
    corpus = tokenizer.encode(CORPUS * 20)
    work = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - plen)
        header = tokenizer.encode(f"Request {len(work)}: ")  # no two prompts share a first block
        work.append(((header + corpus[start:start + plen])[:plen], rng.randint(*output_range)))
    return work


VARIANTS = {  # name -> environment the engine is built under
    "default": {},
    "fused": {"PDSERVE_FUSED": "1", "PDSERVE_BF16_UPCAST": "1"},
    "unfused": {"PDSERVE_FUSED": "0", "PDSERVE_BF16_UPCAST": "1"},  # torch elementwise ops
    "baseline": {"PDSERVE_FUSED": "0", "PDSERVE_BF16_UPCAST": "0"},  # and bf16 GEMMs as before #22
    "packed": {"PDSERVE_PACKED_LINEAR": "1"},  # oneDNN-prepacked weights (float32 too)
    "unpacked": {"PDSERVE_PACKED_LINEAR": "0"},  # F.linear on plain weights (MKL for float32)
}


def run_variants(model_dir, dtype, work, args) -> dict:
    """pdserve under each of --variants, interleaved over --rounds; one result per variant (its rounds listed)."""
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for variant in args.variants:
            saved = {k: os.environ.get(k) for k in VARIANTS[variant]}
            os.environ.update(VARIANTS[variant])
            try:
                result = run_pdserve(model_dir, dtype, work, args)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            print(f"round {r + 1} {variant:<9} {result['elapsed_s']:7.1f} s "
                  f"{result['output_tokens'] / result['elapsed_s']:8.1f} out tok/s", flush=True)
            runs[variant].append(result)
    out = {}
    for variant, results in runs.items():
        name = "pdserve" if variant == "default" else f"pd-{variant}"
        best = min(results, key=lambda x: x["elapsed_s"])
        out[name] = best | {"rounds_elapsed_s": [x["elapsed_s"] for x in results]}
    return out


def run_pdserve(model_dir, dtype, work, args, quantization: str | None = None):
    config = EngineConfig(model=str(model_dir), dtype=dtype, quantization=quantization,
                          scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                                    max_num_seqs=args.max_num_seqs),
                          cache=CacheConfig(kv_cache_memory_bytes=int(args.kv_gib * 2**30),
                                            kv_cache_dtype=args.kv_cache_dtype))
    engine = LLMEngine(config)
    engine.generate([work[0][0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    engine.kv.pool.reset_prefix_cache()
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(work):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    produced = 0
    # Summed over steps: tokens stored vs slots held by the paged cache, and what
    # contiguous allocation would hold for the same running requests.
    stored = paged = contiguous_max = contiguous_reserved = 0
    bs = engine.kv.block_size
    while engine.has_unfinished():
        produced += sum(len(d.token_ids) for d in engine.step())
        running = engine.scheduler.running
        stored += sum(r.num_computed_tokens for r in running)
        paged += engine.kv.pool.num_used_blocks * bs
        contiguous_max += len(running) * engine.max_model_len
        contiguous_reserved += sum(r.num_prompt_tokens + r.params.max_tokens for r in running)
    elapsed = time.perf_counter() - start
    kv = {"paged": stored / paged, "contiguous_max_model_len": stored / contiguous_max,
          "contiguous_prompt_plus_max_tokens": stored / contiguous_reserved}
    return {"elapsed_s": elapsed, "output_tokens": produced, "steps": engine.num_steps,
            "preemptions": engine.scheduler.num_preemptions, "kv_utilisation": kv,
            "max_model_len": engine.max_model_len}


def load_hf(model_dir, dtype):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def run_hf_naive(model, work):
    dev = model.device
    model.generate(torch.tensor([work[0][0]], device=dev), max_new_tokens=2, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    produced = 0
    for prompt, out_len in work:
        out = model.generate(torch.tensor([prompt], device=dev), max_new_tokens=out_len, do_sample=False,
                             pad_token_id=0)
        produced += out.shape[1] - len(prompt)
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": produced}


@torch.inference_mode()
def run_hf_static(model, work, batch_size):
    start = time.perf_counter()
    useful = computed = 0
    for b in range(0, len(work), batch_size):
        batch = work[b:b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        longest = max(o for _, o in batch)
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=longest,
                             do_sample=False, pad_token_id=0)
        computed += (out.shape[1] - width) * len(batch)
        useful += sum(o for _, o in batch)  # tokens past a request's own length are waste
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": useful, "computed_tokens": computed}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload flags, shared with bench/vllm_peer_offline.py so both run the same requests."""
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--seed", type=int, default=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    ap.add_argument("--skip", nargs="*", default=[], choices=["hf-naive", "hf-static"])
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                    help="pdserve runs under these switches (fused: C++ elementwise kernels; unfused: "
                         "PDSERVE_FUSED=0; baseline: also PDSERVE_BF16_UPCAST=0)")
    ap.add_argument("--rounds", type=int, default=1, help="A/B rounds over --variants (the best is reported)")
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "offline_throughput.json"))
    args = ap.parse_args()
    torch.manual_seed(0)

    model_dir = resolve_model_path(args.model)
    work = make_workload(Tokenizer(model_dir), args.num_requests, args.seed, args.prompt_len, args.output_len)
    prompt_tokens = sum(len(p) for p, _ in work)
    results = run_variants(model_dir, args.dtype, work, args)
    if len(set(args.skip)) < 2:
        model = load_hf(model_dir, args.dtype)
        if "hf-static" not in args.skip:
            results["hf-static"] = run_hf_static(model, work, args.static_batch)
        if "hf-naive" not in args.skip:
            results["hf-naive"] = run_hf_naive(model, work)

    for r in results.values():
        r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
        r["total_tok_s"] = (r["output_tokens"] + prompt_tokens) / r["elapsed_s"]
    base = results.get("hf-naive", {}).get("output_tok_s")
    print(f"\nworkload: {len(work)} requests, {prompt_tokens} prompt tokens, "
          f"{sum(o for _, o in work)} output tokens, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"{'system':<12} {'time s':>8} {'out tok/s':>10} {'total tok/s':>12} {'vs naive':>9}")
    for name, r in results.items():
        ratio = f"{r['output_tok_s'] / base:.1f}x" if base else "-"
        print(f"{name:<12} {r['elapsed_s']:>8.1f} {r['output_tok_s']:>10.1f} {r['total_tok_s']:>12.1f} {ratio:>9}")
    first = next(iter(results))
    kv = results[first]["kv_utilisation"]
    print("\nKV memory utilisation (tokens stored / KV slots allocated, averaged over steps):")
    print(f"  pdserve paged blocks                         {kv['paged']:.1%}")
    print(f"  contiguous, max_model_len ({results[first]['max_model_len']}) per request  "
          f"{kv['contiguous_max_model_len']:.1%}")
    print(f"  contiguous, prompt + max_tokens per request  {kv['contiguous_prompt_plus_max_tokens']:.1%}")
    out = {"config": vars(args) | {"prompt_tokens": prompt_tokens, "torch_threads": torch.get_num_threads()},
           "results": results}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
