"""prompt_logprobs: each prompt token's logprob equals transformers' log-softmax at the position before it,
whole or in chunks, with the prefix cache warm (such a request does not read it), and only where the
prompt is computed (a request handed its first token returns none)."""
from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPT_TEXT = "The history of computing spans centuries, from the abacus to mechanical calculators. " * 3


@pytest.fixture(scope="module")
def reference(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32"))
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32)
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    return prompt, logprobs


def check(entries, prompt, logprobs, num_top: int) -> None:
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        row = logprobs[position]
        assert entry["token_id"] == prompt[position + 1]
        assert entry["logprob"] == pytest.approx(row[prompt[position + 1]].item(), abs=1e-4)
        chosen = row[prompt[position + 1]]
        near = int(((row - chosen).abs() < 1e-3).sum())  # ties within float noise may order either way
        assert abs(entry["rank"] - (int((row > chosen).sum()) + 1)) < near
        top = row.topk(num_top)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [2048, 24], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_qwen2_dir, reference, budget):
    prompt, logprobs = reference
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32",
                                    scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                                    cache=CacheConfig(kv_cache_memory_bytes=64 << 20)))
    engine.generate([prompt], SamplingParams(max_tokens=2))  # the prefix cache now holds the prompt
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [out] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                     prompt_logprobs=3))
    check(out.completions[0].prompt_logprobs, prompt, logprobs, 3)
    assert out.num_cached_tokens == 0  # it computed every prompt position
    assert out.completions[0].token_ids == engine.generate([prompt], plain)[0].completions[0].token_ids
    assert engine.kv.pool.num_used_blocks == 0


def test_a_request_handed_its_first_token_returns_no_prompt_logprobs(tiny_qwen2_dir, reference):
    prompt, _ = reference
    engine = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32",
                                    cache=CacheConfig(kv_cache_memory_bytes=64 << 20)))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("decode", prompt, params, first_token_id=5, recompute_prompt=True)
    seen = []
    while engine.has_unfinished():
        seen += [d.prompt_logprobs for d in engine.step()]
    assert seen and all(p is None for p in seen)
