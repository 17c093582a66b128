"""Speculative decoding (ngram / prompt lookup): single-request decode speed with and without it.

Two workloads of single greedy requests on SmolLM2 (one request in the engine at a time):
  repeat   "Repeat this paragraph verbatim: <paragraph>": the answer copies the prompt, so the
           n-gram proposer guesses well (summaries and code edits behave alike);
  nomatch  open questions whose answers do not repeat the prompt: proposals are rare or wrong,
           which shows what speculation costs when it does not help.
Each prompt runs on a plain engine and on an engine with `--speculative-method ngram` in
lockstep (one step of each in turn, in one process), so a shared machine's load falls on both
alike. Decode tok/s counts the tokens after the first one over the summed time of the steps after
the first token (prefill excluded). Greedy outputs of both engines are compared token for token.

  .venv/bin/python bench/spec_decode.py --dtype float32 --num-speculative-tokens 4
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.config import CacheConfig, EngineConfig, SpeculativeConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PARAGRAPHS = [
    "Large language models generate text one token at a time. Serving them efficiently means keeping the "
    "processor busy: batching many requests together, reusing the attention keys and values of tokens already "
    "seen, and never wasting memory on space a request will not use.",
    "Paged attention stores keys and values in fixed-size blocks, like pages of virtual memory, so sequences of "
    "any length share one pool. Continuous batching lets a finished request leave and a new one join at every "
    "step instead of waiting for the slowest member of a batch.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the library and the public parks, and to postpone the new parking garage.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
]
OPEN_QUESTIONS = [
    "Write a short poem about the sea at night.",
    "Give three tips for learning a new language.",
    "Why is the sky blue? Explain briefly.",
    "Describe a good breakfast in a few sentences.",
]


class Run:
    """One request on one engine, stepped from outside; step times summed."""

    def __init__(self, engine: LLMEngine, prompt: list[int], max_tokens: int) -> None:
        self.engine = engine
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        self.tokens: list[int] = []
        self.prefill_s = self.decode_s = 0.0
        self.steps = 0
        self.drafted, self.accepted = engine.num_spec_draft_tokens, engine.num_spec_accepted_tokens

    def step(self) -> None:
        if not self.engine.has_unfinished():
            return
        start = time.perf_counter()
        had_first = bool(self.tokens)
        for delta in self.engine.step():
            self.tokens += delta.token_ids
        elapsed = time.perf_counter() - start
        if had_first:
            self.decode_s += elapsed
            self.steps += 1
        else:
            self.prefill_s += elapsed

    def result(self) -> dict:
        assert self.engine.num_kv_blocks_used == 0
        n = len(self.tokens)
        return {"tokens": self.tokens, "num_tokens": n, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_steps": self.steps,
                "decode_tok_s": (n - 1) / self.decode_s if self.decode_s > 0 else float("nan"),
                "drafted": self.engine.num_spec_draft_tokens - self.drafted,
                "accepted": self.engine.num_spec_accepted_tokens - self.accepted}


def run_pair(plain: LLMEngine, spec: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[dict, dict]:
    """Both engines run the prompt in lockstep (a step of one, then a step of the other), so the load of a
    shared machine falls on both alike."""
    a, b = Run(plain, prompt, max_tokens), Run(spec, prompt, max_tokens)
    while plain.has_unfinished() or spec.has_unfinished():
        a.step()
        b.step()
    return a.result(), b.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32", help="float32: greedy outputs must match token for token")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per workload (at most 4)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_decode.json"))
    args = ap.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    def make(spec: SpeculativeConfig) -> LLMEngine:
        return LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, speculative=spec,
                                      cache=CacheConfig(kv_cache_memory_bytes=256 << 20,
                                                        enable_prefix_caching=False)))

    plain = make(SpeculativeConfig())
    spec = make(SpeculativeConfig(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                                  ngram_min=args.ngram_min, ngram_max=args.ngram_max))
    chat = plain.tokenizer.apply_chat_template
    workloads = {
        "repeat": [chat([{"role": "user", "content": f"Repeat this paragraph verbatim:\n\n{p}"}])
                   for p in PARAGRAPHS[:args.num_prompts]],
        "nomatch": [chat([{"role": "user", "content": q}]) for q in OPEN_QUESTIONS[:args.num_prompts]],
    }
    run_pair(plain, spec, workloads["nomatch"][0], 8)  # warm-up (kernels, allocator)
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join([Path(sys.executable).name, *sys.argv]), "dtype": args.dtype,
               "num_speculative_tokens": args.num_speculative_tokens, "ngram_min": args.ngram_min,
               "ngram_max": args.ngram_max, "torch_threads": torch.get_num_threads(), "workloads": {}}
    rows = []
    for name, prompts in workloads.items():
        per_prompt = []
        for prompt in prompts:
            base, fast = run_pair(plain, spec, prompt, args.max_tokens)
            per_prompt.append({"prompt_tokens": len(prompt), "identical": base["tokens"] == fast["tokens"],
                               "plain": {k: v for k, v in base.items() if k != "tokens"},
                               "ngram": {k: v for k, v in fast.items() if k != "tokens"}})
            print(f"{name}: {len(prompt)} prompt tokens, {base['num_tokens']} out: plain {base['decode_tok_s']:.1f} "
                  f"tok/s, ngram {fast['decode_tok_s']:.1f} tok/s, accepted {fast['accepted']}/{fast['drafted']}",
                  flush=True)
        tok_plain = sum(p["plain"]["num_tokens"] - 1 for p in per_prompt)
        tok_spec = sum(p["ngram"]["num_tokens"] - 1 for p in per_prompt)
        plain_rate = tok_plain / sum(p["plain"]["decode_s"] for p in per_prompt)
        spec_rate = tok_spec / sum(p["ngram"]["decode_s"] for p in per_prompt)
        drafted = sum(p["ngram"]["drafted"] for p in per_prompt)
        accepted = sum(p["ngram"]["accepted"] for p in per_prompt)
        summary = {"plain_decode_tok_s": plain_rate, "ngram_decode_tok_s": spec_rate, "speedup": spec_rate / plain_rate,
                   "median_prompt_speedup": statistics.median(p["ngram"]["decode_tok_s"] / p["plain"]["decode_tok_s"]
                                                              for p in per_prompt),
                   "acceptance_rate": accepted / drafted if drafted else 0.0, "drafted": drafted, "accepted": accepted,
                   "tokens_per_step": tok_spec / max(1, sum(p["ngram"]["decode_steps"] for p in per_prompt)),
                   "all_identical": all(p["identical"] for p in per_prompt)}
        results["workloads"][name] = {"summary": summary, "prompts": per_prompt}
        rows.append((name, summary))
    print(f"\nsingle-request greedy decode, {args.dtype}, K={args.num_speculative_tokens}, "
          f"ngram {args.ngram_min}..{args.ngram_max}, {torch.get_num_threads()} torch threads")
    print(f"{'workload':<9} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>8} {'accept':>7} "
          f"{'tok/step':>8} {'identical':>9}")
    for name, s in rows:
        print(f"{name:<9} {s['plain_decode_tok_s']:>11.1f} {s['ngram_decode_tok_s']:>11.1f} {s['speedup']:>7.2f}x "
              f"{s['acceptance_rate']:>7.1%} {s['tokens_per_step']:>8.2f} {str(s['all_identical']):>9}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
