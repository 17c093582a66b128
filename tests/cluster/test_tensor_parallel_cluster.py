"""Prefill and decode workers of different tensor- and pipeline-parallel shapes behind one router (`pdserve
prefill-worker --tensor-parallel-size 2` ...): P TP=2 -> D TP=1, P TP=1 -> D TP=2, P PP=2 -> D PP=1,
P PP=1 -> D PP=2 and P TP=2 -> D PP=2 on the tiny fixture (4 heads, 2 KV heads, 2 layers). Every sample is
prefilled remotely, its KV crosses between the shapes (each head and layer from the rank or stage that holds
it to the one that owns it), and the greedy tokens equal one engine's; the workers end with no KV block,
request or lease held."""
import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import assert_no_leaks, generate_routed, start_cluster, worker_stats

PROMPTS = [[1 + (13 * i) % 3000 for i in range(70)], list(range(200, 240)), [5, 6, 7] * 15]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def expected(tiny_qwen2_dir):
    one = LLMEngine(EngineConfig(model=str(tiny_qwen2_dir), dtype="float32",
                                 cache=CacheConfig(kv_cache_memory_bytes=8 << 20)))
    outs = one.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [o.completions[0].token_ids for o in outs]


TP2, PP2, ONE = ("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2"), ()


@pytest.mark.parametrize("prefill_shape,decode_shape", [(TP2, ONE), (ONE, TP2), (PP2, ONE), (ONE, PP2), (TP2, PP2)],
                         ids=["tp2-tp1", "tp1-tp2", "pp2-pp1", "pp1-pp2", "tp2-pp2"])
def test_outputs_equal_across_parallel_shapes(tiny_qwen2_dir, expected, prefill_shape, decode_shape):
    model = ("--model", str(tiny_qwen2_dir))
    started = start_cluster([["prefill", *prefill_shape], ["decode", *decode_shape]], *model, router_flags=model)
    router = started[-1]
    try:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            got = generate_routed(router, prompt, max_tokens=MAX_TOKENS)
            assert got["prefill"] == started[0].address  # prefilled remotely: the KV crossed TP sizes
            assert got["tokens"] == want
        assert_no_leaks(started[:2])
        stats = worker_stats(started[1].address)  # routers size a prompt's KV with it (router/link_estimate.py)
        block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, tokens, all KV heads, head_dim, float32
        assert stats.kv_block_bytes == block_bytes
        assert stats.kv_bytes_moved == sum(-(-len(p) // 16) for p in PROMPTS) * block_bytes  # every block pulled
    finally:
        stop_all(started)
