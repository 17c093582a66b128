"""Greedy outputs equal transformers' generate token for token (fp32).

Also under prefix-cache hits, chunked prefill and preemption forced by a tiny
KV budget, for SmolLM2 (Llama) and a tiny random Qwen2 with q/k/v bias.
"""
import json
import subprocess
import sys

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SMOLLM2_TOKENS = 16
"""SmolLM2's reference is transformers' generate one prompt at a time: the costliest part of the module."""
SMOLLM2_GREEDY = SamplingParams(temperature=0.0, max_tokens=SMOLLM2_TOKENS, ignore_eos=True)

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a short poem about autumn leaves falling in the park.",
    "What is 12 times 12?",
]
PARAGRAPH = ("The history of computing spans centuries, from the abacus to mechanical calculators, "
             "from Babbage's analytical engine to the electronic machines of the twentieth century. ")


def smollm2_prompts(tokenizer) -> list[list[int]]:
    """10 prompts from 1 to ~400 tokens; two share a long system prompt."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    system = "You are a careful assistant. " + PARAGRAPH * 3
    prompts += [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                               {"role": "user", "content": q}]) for q in QUESTIONS[:2]]
    prompts += [tokenizer.encode(PARAGRAPH * k + "In summary,") for k in (1, 5, 12)]
    prompts.append(tokenizer.encode("Hello"))
    return prompts


def run(model_dir, prompts, params=GREEDY, **overrides):
    config = EngineConfig(model=str(model_dir), dtype="float32",
                          scheduler=overrides.pop("scheduler", SchedulerConfig()),
                          cache=overrides.pop("cache", CacheConfig()))
    engine = LLMEngine(config)
    outputs = engine.generate(prompts, params)
    return engine, [o.completions[0].token_ids for o in outputs], outputs


def assert_no_leak(engine: LLMEngine):
    assert not engine.has_unfinished()
    assert engine.kv.pool.num_used_blocks == 0
    assert not engine.kv.block_tables


@pytest.fixture(scope="module")
def smollm2_case(smollm2_dir):
    from engine.tokenizer import Tokenizer
    prompts = smollm2_prompts(Tokenizer(smollm2_dir))
    assert len(prompts) == 10 and max(map(len, prompts)) > 300 and min(map(len, prompts)) < 20
    return prompts, hf_greedy(smollm2_dir, prompts, SMOLLM2_TOKENS)


def test_smollm2_with_prefix_cache_hits(smollm2_dir, smollm2_case):
    prompts, expected = smollm2_case
    config = EngineConfig(model=str(smollm2_dir), dtype="float32")
    engine = LLMEngine(config)
    first = engine.generate(prompts, SMOLLM2_GREEDY)
    second = engine.generate(prompts, SMOLLM2_GREEDY)
    assert [o.completions[0].token_ids for o in first] == expected
    assert all(o.num_cached_tokens >= 16 * (len(p) // 16 - 1) for o, p in zip(second, prompts, strict=True))
    assert [o.completions[0].token_ids for o in second] == expected
    assert_no_leak(engine)


def test_smollm2_with_chunked_prefill(smollm2_dir, smollm2_case):
    prompts, expected = smollm2_case
    engine, got, _ = run(smollm2_dir, prompts, SMOLLM2_GREEDY, scheduler=SchedulerConfig(max_num_batched_tokens=48),
                         cache=CacheConfig(enable_prefix_caching=False))
    assert got == expected
    assert_no_leak(engine)


def test_smollm2_with_preemption(smollm2_dir, smollm2_case):
    prompts, expected = smollm2_case
    # 40 blocks of 16 tokens hold the longest prompt (~27 blocks) with its outputs, and not much beside it.
    engine, got, _ = run(smollm2_dir, prompts, SMOLLM2_GREEDY, cache=CacheConfig(num_blocks=40))
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_no_leak(engine)


@pytest.fixture(scope="module")
def qwen2_case(tiny_qwen2_dir):
    import random
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 200))] for _ in range(12)]
    prompts += [prompts[0][:50] + [5] * k for k in (10, 40, 70)]  # shared prefixes
    prompts.append([7])
    return prompts, hf_greedy(tiny_qwen2_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("variant", ["plain", "chunked", "preempt", "cached"])
def test_tiny_qwen2_equals_transformers(tiny_qwen2_dir, qwen2_case, variant):
    prompts, expected = qwen2_case
    kwargs = {"plain": {"cache": CacheConfig(enable_prefix_caching=False)},
              "chunked": {"scheduler": SchedulerConfig(max_num_batched_tokens=32)},
              "preempt": {"cache": CacheConfig(num_blocks=30, enable_prefix_caching=False)},
              "cached": {}}[variant]
    engine, got, outputs = run(tiny_qwen2_dir, prompts, **kwargs)
    if variant == "cached":  # the same prompts again: now their full blocks are cached
        outputs = engine.generate(prompts, GREEDY)
        assert sum(o.num_cached_tokens for o in outputs) >= sum(16 * ((len(p) - 1) // 16) for p in prompts)
        got = [o.completions[0].token_ids for o in outputs]
    if variant == "preempt":
        assert engine.scheduler.num_preemptions > 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} differs"
    assert_no_leak(engine)


def test_smollm2_offline_cli_equals_transformers(tmp_path, smollm2_dir, smollm2_case):
    """`pdserve generate --offline`, 10 prompts submitted together, gives transformers' tokens."""
    prompts, expected = smollm2_case
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "token_ids": p, "temperature": 0, "ignore_eos": True,
                                       "max_tokens": SMOLLM2_TOKENS}) + "\n" for i, p in enumerate(prompts)))
    dst = tmp_path / "out.jsonl"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "generate", "--offline", "--model", "default",
                    "--dtype", "float32", "--input", str(src), "--output", str(dst)], check=True)
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(prompts))]
    assert [r["token_ids"] for r in rows] == expected
    assert all(r["finish_reason"] == "length" and r["usage"]["completion_tokens"] == SMOLLM2_TOKENS for r in rows)
