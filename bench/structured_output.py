"""Structured outputs: what the grammar costs per generated token, and what compiling costs.

  throughput  offline, the default model, batch 1 / 16 / 64 chat prompts: output tok/s with each sample
              constrained by one of the 10 JSON schemas of tests/data/json_schemas.json (greedy), and
              unconstrained with the same number of tokens per sample (each sample's max_tokens = its
              constrained length, ignore_eos: the batch shrinks alike). Runs alternate (plain,
              constrained, plain, ...) so a shared machine's load falls on both; the best of `--repeats`.
  compile     each schema on a fresh backend: cold (the first includes building llguidance's tokenizer
              view, shown apart), then again (cached)
Prints a table and writes JSON (bench/results/structured_output.json).

  .venv/bin/python bench/structured_output.py --dtype float32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured_output.backend import GrammarBackend  # noqa: E402
from engine.structured_output.spec import StructuredOutput  # noqa: E402

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "tests/data/json_schemas.json").read_text())
QUESTIONS = ["Describe a person as a JSON object.", "Give me an order as JSON.", "Rate this review as JSON.",
             "Describe a shape as JSON.", "List some tags as JSON."]


def timed_generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.completions[0].token_ids) for o in outputs)


def throughput(engine: LLMEngine, batch: int, repeats: int) -> dict:
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
               for i in range(batch)]
    schemas = list(SCHEMAS.values())
    constrained = [SamplingParams(temperature=0.0, max_tokens=200,
                                  structured_output=StructuredOutput.json_schema(schemas[i % len(schemas)]))
                   for i in range(batch)]
    for p in constrained:  # compiled before timing (cached afterwards)
        engine.grammars.compile_future(p.structured_output).result()
    lengths = [len(o.completions[0].token_ids) for o in engine.generate(prompts, constrained)]
    plain = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    best = {"plain": 0.0, "constrained": 0.0}
    for _ in range(repeats):
        for name, params in (("plain", plain), ("constrained", constrained)):
            elapsed, tokens = timed_generate(engine, prompts, params)
            best[name] = max(best[name], tokens / elapsed)
    return {"batch": batch, "tokens_per_sample": round(sum(lengths) / batch), "plain_tok_s": best["plain"],
            "constrained_tok_s": best["constrained"], "overhead": 1 - best["constrained"] / best["plain"]}


def compile_times(engine: LLMEngine) -> dict:
    backend = GrammarBackend(engine.tokenizer.hf_tokenizer, engine.model_config.vocab_size)
    start = time.perf_counter()
    backend.compile_future(StructuredOutput.regex("a")).result()
    tokenizer_view_s = time.perf_counter() - start
    cold, cached = {}, {}
    for name, schema in SCHEMAS.items():
        spec = StructuredOutput.json_schema(schema)
        start = time.perf_counter()
        backend.matcher(spec)
        cold[name] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        backend.matcher(spec)
        cached[name] = (time.perf_counter() - start) * 1e3
    backend.shutdown()
    return {"tokenizer_view_s": tokenizer_view_s, "cold_ms": cold, "cached_ms": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/structured_output.json"))
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    rows = [throughput(engine, int(b), args.repeats) for b in args.batches.split(",")]
    compiled = compile_times(engine)
    engine.shutdown()
    print(f"{'batch':>5} {'tokens/sample':>13} {'plain tok/s':>12} {'constrained tok/s':>18} {'overhead':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tokens_per_sample']:>13} {r['plain_tok_s']:>12.1f} "
              f"{r['constrained_tok_s']:>18.1f} {r['overhead']:>8.1%}")
    print(f"\nllguidance tokenizer view: {compiled['tokenizer_view_s']:.2f} s (once per engine)")
    print(f"{'schema':<14} {'cold ms':>8} {'cached ms':>10}")
    for name in SCHEMAS:
        print(f"{name:<14} {compiled['cold_ms'][name]:>8.2f} {compiled['cached_ms'][name]:>10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "dtype": args.dtype, "throughput": rows,
                                          "compile": compiled}, indent=1))


if __name__ == "__main__":
    main()
