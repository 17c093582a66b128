"""Greedy outputs with an fp8 KV cache against the model-dtype cache (issue 17): for each prompt, how many
of the first N tokens agree before the first difference (after it the two continue from different texts).

  PYTHONPATH=. .venv/bin/python bench/kv_fp8_greedy_agreement.py --dtype bfloat16 --tokens 16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import CacheConfig, EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_files import ensure_default_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["What is the capital of France?", "Who wrote Hamlet?", "Write a haiku about the sea.",
           "Explain photosynthesis briefly.", "List three prime numbers.", "Describe a cat in one sentence.",
           "What is 12 times 7?", "Name the largest ocean on Earth."]


def greedy(model: str, dtype: str, kv_cache_dtype: str, tokens: int) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, cache=CacheConfig(kv_cache_memory_bytes=64 << 20,
                                                                                 kv_cache_dtype=kv_cache_dtype)))
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return [o.completions[0].token_ids for o in outs]


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    model = str(ensure_default_model())
    ref, fp8 = (greedy(model, args.dtype, kv, args.tokens) for kv in ("auto", "fp8"))
    prefixes = [agreeing_prefix(a, b) for a, b in zip(ref, fp8, strict=True)]
    print(f"dtype {args.dtype}: agreeing prefix per prompt {prefixes} of {args.tokens}; "
          f"agreement {sum(prefixes) / (args.tokens * len(PROMPTS)):.2f}; "
          f"identical {sum(p == args.tokens for p in prefixes)}/{len(PROMPTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
