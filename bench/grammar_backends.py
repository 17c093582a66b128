"""xgrammar vs llguidance on our tokenizer: the measurement behind the structured-output backend choice.

For the 10 JSON schemas of tests/data/json_schemas.json, on SmolLM2's tokenizer (49,152 tokens):
  setup       building the library's tokenizer view once per engine
  compile     each schema cold (first time) and again (the library's own cache, if it has one)
  mask        filling one sample's next-token bitmask, per step, along a random walk through the
              grammar (each step a random allowed token, seeded, the same walk for both libraries);
              a batch of 64 such walks gives the per-step cost at batch 64 (one fill each)
Prints a table and writes JSON (bench/results/grammar_backends.json).

  .venv/bin/python bench/grammar_backends.py
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine.model_files import resolve_model_path  # noqa: E402

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "tests/data/json_schemas.json").read_text())


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                              defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # compiles lazily: the first one is the cost
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.llg_torch.allocate_token_bitmask(batch, self.vocab_size)


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    bits = bitmask_row.view(-1, 1).bitwise_right_shift(torch.arange(32, dtype=torch.int32)).bitwise_and(1)
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t < vocab_size]


def walk(backend, compiled, seed: int, max_steps: int) -> tuple[list[int], list[float]]:
    """A random path through the grammar: the tokens taken and the time of each mask fill."""
    rng = random.Random(seed)
    matcher = backend.matcher(compiled)
    bitmask = backend.bitmask(1)
    tokens, fill_s = [], []
    for _ in range(max_steps):
        if backend.done(matcher):
            break
        start = time.perf_counter()
        backend.fill(matcher, bitmask, 0)
        fill_s.append(time.perf_counter() - start)
        choices = allowed_tokens(bitmask[0], backend.vocab_size)
        token = rng.choice(choices)
        if not backend.accept(matcher, token):
            raise RuntimeError(f"{backend.name} refused a token its own mask allowed")
        tokens.append(token)
    return tokens, fill_s


def batch_step_s(backend, compiled_by_schema: dict, walks: dict, batch: int) -> float:
    """Mean time of one step's fills for `batch` samples replaying the recorded walks."""
    names = list(compiled_by_schema)
    lanes = [(names[i % len(names)], walks[names[i % len(names)]][0]) for i in range(batch)]
    matchers = [backend.matcher(compiled_by_schema[name]) for name, _ in lanes]
    bitmask = backend.bitmask(batch)
    steps = max(len(tokens) for _, tokens in lanes)
    total = 0.0
    for step in range(steps):
        live = [row for row, (_, tokens) in enumerate(lanes) if step < len(tokens)]
        start = time.perf_counter()
        for row in live:
            backend.fill(matchers[row], bitmask, row)
        total += time.perf_counter() - start
        for row in live:
            backend.accept(matchers[row], lanes[row][1][step])
    return total / steps


def measure(backend_cls, hf_tokenizer, vocab_size: int, walks_per_schema: int) -> dict:
    start = time.perf_counter()
    backend = backend_cls(hf_tokenizer, vocab_size)
    setup_s = time.perf_counter() - start
    compiled, cold, warm = {}, {}, {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled[name] = backend.compile(schema)
        cold[name] = time.perf_counter() - start
        start = time.perf_counter()
        backend.compile(schema)
        warm[name] = time.perf_counter() - start
    fills, walks, first_walk = [], {}, {}
    for name in SCHEMAS:
        walks[name] = []
        for seed in range(walks_per_schema):
            tokens, fill_s = walk(backend, compiled[name], seed, max_steps=200)
            walks[name].append(tokens)
            fills += fill_s
            if seed == 0:  # the grammar's first sample: compile plus every mask of one output
                first_walk[name] = (cold[name] + sum(fill_s)) * 1e3
    return {"setup_s": setup_s, "compile_cold_ms": {k: v * 1e3 for k, v in cold.items()},
            "compile_again_ms": {k: v * 1e3 for k, v in warm.items()},
            "first_sample_ms": first_walk, "walk_tokens": statistics.mean(len(w) for ws in walks.values() for w in ws),
            "fill_us_mean": statistics.mean(fills) * 1e6, "fill_us_p99": sorted(fills)[int(len(fills) * 0.99)] * 1e6,
            "batch64_step_ms": batch_step_s(backend, compiled, walks, 64) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--walks-per-schema", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/grammar_backends.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    path = resolve_model_path(args.model)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    results = {}
    for cls in (XGrammar, LLGuidance):
        try:
            results[cls.name] = measure(cls, hf_tokenizer, vocab_size, args.walks_per_schema)
        except ImportError as exc:  # xgrammar is not a dependency of pdserve: `pip install xgrammar` to compare
            print(f"{cls.name}: not installed ({exc})")
    print(f"{'backend':<11} {'setup s':>8} {'compile cold ms (sum/max)':>26} {'again ms (sum)':>15} "
          f"{'first sample ms (sum)':>22} {'fill us mean':>13} {'fill us p99':>12} {'batch-64 step ms':>17}")
    for name, r in results.items():
        cold = r["compile_cold_ms"]
        print(f"{name:<11} {r['setup_s']:8.2f} {sum(cold.values()):17.1f} / {max(cold.values()):6.1f} "
              f"{sum(r['compile_again_ms'].values()):15.2f} {sum(r['first_sample_ms'].values()):22.1f} "
              f"{r['fill_us_mean']:13.1f} {r['fill_us_p99']:12.1f} "
              f"{r['batch64_step_ms']:17.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": str(path), "vocab_size": vocab_size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
