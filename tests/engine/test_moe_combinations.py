"""Mixture-of-Experts models (the tiny Qwen3-MoE and Mixtral of test_moe_models.py) with the engine's other
features: an fp8 KV cache, speculative decoding (n-gram, draft models, with expert parallelism too), and
weight quantization, which stays refused.

fp8 KV on random tiny checkpoints: their next-token distributions are nearly flat (top-2 gaps of a few
hundredths of a nat), so greedy agreement says little; instead the next-token distribution is compared
teacher-forced, after prompts prefilled in 16-token chunks (each chunk reads the ones before it from the
fp8 cache), with the same engine on a float32 cache: the top-20 tokens overlap by >= 60% on average
(measured 0.86 Qwen3-MoE, 0.79 Mixtral) and the shared tokens' logprobs differ by a median <= 0.15 nat
(measured ~0.06), while K/V read back at 8x their scale overlap by <= 10% (measured 0.00 and 0.02).
Speculative decoding is exact: greedy equals transformers token for token.
"""
import random
import statistics

import pytest

from engine.attention import fp8_kv
from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.model.fp8_checkpoint import save_fp8_checkpoint
from engine.sampling_params import SamplingParams
from tests.engine import test_moe_models
from tests.engine.test_hf_equivalence import GREEDY, assert_no_leak
from tests.engine.test_moe_models import VOCAB, assert_equal
from tests.engine.test_qwen3 import tiny_qwen3

moe_case = test_moe_models.moe_case  # (family, checkpoint, prompts, transformers' greedy tokens), per family

TOP = 20


def engine_for(path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", **overrides))


# ---- fp8 KV cache -----------------------------------------------------------------------------------
def next_token_top(path, kv_cache_dtype: str) -> list[dict[int, float]]:
    """{token: logprob} of the TOP most likely next tokens after each of 11 prefixes of one random prompt,
    prefilled in 16-token chunks."""
    rng = random.Random(5)
    base = [rng.randrange(3, VOCAB) for _ in range(120)]
    engine = engine_for(path, scheduler=SchedulerConfig(max_num_batched_tokens=16),
                        cache=CacheConfig(num_blocks=256, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False))
    outs = engine.generate([base[:n] for n in range(40, 121, 8)],
                           SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP))
    assert_no_leak(engine)
    return [{t["token_id"]: t["logprob"] for t in o.completions[0].logprobs[0]["top_logprobs"]} for o in outs]


def compare(ref: list[dict[int, float]], got: list[dict[int, float]]) -> tuple[float, float]:
    """(mean fraction of the TOP tokens both share, median |logprob difference| over the shared ones)."""
    overlap, diffs = [], []
    for a, b in zip(ref, got, strict=True):
        shared = a.keys() & b.keys()
        overlap.append(len(shared) / TOP)
        diffs += [abs(a[t] - b[t]) for t in shared]
    return statistics.mean(overlap), statistics.median(diffs) if diffs else float("inf")


@pytest.fixture(scope="module")
def float32_kv_top(moe_case):
    return next_token_top(moe_case[1], "auto")


def test_fp8_kv_cache_keeps_the_next_token_distribution(moe_case, float32_kv_top):
    family, path, prompts, expected = moe_case
    overlap, median = compare(float32_kv_top, next_token_top(path, "fp8"))
    print(f"{family}: fp8 KV vs float32 KV: top-{TOP} overlap {overlap:.2f}, median |dlogprob| {median:.3f}")
    assert overlap >= 0.6 and median <= 0.15


def test_a_wrong_fp8_read_scale_is_caught(moe_case, float32_kv_top, monkeypatch):
    """The bounds above fail when reads are broken: K/V read back at 8x their scale."""
    dequantize = fp8_kv.dequantize
    monkeypatch.setattr(fp8_kv, "dequantize", lambda x, scale, dtype: dequantize(x, scale * 8, dtype))
    overlap, _ = compare(float32_kv_top, next_token_top(moe_case[1], "fp8"))
    print(f"{moe_case[0]}: fp8 KV read at 8x its scale: top-{TOP} overlap {overlap:.2f}")
    assert overlap <= 0.1


def test_fp8_kv_generation_keeps_fp8_blocks_first_tokens_exact(moe_case):
    """Whole generations over fp8 blocks free every block; a prompt's first token comes from its own fresh K/V
    (one chunk), so it equals transformers'."""
    family, path, prompts, expected = moe_case
    engine = engine_for(path, cache=CacheConfig(num_blocks=128, kv_cache_dtype="fp8", enable_prefix_caching=False))
    assert str(engine.runner.kv_cache.dtype) == "torch.float8_e4m3fn"
    got = [o.completions[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert all(len(g) == len(e) for g, e in zip(got, expected, strict=True))
    assert_no_leak(engine)


# ---- speculative decoding ---------------------------------------------------------------------------
def test_ngram_speculation_over_an_moe_target_is_exact(moe_case):
    family, path, prompts, expected = moe_case
    engine = engine_for(path, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    got = [o.completions[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert_equal(got, expected)
    assert engine.num_spec_draft_tokens > 0  # proposals were made and verified through the experts
    assert_no_leak(engine)


def test_an_moe_draft_identical_to_the_target_is_always_accepted(moe_case):
    family, path, prompts, expected = moe_case
    prompts, expected = prompts[:3], expected[:3]  # 25 to 117 tokens: a draft model steps slowly
    engine = engine_for(path, speculative=SpeculativeConfig(method="draft", model=str(path), num_speculative_tokens=3))
    got = [o.completions[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert_equal(got, expected)
    assert engine.num_spec_draft_tokens > 0
    assert engine.num_spec_accepted_tokens == engine.num_spec_draft_tokens
    assert_no_leak(engine)


def test_a_dense_draft_for_an_moe_target_keeps_greedy_exact(moe_case, tmp_path, tokenizer_dir):
    family, path, prompts, expected = moe_case
    prompts, expected = prompts[:3], expected[:3]  # 25 to 117 tokens: a draft model steps slowly
    draft = tiny_qwen3(tmp_path / "draft", tokenizer_dir)  # same vocabulary, random: mostly rejected
    engine = engine_for(path, speculative=SpeculativeConfig(method="draft", model=str(draft), num_speculative_tokens=3))
    got = [o.completions[0].token_ids for o in engine.generate(prompts, GREEDY)]
    assert_equal(got, expected)
    assert engine.num_spec_draft_tokens > 0
    assert_no_leak(engine)


def test_ngram_speculation_with_expert_parallel_ranks_is_exact(moe_case):
    family, path, prompts, expected = moe_case
    engine = engine_for(path, tensor_parallel_size=2, enable_expert_parallel=True,
                        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    try:
        got = [o.completions[0].token_ids for o in engine.generate(prompts, GREEDY)]
        assert_equal(got, expected)
        assert engine.num_spec_draft_tokens > 0
        assert_no_leak(engine)
    finally:
        engine.shutdown()


# ---- weight quantization stays refused --------------------------------------------------------------
def test_fp8_quantization_of_an_moe_model_is_refused(moe_case):
    with pytest.raises(ValueError, match=r"quantized weights \(fp8\) are not supported for Mixture-of-Experts"):
        engine_for(moe_case[1], quantization="fp8")


def test_an_fp8_checkpoint_of_an_moe_model_is_refused(moe_case, tmp_path):
    fp8_dir = save_fp8_checkpoint(moe_case[1], tmp_path / "fp8")
    with pytest.raises(ValueError, match=r"quantized weights \(fp8\) are not supported for Mixture-of-Experts"):
        engine_for(fp8_dir)
